"""benchmarks/quality-arms/arm.sh's queue lines, built on CPU before a lease spends minutes on them:
a guard item's folder must be one Hydra parses in output_dir= (the 2026-11-27 lease lost two A/B
arms to output_dir=/tmp/arm-guard2@KEY=VAL), and DFlash2's guard runs two seeds at a time."""

import re
import subprocess
from pathlib import Path

ARM = Path(__file__).resolve().parents[2] / "benchmarks" / "quality-arms" / "arm.sh"


def queue_lines(queue: str) -> list[str]:
    """The shell lines arm.sh writes for one queue (its functions, without sourcing the GPU setup)."""
    text = ARM.read_text()
    functions = text[text.index("WAIT=$1"):text.index("ARMS=$(")]
    done = subprocess.run(["bash", "-c", f"set -- 0\n{functions}\nqueue_cmd {queue!r}"], capture_output=True,
                          text=True, timeout=60, cwd=ARM.parents[2])
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_a_guard_item_with_overrides_writes_into_a_folder_hydra_parses():
    (line,) = queue_lines("guard2@drafter.kind=dflash2@drafter.dflash2.selector_loss_weight=0.1")
    out = re.search(r"--out (\S+)", line).group(1)
    assert out == "/tmp/arm-guard2_drafter.kind_dflash2_drafter.dflash2.selector_loss_weight_0.1"
    assert "=" not in out and "@" not in out
    assert line.endswith(f"date +%s > {out}.t1")
    assert "--seeds 0 1 --parallel 2 drafter.kind=dflash2 drafter.dflash2.selector_loss_weight=0.1 >" in line


def test_dflash2_guards_run_two_at_a_time_and_the_others_three():
    lines = queue_lines("guard3-dflash2,guard3-dspark,guard0")
    assert "--out /tmp/arm-guard3-dflash2 --seeds 0 1 2 --parallel 2 drafter.kind=dflash2 >" in lines[0]
    assert "--seeds 0 1 2 --parallel 3 drafter.kind=dspark loss.position_weighting=decay >" in lines[1]
    assert "--out /tmp/arm-guard0 --seeds 0 >" in lines[2]


def test_an_unknown_arm_is_refused():
    text = ARM.read_text()
    functions = text[text.index("WAIT=$1"):text.index("ARMS=$(")]
    done = subprocess.run(["bash", "-c", f"set -- 0\n{functions}\nqueue_cmd no-such-arm"], capture_output=True,
                          text=True, timeout=60, cwd=ARM.parents[2])
    assert done.returncode != 0 and "unknown arm 'no-such-arm'" in done.stdout


def test_gpu_test_items_name_their_files():
    kinds, datagen = queue_lines("gpu-tests-kinds,gpu-tests-datagen")
    assert "-m gpu" in kinds and "tests/unit/test_topk_kernel.py" in kinds and "datagen" not in kinds
    assert "pytest -q -m gpu -p no:cacheprovider tests/gpu/test_datagen_engine_gpu.py;" in datagen
    assert datagen.endswith("date +%s > /tmp/arm-gpu-tests-datagen.t1")


def test_kinds_gaps_profiles_both_kinds_by_kernel_and_by_gap():
    (line,) = queue_lines("kinds-gaps")
    runs = re.findall(r"python3 benchmarks/profile_step\.py (.*?) > (\S+) 2>&1", line)
    assert [out for _, out in runs] == [f"/tmp/arm-kinds-gaps/profile-{k}-{g}.txt"
                                        for k in ("dflash", "dflash2") for g in ("kernels", "gaps")]
    for (args, out) in runs:
        kind = re.search(r"drafter\.kind=(\w+)", args).group(1)
        assert out.startswith(f"/tmp/arm-kinds-gaps/profile-{kind}-")
        assert args.endswith("--gaps") == out.endswith("-gaps.txt")
        assert "+experiment=qwen25_coder_05b_1xh100" in args and "bench.random_target=true" in args
    assert line.endswith("date +%s > /tmp/arm-kinds-gaps.t1")


def test_datagen_profile_items_pass_their_chunk_length():
    default, sixteen = queue_lines("datagen-profile,datagen-profile-s16")
    assert "OUT=/tmp/arm-datagen-profile bash benchmarks/datagen_engine_gpu.sh 3600 2000 2000  >" in default
    assert "OUT=/tmp/arm-datagen-profile-s16 bash benchmarks/datagen_engine_gpu.sh 3600 2000 2000 16 >" in sixteen
    assert sixteen.endswith("date +%s > /tmp/arm-datagen-profile-s16.t1")


def test_datagen_profile_compiled_items_name_the_kinds():
    """-compiled profiles flex against flex with the decode step compiled, in a folder of its own."""
    default, compiled, both = queue_lines("datagen-profile,datagen-profile-compiled,datagen-profile-s16-compiled")
    assert "KINDS=" not in default
    assert ("KINDS=engine-flex,engine-flex-compiled OUT=/tmp/arm-datagen-profile-compiled bash "
            "benchmarks/datagen_engine_gpu.sh 3600 2000 2000  >") in compiled
    assert ("KINDS=engine-flex,engine-flex-compiled OUT=/tmp/arm-datagen-profile-s16-compiled bash "
            "benchmarks/datagen_engine_gpu.sh 3600 2000 2000 16 >") in both


def test_datagen_profile_packed_items_set_padded_against_packed_prefills():
    """-packed profiles the padded prefill against the packed one (backend.prefill), with the
    compiled decode step under -compiled-packed, flex's otherwise."""
    compiled, plain = queue_lines("datagen-profile-s16-compiled-packed,datagen-profile-packed")
    assert ("KINDS=engine-flex-compiled,engine-flex-compiled-packed OUT=/tmp/arm-datagen-profile-s16-compiled-packed "
            "bash benchmarks/datagen_engine_gpu.sh 3600 2000 2000 16 >") in compiled
    assert ("KINDS=engine-flex,engine-flex-packed OUT=/tmp/arm-datagen-profile-packed bash "
            "benchmarks/datagen_engine_gpu.sh 3600 2000 2000  >") in plain


def test_flex_sweep_item_runs_the_sweep_into_its_folder():
    [line] = queue_lines("flex-sweep")
    assert "mkdir -p /tmp/arm-flex-sweep" in line
    assert "python3 -m benchmarks.flex_decode_sweep --json /tmp/arm-flex-sweep/rows.json" in line
    assert line.endswith("date +%s > /tmp/arm-flex-sweep.t1")


def arm_arguments(arm: str) -> list[str]:
    """The dflash-quality arguments arm.sh gives `arm` (its arm_args function)."""
    text = ARM.read_text()
    functions = text[text.index("WAIT=$1"):text.index("ARMS=$(")]
    done = subprocess.run(["bash", "-c", f"set -- 0\n{functions}\narm_args {arm!r}; printf '%s\\n' \"${{ARGS[@]}}\""],
                          capture_output=True, text=True, timeout=60, cwd=ARM.parents[2])
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_an_arm_on_two_gpus_trains_with_nproc_2_and_keeps_its_seed():
    two = arm_arguments("k-dflash-n2")
    assert "nproc=2" in two and "run_dir=/tmp/arm-k-dflash-n2" in two
    assert any("drafter.kind=dflash" in a for a in two)
    seeded = arm_arguments("k-dflash-n2-s1")
    assert "nproc=2" in seeded and "run_dir=/tmp/arm-k-dflash-n2-s1" in seeded
    assert any('"seed=1"' in a for a in seeded)
    assert not any("nproc" in a for a in arm_arguments("k-dflash"))
