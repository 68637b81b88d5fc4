"""Which layers the monitor watches, and how to see through model wrappers.

A layer is watched when it is a convolution (``nn.Conv1d/2d/3d`` and subclasses: WS/PWS, weight-normed), an
``nn.Linear``, or a normalization layer (:func:`normlab.nn.is_norm_layer`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from normlab.nn import is_norm_layer

__all__ = ["unwrap_model", "is_compiled", "layer_kind", "supported_layers", "effective_weight"]

_CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_MAX_WRAPPERS = 16


def _inner(model: nn.Module) -> nn.Module | None:
    """The module a DDP/DataParallel (``.module``) or torch.compile (``._orig_mod``) wrapper holds, else None."""
    if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
        return model.module
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else None


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP/DataParallel and torch.compile wrappers, in any nesting."""
    for _ in range(_MAX_WRAPPERS):
        inner = _inner(model)
        if inner is None:
            return model
        model = inner
    return model


def is_compiled(model: nn.Module) -> bool:
    """True when a torch.compile wrapper sits anywhere in the wrapper chain of ``model``."""
    for _ in range(_MAX_WRAPPERS):
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            return True
        inner = _inner(model)
        if inner is None:
            return False
        model = inner
    return False


def layer_kind(module: nn.Module) -> str | None:
    """``"conv"``, ``"linear"``, ``"norm"`` or None (not watched)."""
    if isinstance(module, _CONV_TYPES):
        return "conv"
    if isinstance(module, nn.Linear):
        return "linear"
    if is_norm_layer(module):
        return "norm"
    return None


def supported_layers(model: nn.Module, include_norm: bool = True) -> list[tuple[str, nn.Module, str]]:
    """``(name, module, kind)`` of every watched layer of ``model``, in registration order."""
    out = []
    for name, mod in unwrap_model(model).named_modules():
        kind = layer_kind(mod)
        if kind is None or (kind == "norm" and not include_norm):
            continue
        out.append((name or type(mod).__name__, mod, kind))
    return out


@torch.no_grad()
def effective_weight(module: nn.Module) -> Tensor:
    """The kernel the layer applies, detached: ``module.effective_weight()`` where the module has it (WS/PWS
    convs), else ``module.weight`` (a ``weight_norm`` parametrization already yields the effective kernel there)."""
    fn = getattr(module, "effective_weight", None)
    w = fn() if callable(fn) else module.weight
    return w.detach()
