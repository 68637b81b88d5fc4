"""convert_norm and fold_for_inference (the rules: :mod:`normlab.convert`)."""

from __future__ import annotations

import contextlib
import copy
import inspect
import sys
import warnings
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from normlab.convert.dataflow import Flow, fx_flow, hook_flow
from normlab.nn.batch_renorm import SyncBatchRenorm, _BatchRenorm
from normlab.nn.registry import CONV_CLASSES, NORM_NAMES, create_norm, get_conv_class, get_norm_class
from normlab.nn.weight_std import _StdConvNd

__all__ = ["convert_norm", "fold_for_inference", "CONVERT_TARGETS"]

_CONV_TARGETS = ("pws", "ws")
#: What :func:`convert_norm` converts to: a norm name of :data:`normlab.nn.NORM_NAMES` (every torch BatchNorm
#: becomes that layer) or a convolution kind, ``pws`` or ``ws`` (every plain convolution becomes its standardized
#: version).
CONVERT_TARGETS = NORM_NAMES + _CONV_TARGETS
_PLAIN_CONVS = {cls: d for d, cls in CONV_CLASSES["conv"].items()}
_PLAIN_CONVS_BY_DIM = {d: cls for cls, d in _PLAIN_CONVS.items()}
_TRANSPOSED = {nn.ConvTranspose1d: 1, nn.ConvTranspose2d: 2, nn.ConvTranspose3d: 3}
_TRANSPOSED_BY_DIM = {d: cls for cls, d in _TRANSPOSED.items()}
# norms that need a length / spatial axis: refused for a BatchNorm1d over (N, C)
_NEEDS_LENGTH = {"gn": "GroupNorm", "ln": "GroupNorm(1, C)", "in": "InstanceNorm1d", "sn": "SwitchableNorm1d"}
_INSTANCE_STATS = ("in", "sn")


# ------------------------------------------------------------------------------------------------------------
# what a module computes
# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _BN:
    """A module that computes a BatchNorm: over ``dim`` spatial dimensions (None: any), synchronized across ranks,
    frozen (eval statistics in buffers), followed by its ``drop`` and ``act`` children."""

    dim: int | None = 2
    sync: bool = False
    frozen: bool = False
    act: bool = False


def _known_bn_forwards() -> dict:
    """``forward`` function -> :class:`_BN` (dim None for BatchNorm{1,2,3}d: taken from the class)."""
    bn = nn.modules.batchnorm._BatchNorm
    known = {bn.forward: _BN(dim=None), nn.SyncBatchNorm.forward: _BN(dim=None, sync=True)}
    timm_na = sys.modules.get("timm.layers.norm_act")  # loaded whenever a timm layer exists
    if timm_na is not None:
        known[timm_na.BatchNormAct2d.forward] = _BN(act=True)
        known[timm_na.SyncBatchNormAct.forward] = _BN(dim=None, sync=True, act=True)
        known[timm_na.FrozenBatchNormAct2d.forward] = _BN(frozen=True, act=True)
    tv = sys.modules.get("torchvision.ops.misc")
    if tv is not None:
        known[tv.FrozenBatchNorm2d.forward] = _BN(frozen=True)
    return known


def _describe(m: nn.Module, known: dict) -> _BN | None:
    """What BatchNorm ``m`` computes, or None when it is not one (or a BatchNorm subclass with its own forward)."""
    spec = known.get(type(m).forward)
    if spec is None or (spec.act and not (hasattr(m, "drop") and hasattr(m, "act"))):
        return None
    if spec.dim is None and not spec.sync:
        dim = next(
            (d for d, cls in enumerate((nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d), 1) if isinstance(m, cls)), None
        )
        return _BN(dim=dim) if dim is not None else None
    return spec


def _unknown_bn(m: nn.Module, known: dict) -> bool:
    return isinstance(m, nn.modules.batchnorm._BatchNorm) and _describe(m, known) is None


def _channels(m: nn.Module) -> int:
    return getattr(m, "num_features", None) or m.running_mean.numel()


def _names(model: nn.Module) -> dict[int, str]:
    out: dict[int, str] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        out.setdefault(id(m), name or "<model>")
    return out


def _unique_modules(model: nn.Module, keep) -> list[nn.Module]:
    return list({id(m): m for m in model.modules() if keep(m)}.values())


def _swap(model: nn.Module, new: dict[int, nn.Module]) -> nn.Module:
    """Put ``new[id(old)]`` under every name and parent that holds ``old`` (aliases and shared modules stay
    shared); returns the new root if ``model`` itself is replaced."""
    parents = _unique_modules(model, lambda _: True)
    for parent in parents:
        for name, child in list(parent._modules.items()):
            if child is not None and id(child) in new:
                parent._modules[name] = new[id(child)]
    return new.get(id(model), model)


