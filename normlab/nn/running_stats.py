"""Re-estimating running statistics: :func:`update_bn`, ``torch.optim.swa_utils.update_bn`` for every layer that
keeps them, and :func:`has_running_stats`, which says which layers those are.

torch's ``update_bn`` finds the layers by the class ``_BatchNorm``: BatchNorms, timm's ``BatchNormAct2d`` and
normlab's BatchRenorm (a ``_BatchNorm`` subclass), not SwitchableNorm or a tracking InstanceNorm. Which tool finds
which layer: ``docs/batchnorm_tools.md``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.instancenorm import _InstanceNorm

from ._bn_tools import BatchNormTools, begin_reestimation, end_reestimation
from ._modules import unique_modules
from .instance_norm import InstanceNorm1d, InstanceNorm2d, InstanceNorm3d
from .switchable import SwitchableNorm1d, SwitchableNorm2d, SwitchableNorm3d

__all__ = ["update_bn", "has_running_stats"]

_TRACKING = (_NormBase, InstanceNorm1d, InstanceNorm2d, InstanceNorm3d)
_SWITCHABLE = (SwitchableNorm1d, SwitchableNorm2d, SwitchableNorm3d)


def has_running_stats(module: nn.Module) -> bool:
    """True for a layer whose training forward updates running statistics that its eval forward normalizes with.

    Those are torch's BatchNorms (every ``_BatchNorm``: ``nn.BatchNorm1d/2d/3d``, ``nn.SyncBatchNorm``, timm's
    ``BatchNormAct2d``, normlab's BatchRenorm layers) and InstanceNorms (torch's and normlab's) with
    ``track_running_stats=True``, and :class:`SwitchableNorm2d` (1d/3d) with its BatchNorm branch. The frozen
    BatchNorms (torchvision's ``FrozenBatchNorm2d``) keep statistics that nothing updates: False.

    Args:
        module: any module.

    Example:
        >>> has_running_stats(nn.BatchNorm2d(4)), has_running_stats(InstanceNorm2d(4, track_running_stats=True))
        (True, True)
        >>> has_running_stats(nn.InstanceNorm2d(4)), has_running_stats(nn.GroupNorm(2, 4))
        (False, False)
    """
    if isinstance(module, _TRACKING):
        return bool(module.track_running_stats) and getattr(module, "running_mean", None) is not None
    return isinstance(module, _SWITCHABLE) and module.running_mean is not None


def _first_tensor(batch: Any):
    """torch's rule: a batch is a tensor, or a list/tuple whose first element is the model's input."""
    return batch[0] if isinstance(batch, (list, tuple)) else batch


def _explicit_average(layer: nn.Module) -> torch.utils.hooks.RemovableHandle:
    """torch's InstanceNorm skips the update with ``momentum=None``: set the factor ``1 / k`` before its k-th call
    (the cumulative average, as ``momentum=None`` gives the other layers)."""
    calls = [0]

    def pre(module, args):
        calls[0] += 1
        module.momentum = 1.0 / calls[0]

    return layer.register_forward_pre_hook(pre)


def _restore_modes(model: nn.Module, modes: list[tuple[nn.Module, bool]]) -> None:
    """Every module's own training flag as before (parents first, so that a parent's ``train`` does not undo a
    child's), through ``train`` (normlab's layers report skipped batches when they leave training)."""
    for m, mode in modes:
        if m.training != mode:
            m.train(mode)


@torch.no_grad()
def update_bn(loader: Iterable[Any], model: nn.Module, device: int | torch.device | None = None) -> None:
    r"""Re-estimate the running statistics of every layer of ``model`` that keeps them, in one pass over ``loader``.

    ``torch.optim.swa_utils.update_bn`` with its signature, for every layer :func:`has_running_stats` names (torch's
    finds ``_BatchNorm`` layers only): each layer's statistics are reset and become the cumulative average over
    the loader's batches (``momentum=None``; ``1/k`` for the k-th call of torch's InstanceNorm, which skips the
    update with None), with the model in training mode, so that every normalization uses its batch statistics:

    .. math::
        \text{running\_mean} = \frac{1}{K} \sum_{k=1}^{K} \mu_k, \qquad
        \text{running\_var} = \frac{1}{K} \sum_{k=1}^{K} \frac{n_k}{n_k - 1} \sigma^2_k

    over the K calls of the layer, :math:`\mu_k, \sigma^2_k` the batch statistics of its k-th input (n_k values
    per channel; per instance, then averaged over the batch, for an InstanceNorm). BatchRenorm computes BatchNorm
    meanwhile (r = 1, d = 0) and gets its ``num_batches_tracked``, the step of its rmax/dmax schedule, back
    afterwards; the other layers' ``num_batches_tracked`` is the number of batches, as with torch's.
    ``momentum`` and each module's training flag are restored, also when the loader or the model raises; dropout
    and the like run in training mode during the pass, as with torch's.

    Args:
        loader: an iterable of batches, each a tensor or a list/tuple whose first element is the model's input
            (a ``DataLoader``).
        model: the model whose layers to re-estimate.
        device: if given, each input is moved there first.

    Example:
        >>> model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), InstanceNorm2d(4, track_running_stats=True))
        >>> loader = [torch.randn(8, 3, 8, 8) for _ in range(4)]
        >>> update_bn(loader, model)
        >>> int(model[2].num_batches_tracked)
        4
    """
    layers = unique_modules(model, has_running_stats)
    if not layers:
        return
    modes = [(m, m.training) for m in model.modules()]
    momenta = {m: m.momentum for m in layers}
    hooks = []
    for m in layers:
        if isinstance(m, BatchNormTools):
            begin_reestimation(m)  # BatchNorm's output meanwhile; its step back afterwards
        m.reset_running_stats()
        if isinstance(m, _InstanceNorm):
            hooks.append(_explicit_average(m))
        else:
            m.momentum = None
    model.train()
    try:
        for batch in loader:
            x = _first_tensor(batch)
            model(x.to(device) if device is not None else x)
    finally:
        for h in hooks:
            h.remove()
        for m, momentum in momenta.items():
            m.momentum = momentum
            if isinstance(m, BatchNormTools):
                end_reestimation(m)
        _restore_modes(model, modes)
