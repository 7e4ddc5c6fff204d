"""benchmarks/two-gpu/job.sh's per-backend overrides and table.py's resume rows, on CPU before a
lease spends minutes on them."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "benchmarks" / "two-gpu" / "job.sh"


def backend_args(name: str) -> str:
    text = JOB.read_text()
    function = re.search(r"^backend_args\(\) \{.*?^\}", text, re.M | re.S).group(0)
    done = subprocess.run(["bash", "-c", f"{function}\nbackend_args {name}"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_fsdp2_keep_is_fsdp2_without_resharding_and_the_others_their_names():
    assert backend_args("fsdp2-keep") == "backend=fsdp2 backend.reshard_after_forward=false"
    assert [backend_args(b) for b in ("ddp", "fsdp2", "zero2", "zero3")] == [
        "backend=ddp", "backend=fsdp2", "backend=zero2", "backend=zero3"]


def _run(root: Path, name: str, losses: dict[int, float], log: str = "") -> None:
    (root / name).mkdir(parents=True)
    (root / name / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in losses.items()))
    (root / f"{name}.log").write_text(log)


def test_1to2_is_compared_after_the_resume_with_the_run_continued_on_one_gpu(tmp_path):
    full = {s: 10.0 - 0.1 * s for s in range(1, 9)}
    one_gpu = {s: v * 1.01 for s, v in full.items()}  # the 1-GPU run drifted 1% from the 2-GPU one
    _run(tmp_path, "ddp-full", full)
    _run(tmp_path, "ddp-full1", one_gpu)
    resumed = {**{s: one_gpu[s] for s in range(1, 5)}, **{s: one_gpu[s] * (1 + 1e-4) for s in range(5, 9)}}
    _run(tmp_path, "ddp-1to2", resumed, "resumed from /x/checkpoints/step_00000004 (step 4, 16 samples seen)\n")
    _run(tmp_path, "ddp-killed", full, "two-gpu: killed with kill -9 at step 6\n"
                                       "resumed from /x/checkpoints/step_00000004 (step 4, 16 samples seen)\n")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "two-gpu" / "table.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, env={"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    rows = {cells[1]: cells for cells in ([c.strip() for c in line.strip().strip("|").split("|")]
                                          for line in done.stdout.splitlines() if line.startswith("| ddp |"))}
    # against full1, after the resume: the resumed steps' 1e-4, not the 1% between 1 and 2 GPUs
    assert rows["1to2"] == ["ddp", "1to2", "", "4", "5-8 (4)", "1.00e-04", "yes"]
    assert rows["killed"] == ["ddp", "killed", "6", "4", "5-8 (4)", "0.00e+00", "yes"]


def test_profile_phase_runs_profile_step_under_torchrun_for_each_backend_but_zero(tmp_path):
    """job.sh's profile phase: benchmarks/profile_step.py on 2 processes of the real data, the kernel
    tables and the gaps of each non-ZeRO backend, each report in the results folder."""
    text = JOB.read_text()
    functions = "\n".join(re.search(rf"^{name}\(\) \{{.*?^\}}", text, re.M | re.S).group(0)
                          for name in ("backend_args", "profile_phase"))
    # a Python that prints its arguments: the phase's commands, not runs
    script = (f"{functions}\nPY=echo R={tmp_path} BACKENDS='ddp fsdp2 zero2 fsdp2-keep' failed=0\n"
              "REAL=(+experiment=qwen25_coder_05b_1xh100 bench.steps=20) PROFILE_STEPS=(bench.steps=3)\n"
              "profile_phase\n")
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    commands = [(tmp_path / f"profile-{b}{m}.log").read_text().split() for b in ("ddp", "fsdp2", "fsdp2-keep")
                for m in ("", "-gaps")]
    assert not list(tmp_path.glob("profile-zero2*"))
    for (backend, gaps), cmd in zip([(b, g) for b in ("ddp", "fsdp2", "fsdp2-keep") for g in (False, True)], commands):
        assert cmd[:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "benchmarks/profile_step.py"]
        assert cmd[cmd.index("--out") + 1] == str(tmp_path / f"profile-{backend}{'-gaps' if gaps else ''}.txt")
        assert ("--gaps" in cmd) == gaps
        # the profile's few timed steps after the real phase's
        assert cmd.index("bench.steps=3") > cmd.index("bench.steps=20")
        assert " ".join(cmd[6:]).startswith(backend_args(backend))


def test_run_sh_knows_the_profile_phase():
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "two-gpu" / "run.sh"), "0", "nope"], capture_output=True,
                          text=True, timeout=30, cwd=ROOT)
    assert done.returncode == 2 and "(real, paper, resume or profile)" in done.stdout
