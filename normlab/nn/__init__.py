"""normlab layers: modules that hold parameters and buffers and call :mod:`normlab.functional`.

Every name is exported lazily (PEP 562), so importing one family does not import the others.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "batch_renorm": ("BatchRenorm1d", "BatchRenorm2d", "BatchRenorm3d", "SyncBatchRenorm", "RenormSchedule"),
    "instance_norm": ("InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d"),
    "switchable": ("SwitchableNorm1d", "SwitchableNorm2d", "SwitchableNorm3d"),
    "weight_std": ("WSConv1d", "WSConv2d", "WSConv3d", "PWSConv1d", "PWSConv2d", "PWSConv3d"),
    "capsules": ("PrimaryCapsules", "RoutingCapsules", "dynamic_routing", "margin_loss"),
    "param_groups": ("param_groups", "is_norm_layer"),
    "factory": ("create_norm", "create_conv", "NORM_NAMES", "CONV_KINDS"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'normlab.nn' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
