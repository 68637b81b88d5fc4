"""One registry of normalization and convolution names: ``create_norm`` and ``create_conv``.

Names used everywhere in normlab (models, converters, the experiment runner, the CLI):

========  =====================================================================
norm      module
========  =====================================================================
none      ``nn.Identity``
bn        ``nn.BatchNorm{1,2,3}d``
brn       :class:`normlab.nn.BatchRenorm{1,2,3}d`
gn        ``nn.GroupNorm`` (``num_groups`` default: the largest divisor of C that is <= 32)
ln        ``nn.GroupNorm(1, C)`` (layer norm over C and all spatial positions)
in        :class:`normlab.nn.InstanceNorm{1,2,3}d` with ``affine=True``
sn        :class:`normlab.nn.SwitchableNorm{1,2,3}d`
========  =====================================================================

========  =====================================================================
conv      module
========  =====================================================================
conv      ``nn.Conv{1,2,3}d``
wn        ``nn.Conv{1,2,3}d`` with torch's ``weight_norm`` parametrization (per output channel)
ws        :class:`normlab.nn.WSConv{1,2,3}d` (Weight Standardization)
pws       :class:`normlab.nn.PWSConv{1,2,3}d` (Parametric Weight Standardization)
========  =====================================================================
"""

from __future__ import annotations

from torch import nn

from . import batch_renorm, instance_norm, switchable, weight_std

__all__ = ["NORM_NAMES", "CONV_KINDS", "create_norm", "create_conv", "default_groups"]

NORM_NAMES = ("none", "bn", "brn", "gn", "ln", "in", "sn")
CONV_KINDS = ("conv", "wn", "ws", "pws")
_DIMS = (1, 2, 3)


def default_groups(num_channels: int, max_groups: int = 32) -> int:
    """The largest number of groups <= ``max_groups`` that divides ``num_channels``."""
    for g in range(min(max_groups, num_channels), 0, -1):
        if num_channels % g == 0:
            return g
    return 1


def _check(kind: str, value: str, valid: tuple[str, ...], num_channels: int, dim: int) -> str:
    if not isinstance(value, str) or value.lower() not in valid:
        raise ValueError(f"{kind}: unknown name {value!r}; expected one of {', '.join(valid)}")
    if not isinstance(num_channels, int) or num_channels <= 0:
        raise ValueError(f"{kind}: num_channels must be a positive int, got {num_channels!r}")
    if dim not in _DIMS:
        raise ValueError(f"{kind}: dim must be 1, 2 or 3, got {dim!r}")
    return value.lower()


def create_norm(name: str, num_channels: int, dim: int = 2, **kwargs) -> nn.Module:
    """Build the normalization layer called ``name`` for ``num_channels`` channels of ``dim``-D feature maps.

    ``kwargs`` go to the layer's constructor (e.g. ``eps``, ``momentum``, ``rmax``/``dmax`` for brn,
    ``num_groups`` for gn). Input to the returned module: (N, C, *spatial) with ``dim`` spatial dimensions.
    """
    name = _check("create_norm", name, NORM_NAMES, num_channels, dim)
    if name == "none":
        return nn.Identity()
    if name == "bn":
        return getattr(nn, f"BatchNorm{dim}d")(num_channels, **kwargs)
    if name in ("gn", "ln"):
        groups = 1 if name == "ln" else kwargs.pop("num_groups", default_groups(num_channels))
        return nn.GroupNorm(groups, num_channels, **kwargs)
    if name == "brn":
        return getattr(batch_renorm, f"BatchRenorm{dim}d")(num_channels, **kwargs)
    if name == "in":
        kwargs.setdefault("affine", True)
        return getattr(instance_norm, f"InstanceNorm{dim}d")(num_channels, **kwargs)
    return getattr(switchable, f"SwitchableNorm{dim}d")(num_channels, **kwargs)


def create_conv(
    kind: str, in_channels: int, out_channels: int, kernel_size, dim: int = 2, **kwargs
) -> nn.Module:
    """Build a ``dim``-D convolution of kind ``kind`` (conv, wn, ws, pws).

    ``kwargs`` are the usual ``nn.Conv{dim}d`` arguments (stride, padding, dilation, groups, bias, padding_mode)
    plus the kind's own (``eps``, ``weight_cache`` for ws; ``gamma``, ``relative_gamma``, ``fan_mode``,
    ``init_alpha``, ``weight_cache`` for pws).
    Input: (N, in_channels, *spatial); output: (N, out_channels, *spatial').
    """
    kind = _check("create_conv", kind, CONV_KINDS, in_channels, dim)
    if not isinstance(out_channels, int) or out_channels <= 0:
        raise ValueError(f"create_conv: out_channels must be a positive int, got {out_channels!r}")
    if kind in ("conv", "wn"):
        conv = getattr(nn, f"Conv{dim}d")(in_channels, out_channels, kernel_size, **kwargs)
        if kind == "wn":
            conv = nn.utils.parametrizations.weight_norm(conv, name="weight", dim=0)
        return conv
    prefix = "WS" if kind == "ws" else "PWS"
    return getattr(weight_std, f"{prefix}Conv{dim}d")(in_channels, out_channels, kernel_size, **kwargs)
