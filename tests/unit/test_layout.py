"""The import graph runs one way, between files and not only between folders: every
import, lazy ones inside functions included, goes from a layer to itself or to a layer
below it in LAYERS, and no module imports one that imports it back, directly or through
others (no cycle, inside a layer too).

A module belongs to the layer of the longest prefix that names it. The layers, low to high:
the foundations (errors, resources, atomic writes, the contract and the single-file drafter,
which is copied beside exports and so imports nothing of ours), the data formats both sides
of the pipeline share, the structured config, then data, model (the model card beside an
export included), evaluation, distributed and training, export (the Hub push, which reads what
training writes), the commands, and data_gen on top
(it may use dflash_train, never the reverse). A command (a CLI module) sits above every
library, whatever its folder: eval/cli.py and export/cli.py read what the trainer writes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dflash_train", "data_gen")
LAYERS = (
    ("dflash_train.errors", "dflash_train.resources", "dflash_train.atomic", "dflash_train.contract",
     "dflash_train.contract_base", "dflash_train.model.dflash", "dflash_train.model.dflash2", "dflash_train.recipe",
     "dflash_train.console"),
    ("dflash_train.data.format", "dflash_train.data.prompts"),
    ("dflash_train.config",),
    ("dflash_train.data",),
    ("dflash_train.model",),
    ("dflash_train.eval",),
    ("dflash_train.distributed", "dflash_train.training"),
    ("dflash_train.export", "dflash_train.run_lock"),
    ("dflash_train.train", "dflash_train.bench", "dflash_train.quickstart", "dflash_train.quality",
     "dflash_train.eval.cli", "dflash_train.eval.speed", "dflash_train.export.cli"),
    ("data_gen",),
)


def layer_of(module: str) -> int | None:
    """Index in LAYERS of the longest prefix naming ``module`` (None: not ours)."""
    best, best_len = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every import in ``source``, at any depth (functions, if blocks)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod when it is one of ours.
            found += [(node.lineno, f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}") else base)
                      for alias in node.names]
    return list(dict.fromkeys(found))  # one entry per module a statement imports


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    own = layer_of(module)
    bad = []
    for line, name in imported_modules(source, module, is_package):
        theirs = layer_of(name)
        if theirs is not None and theirs > own:
            bad.append(f"{module}:{line} imports {name} (layer {theirs} {LAYERS[theirs][0]}) "
                       f"from layer {own} ({LAYERS[own][0]})")
    return bad


def our_modules() -> list[Path]:
    """Every module of PACKAGES; empty package markers (__init__.py) hold no code to place."""
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py")
                  if p.name != "__init__.py" or p.read_text(encoding="utf-8").strip())


def import_graph(planted: dict[str, str] | None = None) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports; ``planted`` adds source text to a module."""
    graph = {}
    for path in our_modules():
        module = module_name(path)
        source = path.read_text(encoding="utf-8") + "\n" + (planted or {}).get(module, "")
        graph[module] = {name for _, name in imported_modules(source, module, path.name == "__init__.py")
                         if layer_of(name) is not None and name != module}
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle (first module == last) through each module that imports itself back."""
    cycles, covered = [], set()
    for start in sorted(graph):
        if start in covered or start not in _reachable(graph, start):
            continue
        # breadth first: the shortest path from start back to start
        parent, frontier = {start: None}, [start]
        while not any(start in graph.get(m, ()) for m in frontier):
            step = []
            for m in frontier:
                for n in sorted(graph.get(m, ())):
                    if n not in parent:
                        parent[n] = m
                        step.append(n)
            frontier = step
        last = next(m for m in frontier if start in graph.get(m, ()))
        path = [start]
        while last is not None:
            path.append(last)
            last = parent[last]
        cycles.append(path[::-1])
        covered |= set(path)
    return cycles


def test_every_module_has_a_layer():
    unplaced = [module_name(p) for p in our_modules() if layer_of(module_name(p)) is None]
    assert not unplaced, f"add these modules to LAYERS: {unplaced}"


def test_dependencies_run_one_way():
    bad = []
    for path in our_modules():
        bad += violations(path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_module_imports_itself_back():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("module, source, cycle", [
    # two modules of one layer, through a lazy import inside a function
    ("dflash_train.distributed.backend", "def f():\n    from dflash_train.distributed.build import build_backend\n",
     ["dflash_train.distributed.backend", "dflash_train.distributed.build", "dflash_train.distributed.backend"]),
    # three modules of one layer: the state files' format importing the trainer
    ("dflash_train.training.state_files", "from dflash_train.training.trainer import Trainer\n",
     ["dflash_train.distributed.backend", "dflash_train.training.state_files", "dflash_train.training.trainer",
      "dflash_train.distributed.backend"]),
])
def test_a_planted_cycle_is_caught(module, source, cycle):
    assert cycle in import_cycles(import_graph({module: source}))


def test_cycles_are_found_at_any_length():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"], ["e", "e"]]


def test_the_dflash2_file_imports_only_the_drafter_file_beside_it():
    # model/dflash2.py is copied beside a DFlash2 export next to dflash.py, which it imports
    # relatively (trust_remote_code resolves it there).
    source = (ROOT / "dflash_train/model/dflash2.py").read_text(encoding="utf-8")
    ours = [name for _, name in imported_modules(source, "dflash_train.model.dflash2") if layer_of(name) is not None]
    assert ours == ["dflash_train.model.dflash"]
    assert "from .dflash import" in source


def test_the_drafter_file_imports_nothing_of_ours():
    # model/dflash.py is copied verbatim beside every export: it must stand alone.
    source = (ROOT / "dflash_train/model/dflash.py").read_text(encoding="utf-8")
    ours = [name for _, name in imported_modules(source, "dflash_train.model.dflash") if layer_of(name) is not None]
    assert ours == []


@pytest.mark.parametrize("module, source, found", [
    # a lazy import inside a function counts like a top-level one
    ("dflash_train.model.card", "def f():\n    from dflash_train.training.trainer import Trainer\n",
     "dflash_train.model.card:2 imports dflash_train.training.trainer"),
    ("dflash_train.training.trainer", "import data_gen.pipeline\n", "imports data_gen.pipeline"),
    ("dflash_train.data.format", "from dflash_train.eval import cli\n", "imports dflash_train.eval.cli"),
    ("dflash_train.model.target", "from ..training import loss\n", "imports dflash_train.training.loss"),
    ("dflash_train.contract", "if True:\n    from dflash_train.config import TrainConfig\n",
     "imports dflash_train.config (layer 2"),
    ("dflash_train.training.trainer", "from dflash_train.export.cli import find_checkpoint\n",
     "imports dflash_train.export.cli"),
    ("dflash_train.training.trainer", "from dflash_train.export.hub import push_to_hub\n",
     "imports dflash_train.export.hub (layer 7"),
])
def test_an_import_against_the_direction_is_caught(module, source, found):
    (message,) = violations(source, module)
    assert found in message


def test_imports_along_the_direction_pass():
    assert violations("from dflash_train.training.trainer import Trainer\nimport torch\n", "dflash_train.train") == []
    assert violations("from dflash_train.data.format import load_generated\n", "data_gen.pipeline") == []
    assert violations("from dflash_train.model.card import model_card_files\n", "dflash_train.training.trainer") == []
    assert violations("from dflash_train.training.run_dir import EXPORT_DIR\n", "dflash_train.export.cli") == []


def private_imports(source: str, module: str, packages: tuple[str, ...]) -> list[str]:
    """Each ``from X import _name`` in ``source`` where X is a module of ``packages``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in packages:
            found += [f"{module}:{node.lineno} imports {node.module}.{alias.name}" for alias in node.names
                      if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def test_no_private_name_is_imported_across_modules():
    """A leading underscore means "this module's own": a name another module needs gets a
    public name in its home. Tests may import the private helper they test, never another
    test file's (a shared helper is public)."""
    code = [p for folder in (*PACKAGES, "benchmarks") for p in sorted((ROOT / folder).rglob("*.py"))]
    bad = [line for p in code
           for line in private_imports(p.read_text(encoding="utf-8"), module_name(p), (*PACKAGES, "benchmarks"))]
    bad += [line for p in sorted((ROOT / "tests").rglob("*.py"))
            for line in private_imports(p.read_text(encoding="utf-8"), module_name(p), ("tests",))]
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_a_private_import_is_caught():
    source = "from dflash_train.eval.batched import Rows, _first_tokens\nfrom torch._dynamo import config\n"
    assert private_imports(source, "x", PACKAGES) == ["x:1 imports dflash_train.eval.batched._first_tokens"]


def test_backend_workers_import_no_model_code():
    """A distributed worker process reaches the config through the backend: neither may pull
    in transformers (4 s a process) for a constant. The block size's two homes agree."""
    import subprocess
    import sys

    from dflash_train import contract
    from dflash_train.model import dflash

    assert contract.DEFAULT_BLOCK_SIZE == dflash.DEFAULT_BLOCK_SIZE
    code = "import sys, dflash_train.distributed.build; print(sorted(m for m in sys.modules if m == 'transformers'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
