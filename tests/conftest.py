"""Shared pytest fixtures."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core machine extra threads only spin (and slow small models ~10x)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
