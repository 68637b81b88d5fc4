"""Which layers the monitor watches, the kernels they apply, their channel axes, and how to see through wrappers.

A module is watched as a conv/linear layer when it applies a weight as a linear map, by the first of the named
rules in :data:`LINEAR_MAP_RULES` that matches it (checked in this order):

=====================  ==============================================================  ======  ===================
rule                   modules                                                         kind    output filter o
=====================  ==============================================================  ======  ===================
``timm_std_conv``      timm's ``StdConv2d``, ``StdConv2dSame``, ``ScaledStdConv2d``,     conv    ``K[o]``
                       ``ScaledStdConv2dSame``: ``K`` = the standardized kernel their
                       forward computes (``F.batch_norm`` over each filter, eps, and
                       ``gain * scale`` for the scaled ones)
``conv_transpose``     ``nn.ConvTranspose1d/2d/3d``: weight (C_in, C_out/groups, *k)   conv    ``W[g-block, j]``
``conv``               ``nn.Conv1d/2d/3d`` and subclasses: weight (C_out, C_in/g, *k)   conv    ``W[o]``
``linear``             ``nn.Linear`` and subclasses: weight (out, in)                  linear  ``W[o]``
``hf_conv1d``          transformers' ``Conv1D`` (GPT-2, GPT): y = x @ W + b with W      linear  ``W[:, o]``
                       of shape (in, out), transposed relative to ``nn.Linear``
=====================  ==============================================================  ======  ===================

For ``conv_transpose``, ``conv`` and ``linear`` the kernel W is ``module.effective_weight()`` where the module
defines it (normlab's WS/PWS convs standardize their weight on the fly), else ``module.weight`` (a ``weight_norm``
parametrization already yields the applied kernel there).

:func:`effective_weight` is the kernel a layer applies in the layer's own layout (what its forward hands to
``F.conv*``/``F.linear``/``addmm``); :func:`filter_kernel` is that kernel with output filters on dim 0,
(C_out, fan_in-shaped...), the layout :mod:`normlab.monitor.stats` expects. For a transposed convolution, output
channel o = g * (C_out/groups) + j is produced by the C_in/groups input channels of group g through
``W[g*C_in/groups:(g+1)*C_in/groups, j]``: the filter view is W reshaped to (groups, C_in/g, C_out/g, *k), dims 1
and 2 swapped, reshaped to (C_out, C_in/g, *k): the kernel of the equivalent convolution (spatially flipped,
which no statistic here depends on). Its fan_in is C_in/groups * prod(k) entries; with a stride s each output
position sums only about prod(k / s) of them per input channel.

Transformers' ``Conv1D`` is recognized without importing transformers: a class named ``Conv1D`` from a
``transformers`` module (in its MRO) whose weight is (nx, nf). timm's standardized convs likewise: a class of that
name from a ``timm`` module. Modules that hold a weight but apply no linear map of their input are not watched:
``nn.Embedding`` (a lookup), ``nn.MultiheadAttention``'s packed ``in_proj_weight`` (its ``out_proj`` is an
``nn.Linear`` and is watched), ``nn.Bilinear``. Recurrent layers (``nn.RNN``, ``nn.LSTM``, ``nn.GRU``) apply
their weights as linear maps inside the recurrence, on inputs no module hook sees (the hidden state of every time
step, the layers below the top one), so they are not watched either: :func:`unwatched_layers` lists every module
whose own parameters no rule reads, and the monitor warns once when a recurrent layer is among them.

Normalization layers (:func:`normlab.nn.is_norm_layer`) are watched as ``"norm"``. Their per-channel statistics are
taken over the dims they normalize (:func:`input_channel_dims`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from normlab.monitor.ranks import check_filter_placements
from normlab.nn import is_norm_layer

__all__ = [
    "unwrap_model",
    "is_compiled",
    "layer_kind",
    "supported_layers",
    "unwatched_layers",
    "effective_weight",
    "filter_kernel",
    "input_channel_dims",
    "input_channels",
    "layer_type",
    "LinearMapRule",
    "LINEAR_MAP_RULES",
    "linear_map_rule",
]

_MAX_WRAPPERS = 16
TIMM_STD_CONVS = ("StdConv2d", "StdConv2dSame", "ScaledStdConv2d", "ScaledStdConv2dSame")


def _inner(model: nn.Module) -> nn.Module | None:
    """The module a DDP/DataParallel (``.module``) or torch.compile (``._orig_mod``) wrapper holds, else None."""
    if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
        return model.module
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else None


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP/DataParallel and torch.compile wrappers, in any nesting.

    Args:
        model: a module, possibly wrapped (``DistributedDataParallel``, ``DataParallel``, ``torch.compile``).

    Returns:
        The innermost module (``model`` itself when it is not wrapped).

    Example:
        >>> net = nn.Linear(2, 2)
        >>> unwrap_model(nn.DataParallel(net)) is net
        True
    """
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


