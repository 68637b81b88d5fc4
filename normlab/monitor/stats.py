"""Pure statistics of variance transmission (docs/design.md section 2, PWS paper section 3).

Notation for a conv/linear layer l with weight W of shape (N_l, C_in/groups, *k) (Linear: (N_l, n_l)):
filter o is the row ``W[o]``, ``n_l = fan_in = W[o].numel()``. Weights of other layouts (a transposed conv's
(C_in, C_out/groups, *k), transformers' Conv1D (in, out)) are first brought to this one by
:func:`normlab.monitor.filter_kernel`. All variances are biased (population) variances.

For i.i.d. input X (mean E[X], variance Var[X]) the output variance decomposes as::

    Var[Y] = n E[W^2] Var[X] + E^2[X] Var_o[n E[W_o]]

where E[W^2] is the second moment of all weight entries (it equals Var[W] when the entries have zero overall mean,
which is the paper's assumption). The second term is the "shift": it grows with the spread of the filter means.

Every function takes tensors and returns float32/float64 tensors (no Python floats), never changes its inputs and
never builds an autograd graph.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "fan_in",
    "filters",
    "filter_moments",
    "weight_variance",
    "shift_of_average",
    "shift_scale_free",
    "update_ratio",
    "filter_mean_update",
    "input_ratio",
    "channel_input_ratio",
    "live_channel_input_ratio",
    "channel_ratio_summary",
    "moments_ratio_summary",
    "masked_summary",
    "output_variance",
    "output_moments",
    "merge_moments",
    "weight_summary",
    "update_summary",
    "channel_moments",
    "channel_matrix",
    "variance_terms",
]


def _check_weight(weight: Tensor, fn: str) -> None:
    if not isinstance(weight, Tensor):
        raise TypeError(f"{fn}: expected a weight tensor, got {type(weight).__name__}")
    if weight.dim() < 2:
        raise ValueError(f"{fn}: expected a weight of shape (out, in, *kernel) with >= 2 dims, got {weight.dim()}D")


def _as_float(t: Tensor) -> Tensor:
    t = t.detach()
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def fan_in(weight: Tensor) -> int:
    """n_l = number of inputs of one filter: prod(weight.shape[1:]) (= C_in/groups * prod(kernel))."""
    _check_weight(weight, "fan_in")
    return math.prod(weight.shape[1:])


def filters(weight: Tensor) -> Tensor:
    """View the weight as filters: (N_l, n_l), detached, float32 (float64 kept). A weight with no filters (an empty
    shard of a sharded weight) gives (0, n_l)."""
    _check_weight(weight, "filters")
    return _as_float(weight).reshape(weight.shape[0], math.prod(weight.shape[1:]))


def filter_moments(weight: Tensor) -> tuple[Tensor, Tensor]:
    r"""Per-filter mean and biased variance of the weight, centered two-pass (the values of
    :func:`weight_variance`).

    .. math::
        m_o = \frac{1}{n_l} \sum_i W_{o,i}, \qquad
        \mathrm{Var}[W_o] = \frac{1}{n_l} \sum_i (W_{o,i} - m_o)^2

    Shape:
        weight (N_l, ...) -> two (N_l,) tensors (float32; float64 kept).

    Example:
        >>> mean, var = filter_moments(torch.tensor([[1.0, 3.0], [2.0, 2.0]]))
        >>> mean.tolist(), var.tolist()
        ([2.0, 2.0], [1.0, 0.0])
    """
    w = filters(weight)
    mean = w.mean(dim=1)
    d = w - mean[:, None]
    return mean, (d * d).sum(dim=1) / w.shape[1]


def weight_variance(weight: Tensor) -> Tensor:
    """Per-filter biased variance Var[W_o] (paper Fig. 2). weight (N_l, ...) -> (N_l,).

    Centered two-pass (``d = W_o - mean(W_o)``, ``sum(d * d) / n_l``): the value of ``var(dim=1, unbiased=False)``
    up to float rounding, ~5x faster on CPU (the monitor computes it twice per layer on each recorded step).
    """
    w = filters(weight)
    d = w - w.mean(dim=1, keepdim=True)
    return (d * d).sum(dim=1) / w.shape[1]


def shift_of_average(weight: Tensor) -> Tensor:
    """Shift of the average: Var_o[n_l * mean(W_o)], biased variance over output filters. Scalar tensor.

    This is the quantity the PWS authors log. It is 0 for a zero-mean-filter kernel (WS/PWS effective weight)
    and about n_l Var[W] for an i.i.d. random init.
    """
    w = filters(weight)
    n = w.shape[1]
    return (n * w.mean(dim=1)).var(unbiased=False)


def shift_scale_free(weight: Tensor) -> Tensor:
    """Scale-free shift: Var_o[n_l mean(W_o)] / (n_l Var[W]), Var[W] = biased variance of all entries.

    About 1 for an i.i.d. random init, 0 for zero-mean filters; grows when the filter means drift apart.
    Multiplied by E^2[X]/Var[X] it is the ratio of the shift term to the variance term of Var[Y].
    Returns 0 when Var[W] == 0 (all entries equal: no spread, nothing to compare).
    """
    w = filters(weight)
    n = w.shape[1]
    denom = n * _flat_variance(w)
    shift = (n * w.mean(dim=1)).var(unbiased=False)
    return torch.where(denom == 0, 0.0, shift / denom)


def update_ratio(before: Tensor, after: Tensor) -> Tensor:
    """Per-filter update ratio Var[W_o - dW_o] / Var[W_o] (paper Fig. 1a). (N_l, ...) x2 -> (N_l,).

    ``before`` is W before the optimizer step, ``after`` after it; with the paper's dW = W_before - W_after (for
    plain SGD dW = lr * grad), W_o - dW_o is W_after. Momentum and weight decay are therefore included.
    Filters with Var[W_o] == 0 give inf (or nan if they stay constant).
    """
    if before.shape != after.shape:
        raise ValueError(f"update_ratio: before {tuple(before.shape)} and after {tuple(after.shape)} differ in shape")
    return weight_variance(after) / weight_variance(before)


def filter_mean_update(before: Tensor, after: Tensor) -> Tensor:
    """Per-filter mean update mean(dW_o), dW = W_before - W_after (paper Fig. 1b). (N_l, ...) x2 -> (N_l,)."""
    if before.shape != after.shape:
        raise ValueError(
            f"filter_mean_update: before {tuple(before.shape)} and after {tuple(after.shape)} differ in shape"
        )
    return (filters(before) - filters(after)).mean(dim=1)


def input_ratio(x: Tensor) -> Tensor:
    """Global E^2[X] / E[X^2] over all entries of x (paper Fig. 6b); 1/pi for ReLU of N(0, 1). Scalar.

    Returns nan for an all-zero input.
    """
    x = _as_float(x)
    return x.mean().square() / x.square().mean()


def _channel_dims(channel_dim: int | Sequence[int], ndim: int, fn: str) -> tuple[int, ...]:
    dims = (channel_dim,) if isinstance(channel_dim, int) else tuple(channel_dim)
    if not dims or any(not -ndim <= d < ndim for d in dims):
        raise ValueError(f"{fn}: channel_dim must name dims of a {ndim}D input, got {channel_dim!r}")
    dims = tuple(d % ndim for d in dims)
    if len(set(dims)) != len(dims) or len(dims) == ndim:
        raise ValueError(
            f"{fn}: channel_dim must name distinct dims and leave one to average over, got {channel_dim!r}"
        )
    return dims


def channel_moments(x: Tensor, channel_dim: int | Sequence[int] = 1) -> tuple[Tensor, Tensor]:
    """Per-channel mean and E[X^2] over every other dim. x (N, C, *) -> two (C,) tensors (channel_dim=1).

    ``channel_dim`` may be several dims (a LayerNorm's normalized dims): their entries, flattened in that order, are
    the channels. x (B, T, C) with ``channel_dim=-1`` -> (C,) moments over the B*T positions.
    Reduced in place over the other dims (no permuted copy of ``x``, one squared copy).
    """
    x = _as_float(x)
    if x.dim() < 2:
        raise ValueError(f"channel_moments: expected an input with a batch and a channel dim, got {x.dim()}D")
    dims = _channel_dims(channel_dim, x.dim(), "channel_moments")
    rest = [d for d in range(x.dim()) if d not in dims]
    order = sorted(range(len(dims)), key=lambda i: dims[i])  # the reduced result keeps the channel dims ascending
    back = sorted(range(len(dims)), key=lambda i: order[i])

    def reduce(t: Tensor) -> Tensor:
        return t.mean(dim=rest).permute(*back).reshape(-1)

    return reduce(x), reduce(x.square())


def channel_matrix(x: Tensor, channel_dim: int | Sequence[int] = 1, fn: str = "channel_matrix") -> Tensor:
    """x as a (C, M) matrix: one row per channel (the entries of ``channel_dim``, flattened in order), its M values
    over every other dim in the columns. Detached, float32 (float64 kept)."""
    x = _as_float(x)
    if x.dim() < 2:
        raise ValueError(f"{fn}: expected an input with a batch and a channel dim, got {x.dim()}D")
    dims = _channel_dims(channel_dim, x.dim(), fn)
    rest = [d for d in range(x.dim()) if d not in dims]
    return x.permute(*dims, *rest).reshape(math.prod(x.shape[d] for d in dims), -1)


def channel_input_ratio(x: Tensor, channel_dim: int | Sequence[int] = 1) -> Tensor:
    """Per-channel E_c^2[X] / E_c[X^2] (moments over batch and spatial dims). (N, C, *) -> (C,).

    A dead channel (E_c[X^2] = 0: a dead ReLU, a dropped or pruned channel) has no ratio: nan there (0/0);
    :func:`live_channel_input_ratio` leaves such channels out.
    """
    mean, sq = channel_moments(x, channel_dim)
    return mean.square() / sq


def live_channel_input_ratio(x: Tensor, channel_dim: int | Sequence[int] = 1) -> tuple[Tensor, Tensor]:
    r"""Per-channel input ratio of the live channels, and the number of dead ones.

    .. math::
        r_c = \frac{E_c^2[X]}{E_c[X^2]} \quad \text{for every channel } c \text{ with } E_c[X^2] > 0

    A channel with E_c[X^2] = 0 is dead (all its entries are 0) and is excluded: it has no ratio.

    Args:
        x: input (N, C, *) or any shape with the channels on ``channel_dim``.
        channel_dim: the channel dim, or several dims (flattened in order) whose entries are the channels.

    Shape:
        x (N, C, *) -> ratios (C_live,), dead () (int64), C_live + dead = C.

    Example::

        >>> x = torch.tensor([[1.0, 0.0, 2.0], [3.0, 0.0, 2.0]])  # channel 1 is dead
        >>> ratio, dead = live_channel_input_ratio(x)
        >>> ratio, int(dead)
        (tensor([0.8000, 1.0000]), 1)
    """
    mean, sq = channel_moments(x, channel_dim)
    live = sq != 0
    return mean[live].square() / sq[live], (~live).sum()


def masked_summary(values: Tensor, keep: Tensor) -> Tensor:
    """(mean, min, max) of ``values[keep]`` as a (3,) tensor, nan when nothing is kept.

    Computed without reading values back to the host (no boolean indexing), so a monitor can stack many summaries
    and read them in one transfer. values, keep (K,) -> (3,).
    """
    n = keep.sum()
    avg = torch.where(keep, values, 0.0).sum() / n.clamp(min=1)
    low = torch.where(keep, values, math.inf).min()
    high = torch.where(keep, values, -math.inf).max()
    return torch.where(n > 0, torch.stack([avg, low, high]), math.nan)


def channel_ratio_summary(x: Tensor, channel_dim: int | Sequence[int] = 1) -> Tensor:
    """``[mean, min, max, dead, channels]``: the summary of :func:`live_channel_input_ratio` over the live channels,
    the number of dead channels (E_c[X^2] = 0) and of all channels. x (N, C, *) -> (5,).

    The first three are nan when every channel is dead; a non-finite input still gives non-finite values (a nan
    channel is not dead).
    """
    return moments_ratio_summary(*channel_moments(x, channel_dim))


def moments_ratio_summary(mean: Tensor, sq: Tensor) -> Tensor:
    """:func:`channel_ratio_summary` from the per-channel moments (:func:`channel_moments`): ``[mean, min, max,
    dead, channels]`` of ``E_c^2[X] / E_c[X^2]`` over the live channels (``E_c[X^2] > 0``). (C,) x2 -> (5,).

    Example:
        >>> moments_ratio_summary(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([2.0, 0.0, 4.0])).tolist()
        [0.75, 0.5, 1.0, 1.0, 3.0]
    """
    live = sq != 0
    r = mean.square() / torch.where(live, sq, 1.0)
    counts = torch.stack([(~live).sum().to(r.dtype), torch.full_like(r[0], r.numel())])
    return torch.cat([masked_summary(r, live), counts])


def output_variance(y: Tensor) -> Tensor:
    """Var[Y_l]: biased variance over all entries of the layer output. Scalar (nan for an empty tensor).

    Two passes, ``d = y - mean(y)`` then ``d . d / numel``: the same value as ``y.var(unbiased=False)`` up to
    float rounding (centered first, so a large mean does not cancel the variance away) and about 3x faster on CPU
    than torch's single-pass variance; the monitor computes it for every layer at every step
    (the countdown's light steps).
    """
    return _flat_variance(_as_float(y))


def output_moments(y: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and sum of squared deviations ``M2 = sum((y - mean)^2)`` over all entries of ``y``, the moments that
    :func:`merge_moments` merges across ranks: ``M2 / y.numel()`` is :func:`output_variance`. Two scalars (nan mean
    for an empty tensor)."""
    flat = _as_float(y).reshape(-1)
    mean = flat.mean()
    d = flat - mean
    return mean, d.dot(d)


def merge_moments(count: Tensor, mean: Tensor, m2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    r"""Merge ``(count, mean, M2)`` of disjoint parts (dim 0) into those of their union (Chan, Golub and LeVeque's
    pairwise update, what ``SyncBatchNorm`` does with each rank's statistics).

    .. math::
        N = \sum_r n_r, \qquad \bar y = \frac{1}{N}\sum_r n_r \bar y_r, \qquad
        M_2 = \sum_r \left(M_{2,r} + n_r (\bar y_r - \bar y)^2\right)

    and the biased variance of the union is ``M2 / N``. A part with ``n_r = 0`` (its mean and M2 given as 0) adds
    nothing; a single part is returned unchanged.

    Shape:
        count, mean, m2 (R, *) -> three (*) tensors.

    Example:
        >>> a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0, 7.0])
        >>> n, m, m2 = merge_moments(torch.tensor([2.0, 3.0]), torch.stack([a.mean(), b.mean()]),
        ...                          torch.stack([(a - a.mean()).square().sum(), (b - b.mean()).square().sum()]))
        >>> round(float(m2 / n), 5), round(float(torch.cat([a, b]).var(unbiased=False)), 5)
        (4.64, 4.64)
    """
    if count.shape[0] == 1:
        return count[0], mean[0], m2[0]
    total = count.sum(dim=0)
    merged = (count * mean).sum(dim=0) / total
    return total, merged, (m2 + count * (mean - merged).square()).sum(dim=0)


def weight_summary(filter_mean: Tensor, filter_var: Tensor, fan_in: int) -> Tensor:
    r"""The weight statistics of a monitor record from the per-filter moments (:func:`filter_moments`) of all N_l
    filters: ``[weight_var, weight_var_min, weight_var_max, weight_sq_mean, weight_norm, shift, shift_scale_free,
    constant_filters]``.

    With ``n = fan_in``, ``m_o`` the filter means and ``v_o = Var[W_o]`` (every filter has n entries)::

        weight_var = mean_o v_o          E[W^2] = mean_o (v_o + m_o^2)       ||W|| = sqrt(N_l n E[W^2])
        shift = Var_o[n m_o]             Var[W] = mean_o v_o + Var_o[m_o]    shift_scale_free = shift / (n Var[W])

    (``shift_scale_free`` is 0 when ``Var[W] = 0``), the values of :func:`shift_of_average`,
    :func:`shift_scale_free` and the moments over all entries up to float rounding; ``constant_filters`` counts the
    filters with ``v_o = 0``.

    Shape:
        filter_mean, filter_var (N_l,) -> (8,).

    Example:
        >>> w = torch.tensor([[1.0, -1.0], [2.0, 2.0]])
        >>> weight_summary(*filter_moments(w), fan_in=2).tolist()
        [0.5, 0.0, 1.0, 2.5, 3.1622776985168457, 4.0, 1.3333333730697632, 1.0]
    """
    low, high = torch.aminmax(filter_var)
    var_mean = filter_var.mean()
    sq_mean = (filter_var + filter_mean.square()).mean()
    shift = (fan_in * filter_mean).var(unbiased=False)
    denom = fan_in * (var_mean + filter_mean.var(unbiased=False))
    return torch.stack(
        [
            var_mean,
            low,
            high,
            sq_mean,
            (sq_mean * (filter_var.numel() * fan_in)).sqrt(),
            shift,
            torch.where(denom == 0, 0.0, shift / denom),
            (filter_var == 0).sum().to(filter_var.dtype),
        ]
    )


def update_summary(filter_var: Tensor, after_var: Tensor, mean_update: Tensor) -> Tensor:
    """The update statistics of a monitor record: ``[update_ratio_mean, _min, _max, mean_update_mean,
    mean_update_std, mean_update_absmax]`` from the per-filter variances before and after the step and the
    per-filter mean updates (:func:`filter_mean_update`).

    The update ratio ``Var[W_o - dW_o] / Var[W_o]`` (:func:`update_ratio`) is summarized over the filters with
    ``Var[W_o] != 0`` (:func:`masked_summary`: nan when every filter is constant; a nan filter is kept).

    Shape:
        filter_var, after_var, mean_update (N_l,) -> (6,).

    Example:
        >>> update_summary(torch.tensor([1.0, 0.0]), torch.tensor([0.25, 0.0]), torch.zeros(2)).tolist()
        [0.25, 0.25, 0.25, 0.0, 0.0, 0.0]
    """
    varies = filter_var != 0
    ratio = after_var / torch.where(varies, filter_var, 1.0)
    return torch.cat(
        [
            masked_summary(ratio, varies),
            torch.stack([mean_update.mean(), mean_update.std(unbiased=False), mean_update.abs().max()]),
        ]
    )


def _flat_variance(x: Tensor) -> Tensor:
    """Biased variance over all entries of a float tensor, centered two-pass (see :func:`output_variance`)."""
    flat = x.reshape(-1)
    d = flat - flat.mean()
    return d.dot(d) / flat.numel()


def variance_terms(record: dict) -> dict:
    """The two terms of ``Var[Y] = n E[W^2] Var[X] + E^2[X] Var_o[n E[W_o]]`` from one monitor record.

    ``variance_term = fan_in * weight_sq_mean * input_var`` and ``shift_term = input_mean_sq * shift``; empty when the
    record lacks a quantity (e.g. the layer did not run in the recorded forward). The decomposition assumes i.i.d.
    inputs; with zero padding and correlated activations it is an approximation (``docs/design.md`` section 2).
    """
    need = ("fan_in", "weight_sq_mean", "input_var", "input_mean_sq", "shift")
    if any(record.get(k) is None for k in need):
        return {}
    return {
        "variance_term": record["fan_in"] * record["weight_sq_mean"] * record["input_var"],
        "shift_term": record["input_mean_sq"] * record["shift"],
    }
