"""normlab layers: modules that hold parameters and buffers and call :mod:`normlab.functional`.

One file per family: ``batch_renorm.py``, ``instance_norm.py``, ``switchable.py``, ``weight_std.py``,
``capsules.py``; ``factory.py`` maps names ("bn", "brn", "pws", ...) to layers; ``param_groups.py`` builds
optimizer groups without weight decay on norm parameters and PWS ``alpha``.
"""

from .batch_renorm import BatchRenorm1d, BatchRenorm2d, BatchRenorm3d, RenormSchedule, SyncBatchRenorm
from .capsules import PrimaryCapsules, RoutingCapsules, dynamic_routing, margin_loss
from .factory import CONV_KINDS, NORM_NAMES, create_conv, create_norm
from .instance_norm import InstanceNorm1d, InstanceNorm2d, InstanceNorm3d
from .param_groups import is_norm_layer, param_groups
from .switchable import SwitchableNorm1d, SwitchableNorm2d, SwitchableNorm3d
from .weight_std import PWSConv1d, PWSConv2d, PWSConv3d, WSConv1d, WSConv2d, WSConv3d

__all__ = [
    "BatchRenorm1d", "BatchRenorm2d", "BatchRenorm3d", "RenormSchedule", "SyncBatchRenorm",
    "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d",
    "SwitchableNorm1d", "SwitchableNorm2d", "SwitchableNorm3d",
    "WSConv1d", "WSConv2d", "WSConv3d", "PWSConv1d", "PWSConv2d", "PWSConv3d",
    "PrimaryCapsules", "RoutingCapsules", "dynamic_routing", "margin_loss",
    "create_norm", "create_conv", "NORM_NAMES", "CONV_KINDS",
    "param_groups", "is_norm_layer",
]
