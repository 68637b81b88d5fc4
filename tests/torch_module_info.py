"""torch's ModuleInfo entries, and normlab's 16 drop-in layers described with the sample inputs of the layer each
replaces, for the generic module checks of tests/test_module_info.py.

The torch wheel ships ``torch.testing._internal.common_modules`` (``module_db``: a ModuleInfo per torch layer, with
its sample-input function, its flags and its skips) but not pytorch's ``test/test_modules.py``, the TestModule
checks that run over it; tests/test_module_info.py has its own code for those checks. Importing common_modules
imports torch's test utilities, which change process-wide state at import (they freeze ``torch.backends`` flags,
which Lightning's Trainer then may not set; they seed the random generators and patch TorchScript's call): :func:`load`
imports it once and puts that state back, so that the rest of the test session is unaffected.

An :class:`Entry` is a layer under test: torch's own (proof that the checks are right: they all pass) or normlab's,
which takes the ModuleInfo of the torch layer it replaces (its inputs, flags and skips) and says where it differs,
each difference a deviation of docs/deviations.md named here with its reason.
"""

from __future__ import annotations

import inspect
import random
import sys
import unittest
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

import normlab.nn as L

_MODULES = None


def load():
    """``torch.testing._internal.common_modules``, imported once with its process-wide side effects undone."""
    global _MODULES
    if _MODULES is not None:
        return _MODULES
    frozen = torch.backends.flags_frozen()
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    calls = (torch._C.ScriptFunction.__call__, torch._C.ScriptMethod.__call__)
    default_dtype, argv = torch.get_default_dtype(), sys.argv
    sys.argv = argv[:1]  # its argument parser reads sys.argv at import; pytest's options are not its
    try:
        import torch.testing._internal.common_modules as common_modules
    finally:
        sys.argv = argv
        if not frozen:  # disable_global_flags() at import: setting torch.backends.cudnn.benchmark would then raise
            setattr(torch.backends, "__allow_nonbracketed_mutation_flag", True)
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])
        torch._C.ScriptFunction.__call__, torch._C.ScriptMethod.__call__ = calls
        torch.set_default_dtype(default_dtype)
    _MODULES = common_modules
    return common_modules


@dataclass
class Entry:
    """A layer under test with the ModuleInfo (``info``) whose inputs, flags and skips it takes.

    ``ctor`` turns torch's constructor input ``(args, kwargs)`` into the layer's, or returns a string: the reason
    that input is left out (a deviation). ``accepts`` returns the reason a forward input is left out, or None.
    ``constructor_errors``: the reason the layer refuses, at construction, what torch refuses in the forward.
    ``stateful``: the reason its training output reads state a training forward changes (the checks then restore
    the state before each forward, :class:`RestoreState`). ``train_skips``: check name -> the reason it is skipped
    in training mode (a deviation).
    """

    name: str
    cls: type
    info: object
    ctor: object = None
    accepts: object = None
    constructor_errors: str = ""
    stateful: str = ""
    train_skips: dict | None = None
    normlab: bool = True

    def __repr__(self) -> str:
        return self.name

    def module_inputs(self, dtype, requires_grad=False, training=True, device="cpu", errors=False) -> list:
        """torch's sample inputs (or error inputs) of ``info``, with the constructor inputs translated by ``ctor``
        and the inputs this layer leaves out (see :data:`LEFT_OUT`) dropped."""
        func = self.info.module_error_inputs_func if errors else self.info.module_inputs_func
        raw = func(self.info, device=device, dtype=dtype, requires_grad=requires_grad, training=training)
        out = []
        for item in raw:
            module_input = item.module_error_input if errors else item
            if self._translate(module_input):
                out.append(item)
        return out

    def _translate(self, module_input) -> bool:
        """Put this layer's constructor input in ``module_input``; False when the input is left out."""
        ci, fi = module_input.constructor_input, module_input.forward_input
        if self.accepts is not None and fi is not None and self.accepts(fi) is not None:
            return False
        if self.ctor is None:
            return True
        translated = self.ctor(ci.args, ci.kwargs)
        if isinstance(translated, str):
            return False
        common = load()
        module_input.constructor_input = common.FunctionInput(*translated[0], **translated[1])
        return True


