"""Pure tensor functions behind the normlab layers (the ``torch.nn.functional`` of normlab).

Every function here is stateless except where it takes running-statistics buffers explicitly and updates
them in place (as ``torch.nn.functional.batch_norm`` does). Each docstring states the formula it implements;
``docs/design.md`` gives the sources.

Shapes use N = batch, C = channels, ``*`` = any number of spatial dimensions.

``torch.fx.symbolic_trace`` records :func:`instance_norm`, :func:`switchable_norm`, :func:`standardize_weight` and
:func:`pws_weight` as one node each (``torch.fx.wrap``): their input checks read shapes, which a Proxy does not have.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ._dispatch import as_param, centered_moments, clip, param_dtype, plain_eager, snapshot, static_numel, stats_dtype
from ._functions import (
    batchnorm_step,
    fused_batch_renorm,
    is_identity,
    momentum_update,
    switchable_forward,
    takes_fused,
)

__all__ = [
    "moments",
    "instance_norm",
    "batch_moments",
    "renorm_correction",
    "batch_renorm_train",
    "batch_renorm",
    "switchable_norm",
    "standardize_weight",
    "pws_weight",
    "squash",
]


def _normalize_dims(dims: int | Sequence[int], ndim: int, where: str) -> tuple[int, ...]:
    if isinstance(dims, int):
        dims = (dims,)
    out = []
    for d in dims:
        if not isinstance(d, int) or not -ndim <= d < ndim:
            raise ValueError(f"{where}: dims must be integers in [-{ndim}, {ndim - 1}] for a {ndim}D input, got {dims}")
        out.append(d % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{where}: dims must not repeat, got {tuple(dims)}")
    return tuple(out)


# --------------------------------------------------------------------------------------------------
# Moments
# --------------------------------------------------------------------------------------------------
def moments(x: Tensor, dims: int | Sequence[int], keepdim: bool = False, correction: int = 0) -> tuple[Tensor, Tensor]:
    """Mean and variance of ``x`` over ``dims``, like ``tf.nn.moments`` (note the (mean, var) order).

    ``mean = E[x]``; ``var = sum((x - stop_grad(mean))^2) / (count - correction)``.
    The detached mean changes no gradient (d var / d mean is zero at the true mean) and keeps the sum well
    conditioned; a term ``(mean - stop_grad(mean))^2``, zero in value and in first derivative, is subtracted so
    that second derivatives (double backward) are exact too.
    ``correction=0`` is the biased (population) variance, ``correction=1`` the unbiased one.

    Precision: float16/bfloat16 inputs are reduced in float32 and **both results are returned in float32**, so a
    variance above the float16 maximum (65504, reached by values around 300) stays finite. Other dtypes are kept.

    Args:
        x: tensor of any shape.
        dims: dimension or dimensions to reduce.
        keepdim: keep the reduced dimensions with size 1.
        correction: subtracted from the number of reduced elements in the variance's denominator.

    Returns:
        ``(mean, var)``, each of ``x``'s shape without ``dims`` (or with size-1 ``dims`` if ``keepdim``).

    Example:
        >>> x = torch.full((16,), 300.0, dtype=torch.float16) * torch.tensor([1.0, -1.0]).repeat(8).half()
        >>> mean, var = moments(x, 0)
        >>> var.item(), var.dtype          # the float16 variance would overflow (65504)
        (90000.0, torch.float32)
    """
    dims = _normalize_dims(dims, x.dim(), "moments")
    count = math.prod([static_numel(x, d, d + 1) for d in dims])
    if count - correction <= 0:
        raise ValueError(f"moments: need more than correction={correction} elements over dims {dims}, got {count}")
    mean, var = centered_moments(stats_dtype(x), dims, count, correction)
    if not keepdim:
        mean, var = mean.squeeze(dims), var.squeeze(dims)
    return mean, var


# --------------------------------------------------------------------------------------------------
# Instance normalization
# --------------------------------------------------------------------------------------------------
@torch.fx.wrap
def instance_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """Per-sample, per-channel normalization over the spatial dimensions.

    ``y[n, c] = (x[n, c] - mean_nc) / sqrt(var_nc + eps) * weight[c] + bias[c]`` with the biased variance.
    Statistics are computed in float32 for half inputs; the output has ``x``'s dtype and memory format
    (channels_last is kept, unlike torch's CPU instance norm).

    Args:
        x: the input (N, C, *).
        weight: the per-channel scale (C,). Default: None (1).
        bias: the per-channel shift (C,). Default: None (0).
        eps: added to the variance inside the square root. Default: 1e-5.

    Shape:
        x (N, C, *) with at least one spatial dimension; weight, bias (C,) or None; output: x's shape.

    Example:
        >>> y = instance_norm(torch.randn(2, 3, 8, 8) * 5 + 1)
        >>> y.mean((2, 3)).abs().max() < 1e-5
        tensor(True)
    """
    if x.dim() < 3:
        raise ValueError(f"instance_norm: expected input (N, C, *spatial) with >= 3 dims, got {x.dim()}D")
    dims = tuple(range(2, x.dim()))
    mean, var = moments(x, dims, keepdim=True)
    y = (stats_dtype(x) - mean) * torch.rsqrt(var + eps)
    if weight is not None or bias is not None:
        shape = (1, -1) + (1,) * len(dims)
        if weight is not None:
            y = y * weight.reshape(shape).to(y.dtype)
        if bias is not None:
            y = y + bias.reshape(shape).to(y.dtype)
    return y.to(x.dtype)


# --------------------------------------------------------------------------------------------------
# Batch renormalization
# --------------------------------------------------------------------------------------------------
def batch_moments(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-channel batch mean and biased variance of ``x`` (N, C, *) over all dims but 1, without gradient.

    Uses the statistics kernel behind BatchNorm (one fused pass, any memory format), which is several times faster
    on CPU than a generic reduction; under torch.compile, torch.jit.trace and torch.func transforms (that kernel has
    no fake-tensor implementation nor batching rule) ``torch.var_mean`` over the same dims with ``keepdim=True``: the
    exact call of BatchNorm's decomposition, so that when the step then calls ``torch.batch_norm`` on the same input
    the compiler computes the statistics once (the common-subexpression pass merges the two nodes; a different
    expression of the same statistics would cost one more pass over the input). Half inputs are reduced in float32;
    results are float32 (or float64) (C,).

    Args:
        x: the input (N, C, *).

    Returns:
        ``(mean, var)``, each (C,).

    Example:
        >>> mean, var = batch_moments(torch.tensor([[1.0, 10.0], [3.0, 30.0]]))
        >>> mean, var
        (tensor([ 2., 20.]), tensor([  1., 100.]))
    """
    with torch.no_grad():
        xs = stats_dtype(x.detach())
        if plain_eager(x):
            return torch.batch_norm_update_stats(xs, None, None, 0.0)
        var, mean = torch.var_mean(xs, [0] + list(range(2, x.dim())), correction=0, keepdim=True)
        return mean.flatten(), var.flatten()


def renorm_correction(
    batch_mean: Tensor,
    batch_var: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    eps: float,
    rmax: float | Tensor,
    dmax: float | Tensor,
) -> tuple[Tensor, Tensor]:
    """The Batch Renormalization corrections r and d (Ioffe 2017), without gradient.

    ``sigma_B = sqrt(batch_var + eps)``, ``sigma = sqrt(running_var + eps)``,
    ``r = clip(sigma_B / sigma, 1/rmax, rmax)``, ``d = clip((batch_mean - running_mean) / sigma, -dmax, dmax)``.
    ``batch_var`` is the biased batch variance. All inputs are (C,); results are float32 (or float64) (C,).
    ``rmax``/``dmax`` may be Python numbers or scalar tensors (a schedule evaluated on a step tensor).

    Args:
        batch_mean: the batch mean (C,).
        batch_var: the biased batch variance (C,).
        running_mean: the running mean (C,), before this batch updates it.
        running_var: the running variance (C,), before this batch updates it.
        eps: added to both variances inside the square roots.
        rmax: the limit of r (>= 1).
        dmax: the limit of d (>= 0).

    Returns:
        ``(r, d)``, each (C,).

    Example:
        >>> r, d = renorm_correction(torch.tensor([2.0]), torch.tensor([16.0]), torch.zeros(1), torch.ones(1),
        ...                          eps=0.0, rmax=3.0, dmax=5.0)
        >>> r, d          # sigma_B / sigma = 4 is clipped to 3; (mu_B - mu) / sigma = 2 is within 5
        (tensor([3.]), tensor([2.]))
    """
    with torch.no_grad():
        dtype = torch.promote_types(batch_mean.dtype, torch.float32)
        inv_sigma = torch.rsqrt(running_var.to(dtype) + eps)
        r = torch.sqrt(batch_var.detach().to(dtype) + eps).mul_(inv_sigma)
        d = torch.sub(batch_mean.detach().to(dtype), running_mean.to(dtype)).mul_(inv_sigma)
        return clip(r, rmax, inverse=True, in_place=False), clip(d, dmax, inverse=False, in_place=False)


def _composite_batch_renorm(x, running_mean, running_var, weight, bias, momentum, eps, rmax, dmax):
    """:func:`batch_renorm_train` from public ops: statistics, r and d from a snapshot of the running statistics,
    BatchNorm's training call with batch statistics and the folded affine, the new running statistics computed out of
    place. torch.compile, torch.export, torch.jit.trace, torch.func and forward-mode AD trace this one, and it is the
    reference the fused path is tested against. The snapshot (:func:`normlab._dispatch.snapshot`) keeps a compiled
    graph from recomputing r and d in the backward from buffers a caller has updated by then. ``momentum`` may be a
    tensor (the cumulative average ``1 / (num_batches_tracked + 1)`` without a host sync)."""
    pdtype = param_dtype(x)
    weight, bias = as_param(weight, pdtype), as_param(bias, pdtype)
    batch_mean, batch_var = batch_moments(x)
    prior = snapshot(running_mean, running_var)
    r, d = renorm_correction(batch_mean, batch_var, prior[0], prior[1], eps, rmax, dmax)
    if weight is None:
        scale, shift = r, d if bias is None else bias + d
    else:
        scale = weight * r
        shift = weight * d if bias is None else bias + weight * d
    # torch.batch_norm, not F.batch_norm: the batch size was checked by the caller (F.batch_norm's own check branches
    # on traced sizes under jit.trace)
    cudnn = torch.backends.cudnn.enabled
    y = torch.batch_norm(x, scale.to(pdtype), shift.to(pdtype), None, None, True, 0.0, eps, cudnn)
    count = static_numel(x) // static_numel(x, 1, 2)
    return (y, *momentum_update(running_mean, running_var, batch_mean, batch_var, count, momentum))


def batch_renorm_train(
    x: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    momentum: float | Tensor = 0.1,
    eps: float = 1e-5,
    rmax: float | Tensor = 1.0,
    dmax: float | Tensor = 0.0,
    fused: bool | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One Batch Renormalization training step (Ioffe 2017) against given running statistics and limits, without side
    effects: the step every BatchRenorm layer takes (the layer decides the statistics and limits, then writes the
    new running statistics into its buffers).

    ``y = weight * ((x - mu_B) / sigma_B * r + d) + bias`` with r, d from :func:`renorm_correction` applied to
    ``running_mean``/``running_var`` (the statistics before this batch; no gradient through r or d), and BatchNorm's
    update ``new = (1 - momentum) * running + momentum * batch`` (the unbiased batch variance for the variance),
    returned, not written: nothing passed in is modified. r and d are per-channel constants, so the step is one
    BatchNorm step with weight ``weight * r`` and bias ``bias + weight * d``: the fused path (eager CPU/CUDA, the
    default there) runs BatchNorm's statistics kernel once, BatchNorm's normalize kernel and BatchNorm's backward
    kernel (an autograd Function with the folded affine); limits that are the numbers ``rmax=1, dmax=0`` run
    BatchNorm's own training call. The composite path (``fused=False``, and always under torch.compile, torch.export,
    torch.jit.trace, torch.func transforms and forward-mode AD) is the same step in plain differentiable ops. Half
    inputs: statistics in float32, half ``weight``/``bias`` used in float32, the output in x's dtype.

    Args:
        x: the input (N, C, *) with more than one value per channel.
        running_mean: the running mean (C,) before this batch.
        running_var: the running unbiased variance (C,) before this batch.
        weight: the per-channel scale (C,). Default: None (1).
        bias: the per-channel shift (C,). Default: None (0).
        momentum: the update factor, BatchNorm's convention (weight of the batch), a float or a 0-dim tensor (for
            the cumulative average pass ``1 / (num_batches_tracked + 1)``). Default: 0.1.
        eps: added to the variances inside the square roots. Default: 1e-5.
        rmax: the limit of r (>= 1), a number or a 0-dim tensor. Default: 1.0.
        dmax: the limit of d (>= 0), a number or a 0-dim tensor. Default: 0.0.
        fused: take the fused path (True) or the composite one (False). Default: None (fused where it can run).

    Returns:
        ``(y, new_running_mean, new_running_var)``: the output (x's shape and dtype) and the updated statistics.

    Shape:
        x (N, C, *); running_mean, running_var, weight, bias (C,); y: x's shape; the new statistics (C,).

    Example:
        >>> x, rm, rv = torch.randn(8, 4, 5, 5), torch.zeros(4), torch.ones(4)
        >>> y, new_mean, new_var = batch_renorm_train(x, rm, rv, rmax=3.0, dmax=5.0)
        >>> torch.equal(rm, torch.zeros(4)), torch.allclose(new_mean, 0.1 * x.mean((0, 2, 3)))
        (True, True)
    """
    if fused is None:
        fused = takes_fused(x, running_mean, running_var)
    if fused and is_identity(rmax, dmax) and not isinstance(momentum, Tensor):
        return batchnorm_step(x, running_mean, running_var, weight, bias, momentum, eps)
    if fused:
        return fused_batch_renorm(x, running_mean, running_var, weight, bias, momentum, eps, rmax, dmax)
    return _composite_batch_renorm(x, running_mean, running_var, weight, bias, momentum, eps, rmax, dmax)


def batch_renorm(
    x: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float | None = 0.1,
    eps: float = 1e-5,
    rmax: float | Tensor = 1.0,
    dmax: float | Tensor = 0.0,
    fused: bool | None = None,
) -> Tensor:
    """Batch Renormalization (Ioffe 2017), with BatchNorm's buffers and momentum convention (as ``F.batch_norm``).

    Training: ``y = weight * ((x - mu_B) / sigma_B * r + d) + bias`` with r, d from :func:`renorm_correction`
    (computed from the running statistics *before* this batch updates them, no gradient through r or d), then the
    running statistics are updated in place as BatchNorm updates them: :func:`batch_renorm_train`, whose
    implementation notes apply. Limits that are the numbers ``rmax=1, dmax=0`` call ``F.batch_norm`` directly
    (``rmax=1, dmax=0`` gives exactly ``F.batch_norm`` either way). Inference (or ``training`` with no running
    statistics): plain BatchNorm, ``y = weight * (x - mu) / sigma + bias``. The running sigma is
    ``sqrt(running_var + eps)`` (BatchNorm-compatible state; see ``docs/deviations.md``).

    Args:
        x: the input (N, C, *).
        running_mean: the running mean (C,), updated in place in training; None: batch statistics only.
        running_var: the running unbiased variance (C,), updated in place in training; None: batch statistics only.
        weight: the per-channel scale (C,). Default: None (1).
        bias: the per-channel shift (C,). Default: None (0).
        training: normalize with the batch statistics and renormalize (True) or with the running ones (False).
            Default: False.
        momentum: the running-statistics update factor, BatchNorm's convention (weight of the new value); must be
            a float in training with running statistics. Default: 0.1.
        eps: added to the variances inside the square roots. Default: 1e-5.
        rmax: the limit of r (>= 1), a number or a scalar tensor. Default: 1.0.
        dmax: the limit of d (>= 0), a number or a scalar tensor. Default: 0.0.
        fused: take the fused path (True) or the composite one (False). Default: None (fused where it can run).

    Shape:
        x (N, C, *); running_mean, running_var, weight, bias (C,) or None; output: x's shape and dtype.

    Example:
        >>> x, rm, rv = torch.randn(8, 4, 5, 5), torch.zeros(4), torch.ones(4)
        >>> bn = F.batch_norm(x, rm.clone(), rv.clone(), training=True)
        >>> torch.equal(batch_renorm(x, rm, rv, training=True, rmax=1.0, dmax=0.0), bn)   # rmax=1, dmax=0 is BN
        True
    """
    pdtype = param_dtype(x)
    weight, bias = as_param(weight, pdtype), as_param(bias, pdtype)
    use_renorm = training and running_mean is not None and running_var is not None
    if not use_renorm:
        return F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum or 0.0, eps)
    if momentum is None:
        raise ValueError(
            "batch_renorm: momentum must be a float in training with running statistics "
            "(for a cumulative average pass 1 / num_batches_tracked, as BatchRenorm*d does)"
        )
    if static_numel(x) == 0:  # BatchNorm's empty output (with a gradient path to weight and bias); nothing to update
        return F.batch_norm(x, None, None, weight, bias, True, 0.0, eps)
    if is_identity(rmax, dmax) and not isinstance(momentum, Tensor):
        return F.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)
    y, new_mean, new_var = batch_renorm_train(
        x, running_mean, running_var, weight, bias, momentum, eps, rmax, dmax, fused
    )
    with torch.no_grad():
        running_mean.copy_(new_mean)
        running_var.copy_(new_var)
    return y


# --------------------------------------------------------------------------------------------------
# Switchable normalization
# --------------------------------------------------------------------------------------------------
@torch.fx.wrap
def switchable_norm(
    x: Tensor,
    mean_weight: Tensor,
    var_weight: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    using_bn: bool = True,
    using_moving_average: bool = True,
    fused: bool | None = None,
) -> Tensor:
    """Switchable Normalization (Luo et al. 2019): a learned mixture of IN, LN and BN statistics.

    IN statistics per (n, c) over the spatial dims (unbiased variance, as the official code);
    LN and BN statistics are derived from them through ``E[x^2] = var + mean^2``::

        mean_ln = mean_c(mean_in)        var_ln = mean_c(var_in + mean_in^2) - mean_ln^2
        mean_bn = mean_n(mean_in)        var_bn = mean_n(var_in + mean_in^2) - mean_bn^2
        mean = softmax(mean_weight) . (mean_in, mean_ln, mean_bn)   (same for var with var_weight)
        y = (x - mean) / sqrt(var + eps) * weight + bias

    ``mean_weight``/``var_weight`` are logits of shape (3,) (or (2,) with ``using_bn=False``: IN, LN).
    BN statistics: in training the batch's, and (with ``using_moving_average``) the running buffers are updated
    in place as ``running = (1 - momentum) * running + momentum * batch`` (BatchNorm's convention; the official
    0.9 of the old value is 0.1); without moving average the buffers accumulate sums. In eval the running buffers
    are used. Statistics are in float32 for half inputs; the output keeps x's dtype and memory format.

    Implementation: eager on CPU/CUDA an autograd Function with an explicit backward (two passes each way, done by
    BatchNorm's CPU kernels; its output is never a view, so in-place ops such as ``relu_`` work); ``fused=False``,
    torch.compile/export, jit.trace, torch.func, forward-mode AD, the meta device and empty inputs use the composite
    formula. An empty batch gives an empty output and zero gradients.

    Running statistics: a non-finite batch (tensor ops, no host synchronisation; ``docs/design.md``, "Non-finite
    batches"), an empty batch and checkpointing's recomputation leave them unchanged.

    Args:
        x: the input (N, C, *) with more than one spatial value per channel.
        mean_weight: the mean's mixture logits (3,) for IN, LN, BN (or (2,) with ``using_bn=False``).
        var_weight: the variance's mixture logits, the same shape.
        weight: the per-channel scale (C,). Default: None (1).
        bias: the per-channel shift (C,). Default: None (0).
        running_mean: the running BN mean (C,), updated in place in training. Default: None.
        running_var: the running BN variance (C,), updated in place in training. Default: None.
        training: use the batch's BN statistics (and update the running ones) or the running ones.
            Default: False.
        momentum: the running-statistics update factor, BatchNorm's convention (weight of the new value), a float
            (the layers' ``None``, a cumulative average, uses their ``num_batches_tracked``). Default: 0.1.
        eps: added to the mixed variance inside the square root. Default: 1e-5.
        using_bn: mix in BN statistics (the logits then have 3 entries). Default: True.
        using_moving_average: update the running statistics as a moving average; False: accumulate sums.
            Default: True.
        fused: take the autograd Function (True) or the composite formula (False). Default: None (the Function
            where it can run).

    Shape:
        x (N, C, *) with spatial size > 1; weight, bias, running_mean, running_var (C,); output: x's shape.

    Example:
        >>> logits = torch.zeros(3)
        >>> switchable_norm(torch.randn(4, 8, 6, 6), logits, logits, training=True).shape
        torch.Size([4, 8, 6, 6])
    """
    stats = (running_mean, running_var, training, momentum, eps, using_bn, using_moving_average, fused)
    return switchable_forward(x, mean_weight, var_weight, weight, bias, *stats)


# --------------------------------------------------------------------------------------------------
# Weight standardization
# --------------------------------------------------------------------------------------------------
def _filter_moments(weight: Tensor, where: str) -> tuple[Tensor, Tensor]:
    if weight.dim() < 2:
        raise ValueError(
            f"{where}: expected a weight (C_out, C_in/groups, *kernel) with >= 2 dims, got {weight.dim()}D"
        )
    return moments(weight, tuple(range(1, weight.dim())), keepdim=True)


@torch.fx.wrap
def standardize_weight(weight: Tensor, eps: float = 1e-5) -> Tensor:
    """Weight Standardization (Qiao et al. 2019): each output filter to zero mean and unit variance.

    ``W_hat_o = (W_o - mean(W_o)) / sqrt(var(W_o) + eps)`` with the biased variance over all entries of the filter.
    Gradients flow through the mean and the variance.

    Args:
        weight: the raw kernel (C_out, C_in/groups, *kernel).
        eps: added to the filter variance inside the square root. Default: 1e-5.

    Shape:
        weight (C_out, C_in/groups, *kernel) -> the same shape and dtype.

    Example:
        >>> w_hat = standardize_weight(torch.randn(16, 8, 3, 3) + 2.0)
        >>> w_hat.flatten(1).mean(1).abs().max() < 1e-5
        tensor(True)
    """
    mean, var = _filter_moments(weight, "standardize_weight")
    return ((stats_dtype(weight) - mean) * torch.rsqrt(var + eps)).to(weight.dtype)


@torch.fx.wrap
def pws_weight(
    weight: Tensor,
    alpha: Tensor | None = None,
    gamma: float = 1e-3,
    relative_gamma: bool = False,
    fan: int | None = None,
) -> Tensor:
    """Parametric Weight Standardization kernel (Liu et al., AAAI 2021).

    ``W_hat_o = sqrt(2/n) * alpha_o * (W_o - mean(W_o)) / sqrt(var(W_o) + g)`` with the biased variance over the
    filter, ``n = fan`` (default fan_in = C_in/groups * prod(kernel)) and ``g = gamma`` (absolute) or
    ``g = gamma * 2/n`` (``relative_gamma``, the authors' "equiv" mode). Mean and variance are differentiated
    through, so the gradient reaching ``weight`` has exactly zero mean per filter.

    Args:
        weight: the raw kernel (C_out, C_in/groups, *kernel).
        alpha: the per-filter gains (C_out,). Default: None (ones).
        gamma: added to the filter variance inside the square root (> 0). Default: 1e-3.
        relative_gamma: use ``g = gamma * 2/n``. Default: False.
        fan: ``n``. Default: None (fan_in, ``weight[0].numel()``).

    Shape:
        weight (C_out, C_in/groups, *kernel); alpha (C_out,) or None (= ones) -> weight's shape and dtype.

    Example:
        >>> w = torch.randn(64, 32, 3, 3, dtype=torch.float64, requires_grad=True)
        >>> pws_weight(w, gamma=1e-3).sum().backward()
        >>> w.grad.flatten(1).mean(1).abs().max() < 1e-12      # zero-mean gradient per filter
        tensor(True)
    """
    if gamma <= 0:
        raise ValueError(f"pws_weight: gamma must be > 0, got {gamma}")
    mean, var = _filter_moments(weight, "pws_weight")
    n = fan if fan is not None else weight[0].numel()
    g = gamma * 2.0 / n if relative_gamma else gamma
    w_hat = (stats_dtype(weight) - mean) * torch.rsqrt(var + g) * math.sqrt(2.0 / n)
    if alpha is not None:
        if alpha.shape != (weight.shape[0],):
            raise ValueError(f"pws_weight: alpha must have shape ({weight.shape[0]},), got {tuple(alpha.shape)}")
        w_hat = w_hat * alpha.reshape((-1,) + (1,) * (weight.dim() - 1)).to(w_hat.dtype)
    return w_hat.to(weight.dtype)


# --------------------------------------------------------------------------------------------------
# Capsules
# --------------------------------------------------------------------------------------------------
def squash(s: Tensor, dim: int = -1, eps: float = 1e-8) -> Tensor:
    """Capsule non-linearity (Sabour et al. 2017): ``v = |s|^2 / (1 + |s|^2) * s / |s|`` along ``dim``.

    ``eps`` keeps the gradient finite at ``s = 0``. Half inputs are squashed in float32 (``|s|^2`` of a float16
    vector overflows from ``|s| ~ 256``) and returned in their dtype.

    Args:
        s: the vectors to squash.
        dim: the vector axis. Default: -1.
        eps: added to ``|s|^2`` under the square root. Default: 1e-8.

    Shape:
        any; the vector axis is ``dim``; the output has the input's shape.

    Example:
        >>> squash(torch.tensor([[3.0, 4.0]])).norm().item()     # |s| = 5 -> 25 / 26
        0.9615...
    """
    x = stats_dtype(s)
    sq = x.square().sum(dim, keepdim=True)
    return (x * (sq / (1.0 + sq)) * torch.rsqrt(sq + eps)).to(s.dtype)