def _warn_unknown(model: nn.Module, known: dict, names: dict, where: str) -> None:
    unknown = [f"{names[id(m)]} ({type(m).__name__})" for m in _unique_modules(model, lambda m: _unknown_bn(m, known))]
    if unknown:
        warnings.warn(
            f"{where}: left as they are (BatchNorm subclasses with their own forward, which computes "
            f"something else than a BatchNorm): {', '.join(unknown)}",
            UserWarning,
            stacklevel=3,
        )


@contextlib.contextmanager
def _eval_mode(model: nn.Module):
    """Eval mode for a look at the dataflow (no running-statistics update); each module's mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


# ------------------------------------------------------------------------------------------------------------
# convert_norm: norms
# ------------------------------------------------------------------------------------------------------------
def _copy_matching(src: nn.Module, dst: nn.Module, names: tuple[str, ...]) -> None:
    with torch.no_grad():
        for name in names:
            a, b = getattr(src, name, None), getattr(dst, name, None)
            if isinstance(a, Tensor) and isinstance(b, Tensor) and a.numel() == b.numel():
                b.copy_(a.reshape(b.shape).to(b.dtype))


def _norm_act_class(to: str, spec: _BN) -> type:
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


def _new_norm(bn: nn.Module, spec: _BN, to: str, dim: int, kw: dict) -> nn.Module:
    """The ``to`` layer computing in place of ``bn`` (reusing its drop/act modules), with the state that carries."""
    channels = _channels(bn)
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


def _seen_shapes(model: nn.Module, norms: list[nn.Module], x) -> dict[int, list[torch.Size]]:
    """Input shape of every call of each norm on one eval-mode forward of ``x``."""
    seen: dict[int, list[torch.Size]] = {id(m): [] for m in norms}

    def record(m, args):
        if args and isinstance(args[0], Tensor):
            seen[id(m)].append(args[0].shape)

    handles = [m.register_forward_pre_hook(record) for m in norms]
    try:
        with torch.no_grad(), _eval_mode(model):
            model(x)
    finally:
        for h in handles:
            h.remove()
    return seen


def _producers(model: nn.Module, norms: list[nn.Module]) -> dict[int, str]:
    """norm id -> "conv1d" / "linear" when the torch.fx dataflow shows its only input is such a module's output."""
    kinds = {}
    for m in model.modules():
        if isinstance(m, nn.Linear):
            kinds[id(m)] = "linear"
        elif isinstance(m, (nn.Conv1d, nn.ConvTranspose1d)):
            kinds[id(m)] = "conv1d"
    mods = _unique_modules(model, lambda m: id(m) in kinds)
    try:
        flow = fx_flow(model, mods, norms)
    except Exception:  # noqa: BLE001 - no symbolic trace: the producers stay unknown
        return {}
    out = {}
    for n in norms:
        srcs = flow.bn_inputs.get(id(n)) or [None]
        found = {kinds[s[0]] if s is not None else None for s in srcs}
        if len(found) == 1 and None not in found:
            out[id(n)] = found.pop()
    return out


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
    seen = _seen_shapes(model, check, example_input) if example_input is not None else {}
    context = _producers(model, [m for m in bn1d if not seen.get(id(m))])
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


def _convert_norms(model: nn.Module, to: str, example_input, kw: dict) -> nn.Module:
    known, names = _known_bn_forwards(), _names(model)
    bns = [
        (m, spec)
        for m in _unique_modules(model, lambda m: _describe(m, known) is not None)
        for spec in [_describe(m, known)]
    ]
    refused = _refusals(model, to, bns, names, example_input)
    if refused:
        raise ValueError(f"convert_norm(to={to!r}): cannot replace {'; '.join(refused)}")
    _warn_unknown(model, known, names, "convert_norm")
    dims = {}
    if example_input is not None and any(spec.dim is None for _, spec in bns):
        seen = _seen_shapes(model, [m for m, spec in bns if spec.dim is None], example_input)
        dims = {k: len(v[0]) - 2 for k, v in seen.items() if v and 1 <= len(v[0]) - 2 <= 3}
    new = {id(m): _new_norm(m, spec, to, spec.dim or dims.get(id(m), 2), kw) for m, spec in bns}
    return _swap(model, new)


