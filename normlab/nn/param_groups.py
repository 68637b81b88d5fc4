"""Optimizer parameter groups without weight decay on PWS ``alpha``, normalization parameters and biases.

A module is a normalization layer when :func:`normlab.nn.registry.is_norm_layer` says so.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from .._checks import check_number
from .registry import is_norm_layer
from .weight_std import PWS_CONV_TYPES

__all__ = ["param_groups", "NO_DECAY_KINDS"]

#: The parameter kinds :func:`param_groups` can exempt from weight decay (its ``no_decay``).
NO_DECAY_KINDS = ("alpha", "norm", "bias")


def _kinds(module: nn.Module, name: str) -> set[str]:
    kinds = set()
    if name == "alpha" and isinstance(module, PWS_CONV_TYPES):
        kinds.add("alpha")
    if is_norm_layer(module):
        kinds.add("norm")
    if name == "bias":
        kinds.add("bias")
    return kinds


def param_groups(
    model: nn.Module,
    weight_decay: float,
    no_decay: Iterable[str] = NO_DECAY_KINDS,
    trainable_only: bool = True,
) -> list[dict]:
    """Split ``model``'s parameters into a decayed and a non-decayed optimizer group.

    Args:
        model: any module.
        weight_decay: weight decay of the decayed group (>= 0).
        no_decay: which parameters get ``weight_decay=0``: any of ``"alpha"`` (PWS per-channel gains),
            ``"norm"`` (every parameter of a normalization layer, see :func:`is_norm_layer`) and ``"bias"``
            (every parameter named ``bias``). Default: all three (the PWS authors' setting).
        trainable_only: skip parameters with ``requires_grad=False``.

    Returns:
        ``[{"params": [...], "weight_decay": weight_decay, "name": "decay"},
        {"params": [...], "weight_decay": 0.0, "name": "no_decay"}]`` without empty groups (one empty decay group
        is returned for a model without parameters). Each parameter appears exactly once, even when shared
        between modules (its first occurrence in ``model.named_modules()`` decides).
        Pass it directly to an optimizer: ``torch.optim.SGD(param_groups(model, 5e-4), lr=0.1)``.

    Example:
        >>> from normlab.nn import PWSConv2d
        >>> model = nn.Sequential(PWSConv2d(3, 8, 3), nn.BatchNorm2d(8))
        >>> [(g["name"], len(g["params"])) for g in param_groups(model, 5e-4)]  # alpha, biases, BN: no decay
        [('decay', 1), ('no_decay', 4)]
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"param_groups: model must be an nn.Module, got {type(model).__name__}")
    check_number("param_groups", "weight_decay", weight_decay, low=0, finite=False)
    if isinstance(no_decay, str):
        no_decay = (no_decay,)
    no_decay = set(no_decay)
    unknown = no_decay - set(NO_DECAY_KINDS)
    if unknown:
        raise ValueError(
            f"param_groups: unknown no_decay kind(s) {sorted(unknown)}; expected any of {', '.join(NO_DECAY_KINDS)}"
        )
    decay, keep = [], []
    seen: set[int] = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if p is None or id(p) in seen or (trainable_only and not p.requires_grad):
                continue
            seen.add(id(p))
            (keep if _kinds(module, name) & no_decay else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": float(weight_decay), "name": "decay"},
        {"params": keep, "weight_decay": 0.0, "name": "no_decay"},
    ]
    return [g for g in groups if g["params"]] or groups[:1]
