"""Shared pytest fixtures."""

import contextlib
import importlib
import importlib.util
import os
from pathlib import Path

import pytest
import torch
import torchvision_cpu

# Ray in tests stays on the loopback (its local-only switch, read when ray is first imported) and reports nothing
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# torchvision's Python parts (timm imports them) beside the CPU torch: see tests/torchvision_cpu.py
torchvision_cpu.prepare()


TIMM_TABLES = ("_NORM_ACT_MAP", "_NORM_TO_NORM_ACT_MAP", "_NORM_ACT_TYPES", "_NORM_ACT_REQUIRES_ARG")


def timm_tables() -> dict:
    """Copies of timm's private NormAct tables (what normlab.integrations.timm.register() adds to)."""
    import copy

    import timm.layers.create_norm_act as factory

    return {name: copy.copy(getattr(factory, name)) for name in TIMM_TABLES}


@contextlib.contextmanager
def timm_tables_kept():
    """timm's NormAct tables as they were before the block, whatever it registers (nothing without timm)."""
    if importlib.util.find_spec("timm") is None:
        yield
        return
    import timm.layers.create_norm_act as factory

    saved = timm_tables()
    try:
        yield
    finally:
        for name, value in saved.items():
            getattr(factory, name).clear()
            getattr(factory, name).update(value)


@pytest.fixture
def timm_registered():
    """normlab's NormAct classes registered with timm (``register()``, as a timm NormAct architecture needs) for one
    test; timm's tables restored after it."""
    na = needs("normlab.integrations.timm")
    with timm_tables_kept():
        na.register()
        yield


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core machine extra threads only spin (and slow small models ~10x)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def needs(module: str):
    """Import an optional integration's module, or skip the test; ``make test`` sets NORMLAB_REQUIRE_EXTRAS=1,
    which turns a missing extra into a failure (CI installs and tests every integration)."""
    if os.environ.get("NORMLAB_REQUIRE_EXTRAS") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module)


ROOT = Path(__file__).resolve().parents[1]


def load_script(relpath: str):
    """Import a script of the repository that is not in the package (``scripts/x.py``, ``benchmarks/y.py``)."""
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refused(argv, capsys) -> str:
    """Run ``normlab argv``; assert exit code 2 and a one-line message on stderr, and return it."""
    from normlab.cli import main

    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    return err


def idle(model):
    """An optimizer that leaves ``model`` unchanged (lr 0): what a monitor follows in tests that step it by hand."""
    return torch.optim.SGD(model.parameters(), lr=0.0)


def step_without_update(mon) -> None:
    """One monitor step in which the optimizer did not update (as when a GradScaler skips it): the monitor records
    and checks its rules without update ratios (the public way: a deferred step of its optimizer that never came)."""
    from normlab.monitor.optim_step import step_hooks

    hooks = step_hooks(mon.optimizer)
    hooks.defer()
    hooks.finish()


def claimed(out: Path, run: str = "normlab compare") -> Path:
    """``out`` as an earlier run of the command line ``run`` left it: claimed (:mod:`normlab.runner.lock`), for a
    test that plants files there (a corrupt checkpoint, a killed writer's temporary) before the run it tests."""
    import json

    from normlab.runner.lock import CLAIM_NAME

    out.mkdir(parents=True, exist_ok=True)
    (out / CLAIM_NAME).write_text(json.dumps({"run": run, "record": None}))
    return out
