"""The monitor's records, one TypedDict per kind: every key is documented here, once.

A monitor log (``monitor.jsonl``: :meth:`VarianceMonitor.to_jsonl <normlab.monitor.VarianceMonitor.to_jsonl>`,
``normlab train --monitor-every N``, the Lightning callback; all through :func:`normlab.monitor.log.write_monitor_log`)
holds one JSON object a line:

- a :class:`LayerRecord` (a conv / linear layer) or a :class:`NormRecord` (a normalization layer) per layer and
  recorded step, in forward order within a step; ``mon.records`` holds the same dicts;
- one line per event a rule raised (``"event": "rule"``: :meth:`normlab.monitor.Event.to_dict`), or, in logs
  written before the rules existed, at most one :class:`AlarmEvent` (``"event": "alarm"``): the first collapse
  warning;
- at most one :class:`SppEvent` (``"event": "spp"``): signal-propagation data.

Keys are absent where they do not apply. A healthy model's records hold only finite values; a non-finite input or
kernel shows as nan/inf in ``mon.records`` and as null in the file (a nan channel or filter is never left out as dead
or constant). Weight quantities are taken on the kernel the recorded forward used (before the optimizer step). Under
DDP and FSDP2 every record is merged over the ranks (:mod:`normlab.monitor.ranks`): weights over all filters,
activations over every rank's share of the batch.

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
    """Which layer and step a record describes: the keys every layer record has.

    Attributes:
        step: The optimizer step of the record (step 0 = the initial values).
        layer: The module name (``""`` for a bare layer).
        index: Forward order within the step (layers that did not run come after those that ran).
        type: The module's class name (``"Conv2d"``, ``"BatchNorm1d"``, ...).
        kind: ``"conv"`` / ``"linear"`` (the layers of :data:`~normlab.monitor.LINEAR_MAP_RULES`) or ``"norm"``.

    Example:
        >>> sorted(LayerIdentity.__required_keys__)
        ['index', 'kind', 'layer', 'step', 'type']
    """

    step: int
    layer: str
    index: int
    type: str
    kind: Literal["conv", "linear", "norm"]


class ActivationStats(TypedDict, total=False):
    """Moments of the layer's output and input in the recorded forward (absent when the layer did not run).

    Attributes:
        output_var: Var[Y_l] of the layer output (biased, all entries).
        input_mean_sq: E^2[X] of the layer input (paper Fig. 6a).
        input_sq: E[X^2] of the layer input (all entries).
        input_var: Var[X] of the layer input (all entries).
        input_ratio: E^2[X] / E[X^2] over all entries (Fig. 6b; 1/pi for ReLU(N(0,1))); absent for an all-zero
            input.
        input_ratio_ch_mean: Per-channel E_c^2[X] / E_c[X^2], mean over the LIVE channels. The channels are the
            layer's channel axes (``normlab.monitor.layers.input_channel_dims``; conv dim 1, linear the last dim,
            norms the dims they normalize, e.g. a LayerNorm's trailing ``normalized_shape``); absent when every
            channel is dead.
        input_ratio_ch_min: The same, minimum over the live channels.
        input_ratio_ch_max: The same, maximum over the live channels.
        input_dead_channels: Number of dead input channels, with E_c[X^2] = 0 (dead ReLUs, dropped channels, an SE
            bottleneck); they are left out of ``input_ratio_ch_*`` (they have no ratio).

    Example:
        >>> "input_ratio" in ActivationStats.__optional_keys__
        True
    """

    output_var: float | None
    input_mean_sq: float | None
    input_sq: float | None
    input_var: float | None
    input_ratio: float | None
    input_ratio_ch_mean: float | None
    input_ratio_ch_min: float | None
    input_ratio_ch_max: float | None
    input_dead_channels: int


class WeightStats(TypedDict, total=False):
    """Conv / linear only: the kernel the layer APPLIES (normlab WS/PWS: ``effective_weight()``; timm
    StdConv2d/ScaledStdConv2d: the standardized kernel) viewed per output filter
    (:func:`~normlab.monitor.filter_kernel`; row o produces output channel o).

    Attributes:
        fan_in: n_l, the inputs of one filter.
        out_channels: N_l, the number of filters.
        weight_var: Var[W_o] per filter, mean over filters (Fig. 2).
        weight_var_min: Var[W_o], minimum over filters.
        weight_var_max: Var[W_o], maximum over filters.
        weight_sq_mean: E[W^2] over all entries.
        weight_norm: ||W||, the Frobenius norm.
        shift: The shift of the average Var_o[n_l mean(W_o)] (Fig. 1b, right).
        shift_scale_free: shift / (n_l Var[W]), about 1 at random init, 0 for WS/PWS and for a constant kernel.
        constant_filters: Number of filters with Var[W_o] = 0 (zero-initialized gains, skip-init).
        variance_term: n E[W^2] Var[X], the first term of Var[Y] (:func:`~normlab.monitor.stats.variance_terms`).
        shift_term: E^2[X] shift, the second term of Var[Y].

    Example:
        >>> "fan_in" in WeightStats.__optional_keys__
        True
    """

    fan_in: int
    out_channels: int
    weight_var: float | None
    weight_var_min: float | None
    weight_var_max: float | None
    weight_sq_mean: float | None
    weight_norm: float | None
    shift: float | None
    shift_scale_free: float | None
    constant_filters: int
    variance_term: float | None
    shift_term: float | None


class UpdateStats(TypedDict, total=False):
    """Conv / linear, when the step took an optimizer step (dW = W_before - W_after of that step).

    Attributes:
        update_ratio_mean: Var[W_o - dW_o] / Var[W_o], mean over the non-constant filters (Fig. 1a); absent when
            every filter is constant.
        update_ratio_min: The same, minimum.
        update_ratio_max: The same, maximum.
        mean_update_mean: mean(dW_o), mean over filters (Fig. 1b).
        mean_update_std: mean(dW_o), spread (std) over filters.
        mean_update_absmax: mean(dW_o), maximum of its absolute value over filters.

    Example:
        >>> list(UpdateStats.__annotations__)[:2]
        ['update_ratio_mean', 'update_ratio_min']
    """

    update_ratio_mean: float | None
    update_ratio_min: float | None
    update_ratio_max: float | None
    mean_update_mean: float | None
    mean_update_std: float | None
    mean_update_absmax: float | None


class NormRecord(LayerIdentity, ActivationStats):
    """The record of a normalization layer (``kind == "norm"``) at one recorded step.

    Example:
        >>> rec: NormRecord = {"step": 0, "layer": "bn", "index": 1, "type": "BatchNorm1d", "kind": "norm"}
        >>> "shift" in NormRecord.__annotations__
        False
    """


class LayerRecord(LayerIdentity, ActivationStats, WeightStats, UpdateStats):
    """The record of a conv / linear layer (``kind`` ``"conv"`` or ``"linear"``) at one recorded step.

    Example:
        >>> rec: LayerRecord = {"step": 0, "layer": "fc", "index": 0, "type": "Linear", "kind": "linear"}
        >>> "shift" in LayerRecord.__annotations__
        True
    """


class FlaggedEntry(TypedDict):
    """One (layer, quantity) flagged at the alarm's step, as a variance alarm lists them (``details["flagged"]``
    of the :class:`~normlab.monitor.rules.FactorRule` and :class:`~normlab.monitor.rules.CountdownRule` events).

    Attributes:
        layer: The module name (``"(gradient)"`` for the gradient norm).
        index: Its forward order (-1 for the gradient norm).
        quantity: The record key (or countdown rule) that fired.
        initial: The baseline it was measured against.
        value: The quantity's value at that step (null when not finite).
        growth: value / baseline (null for a non-finite value).
        reason: Why, in words.
        direction: Which way the quantity moved; absent in logs of earlier versions (derived when read).

    Example:
        >>> "direction" in FlaggedEntry.__annotations__
        True
    """

    layer: str
    index: int
    quantity: str
    initial: float | None
    value: float | None
    growth: float | None
    reason: str
    direction: Literal["grew", "shrank", "non-finite"]


class AlarmEvent(TypedDict):
    """The first collapse warning as a log line of logs written before the rules existed
    (:func:`~normlab.monitor.log.load_log` reads it as an :class:`~normlab.monitor.Event`:
    :func:`~normlab.monitor.log.legacy_alarm_event`). The file keys ``initial`` and ``growth`` hold the alarm's
    baseline and ratio.

    Attributes:
        event: Marks the line as the alarm event.
        layer: The first flagged layer in forward order.
        step: The recorded step at which it fired.
        quantity: The record key (or countdown rule) that fired.
        value: Its value at that step.
        initial: Its baseline.
        growth: value / baseline.
        reason: Why, in words.
        flagged: Every (layer, quantity) flagged at that step.
        direction: Which way the quantity moved (absent in older logs).

    Example:
        >>> list(AlarmEvent.__annotations__)[:3]
        ['event', 'layer', 'step']
    """

    event: Literal["alarm"]
    layer: str
    step: int
    quantity: str
    value: float | None
    initial: float | None
    growth: float | None
    reason: str
    flagged: list[FlaggedEntry]
    direction: Literal["grew", "shrank", "non-finite"]


class SppEntry(TypedDict):
    """One block or layer of :func:`~normlab.monitor.signal_propagation` on an N(0, 1) input.

    Attributes:
        name: The module name.
        avg_sq_mean: mean_c(mean(x_c)^2), the average channel squared mean.
        avg_var: mean_c(var(x_c)), the average channel variance.
        residual_var: avg_var of the block's residual-branch output (null where no branch is identified).

    Example:
        >>> list(SppEntry.__annotations__)
        ['name', 'avg_sq_mean', 'avg_var', 'residual_var']
    """

    name: str
    avg_sq_mean: float | None
    avg_var: float | None
    residual_var: float | None


class SppEvent(TypedDict):
    """Signal-propagation data (``mon.add_signal_propagation(shape)``) as a log line.

    Attributes:
        event: Marks the line as the spp event.
        mode: ``"blocks"``, ``"layers"`` or ``"modules"``: what the entries are.
        input_shape: The shape of the N(0, 1) input.
        entries: One entry per block or layer, in forward order.

    Example:
        >>> list(SppEvent.__annotations__)
        ['event', 'mode', 'input_shape', 'entries']
    """

    event: Literal["spp"]
    mode: str
    input_shape: list[int]
    entries: list[SppEntry]


#: The ``event`` values of the two event lines.
ALARM_EVENT, SPP_EVENT, RULE_EVENT = "alarm", "spp", "rule"

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
