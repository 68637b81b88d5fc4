"""The monitor's records, one TypedDict per kind: every key is documented here, once.

A monitor log (``monitor.jsonl``: :meth:`VarianceMonitor.to_jsonl <normlab.monitor.VarianceMonitor.to_jsonl>`,
``normlab train --monitor-every N``, the Lightning callback; all through :func:`normlab.monitor.log.write_monitor_log`)
holds one JSON object a line:

- a :class:`LayerRecord` (a conv / linear layer) or a :class:`NormRecord` (a normalization layer) per layer and
  recorded step, in forward order within a step; ``mon.records`` holds the same dicts;
- at most one :class:`AlarmEvent` (``"event": "alarm"``): the first collapse warning;
- at most one :class:`SppEvent` (``"event": "spp"``): signal-propagation data.

Keys are absent where they do not apply. A healthy model's records hold only finite values; a non-finite input or
kernel shows as nan/inf in ``mon.records`` and as null in the file (a nan channel or filter is never left out as dead
or constant). Weight quantities are taken on the kernel the recorded forward used (before the optimizer step).

The key tuples below (:data:`LAYER_KEYS`, ...) are read off these definitions, so a renamed key is one edit here;
modules that name keys check them with :func:`layer_keys` when they are imported.

Example:
    >>> rec: LayerRecord = {"step": 0, "layer": "conv1", "index": 0, "type": "Conv2d", "kind": "conv",
    ...                     "output_var": 1.1, "shift": 0.02}
    >>> layer_keys("output_var", "shift")
    ('output_var', 'shift')
    >>> sorted(set(LayerRecord.__annotations__) - set(NormRecord.__annotations__))[:3]
    ['constant_filters', 'fan_in', 'mean_update_absmax']
"""

from __future__ import annotations

import math
import typing
from typing import Any, Literal, TypedDict

__all__ = [
    "LayerIdentity",
    "ActivationStats",
    "WeightStats",
    "UpdateStats",
    "NormRecord",
    "LayerRecord",
    "FlaggedEntry",
    "AlarmEvent",
    "SppEntry",
    "SppEvent",
    "LAYER_KEYS",
    "NUMBER_KEYS",
    "COUNT_KEYS",
    "ALARM_EVENT",
    "SPP_EVENT",
    "layer_keys",
    "finite_or_null",
]


class LayerIdentity(TypedDict):
    """Which layer and step a record describes: the keys every layer record has."""

    step: int
    """The optimizer step of the record (step 0 = the initial values)."""
    layer: str
    """The module name (``""`` for a bare layer)."""
    index: int
    """Forward order within the step (layers that did not run come after those that ran)."""
    type: str
    """The module's class name (``"Conv2d"``, ``"BatchNorm1d"``, ...)."""
    kind: Literal["conv", "linear", "norm"]
    """``"conv"`` / ``"linear"`` (:data:`~normlab.monitor.layers.LINEAR_MAP_RULES`) or ``"norm"``."""


class ActivationStats(TypedDict, total=False):
    """Moments of the layer's output and input in the recorded forward (absent when the layer did not run)."""

    output_var: float | None
    """Var[Y_l] of the layer output (biased, all entries)."""
    input_mean_sq: float | None
    """E^2[X] of the layer input (paper Fig. 6a)."""
    input_sq: float | None
    """E[X^2] of the layer input (all entries)."""
    input_var: float | None
    """Var[X] of the layer input (all entries)."""
    input_ratio: float | None
    """E^2[X] / E[X^2] over all entries (Fig. 6b; 1/pi for ReLU(N(0,1))); absent for an all-zero input."""
    input_ratio_ch_mean: float | None
    """Per-channel E_c^2[X] / E_c[X^2], mean over the LIVE channels. The channels are the layer's channel axes
    (:func:`~normlab.monitor.layers.input_channel_dims`: conv dim 1, linear the last dim, norms the dims they
    normalize, e.g. a LayerNorm's trailing ``normalized_shape``); absent when every channel is dead."""
    input_ratio_ch_min: float | None
    """The same, minimum over the live channels."""
    input_ratio_ch_max: float | None
    """The same, maximum over the live channels."""
    input_dead_channels: int
    """Number of dead input channels (E_c[X^2] = 0: dead ReLUs, dropped channels, an SE bottleneck), left out of
    ``input_ratio_ch_*`` (they have no ratio)."""


class WeightStats(TypedDict, total=False):
    """Conv / linear only: the kernel the layer APPLIES (normlab WS/PWS: ``effective_weight()``; timm
    StdConv2d/ScaledStdConv2d: the standardized kernel) viewed per output filter
    (:func:`~normlab.monitor.layers.filter_kernel`: row o produces output channel o)."""

    fan_in: int
    """n_l, the inputs of one filter."""
    out_channels: int
    """N_l, the number of filters."""
    weight_var: float | None
    """Var[W_o] per filter, mean over filters (Fig. 2)."""
    weight_var_min: float | None
    """Var[W_o], minimum over filters."""
    weight_var_max: float | None
    """Var[W_o], maximum over filters."""
    weight_sq_mean: float | None
    """E[W^2] over all entries."""
    weight_norm: float | None
    """||W||, the Frobenius norm."""
    shift: float | None
    """The shift of the average Var_o[n_l mean(W_o)] (Fig. 1b, right)."""
    shift_scale_free: float | None
    """shift / (n_l Var[W]): about 1 at random init, 0 for WS/PWS and for a constant kernel."""
    constant_filters: int
    """Number of filters with Var[W_o] = 0 (zero-initialized gains, skip-init)."""
    variance_term: float | None
    """n E[W^2] Var[X], the first term of Var[Y] (:func:`~normlab.monitor.stats.variance_terms`)."""
    shift_term: float | None
    """E^2[X] shift, the second term of Var[Y]."""


