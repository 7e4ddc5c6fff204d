"""dflash-quickstart's recipe, summary lines and choice of dtype for the CPU it runs on."""

import json
from pathlib import Path

import pytest

from data_gen.config import DatagenConfig
from dflash_train.config import TrainConfig, validate
from dflash_train.quickstart import (
    QuickstartConfig,
    _held_out,
    _stages,
    _table,
    cpu_has_native_bf16,
    main,
    stage_overrides,
)
from dflash_train.recipe import load_command

EPYC_NO_AVX512 = "processor\t: 0\nflags\t\t: fpu vme sse sse2 avx avx2 fma\n"
EPYC_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx512f amx_tile amx_bf16 amx_int8\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_held_out_line_reads_the_last_validation(tmp_path):
    assert _held_out(tmp_path) is None  # no training log yet
    rows = [{"step": 60, "expected_tau": 1.05, "val_expected_tau": 1.061},
            {"step": 65, "expected_tau": 1.07},
            {"step": 300, "expected_tau": 1.131, "val_expected_tau": 1.1449}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _held_out(tmp_path) == ("expected tau at step 300: 1.14 on held-out conversations, 1.13 on training "
                                   "rows (teacher-forced, from the per-position accuracy)")
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[1]) + "\n")
    assert _held_out(tmp_path) is None


def test_table_shows_tau_and_gives_the_speedup_only_beside_the_gpu_figure(tmp_path):
    def write(stage, taus, speedup):
        rows = {name: {"num_prompts": 10, "tau": tau, "greedy_agreement": 1.0, "speedup": speedup, "batch_size": 10}
                for name, tau in taus.items()}
        (tmp_path / stage).mkdir()
        (tmp_path / stage / "results.json").write_text(json.dumps({"datasets": rows}))

    write("eval_fresh", {"mtbench": 1.0, "humaneval": 1.0}, 0.3)
    write("eval", {"mtbench": 1.18, "humaneval": 1.15}, 0.35)
    lines = _table(tmp_path).splitlines()
    assert [line.split() for line in lines[:3]] == [
        ["dataset", "prompts", "tau", "fresh", "tau", "trained", "agreement"],
        ["mtbench", "10", "1.00", "1.18", "100%"], ["humaneval", "10", "1.00", "1.15", "100%"]]
    note = " ".join(line.strip() for line in lines[3:])
    assert note.startswith("speedup on this CPU (batch of 10): mtbench 0.35x at tau 1.18 (a speculative step "
                           "= 3.4 plain steps), humaneval 0.35x at tau 1.15 (a speculative step = 3.3 plain steps). "
                           "The speedup of speculative decoding comes from a GPU")
    assert "on one H100" in note and all(line.startswith("    ") for line in lines[4:])


def test_native_bf16_is_read_from_the_cpu_flags():
    assert cpu_has_native_bf16(EPYC_BF16) and cpu_has_native_bf16(SAPPHIRE_RAPIDS) and cpu_has_native_bf16(GRAVITON3)
    assert not cpu_has_native_bf16(EPYC_NO_AVX512)
    assert not cpu_has_native_bf16("model name\t: bf16 in a name is not a flag\n")
    assert not cpu_has_native_bf16("")


def test_stages_run_float32_without_bf16_instructions_and_the_user_still_wins():
    run_dir = Path("runs/qs")  # only named in the commands
    given = {"datagen": [], "train": ["target.dtype=bfloat16"], "eval": ["limit=2"]}
    commands = {name: cmd for name, _, cmd in _stages(run_dir, stage_overrides(given, native_bf16=False))}
    assert commands["datagen"][-1] == "target.dtype=float32"
    train = commands["train"]
    assert train[-3:] == ["target.dtype=float32", "backend.mixed_precision=none", "target.dtype=bfloat16"]
    assert commands["eval-trained"][-1] == "limit=2" and "target.dtype=float32" not in commands["eval-trained"]
    native = {name: cmd for name, _, cmd in _stages(run_dir, stage_overrides(given, native_bf16=True))}
    assert not any("float32" in c or "mixed_precision" in c for cmd in native.values() for c in cmd)


