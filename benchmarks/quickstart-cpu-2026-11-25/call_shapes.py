"""CPU time of the hf generator on the quickstart's first N prompts, for three ways of cutting
them into `generate` calls, interleaved round by round (bf16 target, one thread):

  one batch a call, in prompt order (366852e), a shard of 64 a call (d93caa3), 8 batches a call (now)

    python benchmarks/quickstart-cpu-2026-11-25/call_shapes.py 128 3
"""

import statistics
import sys
import time

import torch

from data_gen.config import DatagenConfig
from data_gen.hf_generator import HFGenerator
from data_gen.pipeline import pad_token_id, setup
from dflash_train.model.target import load_target
from dflash_train.recipe import load_command


def main(n: int, rounds: int) -> None:
    torch.set_num_threads(1)
    args = ["--config-name", "datagen_quickstart", "out_dir=unused", f"num_prompts={n}"]
    cfg = load_command(DatagenConfig, args, "datagen", __doc__, DatagenConfig.validate)
    tokenizer, _, _, shaper, prompts, _ = setup(cfg)
    ids = [shaper.prompt(p.system, p.user_turns, [])[0] for p in prompts]
    target = load_target(cfg.target.name, dtype=torch.bfloat16)
    gen = HFGenerator(target, cfg.backend, cfg.sampling, shaper.stop_ids, pad_token_id(tokenizer, shaper))
    batch = cfg.backend.batch_size
    arms = {"one batch a call": batch, "a shard of 64 a call": 64, "8 batches a call": 8 * batch}
    cpu: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(rounds):
        for name, size in arms.items():
            start = time.process_time()
            for s in range(0, len(ids), size):
                gen.generate(ids[s:s + size], [0] * len(ids[s:s + size]))
            cpu[name].append(time.process_time() - start)
            print(f"round {r} {name}: {cpu[name][-1]:.1f} CPU s", flush=True)
    for name, values in cpu.items():
        print(f"{name}: median {statistics.median(values):.1f} CPU s over {rounds} rounds")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
