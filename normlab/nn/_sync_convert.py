""":meth:`SyncBatchRenorm.convert_sync_batchrenorm <normlab.nn.SyncBatchRenorm.convert_sync_batchrenorm>`: each
BatchRenorm becomes its synchronized version, computing what it computed.

Recognized by ``forward``, as :mod:`normlab.convert` recognizes BatchNorms:

* :class:`~normlab.nn.BatchRenorm1d`/``2d``/``3d`` (or a subclass keeping their forward) ->
  :class:`~normlab.nn.SyncBatchRenorm`;
* :class:`~normlab.integrations.timm.BatchRenormAct2d` (norm, then ``drop``, then ``act``) ->
  :class:`~normlab.integrations.timm.SyncBatchRenormAct` holding the same ``drop`` and ``act`` modules (a plain
  ``SyncBatchRenorm`` would keep them as children and never call them: timm#1254's bug);
* any other BatchRenorm subclass (its own forward computes something unknown) is left as it is, and every such
  module is named in one ``UserWarning``;
* with ``batchnorm=True``, torch's BatchNorms too, each by the converter of its own library: ``nn.BatchNorm1d/2d/3d``
  (or a subclass keeping their forward) by torch's ``SyncBatchNorm.convert_sync_batchnorm``, timm's
  ``BatchNormAct2d`` by timm's ``convert_sync_batchnorm`` (a ``SyncBatchNormAct`` with its ``drop`` and ``act``);
  a BatchNorm subclass with its own forward is left and named in the warning. (torch's and timm's converters refuse
  a model with BatchRenorm, so a model with both kinds is converted here.)

The new layer *shares* the old one's parameter and buffer tensors (optimizers built before the conversion stay
valid), takes its settings (``eps``, ``momentum``, ``affine``, ``track_running_stats``, the bias, ``check_finite``,
the schedule or limits, the training mode, ``qconfig``) and is set under every name that held the old one.
"""

from __future__ import annotations

import sys
import warnings

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from normlab.nn._modules import module_names, name_list, swap_modules, unique_modules, warn_lost_hooks

__all__ = ["to_sync_batchrenorm"]


def _sync_class(m: nn.Module, plain: type, local: tuple[type, ...]) -> type | None:
    """The synchronized class computing what ``m`` computes (``plain`` for a plain BatchRenorm, one of ``local``),
    or None (a subclass with its own forward)."""
    if any(type(m).forward is cls.forward and isinstance(m, cls) for cls in local):
        return plain
    na = sys.modules.get("normlab.integrations.timm")  # loaded whenever a BatchRenormAct2d exists
    if na is not None and isinstance(m, na.BatchRenormAct2d) and type(m).forward is na.BatchRenormAct2d.forward:
        return na.SyncBatchRenormAct
    return None


def _sync_layer(m: nn.Module, cls: type, process_group) -> nn.Module:
    """A ``cls`` sharing ``m``'s parameters and buffers, with its settings (and its drop/act modules)."""
    kw = dict(
        eps=m.eps,
        momentum=m.momentum,
        affine=m.affine,
        track_running_stats=m.track_running_stats,
        process_group=process_group,
        bias=m.bias is not None,
        check_finite=m.check_finite,
    )
    if hasattr(cls, "_init_act"):  # a NormAct class: norm, then drop, then act (m's own, or none)
        kw["apply_act"] = False
    new = cls(m.num_features, **kw)
    new.schedule, new.rmax, new.dmax = m.schedule, m.rmax, m.dmax
    for name, p in m._parameters.items():
        new._parameters[name] = p
    for name, b in m._buffers.items():
        new._buffers[name] = b
    if hasattr(cls, "_init_act") and hasattr(m, "drop") and hasattr(m, "act"):
        new.drop, new.act = m.drop, m.act
    if hasattr(m, "qconfig"):
        new.qconfig = m.qconfig
    return new.train(m.training)


def _torch_sync(m: nn.Module, process_group) -> nn.Module | None:
    """``m`` (a torch BatchNorm, not a BatchRenorm) converted by its own library's converter, or None when its
    forward is neither torch's nor timm's ``BatchNormAct2d``'s (it computes something else)."""
    if type(m).forward is _BatchNorm.forward:
        return nn.SyncBatchNorm.convert_sync_batchnorm(m, process_group)
    norm_act = sys.modules.get("timm.layers.norm_act")
    if norm_act is not None and type(m).forward is norm_act.BatchNormAct2d.forward:
        return norm_act.convert_sync_batchnorm(m, process_group)
    return None


def _converted(m: nn.Module, process_group, plain: type, local: tuple[type, ...], base: type) -> nn.Module | None:
    """The synchronized layer for ``m`` (a BatchRenorm, or with ``batchnorm`` a torch BatchNorm), or None."""
    if isinstance(m, base):
        cls = _sync_class(m, plain, local)
        return None if cls is None else _sync_layer(m, cls, process_group)
    return _torch_sync(m, process_group)


def to_sync_batchrenorm(
    module: nn.Module, process_group, plain: type, local: tuple[type, ...], base: type, batchnorm: bool = False
) -> nn.Module:
    """``module`` with every BatchRenorm (an instance of ``base`` not yet synchronized) replaced by its
    synchronized version (``plain``, the class ``convert_sync_batchrenorm`` is called on, for one of the plain
    ``local`` classes), and with ``batchnorm`` every torch BatchNorm by torch's or timm's; returns the new root when
    ``module`` itself is replaced (the rules: this module's docstring). The classes come as arguments so that this
    module does not import ``batch_renorm``, which calls it."""
    names = module_names(module)
    new, unknown = {}, []

    def wanted(m: nn.Module) -> bool:
        if isinstance(m, base):
            return not isinstance(m, plain)
        return batchnorm and isinstance(m, _BatchNorm) and not isinstance(m, nn.SyncBatchNorm)

    for m in unique_modules(module, wanted):
        out = _converted(m, process_group, plain, local, base)
        if out is None:
            unknown.append(f"{names[id(m)]} ({type(m).__name__})")
        else:
            new[id(m)] = out
    if unknown:
        warnings.warn(
            "SyncBatchRenorm.convert_sync_batchrenorm: left as they are (BatchNorm/BatchRenorm subclasses with "
            f"their own forward, which a synchronized layer would not compute): {name_list(unknown)}",
            UserWarning,
            stacklevel=3,
        )
    replaced = unique_modules(module, lambda m: id(m) in new)
    warn_lost_hooks(replaced, names, "SyncBatchRenorm.convert_sync_batchrenorm")
    return swap_modules(module, new)
