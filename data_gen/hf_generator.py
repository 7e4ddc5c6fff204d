"""`hf` generator: batched generation with the target loaded in-process.

Prompts are sorted by length and batched (length bucketing keeps padding small), left
padded, and generated with `model.generate`. On GPU the target runs in bf16 on the rank's
own device; under torchrun each rank holds a full copy (data parallel).

Sampling does not use torch's global generator (one stream for the whole batch, so a
prompt's answer would depend on its batch-mates): a logits processor picks every row's
token from that prompt's own seeded stream (data_gen/sampling.py), and greedy search then
takes the one token left.
"""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig, LogitsProcessor

from data_gen.config import BackendConfig, SamplingConfig
from data_gen.generators import Completion, Progress, past, trim_response
from data_gen.sampling import sample_tokens, uniform_stream
from dflash_train.model.target import TargetModel, load_target


def rank_device(device: str, local_rank: int) -> str:
    if device != "auto":
        return device
    return f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"


class _SeededSampler(LogitsProcessor):
    """Leaves one finite score per row: the token its own stream draws at this position."""

    def __init__(self, u: torch.Tensor, prompt_width: int, sampling: SamplingConfig):
        self.u, self.prompt_width, self.sampling = u, prompt_width, sampling  # u: (B, max_new_tokens)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        s = self.sampling
        step = input_ids.shape[1] - self.prompt_width
        tokens = sample_tokens(scores, self.u[:, step], s.temperature, s.top_p, s.top_k)  # (B,)
        out = torch.full_like(scores, float("-inf"))
        out[torch.arange(len(tokens), device=scores.device), tokens] = 0
        return out


class HFGenerator:
    def __init__(self, target: TargetModel, cfg: BackendConfig, sampling: SamplingConfig,
                 stop_ids: list[int], pad_id: int):
        # A shallow copy shares the weights but gets a clean generation config: only the
        # configured sampling applies, never the model's shipped defaults (which `generate`
        # merges into every unset field), and the caller's model is left untouched.
        self.target = target  # shared with another generator of other sampling settings
        self.model = copy.copy(target.model)
        self.model.generation_config = GenerationConfig(
            eos_token_id=stop_ids, pad_token_id=pad_id, bos_token_id=target.model.generation_config.bos_token_id)
        self.device = target.device
        if self.device.type == "cpu" and cfg.cpu_threads is not None:
            torch.set_num_threads(cfg.cpu_threads)
        self.cfg, self.sampling = cfg, sampling
        self.stop_ids, self.pad_id = stop_ids, pad_id
        self.kwargs = dict(max_new_tokens=sampling.max_new_tokens, do_sample=False, num_beams=1)

    @classmethod
    def load(cls, spec: str, cfg: BackendConfig, sampling: SamplingConfig, stop_ids: list[int], pad_id: int,
             local_rank: int = 0, dtype: str = "auto", cache_dir: str | None = None) -> "HFGenerator":
        device = rank_device(cfg.device, local_rank)
        return cls(load_target(spec, dtype=dtype, device=device, cache_dir=cache_dir), cfg, sampling, stop_ids, pad_id)

    @torch.inference_mode()
    def _batch(self, prompts: list[list[int]], seeds: list[int]) -> list[Completion]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding: every row's next token is at the end
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        kwargs = dict(self.kwargs)
        if not self.sampling.greedy:
            u = uniform_stream(seeds, self.sampling.max_new_tokens).to(self.device)
            kwargs["logits_processor"] = [_SeededSampler(u, width, self.sampling)]
        out = self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device), **kwargs)
        return [trim_response(row[width:].tolist(), self.stop_ids) for row in out]

    def generate(self, prompts: list[list[int]], seeds: list[int], deadline: float | None = None,
                 progress: Progress | None = None) -> list[Completion | None]:
        # Longest first: an out-of-memory batch fails at once, not at the end of a shard.
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        results: list[Completion | None] = [None] * len(prompts)
        size = self.cfg.batch_size
        for start in range(0, len(order), size):
            if past(deadline):  # the batches not begun stay None
                break
            chunk = order[start:start + size]
            answers = self._batch([prompts[i] for i in chunk], [seeds[i] for i in chunk])
            for i, completion in zip(chunk, answers):
                results[i] = completion
            if progress is not None:
                progress(len(answers), sum(len(a.ids) for a in answers))
        return results