# ------------------------------------------------------------------------------------------------------------------
# Deviations: why an input of the replaced layer is left out for a normlab layer (docs/deviations.md)
# ------------------------------------------------------------------------------------------------------------------
LEFT_OUT = {
    "SwitchableNorm: affine=False, bias=False, track_running_stats=False": (
        "SwitchableNorm always learns weight and bias and keeps running BN statistics (the official layer's "
        "arguments); BatchNorm's inputs that switch them off are left out"
    ),
    "SwitchableNorm1d: (N, C) inputs": (
        "SwitchableNorm1d takes (N, C, L) with L > 1 (it mixes instance statistics over L); BatchNorm1d's (N, C) "
        "inputs are left out"
    ),
}
STATEFUL = (
    "BatchRenorm's training output reads the running statistics (r and d, Ioffe 2017), which every training forward "
    "updates: BatchNorm's is a function of the batch alone, so torch's checks compare (or differentiate numerically) "
    "repeated training forwards of one module; with renormalization active they restore its buffers before each"
)
STOP_GRADIENT = (
    "BatchRenorm's r and d are constants in backprop (stop_gradient, Ioffe 2017), though they depend on the batch: "
    "with renormalization active its training gradient is the paper's, not the numerical derivative of its forward, "
    "so gradcheck cannot hold (tests/test_batch_renorm.py checks it against the formula)"
)
CONSTRUCTOR_ERRORS = (
    "refuses eps <= 0 in the constructor (one line naming the layer), where torch's BatchNorm refuses it in the "
    "training forward"
)


class RestoreState:
    """A forward pre-hook that puts the module's buffers back to their values when it was made (see ``STATEFUL``);
    a module-level class, so that a module carrying it pickles."""

    def __init__(self, module: nn.Module):
        self.state = {name: b.detach().clone() for name, b in module.named_buffers()}

    def __call__(self, module: nn.Module, args) -> None:
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(self.state[name])


def _bound(cls: type, args, kwargs) -> dict:
    """Constructor arguments by name, torch's defaults filled in."""
    bound = inspect.signature(cls).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _renorm(torch_cls: type):
    """BatchRenorm with renormalization active from step 0 (rmax 3, dmax 5); a layer without running statistics
    has nothing to renormalize against and keeps the plain arguments (BatchRenorm refuses rmax/dmax there)."""

    def ctor(args, kwargs):
        if _bound(torch_cls, args, kwargs)["track_running_stats"]:
            kwargs = {**kwargs, "rmax": 3.0, "dmax": 5.0}
        return args, kwargs

    return ctor


def _switchable(torch_cls: type):
    def ctor(args, kwargs):
        a = _bound(torch_cls, args, kwargs)
        if not (a["affine"] and a["track_running_stats"] and a["bias"]):
            return LEFT_OUT["SwitchableNorm: affine=False, bias=False, track_running_stats=False"]
        return (a["num_features"], a["eps"], a["momentum"]), {}

    return ctor


def _spatial_input(fi):
    """SwitchableNorm's forward: (N, C, *spatial) with more than one spatial value."""
    x = fi.args[0]
    return None if x.dim() >= 3 and x.shape[2:].numel() > 1 else LEFT_OUT["SwitchableNorm1d: (N, C) inputs"]


def _renorm_entry(name: str, cls: type, info) -> Entry:
    """BatchRenorm with rmax 3, dmax 5 from step 0 on BatchNorm's inputs."""
    skips = {"test_grad": STOP_GRADIENT, "test_gradgrad": STOP_GRADIENT}
    renorm = _renorm(info.module_cls)
    return Entry(f"{name}-renorm", cls, info, renorm, None, CONSTRUCTOR_ERRORS, STATEFUL, skips)


