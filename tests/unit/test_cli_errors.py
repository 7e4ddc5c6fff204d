"""Every command turns a foreseeable failure into one line naming the file, value or URL and
a non-zero exit, and changes nothing of the user's: the real console commands, run as a user
would, against bad inputs and a hostile machine."""

import dataclasses
import functools
import json
import os
import time
import typing

import pytest
import torch
from omegaconf import OmegaConf

from dflash_train import bench, quality, quickstart
from dflash_train.errors import RunError, one_line, run_command
from dflash_train.export import cli as export_cli
from tests.cli_helpers import assert_one_line_error, full_disk, run_cli, snapshot
from tests.train_data import tiny_inputs, tiny_train_args, write_datagen_dir

OFFLINE_HUB_ID = "dflash-test-org/not-downloaded-model"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_inputs(tmp_path_factory.mktemp("cli"))


def test_run_command_maps_known_errors_to_one_line(capsys):
    def fails(exc):
        raise exc

    for exc, text in [(ValueError("bad\nvalue"), "bad value"),
                      (PermissionError(13, "Permission denied", "/ro/x"), "Permission denied: /ro/x"),
                      (OSError(28, "No space left on device", "/full/y"), "No space left on device: /full/y"),
                      (RunError("diverged"), "diverged")]:
        with pytest.raises(SystemExit) as stop:
            run_command("prog", fails, exc)
        assert stop.value.code == 2
        assert capsys.readouterr().err == f"prog: error: {text}\n"
        assert one_line(exc) == text
    with pytest.raises(KeyError):  # a bug keeps its traceback
        run_command("prog", fails, KeyError("x"))


# Every command, three ways to get its settings wrong: (arguments, what the one line says).
SETTINGS_MISTAKES = {
    "dflash-train": [(["optim.lrr=1", "data.path=d", "output_dir=o"], "unknown key optim.lrr (did you mean optim.lr?)"),
                     (["data.path=d"], "missing value for output_dir: add output_dir=<run folder> to the command"),
                     (["optim.lr=fast", "data.path=d", "output_dir=o"], "wrong type for optim.lr='fast'")],
    "dflash-datagen": [(["sampling.temprature=0", "out_dir=o"],
                        "unknown key sampling.temprature (did you mean sampling.temperature?)"),
                       ([], "missing value for out_dir: add out_dir=<new or empty folder> to the command"),
                       (["sampling.top_k=many", "out_dir=o"], "wrong type for sampling.top_k='many'")],
    "dflash-eval": [(["limt=3", "drafter_path=random"], "unknown key limt (did you mean limit?)"),
                    ([], "missing value for drafter_path: add drafter_path=<drafter directory> or random to the command"),
                    (["batch_size=two", "drafter_path=random"], "wrong type for batch_size='two'")],
    "dflash-export": [(["runs/x", "outt=y"], "unknown key outt (did you mean out?)"),
                      (["out=y"], "missing value for path: add path=<run output_dir or checkpoint directory> to the command"),
                      (["runs/x", "push=maybe"], "wrong type for push='maybe'")],
    "dflash-bench": [(["bench.stepz=3"], "unknown key bench.stepz (did you mean bench.steps?)"),
                     (["--config-name"], "missing value for --config-name: option --config-name needs one"),
                     (["bench.steps=many"], "wrong type for bench.steps='many'")],
}


@pytest.mark.parametrize("prog, args, message", [
    pytest.param(prog, args, message, id=f"{prog}-{kind}")
    for prog, cases in SETTINGS_MISTAKES.items()
    for kind, (args, message) in zip(("unknown-key", "missing-value", "wrong-type"), cases)
])
def test_every_command_names_a_bad_setting_in_one_line(prog, args, message, tmp_path):
    """The same one-line error for the same mistake in every command, before any model or
    data is read (the paths in the arguments do not exist)."""
    done = run_cli(prog, *args, cwd=tmp_path)
    assert_one_line_error(done, prog, message)
    assert not any(tmp_path.iterdir())  # nothing written


