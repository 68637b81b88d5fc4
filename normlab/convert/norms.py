"""``convert_norm`` to a norm name: each BatchNorm becomes that norm, with the state that carries over.

The rules (what is copied, what is refused): :mod:`normlab.convert`.
"""

from __future__ import annotations

import inspect
import warnings
from collections import OrderedDict

from torch import Tensor, nn

from normlab._checks import number_problem
from normlab.convert.dataflow import fixed_shapes, input_producers, seen_shapes
from normlab.convert.recognize import (
    BatchNormSpec,
    build_named,
    describe_batchnorm,
    grouped,
    known_batchnorm_forwards,
    module_names,
    num_channels,
    swap_modules,
    unique_modules,
    warn_lost_hooks,
    warn_unknown_batchnorms,
)
from normlab.convert.state import copy_into, is_frozen, keep_state
from normlab.nn.registry import NormEntry, create_norm, get_norm_class, norm_entry

__all__ = ["new_norm", "convert_norms", "LOOKED_FOR"]

_RUNNING = ("running_mean", "running_var", "num_batches_tracked")


def _copy_matching(src: nn.Module, dst: nn.Module, names: tuple[str, ...]) -> None:
    for name in names:
        a, b = getattr(src, name, None), getattr(dst, name, None)
        if isinstance(a, Tensor) and isinstance(b, Tensor) and a.numel() == b.numel():
            copy_into(b, a)


def _norm_act_class(entry: NormEntry, spec: BatchNormSpec) -> type:
    from normlab.integrations import timm as normlab_timm  # timm is loaded: the model holds a timm layer

    return normlab_timm.norm_act_class(entry.name, sync=spec.sync and entry.sync is not None)


def _accepted(cls: type) -> set[str]:
    """The keyword arguments ``cls`` takes: those of its ``__init__`` and, where that passes ``**kwargs`` on (a
    NormAct class), those of the next ``__init__`` up its bases."""
    names: set[str] = set()
    for base in cls.__mro__:
        init = base.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters
        names |= set(params)
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            break
    return names


def _renorm_limits(bn: nn.Module, spec: BatchNormSpec, kw: dict) -> dict:
    """A BatchRenorm's schedule or limits (unless ``**kw`` gives others)."""
    if not spec.renorm or any(k in kw for k in ("rmax", "dmax", "schedule")):
        return {}
    return {"schedule": bn.schedule} if bn.schedule is not None else {"rmax": bn.rmax, "dmax": bn.dmax}


def _derived(bn: nn.Module, spec: BatchNormSpec, entry: NormEntry, cls: type, kw: dict) -> dict:
    """The BatchNorm's settings the new layer ``cls`` takes: those the entry carries (eps, affine, no bias
    (``bias=False``), ``check_finite``; momentum and ``track_running_stats`` for a norm with BatchNorm's running
    statistics; a BatchRenorm's schedule or limits for brn) that ``cls``'s constructor names."""
    affine = getattr(bn, "affine", True)
    out = {
        "eps": bn.eps,
        "affine": affine,
        "momentum": getattr(bn, "momentum", 0.1),
        "track_running_stats": getattr(bn, "track_running_stats", True),
    }
    if affine and getattr(bn, "bias", 0) is None:
        out["bias"] = False
    if hasattr(bn, "check_finite"):
        out["check_finite"] = bn.check_finite
    out.update(_renorm_limits(bn, spec, kw))
    accepted = _accepted(cls)
    return {k: v for k, v in out.items() if k in entry.carries and k in accepted}


def _out_of_place(m: nn.Module) -> nn.Module:
    """``m`` with ``inplace`` switched off: without the norm in front, an in-place activation (or dropout) would
    overwrite the norm's *input*, which other layers may read too (DPN's dual paths: a wrong forward, or autograd's
    "modified by an inplace operation")."""
    if getattr(m, "inplace", False) is True:
        m.inplace = False
    return m


