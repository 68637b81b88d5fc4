"""Put an existing model on another normalization, and fold weight standardization / BatchNorm for inference.

* :func:`convert_norm` ``(model, to=...)``:

  - ``to`` a norm name (``none``, ``bn``, ``brn``, ``gn``, ``ln``, ``in``, ``sn``): every torch BatchNorm layer
    (``nn.BatchNorm{1,2,3}d``, ``nn.SyncBatchNorm``) is replaced by :func:`normlab.nn.create_norm` ``(to, C, dim)``.
    Copied over: the affine ``weight``/``bias`` whenever the new layer has per-channel ones of the same size;
    the running statistics (``running_mean``, ``running_var``, ``num_batches_tracked``) for ``brn`` (whose state
    is BatchNorm's: ``bn -> brn`` keeps everything, including ``eps``/``momentum``/``affine``/
    ``track_running_stats``) and ``sn`` (its BN branch estimates the same batch moments).
    ``eps`` (and ``affine`` where the new layer takes it) follow the BatchNorm unless given in ``**kw``.
  - ``to="pws"`` or ``"ws"``: every plain ``nn.Conv{1,2,3}d`` (exact type: subclasses, parametrized convs and
    transposed convs are left alone) becomes the matching ``PWSConv``/``WSConv`` with the same arguments, raw
    weight and bias; ``**kw`` go to the new conv (``gamma``, ``relative_gamma``, ``init_alpha``, ``eps`` ...).
    With ``remove_norm`` (default for ``pws``, not for ``ws``) the BatchNorm that *follows* the conv is replaced by
    ``nn.Identity``.
    "Follows" means: the next child registered in the same parent module (``named_children()`` order) is a torch
    BatchNorm with ``num_features == out_channels``. This is the layout of ``nn.Sequential`` stacks and of
    torchvision-style blocks (``conv1, bn1, relu, conv2, bn2``). It is a registration-order rule, not a graph
    analysis: a model whose forward uses its children in another order must be converted by hand.
    When the BatchNorm is removed, the new conv gets a bias (zero-initialised if the old conv had none), as in
    the authors' PWS networks (every PWS conv has a bias).

* :func:`fold_for_inference` ``(model)``: an inference copy in eval mode in which every WS/PWS conv (and every
  conv with a weight parametrization such as ``weight_norm``) is a plain ``nn.Conv{d}d`` holding its kernel
  (always exact), and every eval-mode BatchNorm / BatchRenorm (with running statistics) whose only input is a
  conv's output is folded into the conv's weight and bias and replaced by ``nn.Identity``. Unlike
  :func:`convert_norm`, folding follows the real dataflow, never the registration order: it is established by a
  ``torch.fx`` symbolic trace, or when that fails (data-dependent control flow) by hooks on one forward of
  ``example_input`` (or of a default input built from the first conv's ``in_channels``); see
  :mod:`normlab._dataflow`. A pair is folded only when the BN's only input is that conv's output, the conv's
  output has no other consumer, both run once per forward, nothing else reads their parameters and neither has
  hooks; every other conv/BN pair is left unfolded with a warning that lists it and says why. When the dataflow
  cannot be established no BatchNorm is folded (warning). Folding is computed in float64 and cast back. Give
  ``example_input`` to check that the outputs agree (relative error <= ``rtol``, default 1e-5).
"""

from __future__ import annotations

import copy
import inspect
import warnings

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from normlab._dataflow import Flow, fx_flow, hook_flow
from normlab.nn.batch_renorm import _BatchRenorm
from normlab.nn.registry import CONV_CLASSES, NORM_NAMES, create_norm, get_conv_class, get_norm_class
from normlab.nn.weight_std import _StdConvNd

__all__ = ["convert_norm", "fold_for_inference", "CONVERT_TARGETS"]

_CONV_TARGETS = ("pws", "ws")
CONVERT_TARGETS = NORM_NAMES + _CONV_TARGETS
_PLAIN_CONVS = {cls: d for d, cls in CONV_CLASSES["conv"].items()}
_BN_DIMS = {nn.BatchNorm1d: 1, nn.BatchNorm2d: 2, nn.BatchNorm3d: 3, nn.SyncBatchNorm: 2}


# ------------------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------------------
def _is_torch_bn(m: nn.Module) -> bool:
    return isinstance(m, nn.modules.batchnorm._BatchNorm)


def _foldable_norm(m: nn.Module, channels: int) -> bool:
    """BatchNorm / BatchRenorm in eval mode with running statistics, over ``channels`` channels."""
    if not (_is_torch_bn(m) or isinstance(m, _BatchRenorm)):
        return False
    return (
        not m.training
        and getattr(m, "running_mean", None) is not None
        and getattr(m, "running_var", None) is not None
        and getattr(m, "num_features", None) == channels
    )


