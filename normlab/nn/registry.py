"""The one registry of layer names: ``(name, dim) -> class`` for normalizations and convolutions.

Every other part of normlab (models, converters, the experiment runner, the command line) asks this module.

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
"""

from __future__ import annotations

from torch import nn

from .._checks import check_number
from .batch_renorm import BatchRenorm1d, BatchRenorm2d, BatchRenorm3d
from .instance_norm import InstanceNorm1d, InstanceNorm2d, InstanceNorm3d
from .switchable import SwitchableNorm1d, SwitchableNorm2d, SwitchableNorm3d
from .weight_std import PWSConv1d, PWSConv2d, PWSConv3d, WSConv1d, WSConv2d, WSConv3d

__all__ = [
    "NORM_NAMES",
    "CONV_KINDS",
    "DIMS",
    "NORM_CLASSES",
    "CONV_CLASSES",
    "get_norm_class",
    "get_conv_class",
    "create_norm",
    "create_conv",
    "default_groups",
    "is_norm_layer",
    "comparison_names",
    "resolve_comparison",
]

#: The spatial dimensions every name has a class for (1, 2 and 3).
DIMS = (1, 2, 3)


def _each_dim(cls: type) -> dict[int, type]:
    return {d: cls for d in DIMS}


#: Norm name -> {dim: class}, the classes :func:`create_norm` builds (the table of this module's docstring).
NORM_CLASSES: dict[str, dict[int, type]] = {
    "none": _each_dim(nn.Identity),
    "bn": {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d},
    "brn": {1: BatchRenorm1d, 2: BatchRenorm2d, 3: BatchRenorm3d},
    "gn": _each_dim(nn.GroupNorm),
    "ln": _each_dim(nn.GroupNorm),
    "in": {1: InstanceNorm1d, 2: InstanceNorm2d, 3: InstanceNorm3d},
    "sn": {1: SwitchableNorm1d, 2: SwitchableNorm2d, 3: SwitchableNorm3d},
}
#: Conv kind -> {dim: class}, the classes :func:`create_conv` builds (``wn`` is then parametrized).
CONV_CLASSES: dict[str, dict[int, type]] = {
    "conv": {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d},
    "wn": {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d},
    "ws": {1: WSConv1d, 2: WSConv2d, 3: WSConv3d},
    "pws": {1: PWSConv1d, 2: PWSConv2d, 3: PWSConv3d},
}
#: The names :func:`create_norm` and :func:`get_norm_class` accept, for ``dim`` 1, 2, 3. ``none``
#: (``nn.Identity``), ``bn`` (``nn.BatchNorm{1,2,3}d``), ``brn`` (:class:`BatchRenorm1d`/``2d``/``3d``), ``gn``
#: (``nn.GroupNorm``, the largest divisor of C <= 32 groups), ``ln`` (``nn.GroupNorm`` with one group), ``in``
#: (:class:`InstanceNorm1d`/``2d``/``3d``, affine) and ``sn`` (:class:`SwitchableNorm1d`/``2d``/``3d``).
NORM_NAMES = tuple(NORM_CLASSES)
#: The kinds :func:`create_conv` and :func:`get_conv_class` accept, for ``dim`` 1, 2, 3. ``conv`` (the plain
#: ``nn.Conv{1,2,3}d``), ``wn`` (the plain conv with torch's ``weight_norm`` per output channel), ``ws``
#: (:class:`WSConv1d`/``2d``/``3d``) and ``pws`` (:class:`PWSConv1d`/``2d``/``3d``).
CONV_KINDS = tuple(CONV_CLASSES)

# Normalization layers that are not subclasses of a torch norm class are recognized by this class attribute.
_TORCH_NORMS: tuple[type, ...] = (
    nn.modules.batchnorm._NormBase,  # BatchNorm*, SyncBatchNorm, InstanceNorm*, BatchRenorm* and subclasses
    nn.GroupNorm,
    nn.LayerNorm,
    nn.LocalResponseNorm,
    nn.RMSNorm,
)