def _build(bn: nn.Module, spec: BatchNormSpec, to: str, dim: int, kw: dict) -> nn.Module:
    """The ``to`` layer for ``bn``'s channels with its settings (and its drop/act modules), freshly initialized."""
    channels, entry = num_channels(bn), norm_entry(to)
    if spec.act and to == "none":
        return nn.Sequential(OrderedDict(drop=_out_of_place(bn.drop), act=_out_of_place(bn.act)))
    if to == "none":
        return nn.Identity()
    if spec.act:  # its drop and act are set by new_norm
        cls = _norm_act_class(entry, spec)
        no_act = {"apply_act": False} if "apply_act" in inspect.signature(cls.__init__).parameters else {}
        return cls(channels, **{**_derived(bn, spec, entry, cls, kw), **kw, **no_act})
    if spec.sync and entry.sync is not None:
        return entry.sync(channels, **{**_derived(bn, spec, entry, entry.sync, kw), **kw})
    return create_norm(to, channels, dim=dim, **{**_derived(bn, spec, entry, get_norm_class(to, dim), kw), **kw})


def new_norm(bn: nn.Module, spec: BatchNormSpec, to: str, dim: int, kw: dict, model_ref: Tensor | None = None):
    """The ``to`` layer computing in place of ``bn`` (reusing its drop/act modules), with the state that carries:
    the values (:mod:`normlab.convert`), device, dtype, ``requires_grad`` and training flag
    (``normlab/convert/state.py``). A BatchNorm without tensors (``affine=False, track_running_stats=False``) gives
    the new layer the device and dtype of ``model_ref`` (a tensor of the model, see :func:`model_tensor`)."""
    new = _build(bn, spec, to, dim, kw)
    if to == "none":
        return keep_state(bn, new, True)
    ref = next((t for t in (bn.weight, bn.running_mean, model_ref) if isinstance(t, Tensor)), None)
    if ref is not None:
        new.to(device=ref.device, dtype=ref.dtype)  # first: the values are copied in the final dtype
    _copy_matching(bn, new, ("weight", "bias") + (_RUNNING if norm_entry(to).running_stats else ()))
    if spec.act:
        new.drop, new.act = bn.drop, bn.act
    return keep_state(bn, new, is_frozen(bn, spec.frozen))


def model_tensor(model: nn.Module) -> Tensor | None:
    """The first floating-point parameter or buffer of ``model`` (its device and dtype), or None."""
    tensors = [*model.parameters(), *model.buffers()]
    return next((t for t in tensors if t.is_floating_point()), None)


def _divisor_refusals(entry: NormEntry, bns: list, names: dict, kw: dict) -> list[tuple[str, str]]:
    """For a group norm with ``num_groups``: each BatchNorm whose channel count it does not divide, as (label,
    reason)."""
    g = kw.get("num_groups")
    if entry.statistics != "group" or g is None:
        return []
    expected = number_problem(g, integer=True, low=1)
    if expected is not None:
        return [("any layer", f"num_groups must be {expected}, got {g!r}")]
    out, top = [], max(32, g)
    for m, _ in bns:
        c = num_channels(m)
        if c % g:
            divisors = ", ".join(str(d) for d in range(1, min(c, top) + 1) if c % d == 0)
            label = f"{names[id(m)]} ({type(m).__name__}, {c} channels, divisors up to {top}: {divisors})"
            why = f"channels not divisible by num_groups={g} (without num_groups each layer takes its largest <= 32)"
            out.append((label, why))
    return out


def _degenerate(entry: NormEntry, m: nn.Module, shapes: list, kw: dict) -> tuple[str, str] | None:
    """Why the per-sample norm ``entry`` would compute a constant on an input of one of ``shapes``: a single
    position per channel (instance statistics: ``in``/``sn``) or a single value per group (``gn``/``ln``, e.g. a
    1x1 map with one channel per group), as (the input shape and groups for the label, the reason with ``{on}`` to
    fill in)."""
    c, kind = num_channels(m), next(iter(entry.classes.values())).__name__
    g = entry.groups(c, kw)
    for s in shapes:
        if len(s) < 3 or number_problem(g, integer=True, low=1) is not None:  # a bad num_groups: refused already
            continue
        positions = s[2:].numel()
        if entry.statistics == "instance" and positions < 2:
            return f"input {tuple(s)}", "a single position per channel {on}, instance statistics need more than one"
        if entry.statistics != "instance" and c % g == 0 and c // g * positions < 2:
            return f"input {tuple(s)}, {kind}({g}, {c})", "one value per group {on}, " + kind + " would output its bias"
    return None