# ------------------------------------------------------------------------------------------------------------
# convert_norm: convs
# ------------------------------------------------------------------------------------------------------------
def _conv_kwargs(conv: nn.Module) -> dict:
    out = dict(
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
    if getattr(conv, "transposed", False):
        out["output_padding"] = conv.output_padding
    return out


def _make_std_conv(conv: nn.Module, to: str, dim: int, bias: bool, kw: dict) -> nn.Module:
    cls = get_conv_class(to, dim)
    new = cls(**_conv_kwargs(conv), **{"bias": bias, **kw})
    with torch.no_grad():
        new.weight.copy_(conv.weight)
        if new.bias is not None:
            if conv.bias is not None:
                new.bias.copy_(conv.bias)
            else:
                new.bias.zero_()
    return new.train(conv.training)


def _timm_std_kind(m: nn.Module) -> str | None:
    """ "std" / "scaled" for timm's StdConv2d / ScaledStdConv2d (by their forward), else None."""
    sc = sys.modules.get("timm.layers.std_conv")
    if sc is None:
        return None
    return {sc.StdConv2d.forward: "std", sc.ScaledStdConv2d.forward: "scaled"}.get(type(m).forward)


def _left_convs(model: nn.Module, names: dict) -> list[str]:
    """Convs ``pws``/``ws`` leave as they are, with the reason."""
    out = []
    for m in _unique_modules(model, lambda m: isinstance(m, nn.modules.conv._ConvNd) and type(m) not in _PLAIN_CONVS):
        if isinstance(m, _StdConvNd):
            continue  # a normlab WS/PWS conv already
        if isinstance(m, nn.modules.conv._ConvTransposeNd):
            why = "a transposed conv (normlab has no weight-standardized transposed conv)"
        elif _timm_std_kind(m) is not None:
            why = "already weight-standardized (timm StdConv)"
        else:
            why = "a conv subclass (its forward may differ)"
        out.append(f"{names[id(m)]} ({type(m).__name__}: {why})")
    return out


def _removable_norms(model: nn.Module, convs: list, known: dict, example_input) -> tuple[list, set[int]]:
    """The BatchNorms each of whose calls takes one of ``convs``' outputs as its only input (dataflow), and the
    ids of the convs that feed them."""
    norms = _unique_modules(model, lambda m: _describe(m, known) is not None)
    if not convs or not norms:
        return [], set()
    with _eval_mode(model):
        flow, _, _, why = _trace(model, convs, norms, example_input)
    if flow is None:
        warnings.warn(
            f"convert_norm: remove_norm: the dataflow could not be established ({why}); no BatchNorm "
            "removed (give example_input)",
            UserWarning,
            stacklevel=3,
        )
        return [], set()
    by_id = {id(c): c for c in convs}
    out, feeding = [], set()
    for bn in norms:
        srcs = flow.bn_inputs.get(id(bn)) or [None]
        if all(s is not None and s[0] in by_id and by_id[s[0]].out_channels == _channels(bn) for s in srcs):
            out.append(bn)
            feeding |= {s[0] for s in srcs}
    return out, feeding


def _convert_convs(model: nn.Module, to: str, remove_norm: bool, example_input, kw: dict) -> nn.Module:
    known, names = _known_bn_forwards(), _names(model)
    left = _left_convs(model, names)
    if left:
        warnings.warn(f"convert_norm(to={to!r}): left as they are: {', '.join(left)}", UserWarning, stacklevel=3)
    convs = _unique_modules(model, lambda m: type(m) in _PLAIN_CONVS)
    removed, with_norm = _removable_norms(model, convs, known, example_input) if remove_norm else ([], set())
    _warn_unknown(model, known, names, "convert_norm")
    rest = {k: v for k, v in kw.items() if k != "bias"}
    new = {}
    for conv in convs:
        bias = kw.get("bias", conv.bias is not None or id(conv) in with_norm)
        new[id(conv)] = _make_std_conv(conv, to, _PLAIN_CONVS[type(conv)], bias, rest)
    for bn in removed:
        new[id(bn)] = _new_norm(bn, _describe(bn, known), "none", 2, {})
    return _swap(model, new)


def convert_norm(
    model: nn.Module,
    to: str = "pws",
    *,
    remove_norm: bool | None = None,
    inplace: bool = True,
    example_input: Tensor | None = None,
    **kw,
) -> nn.Module:
    """Swap the normalization of ``model`` (see the module docstring for the rules).

    Args:
        model: any module.
        to: one of ``none, bn, brn, gn, ln, in, sn`` (replace BatchNorm layers) or ``pws, ws`` (replace plain
            convs).
        remove_norm: for ``pws``/``ws``: remove each BatchNorm that normalizes a converted conv's output.
            Default: True for ``pws`` (it is meant to train without output normalization) and
            False for ``ws`` (WS kernels have unit variance per entry, so without a norm every layer multiplies
            the activation variance by its fan-in; ``remove_norm=True`` with ``ws`` warns).
        inplace: True (default): convert ``model`` itself (its submodules are replaced; the returned module is
            ``model`` unless ``model`` itself is a BatchNorm or conv). False: convert a deep copy and leave
            ``model`` as it is.
        example_input: optional input of ``model``: shows the input shape each BatchNorm sees (a ``BatchNorm1d``
            over (N, C) cannot become ``gn, ln, in, sn``) and the dataflow for ``remove_norm`` when ``torch.fx``
            cannot trace the model. Run once in eval mode, without gradient.
        **kw: constructor arguments for the new layers (``num_groups`` for gn, ``rmax`` for brn,
            ``gamma``/``init_alpha`` for pws, ...).

    Returns:
        The converted model.

    Raises:
        ValueError: ``to`` unknown, or a target that cannot apply to some layer (one line naming each).

    Example:
        >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        >>> [type(m).__name__ for m in convert_norm(model, to="pws")]
        ['PWSConv2d', 'Identity', 'ReLU']
        >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
        >>> convert_norm(mlp, to="in")
        Traceback (most recent call last):
        ...
        ValueError: convert_norm(to='in'): cannot replace 1 (BatchNorm1d): its input is an nn.Linear output (N, C); ...
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_norm: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(to, str) or to.lower() not in CONVERT_TARGETS:
        raise ValueError(f"convert_norm: unknown to={to!r}; expected one of {', '.join(CONVERT_TARGETS)}")
    to = to.lower()
    if not inplace:
        model = copy.deepcopy(model)
    if to in NORM_NAMES:
        return _convert_norms(model, to, example_input, kw)
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
    return _convert_convs(model, to, remove_norm, example_input, kw)


# ------------------------------------------------------------------------------------------------------------
# fold_for_inference
# ------------------------------------------------------------------------------------------------------------
def _conv_dim(m: nn.Module) -> int | None:
    """Spatial dims of a conv whose kernel folds into a plain conv (or transposed conv), else None."""
    if type(m) in _TRANSPOSED:
        return _TRANSPOSED[type(m)]
    if _timm_std_kind(m) is not None:
        return 2
    for cls, d in _PLAIN_CONVS.items():
        if type(m) is cls:
            return d
        if isinstance(m, cls) and (isinstance(m, _StdConvNd) or parametrize.is_parametrized(m, "weight")):
            return d  # WS/PWS conv, or a conv with a weight parametrization (e.g. weight_norm): fold its kernel
    return None


def _is_plain(m: nn.Module) -> bool:
    return type(m) in _PLAIN_CONVS or type(m) in _TRANSPOSED


def _effective_weight(conv: nn.Module) -> Tensor:
    """The kernel ``conv`` applies, in float64 (timm's StdConv: ``F.batch_norm`` over each filter, biased
    variance, eps inside the root, times ``gain * scale`` for ScaledStdConv2d)."""
    kind = _timm_std_kind(conv)
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
        out = cls(**{**_conv_kwargs(conv), "bias": b is not None})
        out.weight.copy_(w.to(weight.dtype))
        if b is not None:
            out.bias.copy_(b.to(out.bias.dtype))
    return out.eval()


def _foldable_norm(m: nn.Module, known: dict) -> bool:
    """An eval-mode BatchNorm / BatchRenorm with running statistics (a frozen one, a BatchNorm + activation)."""
    spec = _describe(m, known)
    if spec is None and not (isinstance(m, _BatchRenorm) and _brn_act(m) is not None):
        return False
    return ((spec is not None and spec.frozen) or not m.training) and all(
        getattr(m, k, None) is not None for k in ("running_mean", "running_var")
    )


def _brn_act(m: nn.Module) -> bool | None:
    """For a BatchRenorm: False (plain), True (normlab's timm NormAct: then drop, act), None (own forward)."""
    if type(m).forward is _BatchRenorm.forward or type(m).forward is SyncBatchRenorm.forward:
        return False
    na = sys.modules.get("normlab.integrations.timm")
    return True if na is not None and type(m).forward is na._NormAct.forward else None


def _folded_norm(m: nn.Module, known: dict) -> nn.Module:
    """What is left of a norm folded into its conv: nothing, or its drop and act."""
    spec = _describe(m, known)
    act = spec.act if spec is not None else bool(_brn_act(m))
    return nn.Sequential(OrderedDict(drop=m.drop, act=m.act)) if act else nn.Identity()


# sizes tried for a default example input, per spatial dimension (a model may accept only one)
_DEFAULT_SIZES = {1: (40, 64, 32, 128, 256), 2: (32, 28, 16, 64, 224), 3: (16, 32, 8)}


def _registration_pairs(parent: nn.Module, keep, out: list) -> list[tuple[nn.Module, nn.Module]]:
    """(conv, BN) pairs that are neighbours in registration order: reported when the dataflow is unknown."""
    children = list(parent.named_children())
    for i, (_, child) in enumerate(children):
        is_conv = isinstance(child, nn.modules.conv._ConvNd)
        if is_conv and i + 1 < len(children):
            nxt = children[i + 1][1]
            if keep(nxt) and _channels(nxt) == child.out_channels:
                out.append((child, nxt))
        elif not is_conv:
            _registration_pairs(child, keep, out)
    return out


def _default_inputs(convs: list[nn.Module]):
    """Example inputs for the first conv (registration order): batch 2, a few sizes per spatial dimension."""
    first = convs[0]
    dim = first.weight.dim() - 2
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


def _pair_reason(flow: Flow | None, why: str, conv, bn, pairs, foldable: bool) -> str | None:
    if not foldable:
        return "a BatchNorm subclass with its own forward"
    if _conv_dim(conv) is None:
        return f"{type(conv).__name__} is a conv subclass with its own forward"
    reason = f"dataflow unknown ({why})" if flow is None else flow.verdict(conv, bn)
    if reason is None and conv.out_channels != _channels(bn):
        reason = "channel counts differ"
    if reason is None and (
        conv._forward_hooks or conv._forward_pre_hooks or bn._forward_hooks or bn._forward_pre_hooks
    ):
        reason = "a module has hooks"
    if reason is None and any(conv is c for c, _ in pairs):
        reason = "the conv already folds another BatchNorm"
    return reason


def _fold_plan(model: nn.Module, example_input: Tensor | None, known: dict):
    """Decide the conv -> BN pairs to fold: (pairs, [(conv name, BN name, why not)], default input, its output)."""
    names = _names(model)
    convs = _unique_modules(model, lambda m: isinstance(m, nn.modules.conv._ConvNd))  # foldable or not
    norms = _unique_modules(model, lambda m: _foldable_norm(m, known) or _unknown_bn(m, known))
    if not convs or not norms:
        return [], [], None, None
    flow, x, y, why = _trace(model, convs, norms, example_input)
    by_id = {id(c): c for c in convs}
    pairs, skipped = [], []
    old = {id(b): c for c, b in _registration_pairs(model, lambda m: any(m is n for n in norms), [])}
    for bn in norms:
        conv = by_id.get(flow.source(bn)) if flow is not None else None
        if conv is None and id(bn) not in old:
            continue  # not fed by a conv, and nothing suggested it was: nothing to report
        conv = conv if conv is not None else old[id(bn)]
        reason = _pair_reason(flow, why, conv, bn, pairs, not _unknown_bn(bn, known))
        if reason is None:
            pairs.append((conv, bn))
        else:
            skipped.append((names[id(conv)], names[id(bn)], reason))
    return pairs, skipped, x, y


def _apply_fold(model: nn.Module, pairs: list[tuple[nn.Module, nn.Module]], known: dict) -> nn.Module:
    """Fold each (conv, BN) pair, then turn the remaining WS/PWS/parametrized/StdConv convs into plain convs."""
    new = {}
    for conv, bn in pairs:
        new[id(conv)] = _plain_conv(conv, _conv_dim(conv), bn)
        new[id(bn)] = _folded_norm(bn, known)
    for conv in _unique_modules(model, lambda m: _conv_dim(m) is not None and not _is_plain(m)):
        new.setdefault(id(conv), _plain_conv(conv, _conv_dim(conv), None))
    return _swap(model, new)


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
        consumer, the BN is shared, an activation sits in between, the dataflow could not be established, a
        BatchNorm subclass with its own forward, ...).

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
    known = _known_bn_forwards()
    dim = _conv_dim(folded)
    if dim is not None and not _is_plain(folded):
        folded = _plain_conv(folded, dim, None)
    else:
        pairs, skipped, x, y = _fold_plan(folded, example_input, known)
        folded = _apply_fold(folded, pairs, known)
        if skipped:
            warnings.warn(
                "fold_for_inference: left unfolded: " + "; ".join(f"{c} -> {b} ({why})" for c, b, why in skipped),
                UserWarning,
                stacklevel=2,
            )
        if x is not None:
            _check_outputs(folded.eval(), x, y, rtol, original)
    folded.eval()
    if reference is not None:
        _check_outputs(folded, example_input, reference, rtol, original)
    return folded