def is_norm_layer(module: nn.Module) -> bool:
    """True for torch's normalization layers and for classes that set ``_normlab_norm = True``.

    torch's: every BatchNorm, SyncBatchNorm and InstanceNorm (and their subclasses), ``GroupNorm``,
    ``LayerNorm``, ``LocalResponseNorm``, ``RMSNorm``. normlab's own layers (BatchRenorm*, InstanceNorm*,
    SwitchableNorm*) set the marker, and so can a user-defined norm layer that should be treated the same way
    (no weight decay in :func:`~normlab.nn.param_groups`, recorded as a norm by the monitor).

    Args:
        module: any module.

    Example:
        >>> is_norm_layer(SwitchableNorm2d(8)), is_norm_layer(nn.GroupNorm(2, 8)), is_norm_layer(nn.Conv2d(3, 8, 1))
        (True, True, False)
    """
    return isinstance(module, _TORCH_NORMS) or bool(getattr(type(module), "_normlab_norm", False))


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


def _lookup(table: dict[str, dict[int, type]], what: str, name: str, dim: int) -> tuple[str, type]:
    key = name.lower() if isinstance(name, str) else name
    if key not in table:
        raise ValueError(f"{what}: unknown name {name!r}; expected one of {', '.join(table)}")
    if dim not in DIMS:
        raise ValueError(f"{what}: dim must be 1, 2 or 3, got {dim!r}")
    return key, table[key][dim]


def _check_channels(what: str, arg: str, value) -> None:
    check_number(what, arg, value, integer=True, low=1)


def get_norm_class(name: str, dim: int = 2) -> type:
    """The class :func:`create_norm` builds for ``name`` (``none bn brn gn ln in sn``) and ``dim`` (1, 2, 3).

    Args:
        name: one of :data:`NORM_NAMES` (case-insensitive).
        dim: number of spatial dimensions (1, 2 or 3). Default: 2.

    Example:
        >>> get_norm_class("brn", 2)
        <class 'normlab.nn.batch_renorm.BatchRenorm2d'>
    """
    return _lookup(NORM_CLASSES, "get_norm_class", name, dim)[1]


def get_conv_class(kind: str, dim: int = 2) -> type:
    """The class :func:`create_conv` builds for ``kind`` (``conv wn ws pws``) and ``dim``; ``wn`` is a plain
    ``nn.Conv{dim}d`` that :func:`create_conv` then parametrizes with ``weight_norm``.

    Args:
        kind: one of :data:`CONV_KINDS` (case-insensitive).
        dim: number of spatial dimensions (1, 2 or 3). Default: 2.

    Example:
        >>> get_conv_class("ws", 3).__name__, get_conv_class("wn", 1).__name__
        ('WSConv3d', 'Conv1d')
    """
    return _lookup(CONV_CLASSES, "get_conv_class", kind, dim)[1]


def create_norm(name: str, num_channels: int, dim: int = 2, **kwargs) -> nn.Module:
    """Build the normalization layer ``name`` for ``num_channels`` channels of ``dim``-D feature maps.

    Args:
        name: one of :data:`NORM_NAMES`, ``none, bn, brn, gn, ln, in, sn`` (case-insensitive).
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
    key, cls = _lookup(NORM_CLASSES, "create_norm", name, dim)
    _check_channels("create_norm", "num_channels", num_channels)
    if key == "none":
        return cls()
    if key in ("gn", "ln"):
        groups = 1 if key == "ln" else kwargs.pop("num_groups", default_groups(num_channels))
        return cls(groups, num_channels, **kwargs)
    if key == "in":
        kwargs.setdefault("affine", True)
    return cls(num_channels, **kwargs)


def create_conv(kind: str, in_channels: int, out_channels: int, kernel_size, dim: int = 2, **kwargs) -> nn.Module:
    """Build a ``dim``-D convolution of ``kind`` (``conv, wn, ws, pws``).

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
    key, cls = _lookup(CONV_CLASSES, "create_conv", kind, dim)
    _check_channels("create_conv", "in_channels", in_channels)
    _check_channels("create_conv", "out_channels", out_channels)
    conv = cls(in_channels, out_channels, kernel_size, **kwargs)
    if key == "wn":
        conv = nn.utils.parametrizations.weight_norm(conv, name="weight", dim=0)
    return conv


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
