"""Every Example in the docstrings of the public layers and functions runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["normlab.functional", "normlab.nn.batch_renorm", "normlab.nn.instance_norm", "normlab.nn.switchable",
           "normlab.nn.weight_std", "normlab.nn.capsules", "normlab.nn.registry", "normlab.nn.param_groups",
           "normlab.convert", "normlab.runner.models"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
