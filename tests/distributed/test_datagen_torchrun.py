"""Data parallel dflash-datagen: two torchrun ranks (gloo, CPU) write disjoint shards whose
union is exactly the single-process result; prompts the target writes (a magpie source) are
written by both ranks, a slice of each chunk each, and are those one process writes."""

import json

import subprocess
import sys

import pytest
import torch

from data_gen.pipeline import run
from dflash_train.data.format import load_generated, read_shard_meta
from data_gen.magpie import PROMPTS_DIR
from tests.datagen_helpers import compose_config, overrides, write_prompts

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
NUM_PROMPTS, MAGPIE, SHARD = 8, 2, 2


def test_two_ranks_equal_one_process(tmp_path, smollm2, smollm2_tokenizer):
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, NUM_PROMPTS)
    # batch_size == shard size: each shard is one left-padded batch, on any number of ranks.
    def args_for(out_dir):
        args = overrides(out_dir, prompts, shard_size=SHARD, batch_size=SHARD)
        return [a for a in args if not a.startswith("sources=")] + [
            f"sources=[{{kind: jsonl, path: {prompts}}}, {{kind: magpie, num_prompts: {MAGPIE}, max_tokens: 24}}]"]

    args = args_for(tmp_path / "ddp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "data_gen.cli", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]

    metas = [read_shard_meta(tmp_path / "ddp", k) for k in range((NUM_PROMPTS + MAGPIE) // SHARD)]
    by_rank = {r: [m["shard"] for m in metas if m["rank"] == r] for r in (0, 1)}
    assert by_rank == {0: [0, 2, 4], 1: [1, 3]}
    ids = {r: {p for m in metas if m["rank"] == r for p in m["prompt_ids"]} for r in (0, 1)}
    assert not ids[0] & ids[1] and len(ids[0] | ids[1]) == NUM_PROMPTS + MAGPIE

    single = compose_config(args_for(tmp_path / "single"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks' backend.cpu_threads=1
    try:
        run(single, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    finally:
        torch.set_num_threads(threads)
    ddp = load_generated(tmp_path / "ddp")
    assert ddp[:] == load_generated(tmp_path / "single")[:] and ddp["source"].count("magpie") == MAGPIE

    def chunks(out_dir):  # each chunk file's candidates
        return [[json.loads(line) for line in chunk.read_text().splitlines()]
                for chunk in sorted((out_dir / PROMPTS_DIR / "magpie").glob("*.jsonl"))]

    shared, alone = chunks(tmp_path / "ddp"), chunks(tmp_path / "single")
    # each rank wrote its slice of every chunk: rank 0 the first half (the larger), rank 1 the rest
    assert [[r.pop("rank") for r in c] for c in shared] == [[0] * -(-len(c) // 2) + [1] * (len(c) // 2) for c in alone]
    assert shared == alone and not list((tmp_path / "ddp" / PROMPTS_DIR / "magpie").glob(".*"))
