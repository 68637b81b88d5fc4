"""normlab's norms as timm NormAct layers (norm, then ``drop``, then ``act``), for ``timm.create_model``.

timm builds most of its CNNs from "NormAct" layers: a normalization whose forward also applies a dropout-like
``drop`` module and an activation ``act`` (``timm.layers.BatchNormAct2d``, ``GroupNormAct``, ...). The classes here
are the same layout on normlab's norms, with exactly ``BatchNormAct2d``'s constructor
``(num_features, eps, momentum, affine, track_running_stats, apply_act, act_layer, act_kwargs, inplace,
drop_layer, device, dtype)`` (plus keyword-only arguments of the norm):

- :class:`BatchRenormAct2d`: :class:`~normlab.nn.BatchRenorm2d` (``brn``); state_dict keys equal
  ``BatchNormAct2d``'s (timm checkpoints load); ``rmax``, ``dmax``, ``schedule``, ``check_finite`` keyword-only.
- :class:`SyncBatchRenormAct`: :class:`~normlab.nn.SyncBatchRenorm`; ``process_group`` keyword-only.
- :class:`SwitchableNormAct2d`: :class:`~normlab.nn.SwitchableNorm2d` (``sn``); ``momentum`` is passed on (SN's
  is BatchNorm's convention too); always affine, always with running statistics.
- :class:`InstanceNormAct2d`: :class:`~normlab.nn.InstanceNorm2d` (``in``); ``track_running_stats`` defaults to
  False.
- :class:`GroupNormAct2d`: ``nn.GroupNorm`` with the largest divisor <= 32 of C groups (``gn``); ``num_groups``
  keyword-only; ``momentum`` and ``track_running_stats`` unused.
- :class:`GroupNorm1Act2d`: ``nn.GroupNorm`` with one group (``ln``), as :class:`GroupNormAct2d`.

Importing this module changes nothing in timm. Architectures that take a bare norm class and add their own
activation (timm's ``resnet``) take normlab's norms as they are: ``timm.create_model("resnet18",
norm_layer=BatchRenorm2d)``. Architectures built from NormAct layers (regnet, efficientnet, cspnet, byobnet, ...)
pass their ``norm_layer`` to ``timm.layers.get_norm_act_layer``, which accepts only the classes and strings in
timm's own tables: call :func:`register` once first, then ``timm.create_model("regnetx_002",
norm_layer=BatchRenormAct2d)`` builds the network on BatchRenorm with the architecture's own activations;
``norm_layer=BatchRenorm2d`` (the bare norm) maps to ``BatchRenormAct2d`` the way ``nn.BatchNorm2d`` maps to
``BatchNormAct2d``, and so does ``SwitchableNorm2d``; the strings ``"batchrenorm"`` and ``"switchablenorm"`` work
too. A norm of :func:`normlab.nn.register_norm` has a NormAct class too (:func:`norm_act_class`), which
:func:`register` adds as well. :func:`normlab.convert.convert_norm` of a timm model turns each ``BatchNormAct2d``
into the NormAct class of the target (:func:`norm_act_class`), reusing its ``drop``/``act`` modules, without
:func:`register`. Needs timm (``pip install 'normlab[timm]'``; keeping your torch: docs/integrations.md).
"""

from __future__ import annotations

import importlib
import inspect
from string import Template
from typing import Any

import torch  # noqa: F401 - the docstring examples use it
from torch import Tensor, nn

from normlab.nn._docs import fill
from normlab.nn.batch_renorm import BatchRenorm2d, SyncBatchRenorm
from normlab.nn.instance_norm import InstanceNorm2d
from normlab.nn.registry import NORM_NAMES, default_groups, norm_entry
from normlab.nn.switchable import SwitchableNorm2d

try:
    import timm  # noqa: F401 - the docstring examples use it
    import timm.layers as _timm_layers
    import timm.layers.create_norm_act as _timm_factory
except ImportError:  # pragma: no cover - the extra is not installed
    raise ModuleNotFoundError("timm is not installed: pip install 'normlab[timm]'", name="timm") from None

__all__ = [
    "BatchRenormAct2d",
    "SyncBatchRenormAct",
    "SwitchableNormAct2d",
    "InstanceNormAct2d",
    "GroupNormAct2d",
    "GroupNorm1Act2d",
    "norm_act_class",
    "register",
]