def _conv_kwargs(conv: nn.Module) -> dict:
    return dict(
        in_channels=conv.in_channels,
        out_channels=conv.out_channels,
        kernel_size=conv.kernel_size,
        stride=conv.stride,
        padding=conv.padding,
        dilation=conv.dilation,
        groups=conv.groups,
        padding_mode=conv.padding_mode,
        device=conv.weight.device,
        dtype=conv.weight.dtype,
    )


def _copy_matching(src: nn.Module, dst: nn.Module, names: tuple[str, ...]) -> None:
    with torch.no_grad():
        for name in names:
            a, b = getattr(src, name, None), getattr(dst, name, None)
            if isinstance(a, Tensor) and isinstance(b, Tensor) and a.numel() == b.numel():
                b.copy_(a.reshape(b.shape).to(b.dtype))


def _replace_bn(bn: nn.Module, to: str, kw: dict) -> nn.Module:
    dim = next((d for cls, d in _BN_DIMS.items() if type(bn) is cls), 2)
    channels = bn.num_features
    if to == "none":
        return nn.Identity()
    derived = {"eps": bn.eps, "affine": bn.affine}
    if to in ("brn", "bn"):
        derived.update(momentum=bn.momentum, track_running_stats=bn.track_running_stats)
    accepted = inspect.signature(get_norm_class(to, dim).__init__).parameters
    derived = {k: v for k, v in derived.items() if k in accepted}
    new = create_norm(to, channels, dim=dim, **{**derived, **kw})
    names = ("weight", "bias")
    if to in ("brn", "bn", "sn"):
        names += ("running_mean", "running_var", "num_batches_tracked")
    _copy_matching(bn, new, names)
    ref = next((t for t in (bn.weight, bn.running_mean) if t is not None), None)
    if ref is not None:
        new.to(device=ref.device, dtype=ref.dtype)
    return new.train(bn.training)


def _make_std_conv(conv: nn.Module, to: str, dim: int, bias: bool, kw: dict) -> nn.Module:
    cls = get_conv_class(to, dim)
    args = _conv_kwargs(conv)
    new = cls(**args, **{"bias": bias, **kw})
    with torch.no_grad():
        new.weight.copy_(conv.weight)
        if new.bias is not None:
            if conv.bias is not None:
                new.bias.copy_(conv.bias)
            else:
                new.bias.zero_()
    return new.train(conv.training)


