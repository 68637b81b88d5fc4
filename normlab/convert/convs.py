"""``convert_norm`` to ``pws`` / ``ws``: each plain convolution becomes its weight-standardized version, and
(``remove_norm``) the BatchNorms that only normalize a converted conv's output are removed.

The rules (which convs are left, which norms are removed): :mod:`normlab.convert`.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from normlab.convert.dataflow import eval_mode, one_path, trace_flow
from normlab.convert.norms import new_norm
from normlab.convert.recognize import (
    PLAIN_CONVS,
    STD_CONVS,
    build_named,
    conv_kwargs,
    describe_batchnorm,
    grouped,
    known_batchnorm_forwards,
    module_names,
    name_list,
    num_channels,
    swap_modules,
    timm_std_kind,
    unique_modules,
    warn_lost_hooks,
    warn_unknown_batchnorms,
)
from normlab.convert.state import copy_into, is_frozen, keep_state
from normlab.nn.registry import get_conv_class

__all__ = ["make_std_conv", "convert_convs"]


def make_std_conv(conv: nn.Module, to: str, dim: int, bias: bool, kw: dict) -> nn.Module:
    """The ``to`` (``pws``/``ws``) conv of ``dim`` dims with ``conv``'s arguments, raw weight and bias (zero if new),
    device, dtype, memory format, ``requires_grad`` and training flag (``normlab/convert/state.py``)."""
    cls = get_conv_class(to, dim)
    new = cls(**conv_kwargs(conv), **{"bias": bias, **kw})
    copy_into(new.weight, conv.weight)
    if new.bias is not None:
        if conv.bias is not None:
            copy_into(new.bias, conv.bias)
        else:
            with torch.no_grad():
                new.bias.zero_()
    return keep_state(conv, new, is_frozen(conv))


def _left_convs(model: nn.Module, names: dict) -> list[tuple[str, str]]:
    """Convs ``pws``/``ws`` leave as they are, as (label, reason)."""
    out = []
    for m in unique_modules(model, lambda m: isinstance(m, nn.modules.conv._ConvNd) and type(m) not in PLAIN_CONVS):
        if isinstance(m, STD_CONVS):
            continue  # a normlab WS/PWS conv already
        if isinstance(m, nn.modules.conv._ConvTransposeNd):
            why = "a transposed conv (normlab has no weight-standardized transposed conv)"
        elif timm_std_kind(m) is not None:
            why = "already weight-standardized (timm StdConv)"
        else:
            why = "a conv subclass (its forward may differ)"
        out.append((f"{names[id(m)]} ({type(m).__name__})", why))
    return out


def _removable_norms(model: nn.Module, convs: list, known: dict, example_input) -> tuple[list, set[int]]:
    """The BatchNorms each of whose calls takes one of ``convs``' outputs as its only input (dataflow), and the
    ids of the convs that feed them."""
    norms = unique_modules(model, lambda m: describe_batchnorm(m, known) is not None)
    if not convs or not norms:
        return [], set()
    with eval_mode(model):
        flow, _, _, why = trace_flow(model, convs, norms, example_input)
    if flow is None:
        warnings.warn(
            f"convert_norm: remove_norm: the dataflow could not be established ({why}); no BatchNorm "
            "removed (give example_input)",
            UserWarning,
            stacklevel=4,  # the caller of convert_norm
        )
        return [], set()
    by_id = {id(c): c for c in convs}
    out, feeding = [], set()
    for bn in norms:
        srcs = flow.bn_inputs.get(id(bn)) or [None]
        if all(s is not None and s[0] in by_id and by_id[s[0]].out_channels == num_channels(bn) for s in srcs):
            out.append(bn)
            feeding |= {s[0] for s in srcs}
    path = one_path(flow, why, example_input is not None)
    if path is not None and out:
        names = module_names(model)
        warnings.warn(
            f"convert_norm: remove_norm: the BatchNorms removed {path}; removed: "
            + name_list([names[id(bn)] for bn in out]),
            UserWarning,
            stacklevel=4,  # the caller of convert_norm
        )
    return out, feeding


def convert_convs(model: nn.Module, to: str, remove_norm: bool, example_input, kw: dict) -> nn.Module:
    """``convert_norm(model, to)`` for ``to`` in ``pws``/``ws``, on ``model`` itself (the caller copies it)."""
    known, names = known_batchnorm_forwards(), module_names(model)
    left = _left_convs(model, names)
    if left:
        warnings.warn(f"convert_norm(to={to!r}): left as they are: {grouped(left)}", UserWarning, stacklevel=3)
    convs = unique_modules(model, lambda m: type(m) in PLAIN_CONVS)
    if not convs:
        warnings.warn(
            f"convert_norm(to={to!r}): nothing to convert: no plain convolution (looked for nn.Conv1d/2d/3d, exact "
            "types)",
            UserWarning,
            stacklevel=3,
        )
        return model
    removed, with_norm = _removable_norms(model, convs, known, example_input) if remove_norm else ([], set())
    warn_unknown_batchnorms(model, known, names, "convert_norm")
    rest = {k: v for k, v in kw.items() if k != "bias"}
    new = {}
    for conv in convs:
        bias = kw.get("bias", conv.bias is not None or id(conv) in with_norm)
        new[id(conv)] = build_named(
            lambda conv=conv, bias=bias: make_std_conv(conv, to, PLAIN_CONVS[type(conv)], bias, rest),
            f"convert_norm(to={to!r})",
            conv,
            names[id(conv)],
        )
    for bn in removed:
        new[id(bn)] = new_norm(bn, describe_batchnorm(bn, known), "none", 2, {})
    warn_lost_hooks([*convs, *removed], names, f"convert_norm(to={to!r})")
    return swap_modules(model, new)