class _NormAct:
    """Mixin: ``forward(x) = act(drop(norm(x)))`` with the norm's own parameters at the top level (timm's
    layout, so the state_dict keys are the norm's)."""

    def _init_act(self, apply_act: bool, act_layer, act_kwargs: dict | None, inplace: bool, drop_layer) -> None:
        self.drop = drop_layer() if drop_layer is not None else nn.Identity()
        act = None
        if apply_act and act_layer is not None:
            kwargs = dict(act_kwargs or {})
            kwargs.setdefault("inplace", inplace)
            act = _timm_layers.create_act_layer(act_layer, **kwargs)
        self.act = nn.Identity() if act is None else act

    def forward(self, x: Tensor) -> Tensor:
        """x: the norm's input -> ``act(drop(norm(x)))``, same shape."""
        return self.act(self.drop(super().forward(x)))


_NORM_ACT_DOC = Template("""$summary

    Args:
        num_features: C, the number of channels (dim 1 of the input).
        eps: added to the variance inside the square root.
        momentum: $momentum
        affine: $affine
        track_running_stats: $track
        apply_act: False: no activation (``act`` is ``nn.Identity``), as ``timm.layers.BatchNormAct2d``.
        act_layer: the activation, a class or a timm activation name such as ``"silu"`` (default ``nn.ReLU``).
        act_kwargs: keyword arguments of the activation.
        inplace: the activation's ``inplace`` (unless ``act_kwargs`` sets it).
        drop_layer: a dropout-like module class applied between the norm and the activation (default none).
        device: factory argument of the parameters and buffers.
        dtype: factory argument of the parameters and buffers.
$extra
    Shape:
        $shape

    Example:
$example
    """)


class BatchRenormAct2d(_NormAct, BatchRenorm2d):
    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        apply_act: bool = True,
        act_layer: Any = nn.ReLU,
        act_kwargs: dict | None = None,
        inplace: bool = True,
        drop_layer: Any = None,
        device=None,
        dtype=None,
        **norm_kwargs,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, **norm_kwargs)
        self._init_act(apply_act, act_layer, act_kwargs, inplace, drop_layer)


class SyncBatchRenormAct(_NormAct, SyncBatchRenorm):
    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        apply_act: bool = True,
        act_layer: Any = nn.ReLU,
        act_kwargs: dict | None = None,
        inplace: bool = True,
        drop_layer: Any = None,
        device=None,
        dtype=None,
        *,
        process_group=None,
        **norm_kwargs,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, process_group, device, dtype, **norm_kwargs
        )
        self._init_act(apply_act, act_layer, act_kwargs, inplace, drop_layer)


class SwitchableNormAct2d(_NormAct, SwitchableNorm2d):
    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        apply_act: bool = True,
        act_layer: Any = nn.ReLU,
        act_kwargs: dict | None = None,
        inplace: bool = True,
        drop_layer: Any = None,
        device=None,
        dtype=None,
        **norm_kwargs,
    ) -> None:
        if not affine:
            raise ValueError(
                "SwitchableNormAct2d: affine must be True (SwitchableNorm always has weight and bias), got affine=False"
            )
        if not track_running_stats:
            raise ValueError(
                "SwitchableNormAct2d: track_running_stats must be True (SwitchableNorm keeps running BN statistics; "
                "using_bn=False mixes IN and LN statistics only), got track_running_stats=False"
            )
        super().__init__(num_features, eps, momentum, device=device, dtype=dtype, **norm_kwargs)
        self._init_act(apply_act, act_layer, act_kwargs, inplace, drop_layer)


class InstanceNormAct2d(_NormAct, InstanceNorm2d):
    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = False,
        apply_act: bool = True,
        act_layer: Any = nn.ReLU,
        act_kwargs: dict | None = None,
        inplace: bool = True,
        drop_layer: Any = None,
        device=None,
        dtype=None,
        **norm_kwargs,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, **norm_kwargs)
        self._init_act(apply_act, act_layer, act_kwargs, inplace, drop_layer)


