"""``convert_norm`` to a norm name: each BatchNorm becomes that norm, with the state that carries over.

The rules (what is copied, what is refused): :mod:`normlab.convert`.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict

import torch
from torch import Tensor, nn

from normlab._checks import number_problem
from normlab.convert.dataflow import fixed_shapes, input_producers, seen_shapes
from normlab.convert.recognize import (
    BatchNormSpec,
    build_named,
    describe_batchnorm,
    known_batchnorm_forwards,
    module_names,
    num_channels,
    swap_modules,
    unique_modules,
    warn_lost_hooks,
    warn_unknown_batchnorms,
)
from normlab.nn.batch_renorm import SyncBatchRenorm
from normlab.nn.registry import create_norm, default_groups, get_norm_class

__all__ = ["new_norm", "convert_norms"]

# norms that need a length / spatial axis: refused for a BatchNorm1d over (N, C)
_NEEDS_LENGTH = {"gn": "GroupNorm", "ln": "GroupNorm(1, C)", "in": "InstanceNorm1d", "sn": "SwitchableNorm1d"}
_INSTANCE_STATS = ("in", "sn")
# what a synchronized BatchNorm becomes for the targets with batch statistics (the others are per sample)
_SYNC = {"brn": SyncBatchRenorm, "bn": nn.SyncBatchNorm}


def _copy_matching(src: nn.Module, dst: nn.Module, names: tuple[str, ...]) -> None:
    with torch.no_grad():
        for name in names:
            a, b = getattr(src, name, None), getattr(dst, name, None)
            if isinstance(a, Tensor) and isinstance(b, Tensor) and a.numel() == b.numel():
                b.copy_(a.reshape(b.shape).to(b.dtype))


def _norm_act_class(to: str, spec: BatchNormSpec) -> type:
    from timm.layers import SyncBatchNormAct  # timm is loaded: the model holds a timm layer

    from normlab.integrations import timm as normlab_timm

    if spec.sync and to in ("brn", "bn"):
        return normlab_timm.SyncBatchRenormAct if to == "brn" else SyncBatchNormAct
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
        no_act = {"apply_act": False} if "apply_act" in inspect.signature(cls.__init__).parameters else {}
        new = cls(channels, **{**_derived(bn, to, cls), **kw, **no_act})
        new.drop, new.act = bn.drop, bn.act
    elif spec.sync and to in _SYNC:
        new = _SYNC[to](channels, **{**_derived(bn, to, _SYNC[to]), **kw})
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


def _groups(to: str, channels: int, kw: dict) -> int:
    """The groups of the GroupNorm ``to`` (``gn``/``ln``) builds for ``channels``."""
    return 1 if to == "ln" else kw.get("num_groups") or default_groups(channels)


def _divisor_refusals(to: str, bns: list, names: dict, kw: dict) -> list[str]:
    """For ``gn`` with ``num_groups``: each BatchNorm whose channel count it does not divide."""
    g = kw.get("num_groups")
    if to != "gn" or g is None:
        return []
    expected = number_problem(g, integer=True, low=1)
    if expected is not None:
        return [f"any layer: num_groups must be {expected}, got {g!r}"]
    out = []
    for m, _ in bns:
        c = num_channels(m)
        if c % g:
            top = max(32, g)
            divisors = ", ".join(str(d) for d in range(1, min(c, top) + 1) if c % d == 0)
            out.append(
                f"{names[id(m)]} ({type(m).__name__}): {c} channels, not divisible by num_groups={g} "
                f"(divisors of {c} up to {top}: {divisors}; without num_groups each layer takes its largest <= 32)"
            )
    return out


def _degenerate(to: str, m: nn.Module, shapes: list, kw: dict) -> str | None:
    """Why ``to`` would compute a constant on an input of one of ``shapes``: a single position per channel
    (``in``/``sn``) or a single value per group (``gn``/``ln``, e.g. a 1x1 map with one channel per group)."""
    c = num_channels(m)
    for s in shapes:
        if len(s) < 3:
            continue
        positions = s[2:].numel()
        if to in _INSTANCE_STATS and positions < 2:
            return f"sees input {tuple(s)} {{on}}: instance statistics need more than one position per channel"
        if to in ("gn", "ln") and c % _groups(to, c, kw) == 0 and c // _groups(to, c, kw) * positions < 2:
            g = _groups(to, c, kw)
            return f"sees input {tuple(s)} {{on}}: GroupNorm({g}, {c}) would output its bias (one value per group)"
    return None


def _refusals(model, to: str, bns: list, names: dict, example_input, kw: dict) -> list[str]:
    """Why ``to`` cannot replace each BatchNorm: ``num_groups`` does not divide its channels; its input lacks the
    axis ``to`` normalizes over; or ``to`` would see one value per statistic there (on ``example_input``, else on
    default inputs where the shape is fixed by the architecture: :func:`~normlab.convert.dataflow.fixed_shapes`)."""
    out = _divisor_refusals(to, bns, names, kw)
    if to not in _NEEDS_LENGTH or not bns:
        return out
    mods, bn1d = [m for m, _ in bns], [m for m, spec in bns if spec.dim == 1]
    if example_input is not None:
        seen, on = seen_shapes(model, mods, example_input), "on example_input"
    else:
        seen, on = fixed_shapes(model, mods), "at every input size tried (fixed by the architecture)"
    context = input_producers(model, [m for m in bn1d if not seen.get(id(m))]) if bn1d else {}
    for m in mods:
        shapes, where = seen.get(id(m)) or [], f"{names[id(m)]} ({type(m).__name__})"
        constant = _degenerate(to, m, shapes, kw)
        if any(len(s) == 2 for s in shapes):
            out.append(f"{where} sees (N, C) input {on}: {_NEEDS_LENGTH[to]} needs (N, C, L)")
        elif constant is not None:
            out.append(f"{where} {constant.format(on=on)}")
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
    refused = _refusals(model, to, bns, names, example_input, kw)
    if refused:
        raise ValueError(f"convert_norm(to={to!r}): cannot replace {'; '.join(refused)}")
    warn_unknown_batchnorms(model, known, names, "convert_norm")
    dims = {}
    if example_input is not None and any(spec.dim is None for _, spec in bns):
        seen = seen_shapes(model, [m for m, spec in bns if spec.dim is None], example_input)
        dims = {k: len(v[0]) - 2 for k, v in seen.items() if v and 1 <= len(v[0]) - 2 <= 3}
    new = {
        id(m): build_named(
            lambda m=m, spec=spec: new_norm(m, spec, to, spec.dim or dims.get(id(m), 2), kw),
            f"convert_norm(to={to!r})",
            m,
            names[id(m)],
        )
        for m, spec in bns
    }
    warn_lost_hooks([m for m, _ in bns], names, f"convert_norm(to={to!r})")
    return swap_modules(model, new)  # every new layer built first: a constructor's error changes nothing
