"""The whole pipeline on the embedded SmolLM2 target, CPU only: `dflash-quickstart`.

Four stages, each the project's own console script with its quickstart recipe:
  1. dflash-datagen  regenerate a few hundred ShareGPT answers with the target itself
  2. dflash-train    train a small drafter on them and export it
  3. dflash-eval     a fresh drafter of the same shape (the tau ~ 1 baseline)
  4. dflash-eval     the trained drafter
A stage whose output is complete is reused, so running the command again is cheap and an
interrupted run continues where it stopped (data generation and training resume inside
their stage too). Settings are Hydra overrides of recipes/quickstart.yaml (or of the recipe
--config-name names): `long=true` trains twice as long (recipes/train_quickstart_long.yaml)
in a folder of its own; datagen=[...], train=[...] and eval=[...] list each stage's own
overrides, each item quoted: `dflash-quickstart 'train=["optim.lr=1e-3"]'`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash_train.console import command_lines, note_lines
from dflash_train.data.format import check_out_dir
from dflash_train.errors import check_writable_dir, run_command
from dflash_train.recipe import compose_recipe, load_command, quote_value
from dflash_train.run_lock import hold_folder, stage_env
from dflash_train.training.run_dir import EXPORT_DIR, MANIFEST_COPY, check_output_dir

DATA_DIR = "data/quickstart-smollm2"
RUN_DIR = "runs/quickstart-smollm2"
# First turns only: the drafter trains on single-turn answers, and the README's table is
# measured this way (dflash-eval asks MT-Bench's second question by default). The ten
# prompts of a dataset are decoded as one batch: the table reports acceptance and agreement,
# which batching keeps, and the evaluation takes a third of the time of one prompt at a time
# (the batch-1 latency numbers: `dflash-eval ... batch_size=1`).
EVAL_ARGS = ["datasets=[mtbench,humaneval]", "limit=10", "max_new_tokens=64", "max_turns=1", "batch_size=10"]
# The fresh drafter is the tau ~ 1 baseline: almost none of its drafts is accepted at any
# length, so it answers the same prompts in 8 tokens: 21 s for the stage on the bf16 CPU
# against 27 s at 16 tokens, most of the rest the process's start and the prompts' prefill.
FRESH_EVAL_ARGS = [a if not a.startswith("max_new_tokens=") else "max_new_tokens=8" for a in EVAL_ARGS]
RECIPE, LONG_RECIPE = "train_quickstart", "train_quickstart_long"
# The flags before dflash-quickstart took key=value settings: refused, naming what replaced each.
RETIRED_FLAGS = {"--long": "long=true", "--run-dir": "run_dir=DIR"}
# The quickstart recipes run the target in bf16 and train under bf16 autocast: 2.4x faster
# than float32 on a CPU with bf16 instructions, and about 10x slower on one without them
# (data generation at 20 tok/s against 255 on two AMD EPYC cores of each kind). There the
# stages get float32 instead, before the user's own overrides.
NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 flags; "bf16" is an Arm feature
FLOAT32_OVERRIDES = {"datagen": ["target.dtype=float32"],
                     "train": ["target.dtype=float32", "backend.mixed_precision=none"], "eval": []}


@dataclass
class QuickstartConfig:
    """Every setting of dflash-quickstart; recipes/quickstart.yaml says what each one does."""

    long: bool = False
    run_dir: str | None = None  # None: RUN_DIR, or RUN_DIR-long
    datagen: list[str] = field(default_factory=list)
    train: list[str] = field(default_factory=list)
    eval: list[str] = field(default_factory=list)

    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir or RUN_DIR + ("-long" if self.long else ""))


def _script(name: str) -> str:
    """A console script installed beside this interpreter (the venv's bin/)."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise SystemExit(f"dflash-quickstart: {path} not found; install the project first (make setup)")
    return str(path)


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU computes bf16 natively, from the flags of ``/proc/cpuinfo``
    (``cpuinfo``: its text). Unknown (no such file) counts as no: float32 is never slow."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features") and NATIVE_BF16_FLAGS & set(value.split()):
            return True
    return False


def stage_overrides(extra: dict[str, list[str]], native_bf16: bool) -> dict[str, list[str]]:
    """Each stage's overrides: float32 on a CPU without bf16 instructions, then the user's."""
    return {stage: ([] if native_bf16 else FLOAT32_OVERRIDES[stage]) + given for stage, given in extra.items()}


def drafter_shape(recipe: str, train_overrides: list[str]) -> list[str]:
    """dflash-eval settings for a fresh drafter of the shape ``recipe`` (with the training
    stage's overrides) trains: the baseline is the same model, untrained."""
    from dflash_train.config import TrainConfig

    d = compose_recipe(TrainConfig, recipe, [f"data.path={DATA_DIR}", *train_overrides]).drafter
    ids = "null" if d.target_layer_ids is None else "[" + ",".join(str(i) for i in d.target_layer_ids) + "]"
    return [f"drafter.num_hidden_layers={d.num_hidden_layers}", f"drafter.block_size={d.block_size}",
            f"drafter.num_features={'null' if d.num_features is None else d.num_features}",
            f"drafter.target_layer_ids={ids}"]


