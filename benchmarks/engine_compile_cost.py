"""What a machine's first run pays to compile the engine's decode step (issue 39: the whole job's
first run on a fresh H200 took 42.4K tokens/s against 64.4K warm; the magpie writer's engine and
the answering engine each compiled about 35 s).

A target of Qwen2.5-0.5B's shape (random weights: compile time depends on the graph, not the
values) on the device; one after another in one process, engines of the settings a
`datagen_all_turns` job builds, each timed from its construction to the end of its first drain
(one short prompt: the decode step traced, compiled, captured), with what torch.compile counted
meanwhile (graphs compiled, inductor's FX-graph cache hits and misses). Rows of the cache hold
max_prompt_len and `rows new` tokens:

  answer          greedy, 512 new tokens (the answering engine)
  magpie          temperature 1.0, 256 new tokens, in rows as long as the answers' (as
                  data_gen/pipeline.py builds the magpie writer's engine)
  answer again    the first settings again (a second engine of one shape in one process)
  magpie, own rows  the magpie writer in rows of its own 256 new tokens (as it was built before)

    python -m benchmarks.engine_compile_cost [--cold] [--region layer|model] [--slots 512] [--max-prompt-len 3072]
    python -m benchmarks.engine_compile_cost --device cpu --tiny --slots 4 --max-prompt-len 64

--cold points inductor's and Triton's caches at a new empty folder first, as on a fresh machine.
--region: backend.compile_region, one decoder layer's code (layer, the default) or the whole forward (model).
--tiny: a 2-layer model of tiny widths (the CPU smoke).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

# (name, temperature, new tokens, new tokens the cache rows hold)
ENGINES = (("answer", 0.0, 512, 512), ("magpie", 1.0, 256, 512), ("answer again", 0.0, 512, 512),
           ("magpie, own rows", 1.0, 256, 256))


def target_model(device: str, tiny: bool, max_len: int):
    """Qwen2.5-0.5B's structure and widths (benchmarks/engine_host_cost.py's model), or with
    `tiny` a 2-layer model of tiny widths; random weights."""
    import torch

    from benchmarks.engine_host_cost import tiny_qwen
    from dflash_train.model.target import TargetModel

    if tiny:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=max_len,
                             tie_word_embeddings=True)
        torch.manual_seed(0)
        model = TargetModel(Qwen2ForCausalLM(config).eval())
    else:
        model = tiny_qwen(head_dim=64, intermediate=4864, vocab=151936, max_len=max_len)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model.model.to(device=device, dtype=dtype)
    return model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model of tiny widths (the CPU smoke)")
    p.add_argument("--slots", type=int, default=512)
    p.add_argument("--max-prompt-len", type=int, default=3072)
    p.add_argument("--cold", action="store_true", help="empty inductor and Triton caches first")
    p.add_argument("--region", choices=("layer", "model"), default="layer", help="backend.compile_region")
    args = p.parse_args(argv)
    if args.cold:  # read by inductor and Triton when they first look: before torch compiles anything
        root = tempfile.mkdtemp(prefix="engine-compile-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(root, "triton")
    import torch
    from torch._dynamo.utils import counters

    from data_gen.config import SamplingConfig
    from data_gen.engine import GenerationEngine

    target = target_model(args.device, args.tiny, args.max_prompt_len + 512)
    print(f"{'engine':<18}{'temperature':>12}{'max_new':>9}{'rows new':>10}{'seconds':>9}{'graphs':>8}{'fx hits':>9}"
          f"{'fx misses':>11}  caches {'cold' if args.cold else 'as found'}, {args.slots} slots, {args.device}, "
          f"compile_region={args.region}")
    for name, temperature, max_new, rows_new in ENGINES:
        before = {k: sum(counters[g][k] for g in ("stats", "inductor"))
                  for k in ("unique_graphs", "fxgraph_cache_hit", "fxgraph_cache_miss")}
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine = GenerationEngine(target, args.slots, args.max_prompt_len + rows_new,
                                  SamplingConfig(max_new_tokens=max_new, temperature=temperature), [0],
                                  attention="flex", compile=True, compile_region=args.region)
        engine.submit(0, [5, 6, 7, 8])
        done = list(engine.drain())
        if args.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        after = {k: sum(counters[g][k] for g in ("stats", "inductor")) - v for k, v in before.items()}
        assert len(done) == 1
        print(f"{name:<18}{temperature:>12}{max_new:>9}{rows_new:>10}{seconds:>9.1f}{after['unique_graphs']:>8}"
              f"{after['fxgraph_cache_hit']:>9}{after['fxgraph_cache_miss']:>11}")
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