# ------------------------------------------------------------------------------------------------------------
# convert_norm
# ------------------------------------------------------------------------------------------------------------
def convert_norm(model: nn.Module, to: str = "pws", *, remove_norm: bool | None = None, **kw) -> nn.Module:
    """Swap the normalization of ``model`` in place (see the module docstring for the rules).

    Args:
        model: any module (modified in place; if ``model`` itself is replaced, the new module is returned).
        to: one of ``none, bn, brn, gn, ln, in, sn`` (replace BatchNorm layers) or ``pws, ws`` (replace plain
            convs).
        remove_norm: for ``pws``/``ws``: replace the BatchNorm that follows each converted conv by
            ``nn.Identity``. Default: True for ``pws`` (it is meant to train without output normalization) and
            False for ``ws`` (WS kernels have unit variance per entry, so without a norm every layer multiplies
            the activation variance by its fan-in; ``remove_norm=True`` with ``ws`` warns).
        **kw: constructor arguments for the new layers (``num_groups`` for gn, ``rmax`` for brn,
            ``gamma``/``init_alpha`` for pws, ...).

    Returns:
        The converted model (the same object unless ``model`` itself was a BatchNorm or conv).

    Example:
        >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        >>> [type(m).__name__ for m in convert_norm(model, to="pws")]
        ['PWSConv2d', 'Identity', 'ReLU']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_norm: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(to, str) or to.lower() not in CONVERT_TARGETS:
        raise ValueError(f"convert_norm: unknown to={to!r}; expected one of {', '.join(CONVERT_TARGETS)}")
    to = to.lower()
    if to in NORM_NAMES:
        if _is_torch_bn(model):
            return _replace_bn(model, to, kw)
        for name, child in list(model.named_children()):
            setattr(model, name, convert_norm(child, to, **kw))
        return model
    if remove_norm is None:
        remove_norm = to == "pws"
    elif remove_norm and to == "ws":
        warnings.warn(
            "convert_norm(to='ws', remove_norm=True): WS kernels have unit variance per entry, so without an output "
            "normalization every layer multiplies the activation variance by its fan-in (overflow in deep nets); "
            "keep the norm (the default) or convert to 'pws'",
            UserWarning,
            stacklevel=2,
        )
    if type(model) in _PLAIN_CONVS:
        return _make_std_conv(model, to, _PLAIN_CONVS[type(model)], kw.pop("bias", True), kw)
    _convert_convs(model, to, remove_norm, kw)
    return model


def _convert_convs(parent: nn.Module, to: str, remove_norm: bool, kw: dict) -> None:
    children = list(parent.named_children())
    for i, (name, child) in enumerate(children):
        dim = _PLAIN_CONVS.get(type(child))
        if dim is None:
            _convert_convs(child, to, remove_norm, kw)
            continue
        nxt = children[i + 1] if i + 1 < len(children) else None
        drop = (
            remove_norm and nxt is not None and _is_torch_bn(nxt[1]) and nxt[1].num_features == child.out_channels
        )
        bias = kw.get("bias", child.bias is not None or drop)
        setattr(parent, name, _make_std_conv(child, to, dim, bias, {k: v for k, v in kw.items() if k != "bias"}))
        if drop:
            setattr(parent, nxt[0], nn.Identity())


# ------------------------------------------------------------------------------------------------------------
# fold_for_inference
# ------------------------------------------------------------------------------------------------------------
def _conv_dim(m: nn.Module) -> int | None:
    for cls, d in _PLAIN_CONVS.items():
        if type(m) is cls:
            return d
        if isinstance(m, cls) and (isinstance(m, _StdConvNd) or parametrize.is_parametrized(m, "weight")):
            return d  # WS/PWS conv, or a conv with a weight parametrization (e.g. weight_norm): fold its kernel
    return None


def _plain_conv(conv: nn.Module, dim: int, norm: nn.Module | None) -> nn.Module:
    """A plain nn.Conv{dim}d equal to ``conv`` (effective kernel) followed by the eval-mode ``norm``."""
    with torch.no_grad():
        weight = conv.effective_weight() if hasattr(conv, "effective_weight") else conv.weight
        w = weight.detach().double()
        b = conv.bias.detach().double() if conv.bias is not None else None
        if norm is not None:
            inv_std = torch.rsqrt(norm.running_var.double() + norm.eps)
            scale = inv_std if norm.weight is None else norm.weight.double() * inv_std
            shift = -norm.running_mean.double() * scale
            if norm.bias is not None:
                shift = shift + norm.bias.double()
            w = w * scale.reshape((-1,) + (1,) * (w.dim() - 1))
            b = shift if b is None else b * scale + shift
        out = _PLAIN_CONVS_BY_DIM[dim](**{**_conv_kwargs(conv), "bias": b is not None})
        out.weight.copy_(w.to(weight.dtype))
        if b is not None:
            out.bias.copy_(b.to(out.bias.dtype))
    return out.eval()


_PLAIN_CONVS_BY_DIM = {d: cls for cls, d in _PLAIN_CONVS.items()}


# sizes tried for a default example input, per spatial dimension (a model may accept only one)
_DEFAULT_SIZES = {1: (40, 64, 32, 128, 256), 2: (32, 28, 16, 64, 224), 3: (16, 32, 8)}


def _unique_modules(model: nn.Module, keep) -> list[nn.Module]:
    return list({id(m): m for m in model.modules() if keep(m)}.values())


def _registration_pairs(parent: nn.Module, out: list) -> list[tuple[nn.Module, nn.Module]]:
    """(conv, BN) pairs that are neighbours in registration order: what the old "follows" rule folded."""
    children = list(parent.named_children())
    for i, (_, child) in enumerate(children):
        if _conv_dim(child) is not None and i + 1 < len(children):
            nxt = children[i + 1][1]
            if _foldable_norm(nxt, child.out_channels):
                out.append((child, nxt))
        elif _conv_dim(child) is None:
            _registration_pairs(child, out)
    return out


def _default_inputs(convs: list[nn.Module]):
    """Example inputs for the first conv (registration order): batch 2, a few sizes per spatial dimension."""
    first = convs[0]
    dim = _conv_dim(first)
    gen = torch.Generator().manual_seed(0)
    for size in _DEFAULT_SIZES.get(dim, ()):
        x = torch.randn(2, first.in_channels, *([size] * dim), generator=gen, dtype=first.weight.dtype)
        yield x.to(first.weight.device)


def _trace(model: nn.Module, convs, norms, example_input) -> tuple[Flow | None, Tensor | None, Tensor | None, str]:
    """(flow, input, output) of the first trace that works; input/output only for a hook trace on a default
    input (to check the result with); and what failed."""
    try:
        return fx_flow(model, convs, norms), None, None, ""
    except Exception as e:  # noqa: BLE001 - any failure of symbolic tracing means: try the hooks
        why = f"torch.fx: {type(e).__name__}"
    inputs = [example_input] if example_input is not None else _default_inputs(convs)
    last = "no input to try"
    for x in inputs:
        try:
            flow, out = hook_flow(model, convs, norms, x)
            return flow, (None if example_input is not None else x), out, why
        except Exception as e:  # noqa: BLE001 - the model refuses this input: try the next size
            last = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    given = "example_input" if example_input is not None else "a default input"
    return None, None, None, f"{why}; forward on {given} failed ({last})"


def _fold_plan(model: nn.Module, example_input: Tensor | None):
    """Decide the conv -> BN pairs to fold: (pairs, [(conv name, BN name, why not)], default input, its output)."""
    names = {id(m): n or "<model>" for n, m in model.named_modules()}
    convs = _unique_modules(model, lambda m: _conv_dim(m) is not None)
    norms = _unique_modules(model, lambda m: _foldable_norm(m, getattr(m, "num_features", None)))
    if not convs or not norms:
        return [], [], None, None
    flow, x, y, why = _trace(model, convs, norms, example_input)
    by_id = {id(c): c for c in convs}
    pairs, skipped = [], []
    old = {id(b): c for c, b in _registration_pairs(model, [])}
    for bn in norms:
        conv = by_id.get(flow.source(bn)) if flow is not None else None
        if conv is None and id(bn) not in old:
            continue  # not fed by a conv, and nothing suggested it was: nothing to report
        conv = conv if conv is not None else old[id(bn)]
        reason = f"dataflow unknown ({why})" if flow is None else flow.verdict(conv, bn)
        if reason is None and conv.out_channels != bn.num_features:
            reason = "channel counts differ"
        if reason is None and (conv._forward_hooks or conv._forward_pre_hooks or bn._forward_hooks
                               or bn._forward_pre_hooks):
            reason = "a module has hooks"
        if reason is None and any(conv is c for c, _ in pairs):
            reason = "the conv already folds another BatchNorm"
        if reason is None:
            pairs.append((conv, bn))
        else:
            skipped.append((names[id(conv)], names[id(bn)], reason))
    return pairs, skipped, x, y


def _replace_everywhere(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Put ``new`` wherever ``old`` is registered under ``root`` (every alias)."""
    for m in _unique_modules(root, lambda _: True):
        for name, child in list(m._modules.items()):
            if child is old:
                setattr(m, name, new)