class GroupNormAct2d(_NormAct, nn.GroupNorm):
    _one_group = False

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        apply_act: bool = True,
        act_layer: Any = nn.ReLU,
        act_kwargs: dict | None = None,
        inplace: bool = True,
        drop_layer: Any = None,
        device=None,
        dtype=None,
        *,
        num_groups: int | None = None,
    ) -> None:
        if self._one_group:
            groups = 1
        else:
            groups = default_groups(num_features) if num_groups is None else num_groups
        super().__init__(groups, num_features, eps, affine, device=device, dtype=dtype)
        self._init_act(apply_act, act_layer, act_kwargs, inplace, drop_layer)


class GroupNorm1Act2d(GroupNormAct2d):
    _one_group = True


def _document(cls: type, example: str, **fields: str) -> None:
    cls.__doc__ = fill(_NORM_ACT_DOC, example, optional=("extra",), **fields)


_BN_LIKE = dict(
    affine="learnable per-channel weight and bias, as ``nn.BatchNorm2d``.",
    momentum="running-statistics update factor (``None``: cumulative average), as ``nn.BatchNorm2d``.",
)
_BRN_KWARGS = "``rmax``, ``dmax``, ``schedule``,\n            ``check_finite``).\n"
_document(
    BatchRenormAct2d,
    """>>> m = BatchRenormAct2d(8, act_layer="silu")
>>> sorted(m.state_dict()) == sorted(timm.layers.BatchNormAct2d(8).state_dict())
True""",
    summary=":class:`~normlab.nn.BatchRenorm2d`, then ``drop``, then ``act``: a drop-in for "
    "``timm.layers.BatchNormAct2d``.",
    track="running statistics (BatchRenorm renormalizes against them), as ``nn.BatchNorm2d``.",
    extra="        **norm_kwargs: keyword-only :class:`~normlab.nn.BatchRenorm2d` arguments (" + _BRN_KWARGS,
    shape="Input (N, C, H, W); output: the same.",
    **_BN_LIKE,
)
_document(
    SyncBatchRenormAct,
    """>>> SyncBatchRenormAct(8, rmax=2.0)(torch.randn(2, 8, 4, 4)).shape
torch.Size([2, 8, 4, 4])""",
    summary=":class:`~normlab.nn.SyncBatchRenorm`, then ``drop``, then ``act`` (timm's ``SyncBatchNormAct`` on "
    "BatchRenorm).",
    track="running statistics, as ``nn.SyncBatchNorm``.",
    extra="        process_group: the ranks whose statistics are merged (default: the whole world).\n"
    "        **norm_kwargs: keyword-only :class:`~normlab.nn.SyncBatchRenorm` arguments (" + _BRN_KWARGS,
    shape="Input (N, C, *); output: the same.",
    **_BN_LIKE,
)
_document(
    SwitchableNormAct2d,
    """>>> SwitchableNormAct2d(8, momentum=0.1).momentum
0.1""",
    summary=":class:`~normlab.nn.SwitchableNorm2d`, then ``drop``, then ``act``.",
    momentum="running-statistics update factor (``None``: cumulative average), as ``nn.BatchNorm2d`` and\n"
    "            :class:`~normlab.nn.SwitchableNorm2d`.",
    affine="must be True (SwitchableNorm always has a weight and a bias).",
    track="must be True (SwitchableNorm always keeps running BN statistics; ``using_bn=False`` drops BN).",
    extra="        **norm_kwargs: keyword-only :class:`~normlab.nn.SwitchableNorm2d` arguments (``using_bn``, "
    "``last_gamma``, ``using_moving_average``).\n",
    shape="Input (N, C, H, W) with H * W > 1; output: the same.",
)
_document(
    InstanceNormAct2d,
    """>>> InstanceNormAct2d(4)(torch.randn(2, 4, 5, 5)).shape
torch.Size([2, 4, 5, 5])""",
    summary=":class:`~normlab.nn.InstanceNorm2d`, then ``drop``, then ``act``; ``track_running_stats`` defaults to "
    "False\n    (instance statistics in eval too, the registry's ``in``).",
    momentum="running-statistics update factor, as ``nn.InstanceNorm2d``.",
    affine="learnable per-channel weight and bias.",
    track="keep running statistics and use them in eval (default False).",
    extra="        **norm_kwargs: keyword-only :class:`~normlab.nn.InstanceNorm2d` arguments.\n",
    shape="Input (N, C, H, W) with H * W > 1; output: the same.",
)
_GN_UNUSED = dict(
    momentum="accepted and unused (GroupNorm has no running statistics).",
    affine="learnable per-channel weight and bias.",
    track="accepted and unused.",
    shape="Input (N, C, *); output: the same.",
)
_document(
    GroupNormAct2d,
    """>>> GroupNormAct2d(48).num_groups
24""",
    summary="``nn.GroupNorm`` over ``num_groups`` groups (the registry's ``gn``), then ``drop``, then ``act``, with\n"
    "    BatchNormAct2d's constructor.",
    extra="        num_groups: keyword-only; default: the largest divisor of C that is <= 32.\n",
    **_GN_UNUSED,
)
_document(
    GroupNorm1Act2d,
    """>>> GroupNorm1Act2d(48).num_groups
1""",
    summary="``nn.GroupNorm`` with one group (over C and all positions: the registry's ``ln``), then ``drop``, then\n"
    "    ``act``, with BatchNormAct2d's constructor.",
    extra="        num_groups: ignored (always one group).\n",
    **_GN_UNUSED,
)


