"""What a module computes, recognized by its ``forward`` and not by its class alone; a model's modules, each once.

* :class:`BatchNormSpec` / :func:`describe_batchnorm`: torch's BatchNorms, timm's ``BatchNormAct2d`` /
  ``SyncBatchNormAct`` / ``FrozenBatchNormAct2d``, torchvision's ``FrozenBatchNorm2d`` (whichever of timm and
  torchvision is loaded) and normlab's BatchRenorm layers (``renorm``: a ``_BatchNorm`` subclass that is not a
  plain BatchNorm; also as timm NormAct); a BatchNorm subclass with its own ``forward`` is none of them
  (:func:`is_unknown_batchnorm`).
* timm's ``StdConv2d`` / ``ScaledStdConv2d`` (:func:`timm_std_kind`), normlab's WS/PWS convolutions
  (:data:`STD_CONVS`), torch's plain convolutions (:data:`PLAIN_CONVS`) and their constructor arguments
  (:func:`conv_kwargs`).
* Aliases and shared modules: :func:`unique_modules` lists each module once, :func:`module_names` gives it its
  first name, :func:`swap_modules` puts a replacement under every name and parent that holds it;
  :func:`build_named` names the layer a failing constructor would have replaced, :func:`warn_lost_hooks` the
  replaced layers whose hooks are not carried over.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass

from torch import nn

from normlab.nn._modules import grouped, module_names, name_list, swap_modules, unique_modules, warn_lost_hooks
from normlab.nn.batch_renorm import BATCH_RENORM_TYPES, BatchRenorm1d, BatchRenorm2d, BatchRenorm3d, SyncBatchRenorm
from normlab.nn.registry import conv_entry
from normlab.nn.weight_std import PWS_CONV_TYPES, WS_CONV_TYPES

__all__ = [
    "PLAIN_CONVS",
    "STD_CONVS",
    "BatchNormSpec",
    "known_batchnorm_forwards",
    "describe_batchnorm",
    "is_unknown_batchnorm",
    "num_channels",
    "timm_std_kind",
    "conv_kwargs",
    "module_names",
    "unique_modules",
    "swap_modules",
    "build_named",
    "warn_lost_hooks",
    "warn_unknown_batchnorms",
    "grouped",
    "name_list",
]

#: torch's plain convolution classes -> their spatial dimensions (exact types: a subclass may compute otherwise).
PLAIN_CONVS = {cls: d for d, cls in conv_entry("conv").classes.items()}
#: normlab's weight-standardized convolutions, WS and PWS (their kernel folds into a plain conv).
STD_CONVS = WS_CONV_TYPES + PWS_CONV_TYPES


@dataclass(frozen=True)
class BatchNormSpec:
    """A module that computes a BatchNorm: over ``dim`` spatial dimensions (None: any), synchronized across ranks,
    frozen (eval statistics in buffers), followed by its ``drop`` and ``act`` children, renormalizing in training
    (normlab's BatchRenorm; BatchNorm in eval)."""

    dim: int | None = 2
    sync: bool = False
    frozen: bool = False
    act: bool = False
    renorm: bool = False


def known_batchnorm_forwards() -> dict:
    """``forward`` function -> :class:`BatchNormSpec` (dim None for BatchNorm{1,2,3}d: taken from the class)."""
    bn = nn.modules.batchnorm._BatchNorm
    known = {bn.forward: BatchNormSpec(dim=None), nn.SyncBatchNorm.forward: BatchNormSpec(dim=None, sync=True)}
    timm_na = sys.modules.get("timm.layers.norm_act")  # loaded whenever a timm layer exists
    if timm_na is not None:
        known[timm_na.BatchNormAct2d.forward] = BatchNormSpec(act=True)
        known[timm_na.SyncBatchNormAct.forward] = BatchNormSpec(dim=None, sync=True, act=True)
        known[timm_na.FrozenBatchNormAct2d.forward] = BatchNormSpec(frozen=True, act=True)
    tv = sys.modules.get("torchvision.ops.misc")
    if tv is not None:
        known[tv.FrozenBatchNorm2d.forward] = BatchNormSpec(frozen=True)
    return known


def _renorm_spec(m: nn.Module) -> BatchNormSpec | None:
    """What BatchRenorm ``m`` computes (its forward is BatchRenorm's, SyncBatchRenorm's or that of normlab's timm
    NormAct version), or None (a subclass with its own forward)."""
    forward, dims = type(m).forward, (BatchRenorm1d, BatchRenorm2d, BatchRenorm3d)
    if isinstance(m, SyncBatchRenorm) and forward is SyncBatchRenorm.forward:
        return BatchNormSpec(dim=None, sync=True, renorm=True)
    dim = next((d for d, cls in enumerate(dims, 1) if isinstance(m, cls) and forward is cls.forward), None)
    if dim is not None:
        return BatchNormSpec(dim=dim, renorm=True)
    na = sys.modules.get("normlab.integrations.timm")  # loaded whenever a BatchRenormAct2d exists
    if na is None or forward is not na.BatchRenormAct2d.forward or not (hasattr(m, "drop") and hasattr(m, "act")):
        return None
    if isinstance(m, na.SyncBatchRenormAct):
        return BatchNormSpec(dim=None, sync=True, act=True, renorm=True)
    return BatchNormSpec(act=True, renorm=True) if isinstance(m, na.BatchRenormAct2d) else None


def describe_batchnorm(m: nn.Module, known: dict) -> BatchNormSpec | None:
    """What BatchNorm ``m`` computes, or None when it is not one (or a BatchNorm subclass with its own forward)."""
    if isinstance(m, BATCH_RENORM_TYPES):
        return _renorm_spec(m)
    spec = known.get(type(m).forward)
    if spec is None or (spec.act and not (hasattr(m, "drop") and hasattr(m, "act"))):
        return None
    if spec.dim is None and not spec.sync:
        dim = next(
            (d for d, cls in enumerate((nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d), 1) if isinstance(m, cls)), None
        )
        return BatchNormSpec(dim=dim) if dim is not None else None
    return spec


def is_unknown_batchnorm(m: nn.Module, known: dict) -> bool:
    """A torch BatchNorm subclass whose ``forward`` is none of ``known``'s: it computes something unknown."""
    return isinstance(m, nn.modules.batchnorm._BatchNorm) and describe_batchnorm(m, known) is None


def num_channels(m: nn.Module) -> int:
    """The channels C a BatchNorm-like module normalizes."""
    return getattr(m, "num_features", None) or m.running_mean.numel()


def timm_std_kind(m: nn.Module) -> str | None:
    """ "std" / "scaled" for timm's StdConv2d / ScaledStdConv2d (by their forward), else None."""
    sc = sys.modules.get("timm.layers.std_conv")
    if sc is None:
        return None
    return {sc.StdConv2d.forward: "std", sc.ScaledStdConv2d.forward: "scaled"}.get(type(m).forward)


def conv_kwargs(conv: nn.Module) -> dict:
    """The constructor arguments (bias aside) of a plain conv / transposed conv equal to ``conv``."""
    out = dict(
        in_channels=conv.in_channels,
        out_channels=conv.out_channels,
        kernel_size=conv.kernel_size,
        stride=conv.stride,
        padding=conv.padding,
        dilation=conv.dilation,
        groups=conv.groups,
        padding_mode=conv.padding_mode,
        device=conv.weight.device,
        dtype=conv.weight.dtype,
    )
    if getattr(conv, "transposed", False):
        out["output_padding"] = conv.output_padding
    return out


def build_named(build, where: str, m: nn.Module, name: str):
    """``build()``, with a ``ValueError``/``TypeError`` of the new layer's constructor (which names only its own
    class) re-raised naming the layer it would replace: ``where: cannot build the new layer for name (Type): ...``."""
    try:
        return build()
    except (ValueError, TypeError) as e:
        raise type(e)(f"{where}: cannot build the new layer for {name} ({type(m).__name__}): {e}") from e


def warn_unknown_batchnorms(model: nn.Module, known: dict, names: dict, where: str) -> None:
    """One ``UserWarning`` naming every BatchNorm subclass with its own forward (left as it is)."""
    unknown = [
        f"{names[id(m)]} ({type(m).__name__})" for m in unique_modules(model, lambda m: is_unknown_batchnorm(m, known))
    ]
    if unknown:
        warnings.warn(
            f"{where}: left as they are (BatchNorm subclasses with their own forward, which computes "
            f"something else than a BatchNorm): {name_list(unknown)}",
            UserWarning,
            stacklevel=3,
        )
