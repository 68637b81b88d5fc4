"""What the monitor's hooks compute: the statistics of one recorded forward and of one optimizer step.

:class:`~normlab.monitor.VarianceMonitor` (:mod:`normlab.monitor.monitor`) attaches a forward hook to every watched
layer while a recording step is pending; the hook calls :func:`activation_moments` on the layer's input and output
under ``torch.no_grad`` (detached tensors: outputs and gradients are never changed) and keeps them on the device. At
the optimizer step the monitor hands them, with the effective kernels before and after the step, to a
:class:`StepStats`: each rank's moments are merged across ranks in one collective
(:class:`~normlab.monitor.ranks.Reduction`; nothing on one process), every record key is computed once from the
merged moments by the functions of :mod:`normlab.monitor.stats`, and all of them are read back to the host in ONE
transfer, as the keys of :mod:`normlab.monitor.records` (:class:`~normlab.monitor.records.ActivationStats`,
:class:`~normlab.monitor.records.WeightStats`, :class:`~normlab.monitor.records.UpdateStats`). The same route serves
one process, DDP and FSDP2: only the merge differs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from normlab.monitor import stats
from normlab.monitor.layers import input_channel_dims
from normlab.monitor.ranks import Ranks, Reduction, is_dtensor, local_rows, owned_square_sum
from normlab.monitor.records import layer_keys

__all__ = [
    "ActivationMoments",
    "activation_moments",
    "StepStats",
    "activation_stats",
    "weight_stats",
    "grad_norm",
    "grad_norm_tensor",
    "read_back",
]


def grad_norm_tensor(model: nn.Module) -> Tensor | None:
    """Euclidean norm of every parameter gradient of ``model`` as a scalar tensor, not read back (None: no
    gradient). Sharded gradients (DTensors: FSDP2) count each entry once over all ranks, summed in one
    ``all_reduce`` (:func:`~normlab.monitor.ranks.owned_square_sum`)."""
    norms, squares = [], []
    for p in model.parameters():
        if p.grad is not None:
            if is_dtensor(p.grad):
                squares.append(owned_square_sum(p.grad))
            else:
                norms.append(p.grad.detach().float().norm())
    if not squares:
        return torch.stack(norms).norm() if norms else None
    total = torch.stack(squares).sum().double()
    dist.all_reduce(total)
    if norms:
        total = total + torch.stack(norms).norm().double().square()
    return total.sqrt()


def grad_norm(model: nn.Module) -> float:
    """Euclidean norm of every parameter gradient of ``model`` (one read-back; 0.0 without gradients)."""
    norm = grad_norm_tensor(model)
    return 0.0 if norm is None else float(norm)


def read_back(values: list) -> list[float]:
    """Scalar tensors (and Python numbers, passed through) as Python floats in ONE read-back: the tensors stacked,
    then widened to float64 once (the same values as widening each one first: float32 -> float64 is exact).

    Example:
        >>> read_back([torch.tensor(0.5), 2, torch.tensor(0.25, dtype=torch.float64)])
        [0.5, 2.0, 0.25]
    """
    tensors = [v for v in values if isinstance(v, Tensor)]
    if not tensors:
        return [float(v) for v in values]
    if all(t.dtype == tensors[0].dtype for t in tensors):
        read = iter(torch.stack(tensors).double().tolist())
    else:
        read = iter(torch.stack([t.double() for t in tensors]).tolist())
    return [next(read) if isinstance(v, Tensor) else float(v) for v in values]


# The record keys each part fills, in the order of its values (checked against normlab.monitor.records).
_INPUT_KEYS = layer_keys("input_mean_sq", "input_sq", "input_var", "input_ratio")
_CHANNEL_KEYS = (*layer_keys("input_ratio_ch_mean", "input_ratio_ch_min", "input_ratio_ch_max"), "input_dead_channels")
_WEIGHT_KEYS = layer_keys(
    "weight_var",
    "weight_var_min",
    "weight_var_max",
    "weight_sq_mean",
    "weight_norm",
    "shift",
    "shift_scale_free",
    "constant_filters",
)
_UPDATE_KEYS = layer_keys(
    "update_ratio_mean",
    "update_ratio_min",
    "update_ratio_max",
    "mean_update_mean",
    "mean_update_std",
    "mean_update_absmax",
)


class ActivationMoments(NamedTuple):
    """One rank's moments of a layer's recorded forward, each ``(count, *moments)`` or None (no entries).

    Attributes:
        output: ``(numel, mean, M2)`` of the output (:func:`~normlab.monitor.stats.output_moments`).
        input: ``(numel, E[X], E[X^2])`` of the input over all its entries.
        channels: ``(entries per channel, E_c[X], E_c[X^2])`` over the input's channel dims
            (:func:`~normlab.monitor.layers.input_channel_dims`), two (C,) tensors.
    """

    output: tuple[int, Tensor, Tensor] | None
    input: tuple[int, Tensor, Tensor] | None
    channels: tuple[int, Tensor, Tensor] | None


def activation_moments(module: nn.Module, kind: str, args, output) -> ActivationMoments:
    """The moments of one forward of ``module`` on this rank's batch, on the device (nothing read back).

    Example:
        >>> conv = nn.Conv1d(2, 3, 1)
        >>> moments = activation_moments(conv, "conv", (torch.ones(4, 2, 5),), conv(torch.ones(4, 2, 5)))
        >>> moments.output[0], moments.input[0], moments.channels[0]
        (60, 40, 20)
    """
    out = None
    if isinstance(output, Tensor) and output.numel() > 0:
        out = (output.numel(), *stats.output_moments(output))
    x = args[0] if args and isinstance(args[0], Tensor) else None
    if x is None or x.numel() == 0 or not x.is_floating_point():
        return ActivationMoments(out, None, None)
    xf = x.detach() if x.dtype in (torch.float32, torch.float64) else x.detach().float()
    dims = input_channel_dims(module, kind, x)
    if dims is None:
        return ActivationMoments(out, (x.numel(), xf.mean(), xf.square().mean()), None)
    # the global moments from the per-channel ones (every channel has as many entries)
    ch_mean, ch_sq = stats.channel_moments(xf, dims)
    channels = (x.numel() // ch_mean.numel(), ch_mean, ch_sq)
    return ActivationMoments(out, (x.numel(), ch_mean.mean(), ch_sq.mean()), channels)


class StepStats:
    """The record keys of one step for every watched layer: each rank's moments and per-filter values, merged across
    ``ranks`` in one collective, the keys computed once from the merged values, read back in ONE transfer.

    Every rank adds the same layers in the same order (a layer that did not run on a rank is added with None);
    :meth:`finish` then returns the same records on every rank.

    Args:
        ranks: the ranks to merge over (:class:`~normlab.monitor.ranks.Ranks`; default: this process alone).
        device: where the merge happens when nothing was measured on this rank.

    Example:
        >>> fc = nn.Linear(3, 2)
        >>> step = StepStats()
        >>> step.add_weights("fc", fc.weight.detach(), None)
        >>> records, updates, scalars = step.finish()
        >>> records["fc"]["fan_in"], records["fc"]["out_channels"], updates
        (3, 2, {})
    """

    def __init__(self, ranks: Ranks | None = None, device: torch.device | str | None = None) -> None:
        self.ranks = Ranks() if ranks is None else ranks
        self._red = Reduction(self.ranks, device)
        self._acts: dict[str, tuple] = {}
        self._weights: dict[str, tuple] = {}
        self._scalars: dict[str, tuple] = {}

    def add_output(self, name: str, output: tuple[int, Tensor, Tensor] | None) -> None:
        """The output moments alone (a light step's ``output_var``)."""
        self._acts[name] = (self._red.moments(output), None, None)

    def add_activation(self, name: str, moments: ActivationMoments | None, channels: int | None = None) -> None:
        """A layer's :class:`ActivationMoments` on this rank (None: it did not run here); ``channels``: its input's
        channel count, the same on every rank (None: this rank's input gives it)."""
        m = moments if moments is not None else ActivationMoments(None, None, None)
        if channels is None:
            channels = m.channels[1].numel() if m.channels is not None else 0
        inp = None if m.input is None else (m.input[0], torch.stack(m.input[1:]))
        ch = None if m.channels is None else (m.channels[0], torch.cat(m.channels[1:]))
        red = self._red
        self._acts[name] = (red.moments(m.output), red.weighted(inp, 2), red.weighted(ch, 2 * channels))

    def add_weights(self, name: str, before: Tensor, after: Tensor | None) -> None:
        """A layer's kernels with output filters on dim 0 (:func:`~normlab.monitor.filter_kernel`), before the step
        and after it (None: no step); a DTensor (FSDP2) contributes its local filters."""
        rows, offset = local_rows(before, self.ranks)
        total = before.shape[0]
        mean, var = stats.filter_moments(rows)
        handles = [self._red.rows(var, offset, total), self._red.rows(mean, offset, total)]
        if after is not None:
            rows_after, _ = local_rows(after, self.ranks)
            update = stats.filter_mean_update(rows, rows_after)
            after_var = stats.filter_moments(rows_after)[1]
            handles += [self._red.rows(after_var, offset, total), self._red.rows(update, offset, total)]
        self._weights[name] = (stats.fan_in(before), total, handles)

    def add_mean(self, key: str, value: Tensor | float | None) -> None:
        """A scalar to average over the ranks that give one (None: not given here), e.g. each rank's loss."""
        part = None if value is None else (1, torch.as_tensor(value, dtype=torch.float64).detach().reshape(1))
        self._scalars[key] = (self._red.weighted(part, 1),)

    def finish(self) -> tuple[dict[str, dict], dict[str, Tensor], dict[str, float]]:
        """Merge (one collective) and read back (one transfer): ``({layer: record keys}, {layer: per-filter mean
        updates (N_l,), on the device}, {key: mean over ranks of add_mean's values})``."""
        self._red.run()
        keys: list[tuple[str | None, str]] = []  # (layer or None for a scalar, key)
        values: list = []
        for name, handles in self._acts.items():
            for key, value in self._activation_values(*handles):
                keys.append((name, key))
                values.append(value)
        updates = {}
        for name, (fan_in, _total, handles) in self._weights.items():
            var, mean, *after = (self._red.get(h) for h in handles)
            summaries = [stats.weight_summary(mean, var, fan_in)]
            if after:
                summaries.append(stats.update_summary(var, after[0], after[1]))
                updates[name] = after[1]
            names = _WEIGHT_KEYS + (_UPDATE_KEYS if after else ())
            keys += [(name, k) for k in names]
            values += list(torch.cat(summaries).unbind())
        for key, (handle,) in self._scalars.items():
            mean, count = self._red.get(handle)
            keys += [(None, key), (None, "_n_" + key)]
            values += [mean if mean is None else mean.reshape(()), count]
        read = read_back([v for v in values if v is not None])
        return self._assemble(keys, values, read, updates)

    def _activation_values(self, out_h: int, in_h: int | None, ch_h: int | None) -> list[tuple[str, object]]:
        """(key, value) of a layer's activation keys, with the merged counts as ``_n_*`` keys."""
        count, _mean, m2 = self._red.get(out_h)
        pairs = [("_n_out", count)] + ([("output_var", m2 / count)] if m2 is not None else [])
        if in_h is None:
            return pairs
        moments, count = self._red.get(in_h)
        pairs.append(("_n_in", count))
        if moments is not None:
            m2_in, sq = moments[0].square(), moments[1]
            pairs += zip(_INPUT_KEYS, [m2_in, sq, sq - m2_in, m2_in / sq])
        moments, count = self._red.get(ch_h)
        pairs.append(("_n_ch", count))
        if moments is not None:
            half = moments.numel() // 2
            summary = stats.moments_ratio_summary(moments[:half], moments[half:]).unbind()
            pairs += zip((*_CHANNEL_KEYS, "input_channels"), summary)
        return pairs

    def _assemble(self, keys, values, read, updates) -> tuple[dict[str, dict], dict[str, Tensor], dict[str, float]]:
        """The records from the values read back: keys of quantities with no entries on any rank left out."""
        read_iter = iter(read)
        out: dict[str, dict] = {name: {} for name in (*self._acts, *self._weights)}
        scalars: dict[str, float] = {}
        for (name, key), value in zip(keys, values):
            if value is not None:
                (scalars if name is None else out[name])[key] = next(read_iter)
        for key in list(self._scalars):
            if scalars.pop("_n_" + key) == 0:
                scalars.pop(key, None)
        for name, rec in out.items():
            _drop_absent(rec)
            if name in self._weights:
                fan_in, total, _ = self._weights[name]
                rec.update(fan_in=fan_in, out_channels=total, constant_filters=int(rec["constant_filters"]))
                if rec["constant_filters"] == total:
                    for k in _UPDATE_KEYS[:3]:
                        rec.pop(k, None)
        return out, updates, scalars


def _drop_absent(rec: dict) -> None:
    """Leave out what no rank measured and what is undefined: the input ratio of an all-zero input, the per-channel
    ratios when every channel is dead."""
    if rec.pop("_n_out", 1) == 0:
        rec.pop("output_var", None)
    if rec.pop("_n_in", 1) == 0:
        for k in _INPUT_KEYS:
            rec.pop(k, None)
    elif rec.get("input_sq") == 0.0:
        del rec["input_ratio"]
    no_channels = rec.pop("_n_ch", 1) == 0
    channels = rec.pop("input_channels", None)
    if no_channels:
        for k in _CHANNEL_KEYS:
            rec.pop(k, None)
    elif channels is not None:
        rec["input_dead_channels"] = int(rec["input_dead_channels"])
        if rec["input_dead_channels"] == int(channels):
            for k in _CHANNEL_KEYS[:3]:
                del rec[k]


def activation_stats(module: nn.Module, kind: str, args, output) -> dict:
    """Output variance and input moments of one forward of ``module`` on this process: the keys of
    :class:`~normlab.monitor.records.ActivationStats` (:func:`activation_moments` then :class:`StepStats`).

    One read-back to the host. Undefined quantities are left out: the input ratio of an all-zero input, the
    per-channel ratios when every channel is dead.

    Example:
        >>> conv = nn.Conv1d(2, 3, 1)
        >>> x = torch.zeros(4, 2, 5)
        >>> x[:, 0] = 1.0                                    # channel 1 is dead (all zero)
        >>> out = activation_stats(conv, "conv", (x,), conv(x))
        >>> out["input_mean_sq"], out["input_ratio"], out["input_dead_channels"], out["input_ratio_ch_mean"]
        (0.25, 0.5, 1, 1.0)
    """
    step = StepStats()
    step.add_activation("", activation_moments(module, kind, args, output))
    return step.finish()[0][""]


@torch.no_grad()
def weight_stats(w: Tensor, after: Tensor | None = None) -> dict:
    """Weight-side statistics of the kernels ``w`` (output filters on dim 0) on this process; with ``after`` (the
    kernels after an optimizer step) the update statistics too (:class:`StepStats`).

    A constant filter (Var[W_o] = 0: a zero-initialized gain, skip-init) has no update ratio: it is left out of
    ``update_ratio_*`` and counted in ``constant_filters``; the keys are absent when every filter is constant.
    The keys are those of :class:`~normlab.monitor.records.WeightStats` and
    :class:`~normlab.monitor.records.UpdateStats` (``variance_term``/``shift_term`` come from
    :func:`~normlab.monitor.stats.variance_terms`).

    Example:
        >>> w = torch.tensor([[1.0, -1.0], [2.0, 2.0]])     # filter 1 is constant
        >>> out = weight_stats(w, w * 0.5)
        >>> out["fan_in"], out["out_channels"], out["constant_filters"], out["weight_var_max"], out["update_ratio_mean"]
        (2, 2, 1, 1.0, 0.25)
    """
    step = StepStats()
    step.add_weights("", w, after)
    return step.finish()[0][""]