class _RegisteredNormAct(_NormAct):
    """The NormAct layout on a registered norm class: ``(num_features, *, apply_act, act_layer, act_kwargs, inplace,
    drop_layer, device, dtype, **norm_kwargs)``, the norm built as ``cls(num_features, **norm_kwargs)`` (with
    ``device``/``dtype`` where its constructor takes them, else moved there)."""

    _norm_class: type  # the registered norm class, set on each class made from it

    def __init__(
        self,
        num_features: int,
        *,
        apply_act: bool = True,
        act_layer: Any = nn.ReLU,
        act_kwargs: dict | None = None,
        inplace: bool = True,
        drop_layer: Any = None,
        device=None,
        dtype=None,
        **norm_kwargs,
    ) -> None:
        factory = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
        params = inspect.signature(self._norm_class.__init__).parameters
        takes = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) or "device" in params
        super().__init__(num_features, **norm_kwargs, **(factory if takes else {}))
        if factory and not takes:
            self.to(**factory)
        self._init_act(apply_act, act_layer, act_kwargs, inplace, drop_layer)


_made: dict[str, type] = {}  # "NormAct_<name>" / "SyncNormAct_<name>" -> the class made for a registered norm


def _made_class(name: str, base: type, sync: bool) -> type:
    """The NormAct class of registered norm ``name`` on ``base``, made once; named in this module as
    ``NormAct_<name>`` (``SyncNormAct_<name>``) so that pickle finds it again (module ``__getattr__``)."""
    qualname = f"{'Sync' if sync else ''}NormAct_{name}"
    cls = _made.get(qualname)
    if cls is None or cls._norm_class is not base:
        doc = f"{base.__name__} (registered as {name!r}), then ``drop``, then ``act``; built by norm_act_class."
        cls = type(
            f"{base.__name__}Act",
            (_RegisteredNormAct, base),
            {"__module__": __name__, "__doc__": doc, "_norm_class": base},
        )
        cls.__qualname__ = qualname
        _made[qualname] = cls
    return cls


def _resolve(ref: type | str) -> type:
    """A class, or ``"module:attribute"`` imported."""
    if isinstance(ref, str):
        module, _, attr = ref.partition(":")
        return getattr(importlib.import_module(module), attr)
    return ref


