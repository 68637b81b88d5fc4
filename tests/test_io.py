"""normlab.runner.io: atomic writes that respect the umask at write time, never follow links, clean up."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from normlab.runner.io import (
    TEMP_SUFFIX,
    append_lines,
    atomic_torch_save,
    atomic_write_json,
    atomic_write_text,
    remove_stale_temps,
)


def test_atomic_write_uses_the_umask_of_the_moment(tmp_path):
    # the umask used to be read once at import time (a process-wide side effect of importing normlab)
    old = os.umask(0o077)
    try:
        p = atomic_write_text(tmp_path / "a.txt", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    old = os.umask(0o022)
    try:
        p = atomic_write_text(tmp_path / "b.txt", "y")
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.stat().st_mode) == 0o644


def test_atomic_write_replaces_a_planted_link_and_leaves_its_target_alone(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").symlink_to(outside)
    atomic_write_json(out / "results.json", {"a": float("nan"), "b": torch.tensor(2.0)})
    assert outside.read_text() == "keep"
    assert not (out / "results.json").is_symlink()
    assert json.loads((out / "results.json").read_text()) == {"a": None, "b": 2.0}
    (out / "log.jsonl").symlink_to(outside)
    with pytest.raises(OSError):
        append_lines(out / "log.jsonl", ["{}"])
    assert outside.read_text() == "keep"


def test_failed_write_leaves_old_file_and_no_temp(tmp_path):
    p = atomic_write_text(tmp_path / "f.txt", "old")

    class Boom(Exception):
        pass

    def write(f):
        f.write(b"half")
        raise Boom

    from normlab.runner.io import atomic_write

    with pytest.raises(Boom):
        atomic_write(p, write)
    assert p.read_text() == "old" and not list(tmp_path.glob(f"*{TEMP_SUFFIX}"))
    (tmp_path / f".checkpoint.pt.abc{TEMP_SUFFIX}").write_bytes(b"left by a killed writer")
    atomic_torch_save({"x": 1}, tmp_path / "checkpoint.pt")
    assert [p.name for p in remove_stale_temps(tmp_path)] == [f".checkpoint.pt.abc{TEMP_SUFFIX}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt", "f.txt"]
