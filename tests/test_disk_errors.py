"""Disk full and permission errors while converting: a clear message, and nothing left behind."""
from __future__ import annotations

import errno
import shutil
from collections import namedtuple

import pytest

from lever_actors import bundle, convert as convert_mod
from lever_actors.errors import ModelError


def leftovers(out):
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(out.name))


def test_disk_full_midway_leaves_no_partial_bundle(tiny_gguf, tmp_path, monkeypatch):
    out = tmp_path / "b.bundle"
    calls = {"n": 0}
    real = bundle.RegionWriter.write

    def write(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.f.name))
        return real(self, *a, **kw)

    monkeypatch.setattr(bundle.RegionWriter, "write", write)
    with pytest.raises(ModelError, match="No space left on device.*nothing was left behind"):
        convert_mod.convert(tiny_gguf[0], out, progress=lambda m: None)
    assert leftovers(out) == []


def test_too_little_free_space_is_refused_before_writing(tiny_gguf, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 1 << 20))
    out = tmp_path / "b.bundle"
    with pytest.raises(ModelError, match="needs about .* MiB free"):
        convert_mod.convert(tiny_gguf[0], out, progress=lambda m: None)
    assert leftovers(out) == []


def test_an_unwritable_output_directory_is_a_clear_error(tiny_gguf, tmp_path, monkeypatch):
    from pathlib import Path

    def mkdir(self, *a, **kw):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(ModelError, match="cannot create .*Permission denied"):
        convert_mod.convert(tiny_gguf[0], tmp_path / "b.bundle", progress=lambda m: None)
