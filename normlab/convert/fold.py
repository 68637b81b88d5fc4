""":func:`fold_for_inference`: plain convolutions in place of WS/PWS/parametrized/StdConv ones, and each
eval-mode BatchNorm that only normalizes a conv's output folded into that conv.

The rules (which pairs fold, the output check): :mod:`normlab.convert`.
"""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from normlab.convert.dataflow import Flow, one_path, trace_flow
from normlab.convert.recognize import (
    PLAIN_CONVS,
    STD_CONVS,
    conv_kwargs,
    describe_batchnorm,
    grouped,
    is_unknown_batchnorm,
    known_batchnorm_forwards,
    module_names,
    name_list,
    num_channels,
    swap_modules,
    timm_std_kind,
    unique_modules,
)
from normlab.nn.batch_renorm import BATCH_RENORM_TYPES

__all__ = ["fold_for_inference"]

_PLAIN_CONVS_BY_DIM = {d: cls for cls, d in PLAIN_CONVS.items()}
_TRANSPOSED = {nn.ConvTranspose1d: 1, nn.ConvTranspose2d: 2, nn.ConvTranspose3d: 3}
_TRANSPOSED_BY_DIM = {d: cls for cls, d in _TRANSPOSED.items()}


def _conv_dim(m: nn.Module) -> int | None:
    """Spatial dims of a conv whose kernel folds into a plain conv (or transposed conv), else None."""
    if type(m) in _TRANSPOSED:
        return _TRANSPOSED[type(m)]
    if timm_std_kind(m) is not None:
        return 2
    for cls, d in PLAIN_CONVS.items():
        if type(m) is cls:
            return d
        if isinstance(m, cls) and (isinstance(m, STD_CONVS) or parametrize.is_parametrized(m, "weight")):
            return d  # WS/PWS conv, or a conv with a weight parametrization (e.g. weight_norm): fold its kernel
    return None


def _is_plain(m: nn.Module) -> bool:
    return type(m) in PLAIN_CONVS or type(m) in _TRANSPOSED


def _effective_weight(conv: nn.Module) -> Tensor:
    """The kernel ``conv`` applies, in float64 (timm's StdConv: ``F.batch_norm`` over each filter, biased
    variance, eps inside the root, times ``gain * scale`` for ScaledStdConv2d)."""
    kind = timm_std_kind(conv)
    if kind is None:
        w = conv.effective_weight() if hasattr(conv, "effective_weight") else conv.weight
        return w.detach().double()
    w = conv.weight.detach().double()
    flat = w.reshape(conv.out_channels, -1)
    mean, var = flat.mean(1, keepdim=True), flat.var(1, unbiased=False, keepdim=True)
    flat = (flat - mean) * torch.rsqrt(var + conv.eps)
    if kind == "scaled":
        flat = flat * (conv.gain.detach().double() * conv.scale).reshape(-1, 1)
    return flat.reshape_as(w)


