"""benchmarks/gpu/setup.sh, sourced by every call of a GPU lease, copies each carried data set
once: the checkout's .gpu/data stays on a warm machine, and copying it again truncated Arrow
files that running training jobs had memory-mapped (SIGBUS, two arms of 2026-11-27's leases)."""

import mmap
import os
import subprocess
from pathlib import Path

SETUP = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "setup.sh"


def _call(checkout: Path, root: Path, out: Path) -> str:
    env = {**os.environ, "DATA_ROOT": str(root), "OUT": str(out), "GG_DIR": str(root.parent / "gg"),
           "GGUF": str(root.parent / "q.gguf")}
    done = subprocess.run(["bash", "-c", f"source {SETUP} && echo sourced"], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_second_call_leaves_a_mapped_data_set_as_it_is_and_adds_a_new_one(tmp_path):
    checkout, root = tmp_path / "checkout", tmp_path / "root"
    first = checkout / ".gpu" / "data" / "set-a" / "data"
    first.mkdir(parents=True)
    (first / "shard-0.arrow").write_bytes(bytes(range(256)) * 64)
    assert "sourced" in _call(checkout, root, tmp_path / "out1")
    copied = root / "set-a" / "data" / "shard-0.arrow"
    assert copied.read_bytes() == bytes(range(256)) * 64
    before = copied.stat()
    with open(copied, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        # the next call of the lease, while a job reads the mapped file, with a second set carried
        second = checkout / ".gpu" / "data" / "set-b"
        second.mkdir()
        (second / "rows.jsonl").write_text('{"a": 1}\n')
        _call(checkout, root, tmp_path / "out2")
        assert mapped[:256] == bytes(range(256)) and mapped[-1] == 255
    after = copied.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size)
    assert (root / "set-b" / "rows.jsonl").read_text() == '{"a": 1}\n'
    assert sorted(p.name for p in root.iterdir()) == ["set-a", "set-b"]  # no half-copied folder left


def test_two_scripts_of_one_call_assemble_the_gguf_once_checked(tmp_path):
    """arm.sh and two-gpu/run.sh source the setup in the same call: when the last part arrives
    both may assemble the GGUF; the file that appears is the parts in order, whole, and no
    temporary file is left. A part that does not match the checksum leaves no file at all."""
    import hashlib

    checkout, gg, gguf = tmp_path / "checkout", tmp_path / "gg", tmp_path / "q.gguf"
    parts = [os.urandom(300_000) for _ in range(3)]
    for i, data in enumerate(parts):
        part = checkout / ".gpu" / f"p{i:02d}" / f"q.{i:02d}"
        part.parent.mkdir(parents=True)
        part.write_bytes(data)
    whole = b"".join(parts)
    env = {**os.environ, "DATA_ROOT": str(tmp_path / "root"), "OUT": str(tmp_path / "out"), "GG_DIR": str(gg),
           "GGUF": str(gguf), "QWEN_PARTS": "3", "QWEN_MD5": hashlib.md5(whole).hexdigest()}
    calls = [subprocess.Popen(["bash", "-c", f"source {SETUP} && echo sourced"], cwd=checkout, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [c.communicate(timeout=60) for c in calls]
    assert all(c.returncode == 0 and "sourced" in out for c, (out, _) in zip(calls, outs)), outs
    assert gguf.read_bytes() == whole
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("q.gguf")) == ["q.gguf"]
    gguf.unlink()
    (checkout / ".gpu" / "p01" / "q.01").write_bytes(parts[1][::-1])  # a damaged part
    (gg / "q.01").unlink()
    done = subprocess.run(["bash", "-c", f"source {SETUP}"], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "GGUF md5 mismatch" in done.stdout, done
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("q.gguf")]


def test_frozen_tree_copies_the_checkout_once_without_gpu_files(tmp_path):
    """Jobs that outlive a call run from this copy: a later call's copy of the working tree
    (2026-11-28: a training stage started mid-copy died of ModuleNotFoundError) never reaches it."""
    checkout, tree = tmp_path / "checkout", tmp_path / "tree"
    (checkout / "pkg").mkdir(parents=True)
    (checkout / "pkg" / "mod.py").write_text("A = 1\n")
    (checkout / ".gpu" / "p00").mkdir(parents=True)
    (checkout / ".gpu" / "p00" / "q.00").write_bytes(b"x" * 1000)
    env = {**os.environ, "DATA_ROOT": str(tmp_path / "root"), "OUT": str(tmp_path / "out"),
           "GG_DIR": str(tmp_path / "gg"), "GGUF": str(tmp_path / "q.gguf"), "TREE": str(tree)}

    def frozen() -> str:
        done = subprocess.run(["bash", "-c", f"source {SETUP} > /dev/null && frozen_tree"], cwd=checkout, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert frozen() == str(tree)
    assert (tree / "pkg" / "mod.py").read_text() == "A = 1\n" and not (tree / ".gpu").exists()
    (checkout / "pkg" / "mod.py").write_text("A = 2\n")  # the next call's checkout
    (checkout / "pkg" / "new.py").write_text("")
    assert frozen() == str(tree)
    assert (tree / "pkg" / "mod.py").read_text() == "A = 1\n" and not (tree / "pkg" / "new.py").exists()
