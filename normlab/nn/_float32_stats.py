"""A base for norm layers whose running statistics must stay in (at least) float32."""

from __future__ import annotations

import torch
from torch import nn

from .._dispatch import HALF


class Float32StatsModule(nn.Module):
    """``nn.Module`` whose ``running_mean``/``running_var`` buffers never go below float32.

    ``.half()`` or ``.to(torch.bfloat16)`` convert the parameters and leave the running statistics in float32
    (a variance of 1e8 does not fit in float16); the conversion starts from the value before the cast, so nothing
    is rounded or overflows on the way.
    """

    _float32_buffers = ("running_mean", "running_var")

    def _apply(self, fn, recurse=True):
        before = {name: self._buffers.get(name) for name in self._float32_buffers}
        super()._apply(fn, recurse)
        for name, old in before.items():
            buf = self._buffers.get(name)
            if buf is not None and buf.dtype in HALF:
                keep = old.dtype if old.dtype not in HALF else torch.float32
                self._buffers[name] = old.to(device=buf.device, dtype=keep)
        return self
