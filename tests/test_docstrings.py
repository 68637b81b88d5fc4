"""Every public layer and function carries an Example, and every Example runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib
import inspect

import pytest

MODULES = [
    "normlab.functional",
    "normlab.nn.batch_renorm",
    "normlab.nn.instance_norm",
    "normlab.nn.switchable",
    "normlab.nn.weight_std",
    "normlab.nn.capsules",
    "normlab.nn.registry",
    "normlab.nn.param_groups",
    "normlab.convert.targets",
    "normlab.convert.fold",
    "normlab.monitor",
    "normlab.monitor.hooks",
    "normlab.monitor.monitor",
    "normlab.monitor.records",
    "normlab.monitor.log",
    "normlab.monitor.plotting",
    "normlab.monitor.optim_step",
    "normlab.monitor.rules",
    "normlab.monitor.rules.variance",
    "normlab.monitor.rules.regime",
    "normlab.monitor.guard",
    "normlab.monitor.shards",
    "normlab.monitor.layers",
    "normlab.monitor.spp",
    "normlab.monitor.collapse",
    "normlab.monitor.rules.base",
    "normlab.monitor.rules.replay",
    "normlab.monitor.rules.practitioners",
    "normlab.monitor.rules.transformer",
    "normlab.monitor.probes",
    "normlab.runner.models",
]
# The public API: every class and function in these modules' __all__ documents itself with an Example.
PUBLIC = ["normlab.nn", "normlab.functional", "normlab.convert", "normlab.monitor"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no docstring examples"
    assert result.failed == 0


def _public_callables():
    for module_name in PUBLIC:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                yield f"{module_name}.{name}", obj


@pytest.mark.parametrize("qualname, obj", list(_public_callables()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_public_class_and_function_has_an_example(qualname, obj):
    doc = inspect.getdoc(obj) or ""
    if inspect.isclass(obj) and issubclass(obj, BaseException):
        return  # an exception class is documented by its summary
    assert "Example" in doc and ">>>" in doc, f"{qualname}: no Example section with >>> lines in its docstring"
