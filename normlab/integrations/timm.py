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

Importing this module registers the classes with ``timm.layers.get_norm_act_layer`` (the factory timm's
architectures call on their ``norm_layer`` argument), so ``timm.create_model("regnetx_002",
norm_layer=BatchRenormAct2d)`` builds the network on BatchRenorm with the architecture's own activations;
``norm_layer=BatchRenorm2d`` (the bare norm) maps to ``BatchRenormAct2d`` the way ``nn.BatchNorm2d`` maps to
``BatchNormAct2d``, and so does ``SwitchableNorm2d``; the strings ``"batchrenorm"`` and ``"switchablenorm"`` work
too. Architectures that take a bare norm and add their own activation (timm's ``resnet``) take
``BatchRenorm2d`` itself. :func:`normlab.convert.convert_norm` of a timm model turns each ``BatchNormAct2d`` into
the class of the target here, reusing its ``drop``/``act`` modules. Needs ``pip install 'normlab[timm]'``.
"""

from __future__ import annotations

from string import Template
from typing import Any

import torch  # noqa: F401 - the docstring examples use it
from torch import Tensor, nn

from normlab.nn._docs import fill
from normlab.nn.batch_renorm import BatchRenorm2d, SyncBatchRenorm
from normlab.nn.instance_norm import InstanceNorm2d
from normlab.nn.registry import default_groups
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
    "NORM_ACT_CLASSES",
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


#: The NormAct class of each registry name, which :func:`normlab.convert.convert_norm` builds for a timm
#: ``BatchNormAct2d`` (for ``"bn"`` timm's own ``BatchNormAct2d``).
NORM_ACT_CLASSES: dict[str, type] = {
    "bn": _timm_layers.BatchNormAct2d,
    "brn": BatchRenormAct2d,
    "sn": SwitchableNormAct2d,
    "in": InstanceNormAct2d,
    "gn": GroupNormAct2d,
    "ln": GroupNorm1Act2d,
}


def register() -> None:
    """Make timm's ``get_norm_act_layer`` accept the classes here (done once, on import; idempotent).

    Example:
        >>> timm.layers.get_norm_act_layer(BatchRenorm2d, "silu").func is BatchRenormAct2d
        True
    """
    classes = (
        BatchRenormAct2d,
        SyncBatchRenormAct,
        SwitchableNormAct2d,
        InstanceNormAct2d,
        GroupNormAct2d,
        GroupNorm1Act2d,
    )
    _timm_factory._NORM_ACT_TYPES.update(classes)
    _timm_factory._NORM_ACT_REQUIRES_ARG.update(classes)
    names = {
        "batchrenorm": BatchRenormAct2d,
        "batchrenorm2d": BatchRenormAct2d,
        "switchablenorm": SwitchableNormAct2d,
        "switchablenorm2d": SwitchableNormAct2d,
    }
    _timm_factory._NORM_ACT_MAP.update(names)
    _timm_factory._NORM_TO_NORM_ACT_MAP.update(names)


register()