def _refusals(model, to: str, bns: list, names: dict, example_input, kw: dict) -> list[tuple[str, str]]:
    """Why ``to`` cannot replace each BatchNorm, as (label, reason): ``num_groups`` does not divide its channels;
    its input lacks the axis ``to`` normalizes over; or ``to`` would see one value per statistic there (on
    ``example_input``, else on default inputs where the shape is fixed by the architecture:
    :func:`~normlab.convert.dataflow.fixed_shapes`)."""
    entry = norm_entry(to)
    out = _divisor_refusals(entry, bns, names, kw)
    if not entry.per_sample or not bns:
        return out
    mods, bn1d = [m for m, _ in bns], [m for m, spec in bns if spec.dim == 1]
    if example_input is not None:
        seen, on = seen_shapes(model, mods, example_input), "on example_input"
    else:
        seen, on = fixed_shapes(model, mods), "at every input size tried (fixed by the architecture)"
    context = input_producers(model, [m for m in bn1d if not seen.get(id(m))]) if bn1d else {}
    needs = f"{get_norm_class(to, 1).__name__ if 1 in entry.classes else to} needs (N, C, L)"
    for m in mods:
        shapes, name, kind = seen.get(id(m)) or [], names[id(m)], type(m).__name__
        constant = _degenerate(entry, m, shapes, kw)
        if any(len(s) == 2 for s in shapes):
            out.append((f"{name} ({kind})", f"sees (N, C) input {on}, {needs}"))
        elif constant is not None:
            out.append((f"{name} ({kind}, {constant[0]})", "sees " + constant[1].format(on=on)))
        elif m in bn1d and not shapes and context.get(id(m)) != "conv1d":
            why = (
                "its input is an nn.Linear output (N, C)"
                if context.get(id(m)) == "linear"
                else "its input may be (N, C) (give example_input to show it sees (N, C, L))"
            )
            out.append((f"{name} ({kind})", f"{why}, {needs}"))
    return out


#: What convert_norm looks for, in its warning when a model has none of it.
LOOKED_FOR = (
    "no BatchNorm (looked for torch's BatchNorm1d/2d/3d and SyncBatchNorm and their subclasses that keep their "
    "forward, timm's BatchNormAct2d/SyncBatchNormAct/FrozenBatchNormAct2d, torchvision's FrozenBatchNorm2d, normlab's "
    "BatchRenorm layers and their timm NormAct versions)"
)


def _batchnorms(model: nn.Module, known: dict) -> list[tuple[nn.Module, BatchNormSpec]]:
    """Every BatchNorm of ``model`` (each once) with what it computes."""
    found = unique_modules(model, lambda m: describe_batchnorm(m, known) is not None)
    return [(m, describe_batchnorm(m, known)) for m in found]


def _dims(model, bns: list, example_input) -> dict[int, int]:
    """The spatial dimensions each BatchNorm of any rank (SyncBatchNorm) sees on ``example_input``."""
    if example_input is None or not any(spec.dim is None for _, spec in bns):
        return {}
    seen = seen_shapes(model, [m for m, spec in bns if spec.dim is None], example_input)
    return {k: len(v[0]) - 2 for k, v in seen.items() if v and 1 <= len(v[0]) - 2 <= 3}


def convert_norms(model: nn.Module, to: str, example_input, kw: dict) -> nn.Module:
    """``convert_norm(model, to)`` for a norm name ``to``, on ``model`` itself (the caller copies it)."""
    known, names = known_batchnorm_forwards(), module_names(model)
    bns = _batchnorms(model, known)
    refused = _refusals(model, to, bns, names, example_input, kw)
    if refused:
        raise ValueError(f"convert_norm(to={to!r}): cannot replace {grouped(refused)}")
    warn_unknown_batchnorms(model, known, names, "convert_norm")
    if not bns:
        warnings.warn(f"convert_norm(to={to!r}): nothing to convert: {LOOKED_FOR}", UserWarning, stacklevel=3)
        return model
    dims, ref = _dims(model, bns, example_input), model_tensor(model)
    new = {
        id(m): build_named(
            lambda m=m, spec=spec: new_norm(m, spec, to, spec.dim or dims.get(id(m), 2), kw, ref),
            f"convert_norm(to={to!r})",
            m,
            names[id(m)],
        )
        for m, spec in bns
    }
    warn_lost_hooks([m for m, _ in bns], names, f"convert_norm(to={to!r})")
    return swap_modules(model, new)  # every new layer built first: a constructor's error changes nothing
