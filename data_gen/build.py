"""`build_generator`: the one place that maps the recipe's ``backend.kind`` to a generator.

It sits above the generators (hf_generator.py, engine.py, openai_generator.py), which import the
shared types from generators.py, so that no generator imports a module that imports it
back.
"""

from __future__ import annotations

from data_gen.config import BackendConfig, SamplingConfig


def build_generator(cfg: BackendConfig, sampling: SamplingConfig, target_spec: str, stop_ids: list[int],
                  pad_id: int, tokenizer, local_rank: int = 0, dtype: str = "auto", cache_dir: str | None = None,
                  target=None, max_prompt_len: int | None = None):
    """The generator ``cfg.kind`` names; `target` reuses an already loaded TargetModel (hf,
    engine). The engine sizes its KV cache rows for `max_prompt_len` + max_new_tokens."""
    if cfg.kind == "engine":
        from data_gen.engine import EngineGenerator

        assert max_prompt_len is not None, "the engine needs max_prompt_len to size its KV cache"
        if target is not None:
            return EngineGenerator(target, cfg, sampling, stop_ids, max_prompt_len)
        return EngineGenerator.load(target_spec, cfg, sampling, stop_ids, max_prompt_len, local_rank=local_rank,
                                    dtype=dtype, cache_dir=cache_dir)
    if cfg.kind == "hf":
        from data_gen.hf_generator import HFGenerator

        if target is not None:
            return HFGenerator(target, cfg, sampling, stop_ids, pad_id)
        return HFGenerator.load(target_spec, cfg, sampling, stop_ids, pad_id, local_rank=local_rank, dtype=dtype,
                              cache_dir=cache_dir)
    from data_gen.openai_generator import OpenAIGenerator

    return OpenAIGenerator(cfg, sampling, stop_ids, tokenizer, model_name=cfg.model or target_spec)