def norm_act_class(name: str, sync: bool = False) -> type:
    """The timm NormAct class of registry norm ``name``: the norm, then ``drop``, then ``act``.

    For the built-in names: ``bn`` timm's ``BatchNormAct2d``, ``brn`` :class:`BatchRenormAct2d`, ``sn``
    :class:`SwitchableNormAct2d`, ``in`` :class:`InstanceNormAct2d`, ``gn`` :class:`GroupNormAct2d`, ``ln``
    :class:`GroupNorm1Act2d` (``sync=True``: timm's ``SyncBatchNormAct`` and :class:`SyncBatchRenormAct`); for a
    norm of :func:`normlab.nn.register_norm`, the ``norm_act`` it was registered with, else a subclass of its 2d
    class (``sync``: of its ``sync`` class) made here, with the norm's parameters at the top level (its state_dict
    keys are the norm's) and the constructor ``(num_features, *, apply_act=True, act_layer=nn.ReLU,
    act_kwargs=None, inplace=True, drop_layer=None, **norm_kwargs)``. This is what
    :func:`normlab.convert.convert_norm` puts in place of a timm ``BatchNormAct2d``; after :func:`register`
    ``timm.create_model(..., norm_layer=norm_act_class(name))`` takes it.

    Args:
        name: a norm name of :data:`normlab.nn.NORM_NAMES` other than ``none``.
        sync: the class for a synchronized BatchNorm (the norm's ``sync`` class; refused without one).

    Example:
        >>> norm_act_class("brn") is BatchRenormAct2d, norm_act_class("bn", sync=True).__name__
        (True, 'SyncBatchNormAct')
    """
    entry = norm_entry(name)
    if entry.name == "none":
        raise ValueError("norm_act_class: 'none' has no NormAct class (convert_norm puts nn.Sequential(drop, act))")
    if sync and entry.sync is None:
        raise ValueError(f"norm_act_class({entry.name!r}, sync=True): {entry.name!r} has no synchronized class")
    ref = entry.sync_norm_act if sync else entry.norm_act
    if ref is not None:
        return _resolve(ref)
    base = entry.sync if sync else entry.classes.get(2)
    if base is None:
        raise ValueError(f"norm_act_class({entry.name!r}): a NormAct layer needs a 2d class; {entry.name!r} has none")
    return _made_class(entry.name, base, sync)


def __getattr__(attr: str) -> type:
    """``NormAct_<name>`` / ``SyncNormAct_<name>``: the class :func:`norm_act_class` made for a registered norm
    (how pickle finds it in a process that registered the norm)."""
    sync, _, name = attr.partition("NormAct_")
    if sync in ("", "Sync") and name in NORM_NAMES and not norm_entry(name).builtin:
        return norm_act_class(name, sync=sync == "Sync")
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def _ours(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "normlab" or cls.__module__ == __name__


def register() -> None:
    """Make timm's ``get_norm_act_layer`` (what timm's NormAct architectures call on ``norm_layer``) accept the
    NormAct classes of every norm registered so far. Nothing in timm changes until this is called; calling it again
    adds the norms registered since (idempotent).

    It adds to timm's tables: normlab's NormAct classes (this module's and those :func:`norm_act_class` makes for
    registered norms), and, under the lower-cased name of each norm's 2d class with and without its ``2d``
    (``"batchrenorm2d"``, ``"batchrenorm"``), that NormAct class, where neither torch nor timm uses the name
    (``InstanceNorm2d`` and ``GroupNorm`` are torch's, so ``in``/``gn``/``ln`` have none).

    Example:
        >>> register()
        >>> timm.layers.get_norm_act_layer(BatchRenorm2d, "silu").func is BatchRenormAct2d
        True
    """
    pairs = []  # (norm class, its NormAct class), normlab's NormAct classes only
    for name in NORM_NAMES:
        entry = norm_entry(name)
        if name != "none" and 2 in entry.classes:
            pairs.append((entry.classes[2], norm_act_class(name)))
        if entry.sync is not None:
            pairs.append((None, norm_act_class(name, sync=True)))  # sync classes have no name of their own
    pairs = [(norm, act) for norm, act in pairs if _ours(act)]
    names = {k: act for norm, act in pairs for k in _names(norm, act)}
    acts = {act for _, act in pairs}
    _timm_factory._NORM_ACT_TYPES.update(acts)
    _timm_factory._NORM_ACT_REQUIRES_ARG.update(acts)
    _timm_factory._NORM_ACT_MAP.update(names)
    _timm_factory._NORM_TO_NORM_ACT_MAP.update(names)


def _names(norm: type | None, act: type) -> tuple[str, ...]:
    """timm's names for ``norm`` (its lower-cased class name, with and without ``2d``), unless torch has a class of
    that name or timm uses the name for another layer."""
    if norm is None or hasattr(nn, norm.__name__):
        return ()
    key = norm.__name__.lower()
    keys = (key, key.removesuffix("2d")) if key.endswith("2d") else (key,)
    maps = (_timm_factory._NORM_ACT_MAP, _timm_factory._NORM_TO_NORM_ACT_MAP)
    return tuple(k for k in keys if all(m.get(k, act) is act for m in maps))
