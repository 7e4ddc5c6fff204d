"""benchmarks/datagen_scaling.py, the table of datagen_two_gpu.sh, on out_dirs written here with
the pipeline's own shard and manifest writers: its numbers, its prompt-once check and when it
fails."""

from pathlib import Path

from benchmarks.datagen_scaling import main, table
from data_gen.cli import format_summary
from data_gen.pipeline import RunResult
from dflash_train.data import format as data_format

COUNTS = {"prompts": 4, "rows": 4, "tokens": 8, "response_tokens": 4, "retokenized": 0, "finish_reasons": {},
          "ended_early": {}, "skipped": {}, "skipped_examples": {}}


def summary(seconds: float, prompts_s: float = 0.0, build_s: float = 0.0, write_s: float = 0.0,
            magpie_s: float = 0.0, load_s: float = 0.0) -> str:
    """A rank's summary as dflash-datagen prints it."""
    return format_summary(RunResult("out", COUNTS, 1.0, 1, seconds, True, prompts_s=prompts_s, build_s=build_s,
                                    write_s=write_s, magpie_s=magpie_s, load_s=load_s)) + "\n"


def row(prompt_id: str, ids: list[int]) -> dict:
    return {"input_ids": ids, "loss_mask": [0] * (len(ids) - 1) + [1], "prompt_id": prompt_id, "source": "sharegpt",
            "finish_reason": "stop", "prompt_len": len(ids) - 1, "response_len": 1, "num_tokens": len(ids)}


def write_run(root: Path, gpus: int, shards: list[list[tuple[str, list[int]]]], rank_s: list[float],
              wall: tuple[int, int], generated_per_shard: int = 100, phases=None) -> None:
    """A finished run on ``gpus`` GPUs: shard k (of prompts and their input_ids) written by rank
    k % gpus, its manifest, its log with one summary line a rank and its wall-clock marks."""
    out = root / f"gpus-{gpus}"
    data_format.check_run(out, {})  # run.json: the folder is a run's (consolidate checks it)
    for k, prompts in enumerate(shards):
        data_format.write_shard(out, k, [row(p, ids) for p, ids in prompts],
                                {"shard": k, "prompt_ids": [p for p, _ in prompts], "rank": k % gpus,
                                 "generated_tokens": generated_per_shard})
    ids = {p for prompts in shards for p, _ in prompts}
    rows = sum(map(len, shards))
    data_format.consolidate(out, range(len(shards)), {"format_version": data_format.FORMAT_VERSION,
                                                      "num_shards": len(shards),
                                                      "counts": {"prompts": len(ids), "rows": rows}})
    phases = phases or [(0.0, 0.0)] * len(rank_s)
    (root / f"gpus-{gpus}.log").write_text("".join(summary(s, *p) for s, p in zip(rank_s, phases)))
    (root / f"gpus-{gpus}.t0").write_text(f"{wall[0]}\n")
    (root / f"gpus-{gpus}.t1").write_text(f"{wall[1]}\n")


SHARDS = [[("a", [1, 2]), ("b", [3, 4])], [("c", [5, 6]), ("d", [7, 8])]]


def cells(lines: list[str], gpus: int) -> list[str]:
    return next([c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith(f"| {gpus} |"))


def test_two_gpus_against_one_scaling_and_equal_rows(tmp_path, capsys):
    write_run(tmp_path, 1, SHARDS, [20.0], (100, 150))
    changed = [SHARDS[0], [("c", [5, 6]), ("d", [7, 9])]]  # one row differs (bf16 on a GPU)
    write_run(tmp_path, 2, changed, [9.0, 10.0], (200, 230),
              phases=[(14.2, 0.4, 1.5, 9.1, 3.0), (3.5, 6.25, 0.75, 0.0, 6.0)])
    lines, once, equal = table(tmp_path)
    # 200 tokens over 20 s against over the slower rank's 10 s: 2x, all of two GPUs' share
    assert cells(lines, 1) == ["1", "4", "4", "200", "50", "20.0", "10.0", "", ""]
    assert cells(lines, 2) == ["2", "4", "4", "200", "30", "10.0", "20.0", "100.0%", "83.3%"]
    assert ("2 GPU(s): ranks' answer seconds 9.0, 10.0; shards by rank: rank 0 1, rank 1 1; by process: prompts "
            "ready after 14.2 s (magpie 9.1 s), generator built in 0.4 s, shards written in 1.5 s, target loaded in "
            "3.0 s; prompts ready after 3.5 s (magpie 0.0 s), generator built in 6.2 s, shards written in 0.8 s, "
            "target loaded in 6.0 s") in lines
    assert "2 GPUs: 2.00x one GPU's tokens/s (target 1.9x: met)" in lines
    assert lines[-1].endswith("2 GPU(s) yes (4 distinct of 4 ids in the shards, 4 prompts); "
                              "rows equal to the 1-GPU run's: 3 of 4")
    assert once and not equal
    assert main([str(tmp_path)]) == 0, "bf16: a differing row is counted, not a failure"
    assert main([str(tmp_path), "--exact"]) == 1
    assert "--exact: not every run finished" in capsys.readouterr().err


def test_every_row_equal_passes_exact(tmp_path):
    write_run(tmp_path, 1, SHARDS, [20.0], (100, 150))
    write_run(tmp_path, 2, SHARDS, [12.0, 11.0], (200, 240))
    assert table(tmp_path)[1:] == (True, True)
    assert main([str(tmp_path), "--exact"]) == 0


def test_a_prompt_in_two_shards_fails(tmp_path, capsys):
    write_run(tmp_path, 1, SHARDS, [20.0], (100, 150))
    write_run(tmp_path, 2, [SHARDS[0], [("c", [5, 6]), ("a", [1, 2])]], [9.0, 10.0], (200, 230))
    lines, once, _ = table(tmp_path)
    assert not once and "2 GPU(s) NO (3 distinct of 4 ids in the shards, 3 prompts)" in lines[-1]
    assert main([str(tmp_path)]) == 1
    assert "a prompt id is missing or repeated" in capsys.readouterr().err


def test_runs_not_finished_show_their_state(tmp_path):
    write_run(tmp_path, 1, SHARDS, [20.0], (100, 150))
    (tmp_path / "gpus-1" / "manifest.json").unlink()  # ended without a dataset
    (tmp_path / "gpus-2.t0").write_text("100\n")
    lines, once, equal = table(tmp_path)
    assert cells(lines, 1) == ["1", "failed"] and cells(lines, 2)[1].startswith("running ")
    assert once and not equal and lines[-1] == "check: every prompt id exactly once: no run finished"
    assert main([str(tmp_path)]) == 0 and main([str(tmp_path), "--exact"]) == 1


def test_summaries_before_the_shard_seconds_still_parse():
    from benchmarks.datagen_scaling import PHASES

    old = "prompts ready after 45.8 (magpie writing included), answering generator built in 0.0 (of the 130.2)"
    assert PHASES.findall(old) == [("45.8", "", "0.0", "", "")]
    shards = ("prompts ready after 36.6 (magpie writing included), answering generator built in 0.0, shards written "
              "in 1.6 (of the 63.4)")
    assert PHASES.findall(shards) == [("36.6", "", "0.0", "1.6", "")]
    assert PHASES.findall(summary(20.0, 3.0, 1.0, 2.5, 1.5, 0.5)) == [("3.0", "1.5", "1.0", "2.5", "0.5")]
