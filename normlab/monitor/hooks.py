"""What the monitor's hooks compute: the statistics of one recorded forward and of one optimizer step.

:class:`~normlab.monitor.VarianceMonitor` (:mod:`normlab.monitor.monitor`) attaches a forward hook to every watched
layer while a recording step is pending; the hook calls :func:`activation_stats` on the layer's input and output under
``torch.no_grad`` (detached tensors: outputs and gradients are never changed). At the optimizer step the monitor calls
:func:`weight_stats` on the effective kernels before and after the step. Both return one read-back to the host,
as the keys of :mod:`normlab.monitor.records` (:class:`~normlab.monitor.records.ActivationStats`,
:class:`~normlab.monitor.records.WeightStats`, :class:`~normlab.monitor.records.UpdateStats`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from normlab.monitor import stats
from normlab.monitor.layers import input_channel_dims
from normlab.monitor.records import layer_keys

__all__ = ["activation_stats", "weight_stats", "param_versions", "grad_norm", "grad_norm_tensor", "read_light"]


def grad_norm_tensor(model: nn.Module) -> Tensor | None:
    """Euclidean norm of every parameter gradient of ``model`` as a scalar tensor, not read back (None: no
    gradient)."""
    norms = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
    return torch.stack(norms).norm() if norms else None


def grad_norm(model: nn.Module) -> float:
    """Euclidean norm of every parameter gradient of ``model`` (one read-back; 0.0 without gradients)."""
    norm = grad_norm_tensor(model)
    return 0.0 if norm is None else float(norm)


def _read_back(values: list[Tensor]) -> list[float]:
    """Scalar tensors as Python floats in ONE read-back: stacked, then widened to float64 once (the same values as
    widening each one first: float32 -> float64 is exact)."""
    if all(v.dtype == values[0].dtype for v in values):
        return torch.stack(values).double().tolist()
    return torch.stack([v.double() for v in values]).tolist()


def read_light(output_vars: dict[str, Tensor], grad: Tensor | None) -> tuple[dict[str, float], float | None]:
    """The values of the monitor's light (per-step) path in ONE read-back to the host.

    Args:
        output_vars: {layer: ``Var[Y_l]``} as scalar tensors (:func:`~normlab.monitor.stats.output_variance`, the
            same function as the full record's ``output_var``).
        grad: the gradient norm as a scalar tensor (:func:`grad_norm_tensor`), or None.

    Returns:
        ``({layer: output_var}, grad_norm or None)`` as Python floats.

    Example:
        >>> read_light({"c1": torch.tensor(2.0)}, torch.tensor(0.5))
        ({'c1': 2.0}, 0.5)
    """
    values = [v.detach() for v in output_vars.values()]
    if grad is not None:
        values.append(grad.detach())
    if not values:
        return {}, None
    out = _read_back(values)
    norm = out.pop() if grad is not None else None
    return dict(zip(output_vars, out)), norm


# The record keys each function fills, in the order of its values (checked against normlab.monitor.records).
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


def _input_stats(module: nn.Module, kind: str, x: Tensor) -> tuple[list[str], list[Tensor]]:
    """Moments of a layer's input: global ones, and per channel over :func:`input_channel_dims` (live channels)."""
    xf = x.detach().float() if x.dtype != torch.float64 else x.detach()
    dims = input_channel_dims(module, kind, x)
    if dims is not None:  # the global moments from the per-channel ones (every channel has as many entries)
        ch_mean, ch_sq = stats.channel_moments(xf, dims)
        m, sq = ch_mean.mean(), ch_sq.mean()
    else:
        m, sq = xf.mean(), xf.square().mean()
    names = list(_INPUT_KEYS)
    m2 = m.square()
    values = [m2, sq, sq - m2, m2 / sq]
    if dims is not None:
        names += [*_CHANNEL_KEYS, "input_channels"]
        values += list(stats.moments_ratio_summary(ch_mean, ch_sq).unbind())
    return names, values


def activation_stats(module: nn.Module, kind: str, args, output) -> dict:
    """Output variance and input moments of one recorded forward of ``module``: the keys of
    :class:`~normlab.monitor.records.ActivationStats`.

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
    names, values = [], []
    if isinstance(output, Tensor) and output.numel() > 0:
        names.append("output_var")
        values.append(stats.output_variance(output))
    x = args[0] if args and isinstance(args[0], Tensor) else None
    if x is not None and x.numel() > 0 and x.is_floating_point():
        more = _input_stats(module, kind, x)
        names += more[0]
        values += more[1]
    if not values:
        return {}
    out = dict(zip(names, _read_back(values)))
    if out.get("input_sq") == 0.0:
        del out["input_ratio"]
    if "input_channels" in out:
        channels = int(out.pop("input_channels"))
        out["input_dead_channels"] = int(out["input_dead_channels"])
        if out["input_dead_channels"] == channels:
            for k in _CHANNEL_KEYS[:3]:
                del out[k]
    return out


def param_versions(module: nn.Module) -> tuple[int, ...]:
    """The version counters of ``module``'s parameters (an in-place update, e.g. an optimizer step, bumps them)."""
    return tuple(p._version for p in module.parameters())


@torch.no_grad()
def weight_stats(w: Tensor, after: Tensor | None, mu: Tensor | None) -> dict:
    """Weight-side statistics of the kernels ``w`` (output filters on dim 0) before the step; with ``after``
    (the kernels after it) and ``mu`` (their per-filter mean update), the update statistics too.

    A constant filter (Var[W_o] = 0: a zero-initialized gain, skip-init) has no update ratio: it is left out of
    ``update_ratio_*`` and counted in ``constant_filters``; the keys are absent when every filter is constant.
    The keys are those of :class:`~normlab.monitor.records.WeightStats` and
    :class:`~normlab.monitor.records.UpdateStats` (``variance_term``/``shift_term`` come from
    :func:`~normlab.monitor.stats.variance_terms`).

    Example:
        >>> w = torch.tensor([[1.0, -1.0], [2.0, 2.0]])     # filter 1 is constant
        >>> out = weight_stats(w, w * 0.5, torch.zeros(2))
        >>> out["fan_in"], out["out_channels"], out["constant_filters"], out["weight_var_max"], out["update_ratio_mean"]
        (2, 2, 1, 1.0, 0.25)
    """
    wf = stats.filters(w)
    names = list(_WEIGHT_KEYS)
    # the values of stats.weight_variance, shift_of_average and shift_scale_free, the filter means computed once
    n = wf.shape[1]
    filter_mean = wf.mean(dim=1)
    d = wf - filter_mean[:, None]
    vo = (d * d).sum(dim=1) / n
    shift = (n * filter_mean).var(unbiased=False)
    denom = n * stats.output_variance(wf)  # Var[W] of all entries, as shift_scale_free computes it
    low, high = torch.aminmax(vo)
    values = [
        vo.mean(),
        low,
        high,
        wf.square().mean(),
        wf.norm(),
        shift,
        torch.where(denom == 0, torch.zeros_like(shift), shift / denom),
        (vo == 0).sum().to(vo.dtype),
    ]
    if after is not None:
        varies = vo != 0  # a nan filter is kept: a non-finite kernel must show in the record
        ratio = stats.weight_variance(after) / torch.where(varies, vo, torch.ones_like(vo))
        names += _UPDATE_KEYS
        values += [*stats.masked_summary(ratio, varies).unbind(), mu.mean(), mu.std(unbiased=False), mu.abs().max()]
    out = {"fan_in": wf.shape[1], "out_channels": wf.shape[0]}
    out.update(zip(names, _read_back(values)))
    out["constant_filters"] = int(out["constant_filters"])
    if out["constant_filters"] == wf.shape[0]:
        for k in _UPDATE_KEYS[:3]:
            out.pop(k, None)
    return out
