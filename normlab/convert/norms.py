"""``convert_norm`` to a norm name: each BatchNorm becomes that norm, with the state that carries over.

The rules (what is copied, what is refused): :mod:`normlab.convert`.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict

import torch
from torch import Tensor, nn

from normlab.convert.dataflow import input_producers, seen_shapes
from normlab.convert.recognize import (
    BatchNormSpec,
    describe_batchnorm,
    known_batchnorm_forwards,
    module_names,
    num_channels,
    swap_modules,
    unique_modules,
    warn_unknown_batchnorms,
)
from normlab.nn.batch_renorm import SyncBatchRenorm
from normlab.nn.registry import create_norm, get_norm_class

__all__ = ["new_norm", "convert_norms"]

# norms that need a length / spatial axis: refused for a BatchNorm1d over (N, C)
_NEEDS_LENGTH = {"gn": "GroupNorm", "ln": "GroupNorm(1, C)", "in": "InstanceNorm1d", "sn": "SwitchableNorm1d"}
_INSTANCE_STATS = ("in", "sn")


def _copy_matching(src: nn.Module, dst: nn.Module, names: tuple[str, ...]) -> None:
    with torch.no_grad():
        for name in names:
            a, b = getattr(src, name, None), getattr(dst, name, None)
            if isinstance(a, Tensor) and isinstance(b, Tensor) and a.numel() == b.numel():
                b.copy_(a.reshape(b.shape).to(b.dtype))


def _norm_act_class(to: str, spec: BatchNormSpec) -> type:
    from normlab.integrations import timm as normlab_timm  # timm is loaded: the model holds a timm layer

    if spec.sync and to == "brn":
        return normlab_timm.SyncBatchRenormAct
    return normlab_timm.NORM_ACT_CLASSES[to]


def _derived(bn: nn.Module, to: str, cls: type) -> dict:
    """The BatchNorm's settings the new layer ``cls`` takes: eps, affine; momentum and running statistics for
    bn/brn (sn is always affine and has its own momentum convention)."""
    out = {"eps": bn.eps, "affine": getattr(bn, "affine", True)}
    if to in ("brn", "bn"):
        out.update(momentum=getattr(bn, "momentum", 0.1), track_running_stats=getattr(bn, "track_running_stats", True))
    if to == "sn":
        out.pop("affine")
    accepted = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in out.items() if k in accepted}


def _out_of_place(m: nn.Module) -> nn.Module:
    """``m`` with ``inplace`` switched off: without the norm in front, an in-place activation (or dropout) would
    overwrite the norm's *input*, which other layers may read too (DPN's dual paths: a wrong forward, or autograd's
    "modified by an inplace operation")."""
    if getattr(m, "inplace", False) is True:
        m.inplace = False
    return m


def new_norm(bn: nn.Module, spec: BatchNormSpec, to: str, dim: int, kw: dict) -> nn.Module:
    """The ``to`` layer computing in place of ``bn`` (reusing its drop/act modules), with the state that carries."""
    channels = num_channels(bn)
    if spec.act and to == "none":
        return nn.Sequential(OrderedDict(drop=_out_of_place(bn.drop), act=_out_of_place(bn.act)))
    if to == "none":
        return nn.Identity()
    if spec.act:
        cls = _norm_act_class(to, spec)
        new = cls(channels, **{**_derived(bn, to, cls), **kw, "apply_act": False})
        new.drop, new.act = bn.drop, bn.act
    elif spec.sync and to == "brn":
        new = SyncBatchRenorm(channels, **{**_derived(bn, to, SyncBatchRenorm), **kw})
    else:
        new = create_norm(to, channels, dim=dim, **{**_derived(bn, to, get_norm_class(to, dim)), **kw})
    names = ("weight", "bias")
    if to in ("brn", "bn", "sn"):
        names += ("running_mean", "running_var", "num_batches_tracked")
    _copy_matching(bn, new, names)
    ref = next((t for t in (bn.weight, bn.running_mean) if t is not None), None)
    if ref is not None:
        new.to(device=ref.device, dtype=ref.dtype)
    return new.train(bn.training)


def _refusals(model, to: str, bns: list, names: dict, example_input) -> list[str]:
    """Why ``to`` cannot replace each BatchNorm whose input lacks the axis ``to`` normalizes over."""
    if to not in _NEEDS_LENGTH:
        return []
    bn1d = [m for m, spec in bns if spec.dim == 1]
    check = bn1d + [
        m
        for m, spec in bns
        if example_input is not None and m not in bn1d and (spec.dim is None or to in _INSTANCE_STATS)
    ]
    if not check:
        return []
    seen = seen_shapes(model, check, example_input) if example_input is not None else {}
    context = input_producers(model, [m for m in bn1d if not seen.get(id(m))])
    out = []
    for m in check:
        shapes, where = seen.get(id(m)) or [], f"{names[id(m)]} ({type(m).__name__})"
        if any(len(s) == 2 for s in shapes):
            out.append(f"{where} sees (N, C) input on example_input: {_NEEDS_LENGTH[to]} needs (N, C, L)")
        elif to in _INSTANCE_STATS and any(s[2:].numel() < 2 for s in shapes):
            small = next(tuple(s) for s in shapes if s[2:].numel() < 2)
            out.append(
                f"{where} sees input {small} on example_input: instance statistics need more than one "
                "position per channel"
            )
        elif m in bn1d and not shapes and context.get(id(m)) != "conv1d":
            why = (
                "its input is an nn.Linear output (N, C)"
                if context.get(id(m)) == "linear"
                else "its input may be (N, C) (give example_input to show it sees (N, C, L))"
            )
            out.append(f"{where}: {why}; {_NEEDS_LENGTH[to]} needs (N, C, L)")
    return out


def convert_norms(model: nn.Module, to: str, example_input, kw: dict) -> nn.Module:
    """``convert_norm(model, to)`` for a norm name ``to``, on ``model`` itself (the caller copies it)."""
    known, names = known_batchnorm_forwards(), module_names(model)
    bns = [
        (m, spec)
        for m in unique_modules(model, lambda m: describe_batchnorm(m, known) is not None)
        for spec in [describe_batchnorm(m, known)]
    ]
    refused = _refusals(model, to, bns, names, example_input)
    if refused:
        raise ValueError(f"convert_norm(to={to!r}): cannot replace {'; '.join(refused)}")
    warn_unknown_batchnorms(model, known, names, "convert_norm")
    dims = {}
    if example_input is not None and any(spec.dim is None for _, spec in bns):
        seen = seen_shapes(model, [m for m, spec in bns if spec.dim is None], example_input)
        dims = {k: len(v[0]) - 2 for k, v in seen.items() if v and 1 <= len(v[0]) - 2 <= 3}
    new = {id(m): new_norm(m, spec, to, spec.dim or dims.get(id(m), 2), kw) for m, spec in bns}
    return swap_modules(model, new)
