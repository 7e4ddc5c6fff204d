"""Every command the README and docs/ show in a fenced block parses: each `dflash-*`,
`python -m dflash_train...` / `python -m data_gen.cli`, `torchrun ... -m ...` and launcher line
is read by its command's own settings loader (recipe, typed schema, cross-field checks) on the
CPU, without running it. A renamed key or recipe breaks this test before it breaks a reader."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from data_gen import cli as datagen_cli
from dflash_train import bench, quality, quickstart, train
from dflash_train.eval import cli as eval_cli
from dflash_train.eval import speed
from dflash_train.export import cli as export_cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPTS = {"dflash-train": "dflash_train.train", "dflash-datagen": "data_gen.cli", "dflash-eval": "dflash_train.eval.cli",
           "dflash-export": "dflash_train.export.cli", "dflash-quality": "dflash_train.quality",
           "dflash-quickstart": "dflash_train.quickstart", "dflash-bench": "dflash_train.bench"}
LAUNCHERS = ("launch/torchrun.sh", "launch/deepspeed.sh")
PLACEHOLDER = "..."  # "more overrides here" in an example, not an argument


def loaders(tmp: Path) -> dict:
    """Module -> its command's settings loader (the one its main uses)."""
    return {"dflash_train.train": train.load, "data_gen.cli": datagen_cli.load, "dflash_train.eval.cli": eval_cli.load,
            "dflash_train.eval.speed": speed.load, "dflash_train.export.cli": export_cli.load,
            "dflash_train.quality": quality.load, "dflash_train.quickstart": quickstart.load,
            "dflash_train.bench": lambda argv: bench.load(argv, str(tmp))}


def fenced_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command) of every line inside ``` fences, continuations joined."""
    found, inside, pending, start = [], False, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            inside, pending = not inside, ""
            continue
        if not inside:
            continue
        start = start if pending else number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        found.append((start, pending + line))
        pending = ""
    return found


def command_of(line: str) -> tuple[str, list[str]] | None:
    """(module, arguments) when ``line`` runs one of our commands; None for anything else."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None  # not shell (a table, printed output)
    while words and "=" in words[0] and not words[0].startswith(("-", "+")):
        words = words[1:]  # VAR=value before the command
    if not words:
        return None
    head, rest = Path(words[0]).name, words[1:]
    if head in SCRIPTS or head.startswith("dflash-"):
        found = (SCRIPTS.get(head, head), rest)
    elif head in ("python", "python3", "torchrun") and "-m" in rest:
        at = rest.index("-m")
        found = (rest[at + 1], rest[at + 2:])
    elif words[0] in LAUNCHERS and "--" in rest:
        found = ("dflash_train.bench" if "--bench" in rest[: rest.index("--")] else "dflash_train.train",
                 rest[rest.index("--") + 1:])
    elif head == "sbatch" and any(w.endswith(".sbatch") for w in rest):
        at = next(i for i, w in enumerate(rest) if w.endswith(".sbatch"))
        found = ("dflash_train.train", rest[at + 1:])
    else:
        return None
    module, args = found
    if not module.startswith(("dflash", "data_gen")):
        return None  # another project's command (vllm, sglang) or a benchmark script's own flags
    return module, [a for a in args if a != PLACEHOLDER and a != "&"]


def doc_commands() -> list[tuple[str, str, list[str]]]:
    found = []
    for path in DOCS:
        for number, line in fenced_lines(path.read_text(encoding="utf-8")):
            command = command_of(line)
            if command is not None:
                found.append((f"{path.relative_to(ROOT)}:{number}", *command))
    return found


COMMANDS = doc_commands()


@pytest.mark.parametrize("where, module, args", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_a_documented_command_parses(where, module, args, tmp_path):
    load = loaders(tmp_path).get(module)
    assert load is not None, f"{where}: {module} is not a command of ours"
    load(args)  # raises ValueError naming the key on a misspelled key, a missing value, a wrong type


def test_every_page_s_commands_are_found():
    pages = {where.split(":")[0] for where, _, _ in COMMANDS}
    assert {"README.md", "docs/datagen.md", "docs/training.md", "docs/distributed.md", "docs/export.md",
            "docs/runtime.md", "docs/quality.md", "docs/quickstart.md"} <= pages
    modules = {module for _, module, _ in COMMANDS}
    assert {"dflash_train.train", "data_gen.cli", "dflash_train.eval.cli", "dflash_train.export.cli",
            "dflash_train.quality", "dflash_train.bench", "dflash_train.eval.speed"} <= modules


def test_a_broken_command_in_a_page_is_caught(tmp_path):
    page = ("Train:\n\n```bash\nHF_HUB_OFFLINE=1 dflash-train +experiment=qwen3_8b_8xh100 \\\n"
            "    optim.lrr=3e-4 data.path=d output_dir=o\n```\n")
    ((number, line),) = fenced_lines(page)
    module, args = command_of(line)
    assert (number, module) == (4, "dflash_train.train")
    with pytest.raises(ValueError, match=r"unknown key optim.lrr \(did you mean optim.lr\?\)"):
        loaders(tmp_path)[module](args)


@pytest.mark.parametrize("line, expected", [
    ("torchrun --nproc_per_node 8 -m data_gen.cli target=qwen3_8b out_dir=d", ("data_gen.cli", ["target=qwen3_8b", "out_dir=d"])),
    ("launch/torchrun.sh --gpus 2 --bench -- backend=fsdp2 ...", ("dflash_train.bench", ["backend=fsdp2"])),
    ("sbatch --nodes 4 launch/slurm/torchrun.sbatch epochs=1", ("dflash_train.train", ["epochs=1"])),
    (".venv/bin/dflash-eval limit=10", ("dflash_train.eval.cli", ["limit=10"])),
    ("vllm serve Qwen/Qwen3-8B --port 8000 &", None),
    ("python -m benchmarks.quality_guard --target t", None),
    ("| training min | steps |", None),
])
def test_commands_are_told_apart(line, expected):
    assert command_of(line) == expected