class UpdateStats(TypedDict, total=False):
    """Conv / linear, when the step took an optimizer step (dW = W_before - W_after of that step)."""

    update_ratio_mean: float | None
    """Var[W_o - dW_o] / Var[W_o], mean over the non-constant filters (Fig. 1a); absent when every filter is
    constant."""
    update_ratio_min: float | None
    """The same, minimum."""
    update_ratio_max: float | None
    """The same, maximum."""
    mean_update_mean: float | None
    """mean(dW_o), mean over filters (Fig. 1b)."""
    mean_update_std: float | None
    """mean(dW_o), spread (std) over filters."""
    mean_update_absmax: float | None
    """mean(dW_o), maximum of its absolute value over filters."""


class NormRecord(LayerIdentity, ActivationStats):
    """The record of a normalization layer (``kind == "norm"``) at one recorded step."""


class LayerRecord(LayerIdentity, ActivationStats, WeightStats, UpdateStats):
    """The record of a conv / linear layer (``kind`` ``"conv"`` or ``"linear"``) at one recorded step."""


class FlaggedEntry(TypedDict):
    """One (layer, quantity) flagged at the alarm's step, as the alarm event lists them."""

    layer: str
    """The module name (``"(gradient)"`` for the gradient norm)."""
    index: int
    """Its forward order (-1 for the gradient norm)."""
    quantity: str
    """The record key (or countdown rule) that fired."""
    initial: float | None
    """The baseline it was measured against (:attr:`CollapseAlarm.baseline <normlab.monitor.CollapseAlarm>`)."""
    value: float | None
    """The quantity's value at that step (null when not finite)."""
    growth: float | None
    """value / baseline (:attr:`CollapseAlarm.ratio <normlab.monitor.CollapseAlarm>`; null for a non-finite value)."""
    reason: str
    """Why, in words."""
    direction: Literal["grew", "shrank", "non-finite"]
    """Which way the quantity moved (absent in logs of earlier versions: derived when read)."""


class AlarmEvent(TypedDict):
    """The first collapse warning (:class:`~normlab.monitor.CollapseAlarm`) as a log line. The file keys ``initial``
    and ``growth`` are those of the logs and checkpoints written so far; they hold the alarm's ``baseline`` and
    ``ratio``."""

    event: Literal["alarm"]
    """Marks the line as the alarm event."""
    layer: str
    """The first flagged layer in forward order."""
    step: int
    """The recorded step at which it fired."""
    quantity: str
    """The record key (or countdown rule) that fired."""
    value: float | None
    """Its value at that step."""
    initial: float | None
    """Its baseline."""
    growth: float | None
    """value / baseline."""
    reason: str
    """Why, in words."""
    flagged: list[FlaggedEntry]
    """Every (layer, quantity) flagged at that step."""
    direction: Literal["grew", "shrank", "non-finite"]
    """Which way the quantity moved (absent in older logs)."""


class SppEntry(TypedDict):
    """One block or layer of :func:`~normlab.monitor.signal_propagation` on an N(0, 1) input."""

    name: str
    """The module name."""
    avg_sq_mean: float | None
    """mean_c(mean(x_c)^2), the average channel squared mean."""
    avg_var: float | None
    """mean_c(var(x_c)), the average channel variance."""
    residual_var: float | None
    """avg_var of the block's residual-branch output (null where no branch is identified)."""


class SppEvent(TypedDict):
    """Signal-propagation data (``mon.add_signal_propagation(shape)``) as a log line."""

    event: Literal["spp"]
    """Marks the line as the spp event."""
    mode: str
    """``"blocks"``, ``"layers"`` or ``"modules"``: what the entries are."""
    input_shape: list[int]
    """The shape of the N(0, 1) input."""
    entries: list[SppEntry]
    """One entry per block or layer, in forward order."""


#: The ``event`` values of the two event lines.
ALARM_EVENT, SPP_EVENT = "alarm", "spp"

_HINTS = typing.get_type_hints(LayerRecord)
#: Every key a layer record may have, in the order of the definitions above.
LAYER_KEYS: tuple[str, ...] = tuple(_HINTS)
#: The keys whose values are integer counts.
COUNT_KEYS: tuple[str, ...] = tuple(k for k, t in _HINTS.items() if t is int and k not in ("step", "index"))
#: The keys whose values are numbers or null (not finite).
NUMBER_KEYS: tuple[str, ...] = tuple(k for k, t in _HINTS.items() if t == (float | None))


def layer_keys(*keys: str) -> tuple[str, ...]:
    """``keys``, checked to be keys of :class:`LayerRecord`: modules that name record keys call it at import, so a
    key renamed here fails there at once.

    Example:
        >>> layer_keys("output_var", "input_ratio")
        ('output_var', 'input_ratio')
        >>> layer_keys("outputvar")
        Traceback (most recent call last):
        ...
        KeyError: "layer_keys: 'outputvar' is not a key of LayerRecord (normlab.monitor.records)"
    """
    for k in keys:
        if k not in _HINTS:
            raise KeyError(f"layer_keys: {k!r} is not a key of LayerRecord (normlab.monitor.records)")
    return keys


def finite_or_null(obj: Any) -> Any:
    """``obj`` with every non-finite float (nan, inf) replaced by None, through dicts, lists and tuples (as lists).

    Example:
        >>> finite_or_null({"a": float("nan"), "b": [1.0, float("inf")], "c": "x"})
        {'a': None, 'b': [1.0, None], 'c': 'x'}
    """
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