# The flags each command took before key=value settings, and the setting each refusal names
# instead.
RETIRED_FLAGS = {
    "dflash-export": {"--out": "out=PATH", "--eval-results": "eval_results=FILE", "--push": "push=true",
                      "--repo-id": "repo_id=USER/NAME", "--private": "private=true", "--no-private": "private=false"},
    "dflash-bench": {"--steps": "bench.steps=N", "--warmup": "bench.warmup=N",
                     "--random-target": "bench.random_target=true", "--target-layers": "bench.target_layers=N",
                     "--json": "bench.json=FILE", "--profile": "bench.profile=FILE"},
    "dflash-quality": {"--target": "target=NAME", "--data": "data.path=DIR", "--budget-min": "budget_min=MINUTES",
                       "--run-dir": "run_dir=DIR", "--probe-steps": "probe_steps=N",
                       "--warmup-steps": "warmup_steps=N", "--seconds-per-step": "seconds_per_step=S",
                       "--startup-s": "startup_s=S", "--val-rows": "data.val_rows=N", "--datasets": "datasets=[a,b]",
                       "--limit": "limit=N", "--max-new-tokens": "max_new_tokens=N", "--device": "device=DEVICE",
                       "--set": "target.KEY=VALUE (both stages), train=[...] or eval=[...]",
                       "--eval": "eval=[KEY=VALUE,...]"},
    "dflash-quickstart": {"--long": "long=true", "--run-dir": "run_dir=DIR"},
}
RETIRED = [(prog, flag, setting) for prog, flags in RETIRED_FLAGS.items() for flag, setting in flags.items()]
# A command line that is otherwise right, and the schema its settings go to.
COMMANDS = {"dflash-export": (export_cli.main, ["runs/x"], export_cli.ExportConfig),
            "dflash-bench": (functools.partial(run_command, "dflash-bench", bench.main), ["bench.warmup=1"],
                             bench.BenchConfig),
            "dflash-quality": (quality.main, ["data.path=DATA", "budget_min=1"], quality.QualityConfig),
            "dflash-quickstart": (quickstart.main, [], quickstart.QuickstartConfig)}
# A value for each placeholder the refusals name, where one value stands for all.
VALUES = {"PATH": "exp", "FILE": "r.json", "USER/NAME": "me/drafter", "N": "3", "DIR": "runs/q", "S": "0.5",
          "MINUTES": "2.5", "DEVICE": "cpu"}


def test_the_commands_refuse_every_retired_flag():
    assert {"dflash-export": export_cli.RETIRED_FLAGS, "dflash-bench": bench.RETIRED_FLAGS,
            "dflash-quality": quality.RETIRED_FLAGS, "dflash-quickstart": quickstart.RETIRED_FLAGS} == RETIRED_FLAGS


@pytest.mark.parametrize("prog, flag, setting", RETIRED)
def test_a_retired_flag_is_refused_naming_its_setting(prog, flag, setting, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main, args, _ = COMMANDS[prog]
    for argv in ([*args, flag, "3"], [f"{flag}=3", *args]):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2
        assert capsys.readouterr().err == f"{prog}: error: {flag} is no longer accepted; use {setting}\n"
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("prog, flag, setting", RETIRED)
def test_the_setting_a_refusal_names_is_one_the_command_takes(prog, flag, setting):
    key, _, placeholder = setting.split(" ")[0].partition("=")
    schema = COMMANDS[prog][2]
    node = schema
    for part in key.replace("KEY", "name").split("."):  # target.KEY: any key of the target group
        assert dataclasses.is_dataclass(node) and part in {f.name for f in dataclasses.fields(node)}, setting
        node = typing.get_type_hints(node)[part]
    value = VALUES.get(placeholder, placeholder)
    if placeholder in VALUES or placeholder in ("true", "false"):  # a plain value: it merges as written
        merged = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.from_dotlist([f"{key}={value}"]))
        assert str(OmegaConf.select(merged, key)).lower() == value


@pytest.mark.parametrize("prog, args", [("dflash-export", ["runs/x", "--out", "exp"]),
                                        ("dflash-bench", ["bench.warmup=1", "--steps", "3"])])
def test_the_console_commands_refuse_a_retired_flag_in_one_line(prog, args, tmp_path):
    done = run_cli(prog, *args, cwd=tmp_path)
    assert_one_line_error(done, prog, f"{args[1]} is no longer accepted; use {RETIRED_FLAGS[prog][args[1]]}")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("prog, args", [
    ("dflash-train", ["data.path=DATA", "output_dir=OUT"]),
    ("dflash-eval", ["drafter_path=random", "output_dir=OUT"]),
    ("dflash-datagen", ["out_dir=OUT"]),
])
def test_a_nonexistent_target_path(tiny, prog, args, tmp_path):
    args = [a.replace("OUT", str(tmp_path / "out")).replace("DATA", str(tiny["data"])) for a in args]
    done = run_cli(prog, "target.name=/nonexistent/model", *args)
    assert_one_line_error(done, prog, "target '/nonexistent/model': no such file or folder")


