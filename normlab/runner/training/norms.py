"""Put a comparison's normalization into a model built by someone else (a ``pkg.module:function``, ``timm:NAME``,
``torchvision:NAME`` or a function of the Python API).

A comparison name is ``(norm, conv)`` (:func:`normlab.nn.resolve_comparison`: ``bn`` -> (bn, conv), ``ws+gn`` ->
(gn, ws), ``pws`` -> (none, pws)). A model factory whose signature names ``norm_layer`` builds the norm itself:
it is called with ``norm_layer=NormLayer(norm)`` (``NormLayer(norm)(C)`` is :func:`normlab.nn.create_norm` ``(norm,
C)``, as torchvision's ResNet calls its ``norm_layer``). Any other model is built as its factory builds it (with
BatchNorm layers) and :func:`normlab.convert.convert_norm` puts the norm in place of every BatchNorm: ``convert_norm
(model, to=norm)``. Then the convs: ``ws``/``pws`` by ``convert_norm(model, to=conv, **conv_kwargs)`` (``pws``
removes the BatchNorms its convs feed, ``ws`` keeps them), ``wn`` by torch's ``weight_norm`` on every plain conv
(exact ``nn.Conv1d/2d/3d``; its norms become ``none`` first). A conversion that replaces nothing (a model without
BatchNorm layers asked for ``gn``, or without plain convs asked for ``pws``) is refused in one line rather than
trained as a copy of the original.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from normlab.convert import convert_norm
from normlab.nn import NORM_NAMES as NORMS
from normlab.nn import create_norm

__all__ = ["NormLayer", "put_norm"]

_PLAIN_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass(frozen=True)
class NormLayer:
    """``norm_layer`` for a model constructor: ``NormLayer("gn")(64)`` is ``create_norm("gn", 64, dim)`` (picklable).

    Example:
        >>> layer = NormLayer("gn")(64)
        >>> type(layer).__name__, layer.num_groups, layer.num_channels
        ('GroupNorm', 32, 64)
    """

    norm: str
    dim: int = 2
    kwargs: dict = field(default_factory=dict)

    def __call__(self, num_features: int, **_: object) -> nn.Module:
        return create_norm(self.norm, num_features, dim=self.dim, **self.kwargs)


def _ids(model: nn.Module) -> set[int]:
    return {id(m) for m in model.modules()}


def _convert(model: nn.Module, to: str, what: str, example: torch.Tensor, **kw) -> nn.Module:
    """``convert_norm(model, to, **kw)``; a ValueError if it replaced no module (nothing to convert)."""
    before = _ids(model)
    with warnings.catch_warnings():  # "nothing to convert" is refused below, in one line
        warnings.filterwarnings("ignore", message=r"convert_norm\(to=.*\): nothing to convert")
        model = convert_norm(model, to=to, example_input=example, **kw)
    if _ids(model) == before:
        hint = " (build it with BatchNorm layers, or give its function a norm_layer argument)" if to in NORMS else ""
        raise ValueError(f"convert_norm(to={to!r}) found no {what} to replace in {type(model).__name__}{hint}")
    return model


def _weight_norm(model: nn.Module) -> nn.Module:
    convs = [m for m in model.modules() if type(m) in _PLAIN_CONVS]
    if not convs:
        raise ValueError(f"wn: {type(model).__name__} has no plain convolution to put weight norm on")
    for m in convs:
        nn.utils.parametrizations.weight_norm(m)
    return model


def put_norm(
    model: nn.Module,
    norm: str,
    conv: str,
    example: torch.Tensor,
    *,
    built_with_norm: bool = False,
    norm_kwargs: dict | None = None,
    conv_kwargs: dict | None = None,
) -> nn.Module:
    """``model`` with normalization ``norm`` and convolutions ``conv`` (the module docstring); ``example``: an input
    batch (the shapes each layer sees). ``built_with_norm``: the factory took ``norm_layer`` (the norms are in).

    Raises:
        ValueError: one line, when a conversion cannot apply (:func:`normlab.convert.convert_norm`'s refusals) or
            replaces nothing.
    """
    model.eval()  # the conversions' shape and dataflow passes run without touching running statistics
    if not built_with_norm:
        target = "none" if conv == "wn" else norm
        kwargs = dict(norm_kwargs or {}) if target != "none" else {}
        model = _convert(model, target, "BatchNorm layer", example, **kwargs)
    if conv in ("ws", "pws"):
        model = _convert(model, conv, "plain convolution", example, **(conv_kwargs or {}))
    elif conv == "wn":
        model = _weight_norm(model)
    return model.train()
