"""Shared pytest fixtures of the lab's tests (helpers that tests import: ``labtest.py``)."""

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]  # the repository
sys.path.insert(0, str(ROOT / "tests"))  # torchvision_cpu: torchvision's Python parts beside the CPU torch
import torchvision_cpu  # noqa: E402

# Ray in tests stays on the loopback (its local-only switch, read when ray is first imported) and reports nothing
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
torchvision_cpu.prepare()


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core machine extra threads only spin (and slow small models ~10x)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