def entries() -> list[Entry]:
    """torch's entries for the replaced layers, then normlab's 16 layers (BatchRenorm also renormalizing)."""
    common = load()
    info = {m.module_cls: m for m in common.module_db}
    bn = {d: info[getattr(nn, f"BatchNorm{d}d")] for d in (1, 2, 3)}
    inorm = {d: info[getattr(nn, f"InstanceNorm{d}d")] for d in (1, 2, 3)}
    conv = {d: info[getattr(nn, f"Conv{d}d")] for d in (1, 2, 3)}
    out = [Entry(i.formatted_name, i.module_cls, i, normlab=False) for i in (*bn.values(), *inorm.values())]
    out += [Entry(i.formatted_name, i.module_cls, i, normlab=False) for i in conv.values()]
    for d in (1, 2, 3):
        brn = getattr(L, f"BatchRenorm{d}d")
        out.append(Entry(brn.__name__, brn, bn[d], constructor_errors=CONSTRUCTOR_ERRORS))
        out.append(_renorm_entry(brn.__name__, brn, bn[d]))
    out.append(Entry("SyncBatchRenorm", L.SyncBatchRenorm, bn[2], constructor_errors=CONSTRUCTOR_ERRORS))
    out.append(_renorm_entry("SyncBatchRenorm", L.SyncBatchRenorm, bn[2]))
    for d in (1, 2, 3):
        sn = getattr(L, f"SwitchableNorm{d}d")
        out.append(
            Entry(
                sn.__name__,
                sn,
                bn[d],
                _switchable(bn[d].module_cls),
                _spatial_input,
                constructor_errors=CONSTRUCTOR_ERRORS,
            )
        )
    out += [Entry(f"InstanceNorm{d}d", getattr(L, f"InstanceNorm{d}d"), inorm[d]) for d in (1, 2, 3)]
    for kind in ("WSConv", "PWSConv"):
        out += [Entry(f"{kind}{d}d", getattr(L, f"{kind}{d}d"), conv[d]) for d in (1, 2, 3)]
    return out


# ------------------------------------------------------------------------------------------------------------------
# torch's declared skips, expected failures and tolerances for one check
# ------------------------------------------------------------------------------------------------------------------
def _kind(decorator) -> str:
    """``skip``, ``xfail`` or ``other`` (device-specific decorators: no-ops on the CPU; tolerance overrides)."""
    if decorator is unittest.expectedFailure:
        return "xfail"
    try:
        probe = decorator(lambda: None)
    except Exception:  # a class-only decorator or one that needs a test method
        return "other"
    return "skip" if getattr(probe, "__unittest_skip__", False) else "other"


def declared(entry: Entry, test: str, dtype, training: bool) -> tuple[str, dict]:
    """What torch's ModuleInfo declares for ``test`` on the CPU: ``("skip" | "xfail" | "", overrides)``, with
    ``overrides`` ``{"atol": ..., "rtol": ...}`` from its precision/tolerance overrides."""
    common = load()
    verdict, tol = "", {}
    for info in entry.info.decorators:
        decorators = info.decorators if isinstance(info, common.DecorateInfo) else [info]
        active = not isinstance(info, common.DecorateInfo) or info.is_active(
            "TestModule", test, "cpu", dtype, {"training": training}
        )
        if not active:
            continue
        for decorator in decorators:
            overrides = getattr(decorator, "d", None)
            if isinstance(overrides, dict) and dtype in overrides:
                value = overrides[dtype]
                tol = {"atol": value.atol, "rtol": value.rtol} if hasattr(value, "atol") else {"atol": value}
            elif _kind(decorator) != "other":
                verdict = verdict or _kind(decorator)
    return verdict, tol
