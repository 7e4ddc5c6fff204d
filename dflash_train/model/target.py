"""The frozen target LLM: loading (HF id, local dir, GGUF file) and feature extraction.

A target spec is one string:
  * an HF Hub id (``Qwen/Qwen3-8B``) or a local model directory,
  * a ``.gguf`` file, or a directory holding exactly one ``.gguf`` file,
  * ``pkg:<package>/<file>``: a file shipped inside an installed Python package (how the
    offline default SmolLM2 GGUF arrives). The package is located, never imported.

GGUF files are dequantized once into a safetensors folder under the cache directory and
reused from there (dequantizing takes 10-40 s per load).
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dflash_train.atomic import atomic_write
from dflash_train.model.dflash import EMBEDDING_OFFSET, target_features
from dflash_train.resources import PKG_SCHEME, resolve_path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# Inductor options of the compiled target layers, by target.compile_rounding.
# emulate_precision_casts: a fused chain of low-precision ops rounds to the tensor's dtype
# where the eager ops would, instead of carrying float32 through the fusion and rounding
# once at the end (inductor's default, "fused").
COMPILE_OPTIONS = {"eager": {"emulate_precision_casts": True}, "fused": {}}
HUB_PROBE_TIMEOUT_S = 5


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "dflash_train"


def _find_gguf(spec: str) -> Path | None:
    """The GGUF file a spec names, or None when it names a regular HF model."""
    path = resolve_path(spec, f"target {spec!r}")
    if spec.startswith(PKG_SCHEME) and not path.exists():
        raise ValueError(f"target {spec!r}: {path} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        if len(ggufs) > 1:
            raise ValueError(f"target {spec!r}: several .gguf files in {path}: {[g.name for g in ggufs]}")
    if spec.startswith(PKG_SCHEME):
        raise ValueError(f"target {spec!r}: {path} is not a .gguf file")
    return None


def _file_digest(path: Path, limit: int = 1 << 20) -> str:
    """Cheap identity of a big file: its size plus a hash of its first and last MiB."""
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        h.update(f.read(limit))
        f.seek(max(0, path.stat().st_size - limit))
        h.update(f.read(limit))
    return h.hexdigest()[:16]


# Written beside the weights of a dequantized GGUF: the file it came from.
SOURCE_FILE = "dflash_source.json"


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF file into an HF folder (bf16 safetensors + tokenizer), atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    # save_pretrained refuses a GGUF-loaded model until its quantizer marks are cleared.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        source = {"gguf": gguf.name, "digest": _file_digest(gguf), "weights": _folder_weights(tmp)}
        (tmp / SOURCE_FILE).write_text(json.dumps(source))

    try:
        atomic_write(out, write, folder=True, replace=False)
    except OSError:
        if not (out / "config.json").exists():  # lost a race only if the winner finished
            raise


def _looks_like_path(spec: str) -> bool:
    """A spec a hub id can never be: absolute, relative with dots, home, or a file name."""
    return (spec.startswith(("/", "./", "../", "~")) or spec.endswith(".gguf") or spec.count("/") > 1
            or os.sep != "/" and os.sep in spec)


def _check_hub_id(spec: str) -> None:
    """Fail in seconds, naming the cause, when a hub id cannot be fetched: not cached and
    either offline mode or no network (the hub client would retry for about a minute)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(spec, "config.json"), str):
        return
    where = f"target {spec!r} is neither a local path nor in the Hugging Face cache"
    if constants.HF_HUB_OFFLINE:
        raise ValueError(f"{where}, and HF_HUB_OFFLINE is set: download it where there is a network "
                         "(hf download) or give a local folder")
    url = f"{constants.ENDPOINT}/api/models/{spec}"
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=HUB_PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return  # the hub answered: a missing or gated repo is reported by the hub client itself
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise ValueError(f"{where}, and {constants.ENDPOINT} cannot be reached ({reason}): "
                         "give a local folder or run where the hub is reachable") from None


def resolve_target(spec: str, cache_dir: str | os.PathLike | None = None) -> str:
    """A path or hub id that ``from_pretrained`` loads directly (GGUF converted once)."""
    if not spec:
        raise ValueError("target is empty: give an HF id, a model directory or a .gguf file")
    gguf = _find_gguf(spec)
    if gguf is None:
        if not Path(spec).exists():
            if _looks_like_path(spec):
                raise ValueError(f"target {spec!r}: no such file or folder")
            _check_hub_id(spec)
        return spec
    out = Path(cache_dir or default_cache_dir()) / "targets" / f"{gguf.stem}-{_file_digest(gguf)}"
    if not (out / "config.json").exists():
        _convert_gguf(gguf, out)
    return str(out)


