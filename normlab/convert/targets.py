""":func:`convert_norm`: check the target, then convert the BatchNorms (:mod:`normlab.convert.norms`) or the
convolutions (:mod:`normlab.convert.convs`)."""

from __future__ import annotations

import copy
import warnings

from torch import Tensor, nn

from normlab.convert.convs import convert_convs, make_std_conv
from normlab.convert.norms import convert_norms
from normlab.convert.recognize import PLAIN_CONVS
from normlab.nn.registry import NORM_NAMES, NameView

__all__ = ["convert_norm", "CONVERT_TARGETS"]

_CONV_TARGETS = ("pws", "ws")
#: What :func:`convert_norm` converts to, live (:class:`~normlab.nn.registry.NameView`): a norm name of
#: :data:`normlab.nn.NORM_NAMES`, registered norms included (every torch BatchNorm becomes that layer), or a
#: convolution kind, ``pws`` or ``ws`` (every plain convolution becomes its standardized version).
CONVERT_TARGETS = NameView(lambda: NORM_NAMES + _CONV_TARGETS)


def convert_norm(
    model: nn.Module,
    to: str,
    *,
    remove_norm: bool | None = None,
    inplace: bool = True,
    example_input: Tensor | None = None,
    **kw,
) -> nn.Module:
    """Swap the normalization of ``model`` (the rules: :mod:`normlab.convert`).

    Args:
        model: any module.
        to: required (no default: every target replaces layers): one of ``none, bn, brn, gn, ln, in, sn`` or a
            norm of :func:`~normlab.nn.register_norm` (replace BatchNorm layers) or ``pws, ws`` (replace plain
            convs).
        remove_norm: for ``pws``/``ws``: remove each BatchNorm that normalizes a converted conv's output.
            Default: True for ``pws`` (it is meant to train without output normalization) and
            False for ``ws`` (WS kernels have unit variance per entry, so without a norm every layer multiplies
            the activation variance by its fan-in; ``remove_norm=True`` with ``ws`` warns).
        inplace: True (default): convert ``model`` itself (its submodules are replaced; the returned module is
            ``model`` unless ``model`` itself is a BatchNorm or conv). False: convert a deep copy and leave
            ``model`` as it is.
        example_input: optional input of ``model``: shows the input shape each BatchNorm sees (a ``BatchNorm1d``
            over (N, C) cannot become ``gn, ln, in, sn``; nor can a layer whose statistics would be of a single
            value, e.g. ``gn`` on a 1x1 map with one channel per group) and the dataflow for ``remove_norm`` when
            ``torch.fx`` cannot trace the model. Run once in eval mode, without gradient. Without it, ``gn, ln,
            in, sn`` look at default inputs of two sizes for shapes fixed by the architecture.
        **kw: constructor arguments for the new layers (``num_groups`` for gn, ``rmax`` for brn,
            ``gamma``/``init_alpha`` for pws, ...).

    Returns:
        The converted model.

    Raises:
        ValueError: ``to`` unknown, or a target that cannot apply to some layers: one line giving each reason once,
            with the first few layers and their count.

    Warns:
        UserWarning: nothing to convert (no BatchNorm, or for ``pws``/``ws`` no plain conv), naming what was looked
        for; layers left as they are (BatchNorm subclasses with their own forward, conv subclasses), with why;
        layers whose hooks are not carried over.

    Example:
        >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        >>> [type(m).__name__ for m in convert_norm(model, to="pws")]
        ['PWSConv2d', 'Identity', 'ReLU']
        >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
        >>> convert_norm(mlp, to="in")
        Traceback (most recent call last):
        ...
        ValueError: convert_norm(to='in'): cannot replace 1 (BatchNorm1d): its input is an nn.Linear output (N, C), ...
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_norm: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(to, str) or to.lower() not in CONVERT_TARGETS:
        raise ValueError(f"convert_norm: unknown to={to!r}; expected one of {', '.join(CONVERT_TARGETS)}")
    to = to.lower()
    if not inplace:
        model = copy.deepcopy(model)
    if to in NORM_NAMES:
        return convert_norms(model, to, example_input, kw)
    if remove_norm is None:
        remove_norm = to == "pws"
    elif remove_norm and to == "ws":
        warnings.warn(
            "convert_norm(to='ws', remove_norm=True): WS kernels have unit variance per entry, so without an output "
            "normalization every layer multiplies the activation variance by its fan-in (overflow in deep nets); "
            "keep the norm (the default) or convert to 'pws'",
            UserWarning,
            stacklevel=2,
        )
    if type(model) in PLAIN_CONVS:
        return make_std_conv(model, to, PLAIN_CONVS[type(model)], kw.pop("bias", True), kw)
    return convert_convs(model, to, remove_norm, example_input, kw)
