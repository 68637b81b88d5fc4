"""What a replacement keeps from the layer it replaces: device, dtype and memory format of its tensors, each
parameter's ``requires_grad`` and the training flag.

torch's ``SyncBatchNorm.convert_sync_batchnorm`` keeps them by sharing the old layer's tensors (and sets
``training``); :func:`normlab.convert.convert_norm` builds new parameters where the new layer has others, so it
copies them: a parameter the old layer had keeps its ``requires_grad``; a parameter it lacked (a SwitchableNorm's
mixture logits, a bias the conv gets when its BatchNorm is removed) is frozen when the old layer was (every
parameter with ``requires_grad=False``, or a frozen BatchNorm whose statistics are buffers) and trainable
otherwise. Hooks are not carried (nor are they by torch's converter): one warning names the layers that had
some.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from normlab._dispatch import same_layout

__all__ = ["is_frozen", "copy_into", "keep_state"]


def is_frozen(m: nn.Module, frozen_kind: bool = False) -> bool:
    """``m`` trains nothing: a frozen kind (``frozen_kind``: torchvision's ``FrozenBatchNorm2d``, whose affine
    parameters are buffers), or parameters that all have ``requires_grad=False``."""
    own = list(m.parameters(recurse=False))
    return frozen_kind or (bool(own) and not any(p.requires_grad for p in own))


def copy_into(dst: Tensor, src: Tensor) -> None:
    """``dst`` (a parameter or buffer of the new layer) takes ``src``'s values and memory format (channels_last
    kernels stay channels_last), in its own dtype and on its own device."""
    with torch.no_grad():
        value = src.detach().reshape(dst.shape).to(device=dst.device, dtype=dst.dtype)
        dst.data = same_layout(value.clone(), src) if src.shape == dst.shape else value.clone()


def keep_state(old: nn.Module, new: nn.Module, frozen: bool) -> nn.Module:
    """``new`` with ``old``'s training flag (its own, not its children's: a reused ``act`` keeps its flag) and
    each of its own parameters' ``requires_grad`` from ``old``'s parameter of the same name, else ``not frozen``."""
    before = dict(old.named_parameters(recurse=False))
    for name, p in new.named_parameters(recurse=False):
        src = before.get(name)
        p.requires_grad_(src.requires_grad if src is not None else not frozen)
    new.training = old.training
    return new