def _scale_out_channels(w: Tensor, scale: Tensor, conv: nn.Module) -> Tensor:
    """Multiply each output channel of kernel ``w`` by ``scale`` (transposed: (Cin, Cout/groups, *k))."""
    if not getattr(conv, "transposed", False):
        return w * scale.reshape((-1,) + (1,) * (w.dim() - 1))
    g = conv.groups
    grouped = w.reshape(g, w.shape[0] // g, *w.shape[1:])
    return (grouped * scale.reshape(g, 1, -1, *([1] * (w.dim() - 2)))).reshape_as(w)


def _plain_conv(conv: nn.Module, dim: int, norm: nn.Module | None) -> nn.Module:
    """A plain nn.Conv{dim}d (nn.ConvTranspose{dim}d) equal to ``conv`` (effective kernel) then the eval ``norm``."""
    with torch.no_grad():
        weight = conv.weight
        w = _effective_weight(conv)
        b = conv.bias.detach().double() if conv.bias is not None else None
        if norm is not None:
            inv_std = torch.rsqrt(norm.running_var.double() + norm.eps)
            scale = inv_std if norm.weight is None else norm.weight.double() * inv_std
            shift = -norm.running_mean.double() * scale
            if norm.bias is not None:
                shift = shift + norm.bias.double()
            w = _scale_out_channels(w, scale, conv)
            b = shift if b is None else b * scale + shift
        cls = (_TRANSPOSED_BY_DIM if getattr(conv, "transposed", False) else _PLAIN_CONVS_BY_DIM)[dim]
        out = cls(**{**conv_kwargs(conv), "bias": b is not None})
        out.weight.copy_(w.to(weight.dtype))
        if b is not None:
            out.bias.copy_(b.to(out.bias.dtype))
    return out.eval()


def _is_batch_norm(m: nn.Module, known: dict) -> bool:
    """A BatchNorm / BatchRenorm of any kind (frozen, with activation, a subclass with its own forward)."""
    return describe_batchnorm(m, known) is not None or is_unknown_batchnorm(m, known)


def _unfoldable_norm(m: nn.Module, known: dict) -> str | None:
    """None for an eval-mode BatchNorm / BatchRenorm with running statistics (a frozen one, a BatchNorm +
    activation), else why it cannot be folded."""
    spec = describe_batchnorm(m, known)
    if spec is None:
        kind = "BatchRenorm" if isinstance(m, BATCH_RENORM_TYPES) else "BatchNorm"
        return f"a {kind} subclass with its own forward"
    if any(getattr(m, k, None) is None for k in ("running_mean", "running_var")):
        return "no running statistics: track_running_stats=False, batch statistics in eval too"
    if m.training and not spec.frozen:
        return "the BatchNorm is in training mode"
    return None


def _folded_norm(m: nn.Module, known: dict) -> nn.Module:
    """What is left of a norm folded into its conv: nothing, or its drop and act."""
    act = describe_batchnorm(m, known).act
    return nn.Sequential(OrderedDict(drop=m.drop, act=m.act)) if act else nn.Identity()


def _registration_pairs(parent: nn.Module, keep, out: list) -> list[tuple[nn.Module, nn.Module]]:
    """(conv, BN) pairs that are neighbours in registration order: reported when the dataflow is unknown."""
    children = list(parent.named_children())
    for i, (_, child) in enumerate(children):
        is_conv = isinstance(child, nn.modules.conv._ConvNd)
        if is_conv and i + 1 < len(children):
            nxt = children[i + 1][1]
            if keep(nxt) and num_channels(nxt) == child.out_channels:
                out.append((child, nxt))
        elif not is_conv:
            _registration_pairs(child, keep, out)
    return out


def _pair_reason(flow: Flow | None, why: str, conv, bn, pairs, unfoldable: str | None) -> str | None:
    if unfoldable is not None:
        return unfoldable
    if _conv_dim(conv) is None:
        return f"{type(conv).__name__} is a conv subclass with its own forward"
    reason = f"dataflow unknown ({why})" if flow is None else flow.verdict(conv, bn)
    if reason is None and conv.out_channels != num_channels(bn):
        reason = "channel counts differ"
    if reason is None and (
        conv._forward_hooks or conv._forward_pre_hooks or bn._forward_hooks or bn._forward_pre_hooks
    ):
        reason = "a module has hooks"
    if reason is None and any(conv is c for c, _ in pairs):
        reason = "the conv already folds another BatchNorm"
    return reason


def _path_note(flow: Flow | None, why: str, pairs: list, names: dict, given: bool) -> str | None:
    """The warning that the folds rest on the path one input took (:func:`~normlab.convert.dataflow.one_path`),
    with at least one pair folded on it."""
    path = one_path(flow, why, given)
    if path is None or not pairs:
        return None
    folds = name_list([f"{names[id(c)]} -> {names[id(b)]}" for c, b in pairs])
    return f"fold_for_inference: the folds {path}; folded: {folds}"


def _lone_reason(flow: Flow | None, why: str, bn: nn.Module, unfoldable: str | None) -> str:
    """Why a BatchNorm that no conv feeds stays: it cannot be folded at all, or what its input is."""
    if unfoldable is not None:
        return unfoldable
    if flow is None:
        return f"dataflow unknown ({why})"
    if flow.calls[id(bn)] != 1:
        return f"the BatchNorm runs {flow.calls[id(bn)]} times per forward"
    made_by = flow.producers.get(id(bn))
    return f"its input is {made_by}, not a conv's output" if made_by else "its input is not a conv's output"


def _fold_plan(model: nn.Module, example_input: Tensor | None, known: dict):
    """Decide the conv -> BN pairs to fold: (pairs, [warning], default input, its output); the warnings name every
    BatchNorm left unfolded with the reason (with its conv where one feeds it), and say when the folds rest on the
    path of one traced input."""
    names = module_names(model)
    convs = unique_modules(model, lambda m: isinstance(m, nn.modules.conv._ConvNd))  # foldable or not
    norms = unique_modules(model, lambda m: _is_batch_norm(m, known))
    if not norms:
        return [], [], None, None
    if not convs:
        why = "the model has no conv to fold it into"
        reasons = [(f"{names[id(bn)]} ({type(bn).__name__})", _unfoldable_norm(bn, known) or why) for bn in norms]
        return [], ["fold_for_inference: left unfolded: " + grouped(reasons)], None, None
    flow, x, y, why = trace_flow(model, convs, norms, example_input)
    by_id = {id(c): c for c in convs}
    pairs, skipped = [], []
    old = {id(b): c for c, b in _registration_pairs(model, lambda m: any(m is n for n in norms), [])}
    for bn in norms:
        conv = by_id.get(flow.source(bn)) if flow is not None else None
        conv = conv if conv is not None else old.get(id(bn))
        unfoldable = _unfoldable_norm(bn, known)
        if conv is None:  # no conv feeds it
            skipped.append((f"{names[id(bn)]} ({type(bn).__name__})", _lone_reason(flow, why, bn, unfoldable)))
            continue
        reason = _pair_reason(flow, why, conv, bn, pairs, unfoldable)
        if reason is None:
            pairs.append((conv, bn))
        else:
            skipped.append((f"{names[id(conv)]} -> {names[id(bn)]}", reason))
    notes = ["fold_for_inference: left unfolded: " + grouped(skipped)] if skipped else []
    notes += [n for n in [_path_note(flow, why, pairs, names, example_input is not None)] if n]
    return pairs, notes, x, y


def _apply_fold(model: nn.Module, pairs: list[tuple[nn.Module, nn.Module]], known: dict) -> nn.Module:
    """Fold each (conv, BN) pair, then turn the remaining WS/PWS/parametrized/StdConv convs into plain convs."""
    new = {}
    for conv, bn in pairs:
        new[id(conv)] = _plain_conv(conv, _conv_dim(conv), bn)
        new[id(bn)] = _folded_norm(bn, known)
    for conv in unique_modules(model, lambda m: _conv_dim(m) is not None and not _is_plain(m)):
        new.setdefault(id(conv), _plain_conv(conv, _conv_dim(conv), None))
    return swap_modules(model, new)


def _max_diff(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _exact_output(original: nn.Module | None, x: Tensor) -> Tensor | None:
    """The output of ``original`` in float64 (a copy), or None when there is nothing to compute it from."""
    if original is None or not x.is_floating_point() or x.dtype == torch.float64:
        return None
    with torch.no_grad():
        return copy.deepcopy(original).double().eval()(x.double())


def _check_outputs(
    folded: nn.Module, x: Tensor, reference: Tensor, rtol: float, original: nn.Module | None = None
) -> None:
    """``max|folded(x) - reference| <= rtol * max|reference|``, or, where the rounding of a deep float32 model
    exceeds that, the folded output is as close to the exact function (``original`` in float64) as the original's
    own output is: within ``rtol * max|y|`` plus twice the original's own rounding error."""
    with torch.no_grad():
        out = folded(x)
    err, scale = _max_diff(out, reference), reference.double().abs().max().item()
    tol = rtol * max(scale, 1e-30)
    if err <= tol:
        return
    exact = _exact_output(original, x)
    if exact is not None and _max_diff(out, exact) <= tol + 2 * _max_diff(reference, exact):
        return
    raise RuntimeError(
        f"fold_for_inference: folded output differs from the original by {err:.3g} (max |y| {scale:.3g}); "
        "a folded BatchNorm may not be applied to its conv's output on every path (data-dependent control flow)"
    )


def fold_for_inference(
    model: nn.Module, example_input: Tensor | None = None, *, inplace: bool = False, rtol: float = 1e-5
) -> nn.Module:
    """An eval-mode model without WS/PWS kernels to recompute and without the BatchNorms that only normalize a
    conv's output (the dataflow rule: :mod:`normlab.convert`).

    Args:
        model: any module. Put in eval mode first (a copy unless ``inplace``).
        example_input: optional input; if given, it is used for the hook trace when ``torch.fx`` cannot trace the
            model, and the folded model's output is compared with the original's (eval mode): ``RuntimeError``
            when ``max|diff| > rtol * max|y|``. Without it a hook trace runs on a default input and is checked
            the same way.
        inplace: modify ``model`` itself instead of a deep copy.
        rtol: tolerance of the check.

    Returns:
        The folded model, in eval mode. Model outputs are equal to the eval-mode original up to rounding.

    Warns:
        UserWarning: one line naming every BatchNorm left unfolded (``conv -> bn`` where a conv feeds it) and
        why, each reason once (an activation sits in between, e.g. conv -> ReLU -> BN, or its input is the
        model's input, a Linear's output, a sum; the conv's output has another consumer, the BN is shared, the
        dataflow could not be established, a BatchNorm subclass with its own forward, a BatchNorm without running
        statistics, in training mode, ...); and a second one naming every folded pair when the folds rest on a
        hook trace of one forward that read tensor values (data-dependent control flow: another input may take
        another path).

    Example:
        >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).eval()
        >>> x = torch.randn(2, 3, 16, 16)
        >>> folded = fold_for_inference(model, example_input=x)
        >>> [type(m).__name__ for m in folded]
        ['Conv2d', 'Identity', 'ReLU']
        >>> torch.allclose(folded(x), model(x), atol=1e-5)
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fold_for_inference: model must be an nn.Module, got {type(model).__name__}")
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    reference = None
    if example_input is not None:
        with torch.no_grad():
            reference = model(example_input)
    folded = model if inplace else copy.deepcopy(model)
    original = None if inplace else model  # unchanged: the float64 reference of the check
    if not inplace:
        for m, mode in modes:
            m.training = mode
    known = known_batchnorm_forwards()
    dim = _conv_dim(folded)
    if dim is not None and not _is_plain(folded):
        folded = _plain_conv(folded, dim, None)
    else:
        pairs, notes, x, y = _fold_plan(folded, example_input, known)
        folded = _apply_fold(folded, pairs, known)
        for note in notes:
            warnings.warn(note, UserWarning, stacklevel=2)
        if x is not None:
            _check_outputs(folded.eval(), x, y, rtol, original)
    folded.eval()
    if reference is not None:
        _check_outputs(folded, example_input, reference, rtol, original)
    return folded
