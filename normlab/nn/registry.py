"""The one registry of layer names: ``(name, dim) -> class`` for normalizations and convolutions, open to a user's.

Every other part of normlab (models, converters, the timm adapter, the comparison runner, the command line) asks
this module: what each name builds and what the converters must know about it are attributes of its entry
(:class:`NormEntry`, :class:`ConvEntry`), and :data:`NORM_NAMES` / :data:`CONV_KINDS` are live views of the
names, so that a norm registered with :func:`register_norm` is accepted wherever a built-in name is.

========  ==================================================================  ==============================
norm      class for ``dim`` = 1, 2, 3                                         constructor defaults
========  ==================================================================  ==============================
none      ``nn.Identity``
bn        ``nn.BatchNorm{1,2,3}d``
brn       :class:`~normlab.nn.BatchRenorm1d` / ``2d`` / ``3d``
gn        ``nn.GroupNorm``                                                    ``num_groups``: largest divisor
                                                                              of C that is <= 32
ln        ``nn.GroupNorm`` with one group (over C and all positions)          ``num_groups=1``
in        :class:`~normlab.nn.InstanceNorm1d` / ``2d`` / ``3d``               ``affine=True``
sn        :class:`~normlab.nn.SwitchableNorm1d` / ``2d`` / ``3d``
========  ==================================================================  ==============================

========  ==================================================================
conv      class for ``dim`` = 1, 2, 3
========  ==================================================================
conv      ``nn.Conv{1,2,3}d``
wn        ``nn.Conv{1,2,3}d`` with torch's ``weight_norm`` parametrization per output channel
ws        :class:`~normlab.nn.WSConv1d` / ``2d`` / ``3d`` (Weight Standardization)
pws       :class:`~normlab.nn.PWSConv1d` / ``2d`` / ``3d`` (Parametric Weight Standardization)
========  ==================================================================

Comparison names (the vocabulary of the PWS paper's tables, used by the experiment runner): an output
normalization with a plain conv (``bn`` = ``("bn", "conv")``), a weight reparametrization without an output
normalization (``pws`` = ``("none", "pws")``), or ``<conv>+<norm>`` (``ws+gn`` = ``("gn", "ws")``).

**A user's norm.** ``register_norm("frn", FilterResponseNorm2d, statistics="instance")`` makes ``"frn"`` a name
like the built-ins: :func:`create_norm`, :func:`~normlab.convert.convert_norm` ``(model, to="frn")``, comparison
names (``frn``, ``ws+frn``) in a grid and ``normlab compare --norms``, the timm adapter
(:func:`normlab.integrations.timm.norm_act_class`) and :func:`is_norm_layer` (no weight decay in
:func:`~normlab.nn.param_groups`, recorded as a norm by the monitor). A registration lasts for the process: worker
processes of a comparison see it when they import the module that registers it, so register in the module of the
model factory the workers import (``normlab compare --model mypkg.models:build``), at import time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch  # noqa: F401 - the docstring examples use it
from torch import nn

from .._checks import check_number
from ._registration import (
    STATISTICS,
    check_classes,
    check_name,
    check_optional_class,
    check_options,
    check_signature,
)
from .batch_renorm import BatchRenorm1d, BatchRenorm2d, BatchRenorm3d, SyncBatchRenorm
from .instance_norm import InstanceNorm1d, InstanceNorm2d, InstanceNorm3d
from .switchable import SwitchableNorm1d, SwitchableNorm2d, SwitchableNorm3d
from .weight_std import PWSConv1d, PWSConv2d, PWSConv3d, WSConv1d, WSConv2d, WSConv3d

__all__ = [
    "NORM_NAMES",
    "CONV_KINDS",
    "DIMS",
    "STATISTICS",
    "NameView",
    "NormEntry",
    "ConvEntry",
    "norm_entry",
    "conv_entry",
    "register_norm",
    "unregister_norm",
    "register_conv",
    "unregister_conv",
    "get_norm_class",
    "get_conv_class",
    "create_norm",
    "create_conv",
    "default_groups",
    "is_norm_layer",
    "comparison_names",
    "resolve_comparison",
]

#: The spatial dimensions every built-in name has a class for (1, 2 and 3).
DIMS = (1, 2, 3)
# BatchNorm's settings a new layer in a BatchNorm's place takes by default (convert_norm): those of every norm, and
# those of a norm that keeps BatchNorm's running statistics.
_CARRIES = ("eps", "affine", "bias", "check_finite")
_CARRIES_RUNNING = ("momentum", "track_running_stats")


class NameView(Sequence):
    """A live, read-only sequence of names (:data:`~normlab.nn.NORM_NAMES`, :data:`~normlab.nn.CONV_KINDS`): it
    lists the registry's names each time it is read, so a module that imported it sees the names registered later.
    Compares equal to the tuple of its names; ``+`` gives a tuple.

    Example:
        >>> CONV_KINDS == ("conv", "wn", "ws", "pws"), "pws" in CONV_KINDS, CONV_KINDS + ("x",)
        (True, True, ('conv', 'wn', 'ws', 'pws', 'x'))
    """

    def __init__(self, names: Callable[[], tuple[str, ...]]) -> None:
        self._names = names

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name) -> bool:
        return name in self._names()

    def __add__(self, other) -> tuple:
        return self._names() + tuple(other)

    def __radd__(self, other) -> tuple:
        return tuple(other) + self._names()

    def __eq__(self, other) -> bool:
        return self._names() == (tuple(other) if isinstance(other, (tuple, NameView)) else other)

    __hash__ = None  # type: ignore[assignment] - it changes

    def __repr__(self) -> str:
        return repr(self._names())


def _call(cls: type, num_channels: int, kwargs: dict) -> nn.Module:
    return cls(num_channels, **kwargs)


def _call_grouped(cls: type, num_channels: int, kwargs: dict) -> nn.Module:
    return cls(num_channels, **{"num_groups": default_groups(num_channels), **kwargs})


@dataclass(frozen=True)
class NormEntry:
    """One norm name: what :func:`create_norm` builds for it and what the converter and the timm adapter need.

    Attributes:
        name: the registry name.
        classes: {dim: class}, the classes built for each dim (every layer of a registered class counts as a norm
            layer: :func:`is_norm_layer`).
        statistics: what one statistic is computed over: ``"batch"`` (per channel over the
            batch and the positions: BatchNorm), ``"instance"`` (per sample and channel over the positions; a
            norm mixing several, as SwitchableNorm, takes its finest per-sample one), ``"group"`` (per sample
            over a group of channels and the positions; the constructor takes ``num_groups``), ``"layer"`` (per
            sample over every channel and position) or ``"none"`` (no statistics of its input). The converter
            refuses a per-sample norm for a ``BatchNorm1d`` over (N, C) and wherever one statistic would be of a
            single value.
        running_stats: keeps BatchNorm's running statistics (``running_mean``, ``running_var``,
            ``num_batches_tracked``, BatchNorm's meaning and ``momentum``): the converter copies them.
        sync: the synchronized class that replaces a ``SyncBatchNorm`` (batch statistics across ranks); without
            one a synchronized BatchNorm becomes the plain class, computing on each rank's own batch.
        norm_act: the timm NormAct class (a class or ``"module:attribute"``); None: made from the 2d class by
            :func:`normlab.integrations.timm.norm_act_class`.
        sync_norm_act: the same for ``sync``.
        carries: the BatchNorm settings a layer built in a BatchNorm's place takes (where its constructor names
            them): ``eps``, ``affine``, ``bias``, ``check_finite``, and with ``running_stats`` ``momentum``,
            ``track_running_stats``.
        builtin: one of normlab's names (cannot be unregistered).
        build: ``(cls, num_channels, kwargs) -> layer``; default ``cls(num_channels, **kwargs)`` (for ``"group"``
            statistics with ``num_groups`` the largest divisor of C <= 32 unless given).

    Example:
        >>> e = norm_entry("gn")
        >>> e.statistics, e.groups(96, {}), e.running_stats, norm_entry("brn").sync.__name__
        ('group', 32, False, 'SyncBatchRenorm')
    """

    name: str
    classes: Mapping[int, type]
    statistics: str
    running_stats: bool = False
    sync: type | None = None
    norm_act: type | str | None = None
    sync_norm_act: type | str | None = None
    carries: tuple[str, ...] = _CARRIES
    builtin: bool = False
    build: Callable[[type, int, dict], nn.Module] = field(default=_call, repr=False)

    @property
    def per_sample(self) -> bool:
        """Whether the statistics are per sample (instance, group, layer); a BatchNorm1d over (N, C) cannot become
        such a norm."""
        return self.statistics in ("instance", "group", "layer")

    def groups(self, num_channels: int, kwargs: Mapping[str, Any]) -> int | None:
        """How many groups of channels the per-sample statistics of a layer for ``num_channels`` split the
        channels into (``instance``: C, ``group``: ``num_groups`` or the largest divisor <= 32, ``layer``: 1); None
        for batch or no statistics."""
        if self.statistics == "instance":
            return num_channels
        if self.statistics == "group":
            return kwargs.get("num_groups") or default_groups(num_channels)
        return 1 if self.statistics == "layer" else None


@dataclass(frozen=True)
class ConvEntry:
    """One conv kind: the classes :func:`create_conv` builds, and the constructor arguments a comparison name may
    set after colons (``pws:gamma=1e-2``).

    Attributes:
        name: the registry name.
        classes: {dim: class}; each constructor takes ``nn.Conv{dim}d``'s ``(in_channels, out_channels,
            kernel_size, **kw)``.
        options: {argument: bool, int, float or str}, parsed from ``name:argument=value``.
        builtin: one of normlab's kinds (cannot be unregistered).
        weight_norm: parametrize the built conv with torch's ``weight_norm`` per output channel (``wn``).

    Example:
        >>> conv_entry("pws").options["gamma"], conv_entry("ws").classes[3].__name__
        (<class 'float'>, 'WSConv3d')
    """

    name: str
    classes: Mapping[int, type]
    options: Mapping[str, type] = field(default_factory=dict)
    builtin: bool = False
    weight_norm: bool = False


def _norm(name: str, classes, statistics: str, build=_call, **kw) -> NormEntry:
    classes = classes if isinstance(classes, dict) else {d: classes for d in DIMS}
    return NormEntry(name, MappingProxyType(classes), statistics, builtin=True, build=build, **kw)


_BN_LIKE = dict(running_stats=True, carries=_CARRIES + _CARRIES_RUNNING)
_NORMS: dict[str, NormEntry] = {
    e.name: e
    for e in (
        _norm("none", nn.Identity, "none", lambda cls, c, kw: cls()),
        _norm(
            "bn",
            {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d},
            "batch",
            sync=nn.SyncBatchNorm,
            norm_act="timm.layers:BatchNormAct2d",
            sync_norm_act="timm.layers:SyncBatchNormAct",
            **_BN_LIKE,
        ),
        _norm(
            "brn",
            {1: BatchRenorm1d, 2: BatchRenorm2d, 3: BatchRenorm3d},
            "batch",
            sync=SyncBatchRenorm,
            norm_act="normlab.integrations.timm:BatchRenormAct2d",
            sync_norm_act="normlab.integrations.timm:SyncBatchRenormAct",
            running_stats=True,
            carries=_CARRIES + _CARRIES_RUNNING + ("schedule", "rmax", "dmax"),
        ),
        _norm(
            "gn",
            nn.GroupNorm,
            "group",
            lambda cls, c, kw: cls(kw.pop("num_groups", default_groups(c)), c, **kw),
            norm_act="normlab.integrations.timm:GroupNormAct2d",
        ),
        _norm(
            "ln",
            nn.GroupNorm,
            "layer",
            lambda cls, c, kw: cls(1, c, **kw),
            norm_act="normlab.integrations.timm:GroupNorm1Act2d",
        ),
        _norm(
            "in",
            {1: InstanceNorm1d, 2: InstanceNorm2d, 3: InstanceNorm3d},
            "instance",
            lambda cls, c, kw: cls(c, **{"affine": True, **kw}),
            norm_act="normlab.integrations.timm:InstanceNormAct2d",
        ),
        _norm(  # always affine: BatchNorm's affine is not passed on
            "sn",
            {1: SwitchableNorm1d, 2: SwitchableNorm2d, 3: SwitchableNorm3d},
            "instance",
            norm_act="normlab.integrations.timm:SwitchableNormAct2d",
            running_stats=True,
            carries=("eps", "bias", "check_finite", "momentum"),
        ),
    )
}
_PWS_OPTIONS = {"gamma": float, "relative_gamma": bool, "init_alpha": bool, "fan_mode": str}
_CONVS: dict[str, ConvEntry] = {
    e.name: e
    for e in (
        ConvEntry("conv", MappingProxyType({1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}), builtin=True),
        ConvEntry("wn", MappingProxyType({1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}), builtin=True, weight_norm=True),
        ConvEntry("ws", MappingProxyType({1: WSConv1d, 2: WSConv2d, 3: WSConv3d}), {"eps": float}, builtin=True),
        ConvEntry("pws", MappingProxyType({1: PWSConv1d, 2: PWSConv2d, 3: PWSConv3d}), _PWS_OPTIONS, builtin=True),
    )
}

#: The norm names, live (:class:`NameView`): the built-ins ``none`` (``nn.Identity``), ``bn``
#: (``nn.BatchNorm{1,2,3}d``), ``brn`` (:class:`BatchRenorm1d`/``2d``/``3d``), ``gn`` (``nn.GroupNorm``, the
#: largest divisor of C <= 32 groups), ``ln`` (``nn.GroupNorm`` with one group), ``in``
#: (:class:`InstanceNorm1d`/``2d``/``3d``, affine), ``sn`` (:class:`SwitchableNorm1d`/``2d``/``3d``), then those
#: of :func:`register_norm` in the order registered.
NORM_NAMES = NameView(lambda: tuple(_NORMS))
#: The conv kinds, live: ``conv`` (the plain ``nn.Conv{1,2,3}d``), ``wn`` (the plain conv with torch's
#: ``weight_norm`` per output channel), ``ws`` (:class:`WSConv1d`/``2d``/``3d``), ``pws``
#: (:class:`PWSConv1d`/``2d``/``3d``), then those of :func:`register_conv`.
CONV_KINDS = NameView(lambda: tuple(_CONVS))

# Normalization layers that are not subclasses of a torch norm class are recognized by this class attribute.
_TORCH_NORMS: tuple[type, ...] = (
    nn.modules.batchnorm._NormBase,  # BatchNorm*, SyncBatchNorm, InstanceNorm*, BatchRenorm* and subclasses
    nn.GroupNorm,
    nn.LayerNorm,
    nn.LocalResponseNorm,
    nn.RMSNorm,
)


def is_norm_layer(module: nn.Module) -> bool:
    """True for torch's normalization layers, for the classes of :func:`register_norm` and for classes that set
    ``_normlab_norm = True``.

    torch's: every BatchNorm, SyncBatchNorm and InstanceNorm (and their subclasses), ``GroupNorm``,
    ``LayerNorm``, ``LocalResponseNorm``, ``RMSNorm``. normlab's own layers (BatchRenorm*, InstanceNorm*,
    SwitchableNorm*) set the marker. A norm layer gets no weight decay in :func:`~normlab.nn.param_groups` and is
    recorded as a norm by the monitor.

    Args:
        module: any module.

    Example:
        >>> is_norm_layer(SwitchableNorm2d(8)), is_norm_layer(nn.GroupNorm(2, 8)), is_norm_layer(nn.Conv2d(3, 8, 1))
        (True, True, False)
    """
    if isinstance(module, _TORCH_NORMS) or getattr(type(module), "_normlab_norm", False):
        return True
    registered = tuple(c for e in _NORMS.values() if not e.builtin for c in (*e.classes.values(), e.sync) if c)
    return isinstance(module, registered)


def default_groups(num_channels: int, max_groups: int = 32) -> int:
    """The largest number of groups ``<= max_groups`` that divides ``num_channels`` (GroupNorm's default here).

    Args:
        num_channels: C, the channels to split into groups.
        max_groups: the most groups allowed. Default: 32.

    Example:
        >>> default_groups(96), default_groups(100), default_groups(7)
        (32, 25, 7)
    """
    return next(g for g in range(min(max_groups, num_channels), 0, -1) if num_channels % g == 0)


def _entry(table: dict, what: str, name: str):
    key = name.lower() if isinstance(name, str) else name
    if key not in table:
        raise ValueError(f"{what}: unknown name {name!r}; expected one of {', '.join(table)}")
    return table[key]


def _class(table: dict, what: str, name: str, dim: int) -> tuple[Any, type]:
    entry = _entry(table, what, name)
    if dim not in DIMS:
        raise ValueError(f"{what}: dim must be 1, 2 or 3, got {dim!r}")
    if dim not in entry.classes:
        have = ", ".join(f"{d}d" for d in sorted(entry.classes))
        raise ValueError(f"{what}: {entry.name!r} has no {dim}d class (registered for {have})")
    return entry, entry.classes[dim]


def _check_channels(what: str, arg: str, value) -> None:
    check_number(what, arg, value, integer=True, low=1)


def norm_entry(name: str) -> NormEntry:
    """The :class:`NormEntry` of norm ``name`` (case-insensitive); an unknown name lists the known ones.

    Args:
        name: one of :data:`NORM_NAMES`.

    Example:
        >>> norm_entry("BRN").classes[1].__name__, norm_entry("in").per_sample
        ('BatchRenorm1d', True)
    """
    return _entry(_NORMS, "norm_entry", name)


def conv_entry(kind: str) -> ConvEntry:
    """The :class:`ConvEntry` of conv ``kind`` (case-insensitive); an unknown kind lists the known ones.

    Args:
        kind: one of :data:`CONV_KINDS`.

    Example:
        >>> conv_entry("wn").weight_norm, sorted(conv_entry("ws").options)
        (True, ['eps'])
    """
    return _entry(_CONVS, "conv_entry", kind)


def get_norm_class(name: str, dim: int = 2) -> type:
    """The class :func:`create_norm` builds for ``name`` (``none bn brn gn ln in sn`` or a registered norm) and
    ``dim`` (1, 2, 3).

    Args:
        name: one of :data:`NORM_NAMES` (case-insensitive).
        dim: number of spatial dimensions (1, 2 or 3). Default: 2.

    Example:
        >>> get_norm_class("brn", 2)
        <class 'normlab.nn.batch_renorm.BatchRenorm2d'>
    """
    return _class(_NORMS, "get_norm_class", name, dim)[1]


def get_conv_class(kind: str, dim: int = 2) -> type:
    """The class :func:`create_conv` builds for ``kind`` (``conv wn ws pws`` or a registered conv) and ``dim``;
    ``wn`` is a plain ``nn.Conv{dim}d`` that :func:`create_conv` then parametrizes with ``weight_norm``.

    Args:
        kind: one of :data:`CONV_KINDS` (case-insensitive).
        dim: number of spatial dimensions (1, 2 or 3). Default: 2.

    Example:
        >>> get_conv_class("ws", 3).__name__, get_conv_class("wn", 1).__name__
        ('WSConv3d', 'Conv1d')
    """
    return _class(_CONVS, "get_conv_class", kind, dim)[1]


def create_norm(name: str, num_channels: int, dim: int = 2, **kwargs) -> nn.Module:
    """Build the normalization layer ``name`` for ``num_channels`` channels of ``dim``-D feature maps.

    Args:
        name: one of :data:`NORM_NAMES`, ``none, bn, brn, gn, ln, in, sn`` or a registered norm (case-insensitive).
        num_channels: C, the size of dim 1 of the input.
        dim: number of spatial dimensions (1, 2 or 3).
        **kwargs: passed to the layer's constructor (``eps``, ``momentum``, ``rmax``/``dmax``/``schedule`` for
            brn, ``num_groups`` for gn, ...).

    Shape:
        Input (N, C, *spatial) with ``dim`` spatial dimensions; output: the same shape.

    Example:
        >>> create_norm("gn", 96)
        GroupNorm(32, 96, eps=1e-05, affine=True, bias=True)
        >>> create_norm("brn", 64, rmax=3.0, dmax=5.0).rmax
        3.0
    """
    entry, cls = _class(_NORMS, "create_norm", name, dim)
    _check_channels("create_norm", "num_channels", num_channels)
    return entry.build(cls, num_channels, dict(kwargs))


def create_conv(kind: str, in_channels: int, out_channels: int, kernel_size, dim: int = 2, **kwargs) -> nn.Module:
    """Build a ``dim``-D convolution of ``kind`` (``conv, wn, ws, pws`` or a registered conv).

    Args:
        kind: the convolution kind, one of :data:`CONV_KINDS` (case-insensitive).
        in_channels: C_in, the number of channels of the input.
        out_channels: C_out, the number of filters (channels of the output).
        kernel_size: the size of the kernel (int or tuple).
        dim: number of spatial dimensions (1, 2 or 3).
        **kwargs: ``nn.Conv{dim}d`` arguments (stride, padding, dilation, groups, bias, padding_mode, ...) and the
            kind's own (``eps`` for ws; ``gamma``, ``relative_gamma``, ``fan_mode``, ``init_alpha`` for pws).

    Shape:
        Input (N, in_channels, *spatial); output (N, out_channels, *spatial').

    Example:
        >>> create_conv("pws", 64, 128, 3, padding=1, gamma=1e-2)
        PWSConv2d(64, 128, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), gamma=0.01)
    """
    entry, cls = _class(_CONVS, "create_conv", kind, dim)
    _check_channels("create_conv", "in_channels", in_channels)
    _check_channels("create_conv", "out_channels", out_channels)
    conv = cls(in_channels, out_channels, kernel_size, **kwargs)
    if entry.weight_norm:
        conv = nn.utils.parametrizations.weight_norm(conv, name="weight", dim=0)
    return conv


def _taken() -> dict[str, str]:
    """Every name a new norm or conv may not take, with what holds it."""
    taken = {}
    for what, table in (("norm", _NORMS), ("conv", _CONVS)):
        for n, e in table.items():
            taken[n] = (
                f"the built-in {what} {n!r}"
                if e.builtin
                else f"the {what} {n!r} registered (unregister_{what} it first)"
            )
    return taken


def register_norm(
    name: str,
    layer: type | Mapping[int, type],
    *,
    statistics: str,
    running_stats: bool = False,
    sync: type | None = None,
    norm_act: type | str | None = None,
    sync_norm_act: type | str | None = None,
) -> NormEntry:
    """Register a normalization under ``name``, usable wherever normlab takes a norm name (module docstring).

    A registered class is built as ``cls(num_features, **kwargs)`` (``"group"`` statistics: with ``num_groups``,
    the largest divisor of C <= 32 unless given) and counts as a norm layer (:func:`is_norm_layer`); a layer with
    another constructor is registered through a small subclass. A registration lasts for the process and cannot
    replace a name: registering the same entry again does nothing, another one under a taken name is refused
    (:func:`unregister_norm` first). Each refusal is one line, before anything is registered.

    Args:
        name: lower-case letters, digits and ``_`` (not a norm or conv name already).
        layer: an ``nn.Module`` subclass (every dim) or ``{dim: class}`` for some of 1, 2, 3.
        statistics: what one statistic is computed over: ``batch``, ``instance``, ``group``, ``layer`` or
            ``none`` (:class:`NormEntry`); what :func:`~normlab.convert.convert_norm` checks before replacing a
            BatchNorm.
        running_stats: the layer keeps BatchNorm's ``running_mean``, ``running_var`` and
            ``num_batches_tracked`` (BatchNorm's meaning and ``momentum``); converting a BatchNorm copies them.
        sync: the synchronized class for a ``SyncBatchNorm`` (``statistics="batch"``); constructor as ``layer``'s.
        norm_act: its timm NormAct class (``timm.layers.BatchNormAct2d``'s constructor, the norm's parameters at
            the top level); default: made from the 2d class by :func:`normlab.integrations.timm.norm_act_class`.
        sync_norm_act: the same for ``sync``.

    Returns:
        The new :class:`NormEntry`.

    Example:
        >>> class FRN(nn.Module):  # filter response normalization, without its threshold
        ...     def __init__(self, num_features, eps=1e-6):
        ...         super().__init__()
        ...         self.eps, self.weight = eps, nn.Parameter(torch.ones(num_features))
        ...     def forward(self, x):
        ...         nu2 = x.square().mean(dim=tuple(range(2, x.dim())), keepdim=True)
        ...         return x * torch.rsqrt(nu2 + self.eps) * self.weight.view(-1, *[1] * (x.dim() - 2))
        >>> _ = register_norm("frn", FRN, statistics="instance")
        >>> create_norm("frn", 8, dim=3).eps, is_norm_layer(FRN(4)), resolve_comparison("ws+frn")
        (1e-06, True, ('frn', 'ws'))
        >>> unregister_norm("frn")
    """
    call = f"register_norm({name!r})"
    existing = _NORMS.get(name) if isinstance(name, str) else None
    if existing is None or existing.builtin:
        check_name(call, name, _taken())
    entry = _norm_entry(call, name, layer, statistics, running_stats, sync, norm_act, sync_norm_act)
    if existing is not None and existing != entry:
        check_name(call, name, _taken())
    return _NORMS.setdefault(name, entry)


def _norm_entry(call, name, layer, statistics, running_stats, sync, norm_act, sync_norm_act) -> NormEntry:
    """The entry :func:`register_norm` would make, each argument checked (one line each)."""
    classes = check_classes(call, layer, DIMS)
    if statistics not in STATISTICS:
        raise ValueError(f"{call}: statistics must be one of {', '.join(STATISTICS)}, got {statistics!r}")
    if not isinstance(running_stats, bool):
        raise TypeError(f"{call}: running_stats must be True or False, got {running_stats!r}")
    check_optional_class(call, "sync", sync)
    check_optional_class(call, "norm_act", norm_act, allow_str=True)
    check_optional_class(call, "sync_norm_act", sync_norm_act, allow_str=True)
    if sync is not None and statistics != "batch":
        raise ValueError(f"{call}: sync is for batch statistics, got statistics={statistics!r}")
    grouped = {"num_groups": 2} if statistics == "group" else {}
    expected = "(num_features, num_groups=..., **kw)" if grouped else "(num_features, **kw)"
    for cls in {*classes.values(), *([sync] if sync else [])}:
        check_signature(call, cls, expected, 8, **grouped)
    return NormEntry(
        name,
        MappingProxyType(classes),
        statistics,
        running_stats=running_stats,
        sync=sync,
        norm_act=norm_act,
        sync_norm_act=sync_norm_act,
        carries=_CARRIES + (_CARRIES_RUNNING if running_stats else ()),
        build=_call_grouped if grouped else _call,
    )


def register_conv(
    name: str, layer: type | Mapping[int, type], *, options: Mapping[str, type] | None = None
) -> ConvEntry:
    """Register a convolution kind under ``name``: :func:`create_conv` builds it, and comparison names take it
    (``name``, ``name+gn``, ``name:option=value``). As :func:`register_norm`: for the process, refused in one line
    for a taken name, a class that is not an ``nn.Module`` or a constructor that does not take ``nn.Conv2d``'s
    ``(in_channels, out_channels, kernel_size, **kw)``. :func:`~normlab.convert.convert_norm` converts to ``ws`` and
    ``pws`` only (it folds and removes norms by what those kernels compute).

    Args:
        name: lower-case letters, digits and ``_`` (not a norm or conv name already).
        layer: an ``nn.Module`` subclass (every dim) or ``{dim: class}`` for some of 1, 2, 3.
        options: {constructor argument: bool, int, float or str} a comparison name may set after a colon.

    Returns:
        The new :class:`ConvEntry`.

    Example:
        >>> class CenteredConv2d(nn.Conv2d):  # each filter's kernel with its mean removed
        ...     def forward(self, x):
        ...         w = self.weight - self.weight.mean(dim=(1, 2, 3), keepdim=True)
        ...         return self._conv_forward(x, w, self.bias)
        >>> _ = register_conv("centered", {2: CenteredConv2d})
        >>> type(create_conv("centered", 3, 8, 3)).__name__, resolve_comparison("centered+gn")
        ('CenteredConv2d', ('gn', 'centered'))
        >>> unregister_conv("centered")
    """
    call = f"register_conv({name!r})"
    existing = _CONVS.get(name) if isinstance(name, str) else None
    if existing is None or existing.builtin:
        check_name(call, name, _taken())
    classes = check_classes(call, layer, DIMS)
    for cls in set(classes.values()):
        check_signature(call, cls, "(in_channels, out_channels, kernel_size, **kw)", 3, 8, 3)
    entry = ConvEntry(name, MappingProxyType(classes), MappingProxyType(check_options(call, options)))
    if existing is not None and existing != entry:
        check_name(call, name, _taken())
    return _CONVS.setdefault(name, entry)


def _unregister(table: dict, what: str, name: str) -> None:
    entry = table.get(name) if isinstance(name, str) else None
    if entry is None or entry.builtin:
        registered = [n for n, e in table.items() if not e.builtin]
        why = "a built-in" if entry is not None else "not registered"
        raise ValueError(f"unregister_{what}({name!r}): {why}; registered: {', '.join(registered) or 'none'}")
    del table[name]


def unregister_norm(name: str) -> None:
    """Remove a norm of :func:`register_norm` (a built-in name is refused in one line).

    Args:
        name: a name :func:`register_norm` registered.

    Example:
        >>> _ = register_norm("bn_again", nn.BatchNorm2d, statistics="batch", running_stats=True)
        >>> unregister_norm("bn_again"); "bn_again" in NORM_NAMES
        False
    """
    _unregister(_NORMS, "norm", name)


def unregister_conv(name: str) -> None:
    """Remove a conv kind of :func:`register_conv` (a built-in kind is refused in one line).

    Args:
        name: a name :func:`register_conv` registered.

    Example:
        >>> _ = register_conv("conv_again", nn.Conv2d); unregister_conv("conv_again"); "conv_again" in CONV_KINDS
        False
    """
    _unregister(_CONVS, "conv", name)


def comparison_names() -> tuple[str, ...]:
    """Single comparison names: every norm (with a plain conv) and every non-plain conv kind (without a norm).

    Example:
        >>> comparison_names()
        ('none', 'bn', 'brn', 'gn', 'ln', 'in', 'sn', 'wn', 'ws', 'pws')
    """
    return NORM_NAMES + tuple(k for k in CONV_KINDS if k != "conv")


def resolve_comparison(name: str) -> tuple[str, str]:
    """Map a comparison name to ``(norm, conv)``: ``bn -> (bn, conv)``, ``pws -> (none, pws)``,
    ``ws+gn -> (gn, ws)``. Unknown names raise ValueError listing the valid ones.

    Args:
        name: a name of :func:`comparison_names` or ``<conv>+<norm>`` (either order, case-insensitive).

    Example:
        >>> resolve_comparison("bn"), resolve_comparison("pws"), resolve_comparison("ws+gn")
        (('bn', 'conv'), ('none', 'pws'), ('gn', 'ws'))
    """
    parts = [p for p in str(name).strip().lower().split("+") if p]
    if len(parts) == 1 and parts[0] in NORM_NAMES:
        return parts[0], "conv"
    if len(parts) == 1 and parts[0] in CONV_KINDS and parts[0] != "conv":
        return "none", parts[0]
    if len(parts) == 2:
        convs = [p for p in parts if p in CONV_KINDS]
        norms = [p for p in parts if p in NORM_NAMES]
        if len(convs) == 1 and len(norms) == 1:
            return norms[0], convs[0]
    raise ValueError(
        f"resolve_comparison: unknown normalization {name!r}; valid names: {', '.join(comparison_names())} "
        f"or '<conv>+<norm>' with conv in {{{', '.join(k for k in CONV_KINDS if k != 'conv')}}} and norm in "
        f"{{{', '.join(n for n in NORM_NAMES if n != 'none')}}} (e.g. ws+gn)"
    )
