"""normlab layers: modules that hold parameters and buffers and call :mod:`normlab.functional`.

One file per family (``batch_renorm``, ``instance_norm``, ``switchable``, ``weight_std``, ``capsules``);
``registry`` maps names (``bn``, ``brn``, ``pws``, ...) to classes for every dimension and takes a user's norm or
conv (``register_norm``, ``register_conv``); ``param_groups`` builds
optimizer groups without weight decay on norm parameters, PWS ``alpha`` and biases; ``running_stats`` re-estimates
every layer's running statistics (``update_bn``, torch's for every layer that keeps them).
"""

from ._non_finite import skipped_batches
from .batch_renorm import (
    BATCH_RENORM_TYPES,
    BatchRenorm1d,
    BatchRenorm2d,
    BatchRenorm3d,
    RenormSchedule,
    SyncBatchRenorm,
)
from .capsules import PrimaryCapsules, RoutingCapsules, dynamic_routing, margin_loss
from .instance_norm import InstanceNorm1d, InstanceNorm2d, InstanceNorm3d
from .param_groups import param_groups
from .registry import (
    CONV_KINDS,
    NORM_NAMES,
    ConvEntry,
    NormEntry,
    comparison_names,
    conv_entry,
    create_conv,
    create_norm,
    default_groups,
    get_conv_class,
    get_norm_class,
    is_norm_layer,
    norm_entry,
    register_conv,
    register_norm,
    resolve_comparison,
    unregister_conv,
    unregister_norm,
)
from .running_stats import has_running_stats, update_bn
from .switchable import SwitchableNorm1d, SwitchableNorm2d, SwitchableNorm3d
from .weight_std import PWS_CONV_TYPES, WS_CONV_TYPES, PWSConv1d, PWSConv2d, PWSConv3d, WSConv1d, WSConv2d, WSConv3d

__all__ = [
    "BatchRenorm1d",
    "BatchRenorm2d",
    "BatchRenorm3d",
    "RenormSchedule",
    "SyncBatchRenorm",
    "BATCH_RENORM_TYPES",
    "InstanceNorm1d",
    "InstanceNorm2d",
    "InstanceNorm3d",
    "SwitchableNorm1d",
    "SwitchableNorm2d",
    "SwitchableNorm3d",
    "WSConv1d",
    "WSConv2d",
    "WSConv3d",
    "PWSConv1d",
    "PWSConv2d",
    "PWSConv3d",
    "WS_CONV_TYPES",
    "PWS_CONV_TYPES",
    "PrimaryCapsules",
    "RoutingCapsules",
    "dynamic_routing",
    "margin_loss",
    "create_norm",
    "create_conv",
    "get_norm_class",
    "get_conv_class",
    "default_groups",
    "NORM_NAMES",
    "CONV_KINDS",
    "register_norm",
    "unregister_norm",
    "register_conv",
    "unregister_conv",
    "norm_entry",
    "conv_entry",
    "NormEntry",
    "ConvEntry",
    "comparison_names",
    "resolve_comparison",
    "param_groups",
    "is_norm_layer",
    "skipped_batches",
    "update_bn",
    "has_running_stats",
]
