"""What the lab's tests share: the repository's paths, loading a script of ``lab/scripts``, optional extras and the
one-line refusal of a ``normlab-lab`` command."""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository
LAB = ROOT / "lab"


def load_script(relpath: str):
    """Import a script of the repository that is not in a package (``lab/scripts/<name>.py``)."""
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def needs(module: str):
    """Import an optional extra's module, or skip the test; under ``make test`` (NORMLAB_REQUIRE_EXTRAS=1) a
    missing extra fails instead."""
    if os.environ.get("NORMLAB_REQUIRE_EXTRAS") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module)


def refused(argv, capsys) -> str:
    """Run ``normlab-lab argv``; assert exit code 2 and a one-line message on stderr, and return it."""
    from normlab_lab.cli import main

    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    return err