@pytest.mark.parametrize("offline", [True, False])
def test_a_hub_id_that_cannot_be_fetched_fails_in_seconds(tmp_path, offline):
    env = {"HF_HUB_OFFLINE": "1"} if offline else {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"}
    env["HF_HOME"] = str(tmp_path / "hf")  # an empty cache
    start = time.perf_counter()
    done = run_cli("dflash-eval", f"target.name={OFFLINE_HUB_ID}", "drafter_path=random",
                   f"output_dir={tmp_path / 'out'}", env=env)
    cause = "HF_HUB_OFFLINE is set" if offline else "http://127.0.0.1:9 cannot be reached"
    assert_one_line_error(done, "dflash-eval", f"target '{OFFLINE_HUB_ID}' is neither a local path nor in the "
                                               "Hugging Face cache", cause)
    assert time.perf_counter() - start < 45  # the hub client alone would retry for about a minute


def test_cuda_without_a_gpu(tiny, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = run_cli("dflash-eval", "drafter_path=random", "device=cuda", f"output_dir={tmp_path / 'e'}")
    assert_one_line_error(done, "dflash-eval", "device='cuda' but no CUDA GPU is available")
    args = tiny_train_args(tiny["target"], tiny["data"], tmp_path / "t", "backend.device=cuda")
    done = run_cli("dflash-train", *args)
    assert_one_line_error(done, "dflash-train", "backend.device='cuda'")


def test_a_missing_sharegpt_file(tmp_path):
    done = run_cli("dflash-datagen", f"out_dir={tmp_path / 'out'}", "exclude_eval=[]",
                   f"sources=[{{kind: sharegpt, path: {tmp_path / 'ShareGPT.json'}}}]")
    assert_one_line_error(done, "dflash-datagen", f"no such file '{tmp_path / 'ShareGPT.json'}'")


def test_a_non_utf8_prompt_file_is_named(tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_bytes(json.dumps({"prompt": "fine"}).encode() + b"\n" + b'{"prompt": "caf\xe9"}\n')
    done = run_cli("dflash-datagen", f"out_dir={tmp_path / 'out'}", "exclude_eval=[]",
                   f"sources=[{{kind: jsonl, path: {bad}}}]")
    assert_one_line_error(done, "dflash-datagen", f"{bad}:2: not UTF-8 text")
    done = run_cli("dflash-eval", "drafter_path=random", f"datasets=[{bad}]", f"output_dir={tmp_path / 'e'}")
    assert_one_line_error(done, "dflash-eval", f"{bad}:2: not UTF-8 text")


def test_a_truncated_arrow_file_and_an_empty_dataset(tiny, tmp_path):
    data = write_datagen_dir(tmp_path / "data", tiny["target"], tiny["tok"])
    arrow = next((data / "data").glob("*.arrow"))
    os.truncate(arrow, arrow.stat().st_size // 2)
    done = run_cli("dflash-train", *tiny_train_args(tiny["target"], data, tmp_path / "run"))
    assert_one_line_error(done, "dflash-train", f"'{arrow}' is damaged (its sha256 does not match manifest.json)")
    empty = write_datagen_dir(tmp_path / "empty", tiny["target"], tiny["tok"], rows=[])
    done = run_cli("dflash-train", *tiny_train_args(tiny["target"], empty, tmp_path / "run"))
    assert_one_line_error(done, "dflash-train", f"'{empty}' is an empty dataset (its manifest counts 0 rows)")
    empty_prompts = tmp_path / "none.jsonl"
    empty_prompts.write_text("\n")
    done = run_cli("dflash-eval", "drafter_path=random", f"datasets=[{empty_prompts}]", f"output_dir={tmp_path / 'e'}")
    assert_one_line_error(done, "dflash-eval", f"dataset '{empty_prompts}' has no prompts")


def test_a_diverging_run_ends_in_one_line(tiny, tmp_path):
    done = run_cli("dflash-train", *tiny_train_args(tiny["target"], tiny["data"], tmp_path / "run", "optim.lr=1e30",
                                                    "optim.warmup_ratio=0", "max_nan_skips=0"))
    assert_one_line_error(done, "dflash-train", "1 steps had a non-finite loss or gradients (max_nan_skips=0)")


def test_export_onto_a_full_disk_fails_before_reading_the_checkpoint(tiny, tmp_path):
    from dflash_train.training.trainer import Trainer
    from tests.train_data import tiny_train_config

    Trainer(tiny_train_config(tiny["target"], tiny["data"], tmp_path / "run", max_steps=1)).fit()
    before = snapshot(tmp_path / "run")
    with full_disk(tmp_path / "full") as full:
        done = run_cli("dflash-export", tmp_path / "run", f"out={full / 'export'}")
        assert_one_line_error(done, "dflash-export", str(full / "export"), "MiB free on its disk")
    assert snapshot(tmp_path / "run") == before