def _hub_snapshot(spec: str) -> Path | None:
    """The local snapshot folder of a cached hub model, without any network access."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(spec, "config.json")
    return Path(found).parent if isinstance(found, str) else None


def weights_digest(spec: str) -> str:
    """Identity of a target's weights by content, whatever path or hub id names them.

    A GGUF file: its digest (the tokenizer is inside it too). A model folder, or the cached
    snapshot of a hub id: the digests of its weight files (size plus first and last MiB of
    each, which tell apart any two checkpoints in practice at a fraction of a full hash).
    """
    gguf = _find_gguf(spec)
    if gguf is not None:
        return "gguf-" + _file_digest(gguf)
    folder = Path(spec) if Path(spec).is_dir() else _hub_snapshot(spec)
    if folder is None:
        return f"hub-{spec}"  # not downloaded: only the name can be compared
    weights = _folder_weights(folder)
    if weights is None:  # a tokenizer and config only (the openai backend's server holds the weights)
        config = folder / "config.json"
        return "config-" + (hashlib.sha256(config.read_bytes()).hexdigest()[:16] if config.is_file() else spec)
    return _gguf_of_copy(folder, weights) or weights


def _folder_weights(folder: Path) -> str | None:
    files = sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}:{_file_digest(f)};".encode())
    return "weights-" + h.hexdigest()[:16]


def _gguf_of_copy(folder: Path, weights: str) -> str | None:
    """The identity of the GGUF file ``folder`` was dequantized from (its dflash_source.json),
    when its weights are still the ones written then: a GGUF and our copy of it are one
    target. Copies of older versions recorded no weights digest: their source is taken."""
    try:
        source = json.loads((folder / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(source, dict) or not source.get("digest") or source.get("weights", weights) != weights:
        return None
    return "gguf-" + source["digest"]


def target_identity(spec: str, cache_dir: str | os.PathLike | None = None) -> dict:
    """What names a target's weights: used in data manifests and model cards.

    ``weights`` is what data checks compare; ``spec`` and ``name_or_path`` say where they
    were found; ``revision`` is the identity older manifests recorded (kept comparable)."""
    path = resolve_target(spec, cache_dir)
    ident = {"spec": spec, "name_or_path": path, "weights": weights_digest(spec)}
    gguf = _find_gguf(spec)
    if gguf is not None:
        ident["revision"] = ident["weights"]
    elif Path(path, "config.json").exists():
        ident["revision"] = "dir-" + hashlib.sha256(Path(path, "config.json").read_bytes()).hexdigest()[:16]
    else:
        ident["revision"] = "hub"
    return ident


def load_tokenizer(spec: str, cache_dir: str | os.PathLike | None = None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_target(spec, cache_dir))


class _StopForward(Exception):
    """Raised by a forward hook to end the target's forward after the last needed layer."""


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer stack of an HF causal LM (``model.model.layers`` for Llama/Qwen)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"target {type(model).__name__} has no decoder layer list at .model.layers")
    return layers


