"""Exports, data and checkpoints follow the umask: a serving process of another account
reads a drafter exported under umask 022, whatever modes the writing library chose."""

import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dflash_train.atomic import atomic_write


@pytest.mark.parametrize("mask, folder_mode, file_mode", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_a_published_folder_takes_the_umask_modes(tmp_path, mask, folder_mode, file_mode):
    def write(tmp: Path):
        save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))  # safetensors writes 0600
        (tmp / "sub").mkdir(mode=0o700)
        (tmp / "sub" / "config.json").write_text("{}")

    before = os.umask(mask)
    try:
        out = atomic_write(tmp_path / "export", write, folder=True)
    finally:
        os.umask(before)
    modes = {p.relative_to(out).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [out, *out.rglob("*")]}
    assert modes == {".": folder_mode, "model.safetensors": file_mode, "sub": folder_mode,
                     "sub/config.json": file_mode}