def _apply_fold(model: nn.Module, pairs: list[tuple[nn.Module, nn.Module]]) -> None:
    """Fold each (conv, BN) pair, then turn the remaining WS/PWS/parametrized convs into plain convs."""
    for conv, bn in pairs:
        _replace_everywhere(model, conv, _plain_conv(conv, _conv_dim(conv), bn))
        _replace_everywhere(model, bn, nn.Identity())
    for conv in _unique_modules(model, lambda m: _conv_dim(m) is not None and type(m) not in _PLAIN_CONVS):
        _replace_everywhere(model, conv, _plain_conv(conv, _conv_dim(conv), None))


def _check_outputs(folded: nn.Module, x: Tensor, reference: Tensor, rtol: float) -> None:
    with torch.no_grad():
        out = folded(x)
    err = (out.double() - reference.double()).abs().max().item()
    scale = reference.double().abs().max().item()
    if not err <= rtol * max(scale, 1e-30):
        raise RuntimeError(
            f"fold_for_inference: folded output differs from the original by {err:.3g} (max |y| {scale:.3g}); "
            "a folded BatchNorm may not be applied to its conv's output on every path (data-dependent control flow)"
        )


def fold_for_inference(
    model: nn.Module, example_input: Tensor | None = None, *, inplace: bool = False, rtol: float = 1e-5
) -> nn.Module:
    """An eval-mode model without WS/PWS kernels to recompute and without the BatchNorms that only normalize a
    conv's output (see the module docstring for the dataflow rule).

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
        UserWarning: listing each conv -> BatchNorm pair left unfolded and why (the conv's output has another
        consumer, the BN is shared, an activation sits in between, the dataflow could not be established, ...).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fold_for_inference: model must be an nn.Module, got {type(model).__name__}")
    was_training = model.training
    model.eval()
    reference = None
    if example_input is not None:
        with torch.no_grad():
            reference = model(example_input)
    folded = model if inplace else copy.deepcopy(model)
    if not inplace:
        model.train(was_training)
    dim = _conv_dim(folded)
    if dim is not None and type(folded) not in _PLAIN_CONVS:
        folded = _plain_conv(folded, dim, None)
    else:
        pairs, skipped, x, y = _fold_plan(folded, example_input)
        _apply_fold(folded, pairs)
        if skipped:
            warnings.warn("fold_for_inference: left unfolded: " + "; ".join(
                f"{c} -> {b} ({why})" for c, b, why in skipped), UserWarning, stacklevel=2)
        if x is not None:
            _check_outputs(folded.eval(), x, y, rtol)
    folded.eval()
    if reference is not None:
        _check_outputs(folded, example_input, reference, rtol)
    return folded