@dataclass
class TargetModel:
    """A frozen HF causal LM and the pieces of it a DFlash drafter uses."""

    model: nn.Module

    def __post_init__(self):
        self.model.eval().requires_grad_(False)

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return len(decoder_layers(self.model))

    @property
    def hidden_size(self) -> int:
        return self.model.get_input_embeddings().weight.shape[1]

    @property
    def vocab_rows(self) -> int:
        """Rows of the input embedding: every valid token id (mask id included) is below it."""
        return self.model.get_input_embeddings().weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        """The output projection; it is the embedding when ``tie_word_embeddings`` is set."""
        return self.model.get_output_embeddings()

    def compile_layers(self, rounding: str = "eager") -> None:
        """``torch.compile`` each decoder layer's forward, fusing what runs between the
        matmuls (RMSNorm in float32, rotary, SiLU-and-multiply, residual adds), which an
        eager forward runs as separate kernels over the whole row. Only ``forward`` is
        compiled, so the feature hooks stay outside the graph; the layers share one code
        object, so one graph serves them all (their weights are its inputs).
        ``rounding``: a key of ``COMPILE_OPTIONS`` (target.compile_rounding)."""
        options = COMPILE_OPTIONS[rounding]
        for layer in decoder_layers(self.model):
            layer.forward = torch.compile(layer.forward, options=options)

    def uncompile_layers(self) -> None:
        """Undo ``compile_layers``: every layer runs its class's eager forward again."""
        for layer in decoder_layers(self.model):
            layer.__dict__.pop("forward", None)

    def features(self, input_ids, layer_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        """Concatenated outputs of decoder layers ``layer_ids``: (b, T, len(ids) * hidden).

        The forward stops after ``max(layer_ids)``; the LM head is never run. The last
        layer's entry in HF's ``hidden_states`` is taken after the final norm, so that id
        is served by a full forward to keep the semantics of ``hidden_states[i + 1]``.
        """
        return self._forward(input_ids, layer_ids, attention_mask, position_ids, final=False)[0]

    def features_and_final(self, input_ids, layer_ids, attention_mask=None,
                           position_ids=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``features`` and the final hidden states after the final norm, (b, T, hidden):
        what the LM head turns into the target's next-token logits (for distillation).

        The forward then runs every layer instead of stopping after ``max(layer_ids)``
        (the default ids stop 3 layers early, so about 10% more target compute on 36
        layers); the LM head is still not run here.
        """
        return self._forward(input_ids, layer_ids, attention_mask, position_ids, final=True)

    def _forward(self, input_ids, layer_ids, attention_mask, position_ids, final: bool):
        n = self.num_layers
        bad = [i for i in layer_ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"target_layer_ids={list(layer_ids)} but the target has {n} layers (0..{n - 1})")
        kwargs = dict(attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        base = getattr(self.model, "model", self.model)  # the decoder stack without the LM head
        if max(layer_ids) == n - 1:
            out = (base if final else self.model)(input_ids, output_hidden_states=True, **kwargs)
            feats = target_features(out.hidden_states, layer_ids)
            return feats, (out.last_hidden_state if final else None)
        captured: dict[int, torch.Tensor] = {}
        last = max(layer_ids)
        layers = decoder_layers(self.model)

        def hook(idx):
            def fn(_module, _inputs, output):
                # Stored where hidden_states would hold it, so one function concatenates both.
                captured[idx + EMBEDDING_OFFSET] = output[0] if isinstance(output, tuple) else output
                if idx == last and not final:
                    raise _StopForward

            return fn

        handles = [layers[i].register_forward_hook(hook(i)) for i in sorted(set(layer_ids))]
        out = None
        try:
            out = base(input_ids, **kwargs)
        except _StopForward:
            pass
        finally:
            for h in handles:
                h.remove()
        feats = target_features(captured, layer_ids)
        return feats, (out.last_hidden_state if final else None)


def target_dtype(dtype: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """The torch dtype of a target recipe's ``dtype`` on ``device``: ``auto`` is float32 on
    CPU and bfloat16 on an accelerator (never the checkpoint's own dtype: a GGUF converted
    into the cache is float32, which would make a GPU target run 4x slower)."""
    if dtype == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def load_target(
    spec: str,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike | None = None,
) -> TargetModel:
    """Load a frozen target. ``dtype='auto'`` is float32 on CPU and bfloat16 elsewhere (see
    ``target_dtype``; a caller that loads on the CPU and moves the model later resolves it
    for the device the model will run on)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_target(spec, cache_dir), dtype=target_dtype(dtype, device))
    return TargetModel(model.to(device))


def stop_token_ids(tokenizer, generation_config=None) -> list[int]:
    """Ids that end an assistant turn: the generation config's eos ids (one or a list), then
    the tokenizer's, without repeats; empty when neither has one. Data generation records
    this order in its manifest; decoding only tests membership."""
    ids: list[int] = []
    eos = getattr(generation_config, "eos_token_id", None)
    for i in [*(eos if isinstance(eos, (list, tuple)) else [eos]), tokenizer.eos_token_id]:
        if i is not None and i not in ids:
            ids.append(int(i))
    return ids


def template_sha256(template: str | None) -> str | None:
    return None if template is None else hashlib.sha256(template.encode()).hexdigest()[:16]


def tokenizer_identity(tokenizer) -> dict:
    """What of a tokenizer the training data depends on, field by field.

    The rows hold token ids and a loss mask already, so labels depend on what an id means
    (the vocabulary: every token string and its id, added tokens included) and on the chat
    template the conversations were rendered with (which the drafter will be served with).
    Left out on purpose: which tokens a library version calls "special" and the stop-id
    list. Both vary across transformers versions for the same file (Qwen2.5's GGUF: stop
    ids [151645, 151643] under 5.17, [151645] under 5.2x) and neither changes a stored row:
    stop ids only decided where generation ended, which the rows already record (the
    manifest keeps them under template.stop_token_ids)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    template = getattr(tokenizer, "chat_template", None)
    return {"vocab_size": len(vocab),
            "vocab_sha256": hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16],
            "chat_template_sha256": template_sha256(
                template if template is None or isinstance(template, str) else json.dumps(template, sort_keys=True))}


def tokenizer_hash(tokenizer) -> str:
    """The tokenizer identity of manifests before ``tokenizer_identity``: vocabulary,
    specials and template in one hash. Its specials make it depend on the transformers
    version; it is still written, for older readers, and read from older manifests."""
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": sorted(str(t) for t in tokenizer.all_special_tokens),
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