def _stages(run_dir: Path, extra: dict[str, list[str]], recipe: str = RECIPE) -> list[tuple[str, Path, list[str]]]:
    """(name, file that marks the stage done, command); ``recipe``: the training recipe."""
    export = run_dir / "export"
    return [
        ("datagen", Path(DATA_DIR) / "manifest.json",
         [_script("dflash-datagen"), "--config-name", "datagen_quickstart", f"out_dir={DATA_DIR}", *extra["datagen"]]),
        ("train", export / "model.safetensors",
         [_script("dflash-train"), "--config-name", recipe, f"output_dir={quote_value(str(run_dir))}",
          f"data.path={DATA_DIR}", *extra["train"]]),
        ("eval-fresh", run_dir / "eval_fresh" / "results.json",
         [_script("dflash-eval"), "drafter_path=random", *drafter_shape(recipe, extra["train"]),
          f"output_dir={quote_value(str(run_dir / 'eval_fresh'))}",
          *FRESH_EVAL_ARGS, *extra["eval"]]),
        ("eval-trained", run_dir / "eval" / "results.json",
         [_script("dflash-eval"), f"drafter_path={quote_value(str(export))}",
          f"output_dir={quote_value(str(run_dir / 'eval'))}", *EVAL_ARGS,
          *extra["eval"]]),
    ]


def _table(run_dir: Path) -> str:
    """tau of both drafters and the lossless check; the trained drafter's speedup only in
    the sentence that says where speculative decoding pays (a GPU) and by how much there."""
    from dflash_train.eval.report import cpu_speedup_note

    fresh = json.loads((run_dir / "eval_fresh" / "results.json").read_text())["datasets"]
    trained = json.loads((run_dir / "eval" / "results.json").read_text())["datasets"]
    rows = [f"{'dataset':<10} {'prompts':>7} {'tau fresh':>9} {'tau trained':>11} {'agreement':>9}"]
    for name, t in trained.items():
        agree = t["greedy_agreement"]
        rows.append(f"{name:<10} {t['num_prompts']:>7} {fresh[name]['tau']:>9.2f} {t['tau']:>11.2f} "
                    f"{'-' if agree is None else f'{100 * agree:.0f}%':>9}")
    batch = max(t.get("batch_size", 1) for t in trained.values())
    rows += note_lines(cpu_speedup_note({name: (t["tau"], t["speedup"]) for name, t in trained.items()}, batch))
    return "\n".join(rows)


def _held_out(run_dir: Path) -> str | None:
    """The last validation of the training log, beside the training rows' figure."""
    from dflash_train.training.logging import METRICS_FILE

    log = run_dir / METRICS_FILE
    lines = log.read_text().splitlines() if log.exists() else []
    last = next((json.loads(line) for line in reversed(lines) if "val_expected_tau" in line), None)
    if last is None:
        return None
    return (f"expected tau at step {last['step']}: {last['val_expected_tau']:.2f} on held-out conversations, "
            f"{last['expected_tau']:.2f} on training rows (teacher-forced, from the per-position accuracy)")


def main(argv: list[str] | None = None) -> None:
    run_command("dflash-quickstart", _run, argv)


def _run(argv: list[str] | None) -> None:
    cfg = load_command(QuickstartConfig, argv, "quickstart", __doc__, retired=RETIRED_FLAGS)
    run_dir = cfg.resolved_run_dir()
    native_bf16 = cpu_has_native_bf16()
    if not native_bf16:
        print("this CPU has no bf16 instructions (AVX512-BF16, AMX or Arm BF16): the target runs in float32 "
              "and training without bf16 autocast", flush=True)
    extra = stage_overrides({"datagen": cfg.datagen, "train": cfg.train, "eval": cfg.eval}, native_bf16)
    # The folders its stages write, held for them (a second quickstart is refused at once).
    with hold_folder(DATA_DIR, "the quickstart data folder", "dflash-quickstart"), \
            hold_folder(run_dir, "run_dir", "dflash-quickstart"):
        _stages_in(run_dir, extra, cfg.long)


def _stages_in(run_dir: Path, extra: dict, long: bool) -> None:
    # Before the first stage: a folder of the user's is refused now, not after minutes of
    # data generation (each stage applies the same rule again to its own folder).
    check_out_dir(DATA_DIR)
    check_output_dir(run_dir, (f"{EXPORT_DIR}/*", MANIFEST_COPY, "eval/*", "eval_fresh/*"), key="run_dir")
    check_writable_dir(run_dir, "run_dir")
    check_writable_dir(DATA_DIR, "the quickstart data folder")
    start = time.perf_counter()
    for i, (name, done, command) in enumerate(_stages(run_dir, extra, LONG_RECIPE if long else RECIPE), 1):
        if done.exists():
            print(f"[{i}/4] {name}: done already ({done}), reused", flush=True)
            continue
        print(command_lines(f"[{i}/4] {name}:", [Path(command[0]).name, *command[1:]]), flush=True)
        t0 = time.perf_counter()
        if subprocess.run(command, env=stage_env()).returncode != 0:
            raise SystemExit(f"dflash-quickstart: stage {name} failed; fix the error above and run again "
                             f"(finished stages are reused)")
        print(f"[{i}/4] {name}: finished in {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"\nDFlash drafter for SmolLM2-135M-Instruct ({time.perf_counter() - start:.0f} s in all)")
    print(_table(run_dir))
    held_out = _held_out(run_dir)
    if held_out:
        print(held_out)
    print(f"\nexported drafter: {run_dir / 'export'}")
    print(f"acceptance plots: {run_dir / 'eval' / 'acceptance.png'}, {run_dir / 'eval_fresh' / 'acceptance.png'}")


if __name__ == "__main__":
    main()