def test_fresh_drafter_answers_in_8_tokens_and_long_trains_with_its_own_recipe():
    none = {"datagen": [], "train": [], "eval": []}
    short = {name: cmd for name, _, cmd in _stages(Path("runs/qs"), none)}
    assert short["train"][1:3] == ["--config-name", "train_quickstart"]
    fresh, trained = short["eval-fresh"], short["eval-trained"]
    assert [c for c in fresh if c.startswith("max_new_tokens=")] == ["max_new_tokens=8"]
    assert [c for c in trained if c.startswith("max_new_tokens=")] == ["max_new_tokens=64"]
    # same prompts, turns and batch for both drafters: only the answer length differs
    assert [c for c in fresh if c.startswith(("datasets=", "limit=", "max_turns=", "batch_size="))] == \
        [c for c in trained if c.startswith(("datasets=", "limit=", "max_turns=", "batch_size="))]
    # the fresh drafter has the shape of the one the training stage trains, overrides included
    assert [c for c in fresh if c.startswith("drafter")] == [
        "drafter_path=random", "drafter.num_hidden_layers=2", "drafter.block_size=4", "drafter.num_features=null",
        "drafter.target_layer_ids=[2,6,10]"]
    wider = {"datagen": [], "train": ["drafter.block_size=8", "drafter.target_layer_ids=[1,5]"], "eval": []}
    fresh8 = {name: cmd for name, _, cmd in _stages(Path("runs/qs"), wider)}["eval-fresh"]
    assert "drafter.block_size=8" in fresh8 and "drafter.target_layer_ids=[1,5]" in fresh8
    long = {name: (done, cmd) for name, done, cmd in _stages(Path("runs/qs-long"), none, "train_quickstart_long")}
    assert long["train"][1][1:4] == ["--config-name", "train_quickstart_long", "output_dir=runs/qs-long"]
    assert long["train"][0] == Path("runs/qs-long/export/model.safetensors")


def test_long_recipe_is_the_quickstart_trained_twice_as_long():
    short, long = (load_command(TrainConfig, [], name, "", validate)
                   for name in ("train_quickstart", "train_quickstart_long"))
    gen = load_command(DatagenConfig, [], "datagen_quickstart", "", DatagenConfig.validate)
    rows = gen.num_prompts - short.data.val_rows  # the answers less the held-out ones: 496
    assert [c.epochs * rows // c.optim.micro_batch_size for c in (short, long)] == [4 * 496, 8 * 496]
    # the same data, drafter, dtype and optimisation: only the number of epochs differs
    assert (short.data, short.drafter, short.target, short.optim, short.loss) == \
        (long.data, long.drafter, long.target, long.optim, long.loss)
    assert (short.output_dir, long.output_dir) == ("runs/quickstart-smollm2", "runs/quickstart-smollm2-long")


QUOTE_HINT = """(quote a value holding '=', each item of a list of overrides: train='["optim.lr=1e-3", "seed=1"]')"""


def _quickstart(*overrides: str) -> QuickstartConfig:
    return load_command(QuickstartConfig, list(overrides), "quickstart", "")


def test_recipe_defaults_long_and_stage_lists():
    plain = _quickstart()  # make quickstart: no arguments
    assert (plain.long, plain.datagen, plain.train, plain.eval) == (False, [], [], [])
    assert plain.resolved_run_dir() == Path("runs/quickstart-smollm2")
    assert _quickstart("long=true").resolved_run_dir() == Path("runs/quickstart-smollm2-long")
    assert _quickstart("long=true", "run_dir=elsewhere").resolved_run_dir() == Path("elsewhere")
    cfg = _quickstart('train=["optim.lr=1e-3", "seed=1"]', 'eval=["limit=2"]', 'datagen=["num_prompts=64"]')
    extra = stage_overrides({"datagen": cfg.datagen, "train": cfg.train, "eval": cfg.eval}, native_bf16=True)
    commands = {name: cmd for name, _, cmd in _stages(cfg.resolved_run_dir(), extra)}
    assert commands["train"][-2:] == ["optim.lr=1e-3", "seed=1"]
    assert commands["datagen"][-1] == "num_prompts=64" and commands["eval-trained"][-1] == "limit=2"


@pytest.mark.parametrize("argv, message", [
    (["long=maybe"], "wrong type for long='maybe': is not a valid bool (type str)"),
    (["--long"], "--long is no longer accepted; use long=true"),
    (["--lnog"], "unknown option --lnog (options: --config-name, -cn; settings are key=value)"),
    (["lnog=true"], "unknown key lnog (did you mean long?)"),
    # a training stage's setting is checked before data generation starts
    (['train=["optim.lrr=1e-3"]'], "unknown key optim.lrr (did you mean optim.lr?)"),
    (["train=[optim.lr=1e-3]"], "cannot parse override 'train=[optim.lr=1e-3]': no viable alternative at input "
     f"'[optim.lr=' {QUOTE_HINT}"),
    (["train=optim.lr=1e-3"],
     f"cannot parse override 'train=optim.lr=1e-3': mismatched input '=' expecting <EOF> {QUOTE_HINT}"),
])
def test_bad_settings_are_refused_in_one_line_before_any_stage(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)  # the stages would write data/ and runs/ here
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == f"dflash-quickstart: error: {message}"
    assert list(tmp_path.iterdir()) == []