# ------------------------------------------------------------------------------------------- linear maps
def _from_library(module: nn.Module, package: str, names: tuple[str, ...]) -> bool:
    """True when a class of ``module``'s MRO is named one of ``names`` and defined in package ``package``."""
    return any(c.__name__ in names and c.__module__.split(".")[0] == package for c in type(module).__mro__)


def _is_hf_conv1d(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (
        _from_library(module, "transformers", ("Conv1D",))
        and isinstance(w, Tensor)
        and w.dim() == 2
        and tuple(w.shape) == (getattr(module, "nx", None), getattr(module, "nf", None))
    )


def _own_kernel(module: nn.Module) -> Tensor:
    """``module.effective_weight()`` where the module defines it (normlab's WS/PWS convs), else ``module.weight``."""
    fn = getattr(module, "effective_weight", None)
    return fn() if callable(fn) else module.weight


def _timm_std_kernel(module: nn.Module) -> Tensor:
    """The kernel timm's (Scaled)StdConv2d(Same) forward computes: each filter standardized by F.batch_norm."""
    gain = getattr(module, "gain", None)
    scale = (gain * module.scale).view(-1) if gain is not None else None
    w = module.weight
    return F.batch_norm(
        w.reshape(1, w.shape[0], -1), None, None, weight=scale, training=True, momentum=0.0, eps=module.eps
    ).reshape_as(w)


def _transpose_filters(w: Tensor, module: nn.Module) -> Tensor:
    """ConvTranspose weight (C_in, C_out/g, *k) -> the equivalent conv's filters (C_out, C_in/g, *k)."""
    g = module.groups
    c_in, c_out_g, k = w.shape[0], w.shape[1], w.shape[2:]
    return w.reshape(g, c_in // g, c_out_g, *k).transpose(1, 2).reshape(g * c_out_g, c_in // g, *k)


@dataclass(frozen=True)
class LinearMapRule:
    """How the monitor reads one family of weight-applying modules (see the table in this module's docstring).

    Args:
        name: the rule's name.
        kind: ``"conv"`` or ``"linear"`` (the record's ``kind``).
        matches: module -> True when the rule applies.
        kernel: module -> the kernel the module applies, in its own layout (may carry autograd; read detached).
        filters: (kernel, module) -> that kernel with output filters on dim 0.
        rows_are_filters: dim 0 of the module's weight indexes its output filters (``filters`` is the identity), so a
            weight sharded on dim 0 (FSDP2) keeps whole filters on each rank.
    """

    name: str
    kind: str
    matches: Callable[[nn.Module], bool]
    kernel: Callable[[nn.Module], Tensor]
    filters: Callable[[Tensor, nn.Module], Tensor] = lambda w, m: w
    rows_are_filters: bool = True


def _is_timm_std_conv(module: nn.Module) -> bool:
    return isinstance(module, nn.Conv2d) and _from_library(module, "timm", TIMM_STD_CONVS)


#: How the monitor finds the conv and linear layers. The first rule that matches a module gives its kernel and
#: output filters; in order, ``timm_std_conv`` (timm's ``StdConv2d``, ``ScaledStdConv2d`` and their ``Same``
#: variants: the standardized kernel their forward computes), ``conv_transpose`` (``nn.ConvTranspose1d/2d/3d``),
#: ``conv`` (``nn.Conv1d/2d/3d`` and subclasses, WS/PWS included: their effective kernel), ``linear``
#: (``nn.Linear`` and subclasses) and ``hf_conv1d`` (transformers' ``Conv1D``, weight (in, out)).
LINEAR_MAP_RULES: tuple[LinearMapRule, ...] = (
    LinearMapRule("timm_std_conv", "conv", _is_timm_std_conv, _timm_std_kernel),
    LinearMapRule(
        "conv_transpose",
        "conv",
        lambda m: isinstance(m, nn.modules.conv._ConvTransposeNd),
        _own_kernel,
        _transpose_filters,
        rows_are_filters=False,
    ),
    LinearMapRule("conv", "conv", lambda m: isinstance(m, nn.modules.conv._ConvNd), _own_kernel),
    LinearMapRule("linear", "linear", lambda m: isinstance(m, nn.Linear), _own_kernel),
    LinearMapRule("hf_conv1d", "linear", _is_hf_conv1d, lambda m: m.weight, lambda w, m: w.t(), rows_are_filters=False),
)


def linear_map_rule(module: nn.Module) -> LinearMapRule | None:
    """The first rule of :data:`LINEAR_MAP_RULES` that matches ``module``, or None (no linear map)."""
    return next((r for r in LINEAR_MAP_RULES if r.matches(module)), None)


def layer_kind(module: nn.Module) -> str | None:
    """``"conv"``, ``"linear"``, ``"norm"`` or None (not watched)."""
    rule = linear_map_rule(module)
    if rule is not None:
        return rule.kind
    if is_norm_layer(module):
        return "norm"
    return None


def layer_type(module: nn.Module) -> str:
    """The class name of a watched layer for its record: the layer's own class, also under FSDP2, which swaps the
    class of every module it shards for a subclass named ``FSDP<name>``.

    Example:
        >>> layer_type(nn.Conv2d(1, 1, 1))
        'Conv2d'
    """
    cls = type(module)
    fsdp = _fsdp_module_class()
    if fsdp is not None and issubclass(cls, fsdp):
        cls = next((c for c in cls.__mro__[1:] if not issubclass(c, fsdp)), cls)
    return cls.__name__


def _fsdp_module_class():
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def supported_layers(model: nn.Module, include_norm: bool = True) -> list[tuple[str, nn.Module, str]]:
    """``(name, module, kind)`` of every watched layer of ``model``, in registration order.

    Args:
        model: any module (wrappers are stripped by :func:`unwrap_model`).
        include_norm: also list the normalization layers (kind ``"norm"``).

    Returns:
        One tuple per layer: its qualified name, the module and its kind (the :data:`LINEAR_MAP_RULES` kind of a
        layer that applies a weight as a linear map, or ``"norm"``).

    Example:
        >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
        >>> [(name, kind) for name, _, kind in supported_layers(model)]
        [('0', 'conv'), ('1', 'norm'), ('4', 'linear')]
    """
    out = []
    for name, mod in unwrap_model(model).named_modules():
        kind = layer_kind(mod)
        if kind is None or (kind == "norm" and not include_norm):
            continue
        out.append((name or type(mod).__name__, mod, kind))
    return out


def unwatched_layers(model: nn.Module, include_norm: bool = True) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every module of ``model`` that holds parameters of its own (not only its children's)
    and that :func:`supported_layers` does not list: what the monitor's records and rules never read.

    Args:
        model: any module (wrappers are stripped by :func:`unwrap_model`).
        include_norm: as in :func:`supported_layers` (False also lists the normalization layers).

    Example:
        >>> model = nn.Sequential(nn.Embedding(10, 4), nn.GRU(4, 8, batch_first=True))
        >>> [(name, type(mod).__name__) for name, mod in unwatched_layers(model)]
        [('0', 'Embedding'), ('1', 'GRU')]
    """
    watched = {id(mod) for _, mod, _ in supported_layers(model, include_norm=include_norm)}
    out = []
    for name, mod in unwrap_model(model).named_modules():
        if id(mod) not in watched and next(mod.parameters(recurse=False), None) is not None:
            out.append((name or type(mod).__name__, mod))
    return out


def _rule_of(module: nn.Module, fn: str) -> LinearMapRule:
    rule = linear_map_rule(module)
    if rule is None:
        raise TypeError(
            f"{fn}: {type(module).__name__} applies no weight as a linear map "
            "(expected a module matched by normlab.monitor.layers.LINEAR_MAP_RULES)"
        )
    return rule


def check_sharding(module: nn.Module, where: str) -> None:
    """Refuse, in one line naming ``where``, a layer whose weight is a DTensor placed so that an output filter is split
    across ranks (:func:`~normlab.monitor.ranks.check_filter_placements`): the monitor reads whole filters. A plain
    weight, FSDP2's ``Shard(0)`` on a conv/linear weight and ``Replicate`` pass."""
    rule = linear_map_rule(module)
    weight = getattr(module, "weight", None)
    if rule is not None and isinstance(weight, Tensor):
        check_filter_placements(weight, where, rows_are_filters=rule.rows_are_filters)


@torch.no_grad()
def effective_weight(module: nn.Module) -> Tensor:
    """The kernel the layer applies, detached, in the layer's own layout (:data:`LINEAR_MAP_RULES`).

    ``module.effective_weight()`` where the module has it (WS/PWS convs), the standardized kernel for timm's
    standardized convs, else ``module.weight`` (a ``weight_norm`` parametrization already yields the effective
    kernel there).

    Example::

        >>> conv = nn.ConvTranspose2d(4, 6, 3, groups=2)
        >>> effective_weight(conv).shape, filter_kernel(conv).shape
        (torch.Size([4, 3, 3, 3]), torch.Size([6, 2, 3, 3]))
    """
    rule = _rule_of(module, "effective_weight")
    check_sharding(module, f"effective_weight: {type(module).__name__}")
    return rule.kernel(module).detach()


@torch.no_grad()
def filter_kernel(module: nn.Module, kernel: Tensor | None = None) -> Tensor:
    """The applied kernel (or ``kernel``, in the layer's layout) with output filters on dim 0: (C_out, ...).

    Row o of ``filter_kernel(m).reshape(C_out, -1)`` holds the weights that produce output channel (feature) o.

    Args:
        module: a layer that applies a weight as a linear map (:data:`LINEAR_MAP_RULES`).
        kernel: a kernel in the layer's own layout to bring to that view (default: the one the layer applies).

    Example:
        >>> up = nn.ConvTranspose2d(4, 6, 3)          # weight (C_in, C_out, k, k)
        >>> filter_kernel(up).shape                   # the equivalent convolution's filters
        torch.Size([6, 4, 3, 3])
    """
    rule = _rule_of(module, "filter_kernel")
    check_sharding(module, f"filter_kernel: {type(module).__name__}")
    w = rule.kernel(module).detach() if kernel is None else kernel
    return rule.filters(w, module)


# ------------------------------------------------------------------------------------------ channel axes
_CHANNELS_FIRST_NAME = re.compile(r"[23]d(Fp32)?$")


def _channels_first_layer_norm(module: nn.Module) -> bool:
    """LayerNorm subclasses that normalize dim 1 of (N, C, H, W): Hugging Face's ``data_format="channels_first"``
    and timm's ``LayerNorm2d``/``LayerNorm2dFp32``/``LayerNormExp2d`` (they permute around F.layer_norm)."""
    return getattr(module, "data_format", None) == "channels_first" or bool(
        _CHANNELS_FIRST_NAME.search(type(module).__name__)
    )


def _layer_norm_dims(module: nn.Module, x: Tensor) -> tuple[int, ...] | None:
    shape = tuple(module.normalized_shape)
    k = len(shape)
    trailing, leading = tuple(range(x.dim() - k, x.dim())), tuple(range(1, 1 + k))
    first = [leading, trailing] if _channels_first_layer_norm(module) else [trailing, leading]
    for dims in first:
        if x.dim() > k and all(0 <= d < x.dim() for d in dims) and tuple(x.shape[d] for d in dims) == shape:
            return dims
    return None


def input_channel_dims(module: nn.Module, kind: str, x: Tensor) -> tuple[int, ...] | None:
    """The dims of ``x`` (the layer's input) that index its channels, for per-channel input statistics.

    conv: dim 1 of (N, C, *), dim 0 of an unbatched (C, *) input. linear (``nn.Linear``, ``Conv1D``): the last dim
    (the feature of (N, F), (B, T, F), (B, H, W, F) inputs). norm: the normalized dims: ``nn.LayerNorm`` /
    ``nn.RMSNorm`` the trailing ``len(normalized_shape)`` dims (dim 1 for channels-first LayerNorm subclasses:
    HF ``data_format="channels_first"``, timm ``LayerNorm2d``), BatchNorm/GroupNorm/InstanceNorm/normlab norms dim 1.
    None when ``x`` has no channel axis (a 1-D input, a shape that does not match ``normalized_shape``).
    """
    if x.dim() < 2:
        return None
    if kind == "linear":
        return (x.dim() - 1,)
    if kind == "conv":
        return (0,) if x.dim() == len(getattr(module, "kernel_size", ())) + 1 else (1,)
    if isinstance(module, nn.LayerNorm | nn.RMSNorm):
        return _layer_norm_dims(module, x)
    return (1,)


def input_channels(module: nn.Module, kind: str) -> int | None:
    """How many channels :func:`input_channel_dims` finds in the layer's input, read from the module (the same on
    every rank, before any forward): conv/linear from the weight (``in_channels``, ``in_features``, a ``Conv1D``'s
    ``nx``), norms from ``num_features``, ``num_channels`` or ``normalized_shape``; None when the module does not say
    (a lazy layer before its first forward, a norm of another shape).

    Example:
        >>> input_channels(nn.Conv2d(3, 8, 3), "conv"), input_channels(nn.LayerNorm([4, 5]), "norm")
        (3, 20)
    """
    if kind != "norm":
        rule = linear_map_rule(module)
        weight = getattr(module, "weight", None)
        if rule is None or not isinstance(weight, Tensor) or isinstance(weight, nn.parameter.UninitializedParameter):
            return None
        if rule.name == "hf_conv1d":
            return int(weight.shape[0])
        if rule.name == "conv_transpose":
            return int(weight.shape[0])
        per_group = int(weight.shape[1])
        return per_group * getattr(module, "groups", 1) if kind == "conv" else per_group
    for attr in ("num_features", "num_channels"):
        value = getattr(module, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, tuple | list) and shape and all(isinstance(d, int) for d in shape):
        return math.prod(shape)
    return None
