"""`openai` generator: any OpenAI-compatible server (vLLM, SGLang) serving the target.

Prompts go to `/v1/completions` as token ids (rendered and tokenized here, with the same
tokenizer), so the server sees exactly the prompt the `hf` generator would. The response's
token ids are taken from the server (`return_token_ids`, vLLM >= 0.10.2) when it sends
them; otherwise the text is tokenized with the same tokenizer and the row is counted as
`retokenized` (decode/encode is almost, not always, the identity).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from data_gen.config import BackendConfig, SamplingConfig
from data_gen.generators import Completion, Failure, GeneratorUnavailable, Progress, past
from dflash_train.errors import RunError

RETRYABLE_HTTP = (408, 429, 500, 502, 503, 504)
AUTH_HTTP = (401, 403)  # the key is refused: no prompt will get an answer, so none is recorded as failed


class _Retryable(Exception):
    pass


class _BadResponse(Exception):
    """The server answered, but not with a well-formed completion of valid token ids."""


class OpenAIGenerator:
    def __init__(self, cfg: BackendConfig, sampling: SamplingConfig, stop_ids: list[int], tokenizer,
                 model_name: str):
        self.cfg, self.sampling = cfg, sampling
        self.stop_ids, self.tokenizer, self.model_name = stop_ids, tokenizer, model_name
        self.base_url = cfg.base_url.rstrip("/")
        self._check_server()

    def _request(self, path: str, body: dict | None = None) -> dict:
        """One HTTP call; raises _Retryable for what a later attempt may fix."""
        headers = {"Content-Type": "application/json"}
        if self.cfg.api_key:
            headers["Authorization"] = f"Bearer {self.cfg.api_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.cfg.timeout_s) as resp:
                raw = resp.read()
            try:
                return json.loads(raw)
            except ValueError:
                raise _BadResponse(f"not JSON: {raw[:80]!r}") from None
        except urllib.error.HTTPError as e:
            detail = f"HTTP {e.code} from {self.base_url + path}: {e.read()[:200]!r}"
            if e.code in AUTH_HTTP:
                key = "is not set" if not self.cfg.api_key else "was refused"
                raise RunError(f"{detail}: backend.api_key {key}; set the server's key and rerun the same command "
                               "(nothing was recorded for the prompts of this shard)") from None
            if e.code in RETRYABLE_HTTP:
                raise _Retryable(detail) from None
            raise ValueError(detail) from None
        except (urllib.error.URLError, socket.timeout, ConnectionError) as e:
            raise _Retryable(f"cannot reach {self.base_url + path}: {getattr(e, 'reason', e)}") from None

    def _with_retries(self, path: str, body: dict | None = None) -> dict:
        for attempt in range(self.cfg.max_retries + 1):
            try:
                return self._request(path, body)
            except _Retryable:
                if attempt == self.cfg.max_retries:
                    raise
                time.sleep(self.cfg.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    def _check_server(self) -> None:
        """Fail fast on a dead server or one that serves another model."""
        try:
            listing = self._with_retries("/models")
            if not isinstance(listing, dict) or not isinstance(listing.get("data"), list):
                raise _BadResponse(f"no model list in {str(listing)[:80]!r}")
            served = [m.get("id") for m in listing["data"] if isinstance(m, dict)]
        except _Retryable as e:
            raise GeneratorUnavailable(f"openai backend: {e}") from None
        except _BadResponse as e:
            raise GeneratorUnavailable(f"openai backend: bad response from {self.base_url}/models: {e}") from None
        if self.model_name not in served:
            raise ValueError(f"backend.model={self.model_name!r} is not served by {self.base_url} "
                             f"(it serves {served}); set backend.model to the served name")

    def _body(self, prompt: list[int], seed: int) -> dict:
        s = self.sampling
        # Every sampling field is explicit: servers otherwise apply the model's defaults. The stop
        # ids too: a magpie prompt ends at the end of a user turn, which may not be the eos.
        return {"model": self.model_name, "prompt": prompt, "max_tokens": s.max_new_tokens,
                "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k or -1, "min_p": 0.0,
                "repetition_penalty": 1.0, "seed": seed, "n": 1, "return_token_ids": True,
                "skip_special_tokens": False, "stop_token_ids": self.stop_ids}

    def _one(self, prompt: list[int], seed: int) -> Completion | Failure:
        try:
            return self._completion(self._with_retries("/completions", self._body(prompt, seed)))
        except _Retryable as e:
            return Failure(str(e), retryable=True)
        except _BadResponse as e:
            # A server answering garbage is broken, not the prompt: retryable, so the shard
            # stays uncommitted and a rerun against a healthy server generates it.
            return Failure(f"bad response from {self.base_url}/completions: {e}", retryable=True)
        except ValueError as e:  # an HTTP 4xx: this prompt is refused (e.g. too long for the server)
            return Failure(str(e), retryable=False)

    def _completion(self, response) -> Completion:
        """The completion of one response, checked field by field before it can become data."""
        choices = response.get("choices") if isinstance(response, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise _BadResponse(f"no choices in {str(response)[:80]!r}")
        choice = choices[0]
        reason = choice.get("finish_reason")
        if reason not in ("stop", "length"):
            raise _BadResponse(f"finish_reason={reason!r}, expected 'stop' or 'length'")
        ids = choice.get("token_ids")
        exact = ids is not None
        if reason == "length" and (ids == [] or (not exact and choice.get("text") == "")):
            # a generation cut at max_tokens without a single token: the server is broken
            raise _BadResponse("an empty answer with finish_reason='length'")
        if exact:
            vocab = len(self.tokenizer)
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise _BadResponse(f"token_ids is not a list of integers: {str(ids)[:80]}")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise _BadResponse(f"token ids {bad[:3]} outside the vocabulary [0, {vocab})")
        else:
            text = choice.get("text")
            if not isinstance(text, str):
                raise _BadResponse("neither token_ids nor text in the choice")
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        ids = list(ids)
        # Servers end on the stop token but may leave it out of the ids; the row needs it.
        if reason == "stop" and (not ids or ids[-1] not in self.stop_ids):
            ids.append(self.stop_ids[0])
        return Completion(ids, reason, exact_ids=exact)

    def generate(self, prompts: list[list[int]], seeds: list[int], deadline: float | None = None,
                 progress: Progress | None = None) -> list[Completion | Failure | None]:
        def one(prompt: list[int], seed: int) -> Completion | Failure | None:
            if past(deadline):  # a request not sent in time
                return None
            result = self._one(prompt, seed)
            if progress is not None and isinstance(result, Completion):
                progress(1, len(result.ids))  # from the pool's threads: tqdm's update holds a lock
            return result

        # Servers take int32 seeds; a server's own sampler decides how far a seed pins the answer.
        with ThreadPoolExecutor(max_workers=self.cfg.max_concurrency) as pool:
            return list(pool.map(one, prompts, [s & 0x7FFFFFFF for s in seeds]))
