"""Pure tensor functions behind the normlab layers (the ``torch.nn.functional`` of normlab).

Every function here is stateless except where it takes running-statistics buffers explicitly and updates
them in place (as ``torch.nn.functional.batch_norm`` does). Each docstring states the formula it implements;
``docs/design.md`` gives the sources.

Shapes use N = batch, C = channels, ``*`` = any number of spatial dimensions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "moments",
    "instance_norm",
    "batch_moments",
    "renorm_correction",
    "batch_renorm",
    "switchable_norm",
    "standardize_weight",
    "pws_weight",
    "squash",
]

_HALF = (torch.float16, torch.bfloat16)


def _stats_dtype(x: Tensor) -> Tensor:
    """Half-precision tensors are promoted to float32 for statistics; others are returned unchanged."""
    return x.float() if x.dtype in _HALF else x


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
def moments(
    x: Tensor, dims: int | Sequence[int], keepdim: bool = False, correction: int = 0
) -> tuple[Tensor, Tensor]:
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
    """
    dims = _normalize_dims(dims, x.dim(), "moments")
    count = math.prod([x.shape[d] for d in dims])
    if count - correction <= 0:
        raise ValueError(
            f"moments: need more than correction={correction} elements over dims {dims}, got {count}"
        )
    y = _stats_dtype(x)
    mean = y.mean(dims, keepdim=True)
    shift = mean.detach()
    var = (y - shift).square().sum(dims, keepdim=True) / (count - correction)
    # Zero in value and in first derivative; restores the exact second derivative that the detached mean drops
    # (var = E[(x-c)^2] - (E[x]-c)^2 holds for any constant c), so double backward (gradient penalties) is right.
    var = var - (mean - shift).square() * (count / (count - correction))
    if not keepdim:
        mean, var = mean.squeeze(dims), var.squeeze(dims)
    return mean, var


# --------------------------------------------------------------------------------------------------
# Instance normalization
# --------------------------------------------------------------------------------------------------
def instance_norm(
    x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5
) -> Tensor:
    """Per-sample, per-channel normalization over the spatial dimensions.

    ``y[n, c] = (x[n, c] - mean_nc) / sqrt(var_nc + eps) * weight[c] + bias[c]`` with the biased variance.
    Statistics are computed in float32 for half inputs; the output has ``x``'s dtype and memory format
    (channels_last is kept, unlike torch's CPU instance norm).

    Shapes: x (N, C, *) with at least one spatial dimension; weight, bias (C,) or None.
    """
    if x.dim() < 3:
        raise ValueError(f"instance_norm: expected input (N, C, *spatial) with >= 3 dims, got {x.dim()}D")
    dims = tuple(range(2, x.dim()))
    mean, var = moments(x, dims, keepdim=True)
    y = (_stats_dtype(x) - mean) * torch.rsqrt(var + eps)
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
    on CPU than a generic reduction; under torch.compile (that kernel has no fake-tensor implementation) the
    two-pass :func:`moments`, which the compiler fuses. Half inputs are reduced in float32; results are float32
    (or float64) (C,).
    """
    with torch.no_grad():
        xs = _stats_dtype(x.detach())
        if hasattr(torch, "batch_norm_update_stats") and not torch.compiler.is_compiling():
            return torch.batch_norm_update_stats(xs, None, None, 0.0)
        return moments(xs, (0,) + tuple(range(2, x.dim())))


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
    """
    with torch.no_grad():
        dtype = torch.promote_types(batch_mean.dtype, torch.float32)
        inv_sigma = torch.rsqrt(running_var.to(dtype) + eps)
        r = torch.sqrt(batch_var.detach().to(dtype) + eps).mul_(inv_sigma)
        d = torch.sub(batch_mean.detach().to(dtype), running_mean.to(dtype)).mul_(inv_sigma)
        return _clip(r, rmax, inverse=True), _clip(d, dmax, inverse=False)


def _clip(t: Tensor, limit: float | Tensor, inverse: bool) -> Tensor:
    """``t`` clipped in place to ``[1/limit, limit]`` (``inverse``) or ``[-limit, limit]``."""
    if isinstance(limit, Tensor):
        limit = limit.to(t)
        return torch.clamp(t, limit.reciprocal() if inverse else -limit, limit)
    return t.clamp_(1.0 / limit if inverse else -limit, limit)


def _is_identity(rmax: float | Tensor, dmax: float | Tensor) -> bool:
    """True when the limits are the numbers rmax=1, dmax=0 (then r = 1, d = 0: the layer is BatchNorm)."""
    return not isinstance(rmax, Tensor) and not isinstance(dmax, Tensor) and rmax == 1 and dmax == 0


def _param_dtype(x: Tensor) -> torch.dtype:
    """dtype of the per-channel parameters the fused kernels take with input ``x`` (float32 for half inputs)."""
    return torch.float32 if x.dtype in _HALF else x.dtype


def _as_param(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``t`` in ``dtype`` (a module converted with ``.half()`` has half weights; the kernels want float32)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _fused_device(x: Tensor) -> bool:
    """Eager CPU/CUDA tensors take the fused paths; torch.compile and other devices take the composite one."""
    return x.device.type in ("cpu", "cuda") and not torch.compiler.is_compiling()


class _BatchNormWithAffine(torch.autograd.Function):
    """BatchNorm with precomputed batch statistics and the per-channel affine ``weight * r``, ``bias + weight * d``.

    Forward: ``y = (x - mean) * invstd * (weight * r) + (bias + weight * d)`` in one pass of BatchNorm's own
    normalize kernel. Backward: BatchNorm's backward kernel (``native_batch_norm_backward`` with the saved mean and
    inverse std, as in BatchNorm training), then ``dL/dweight = dL/dscale * r + dL/dshift * d``, ``dL/dbias =
    dL/dshift``. r and d are constants (no gradient). The backward is built from differentiable ops, so double
    backward works as for BatchNorm.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, r, d, eps):
        if weight is None:
            scale, shift = r, d if bias is None else bias + d
        else:
            scale = weight * r
            shift = weight * d if bias is None else torch.addcmul(bias, weight, d)
        ctx.save_for_backward(x, weight, mean, invstd, r, d)
        ctx.eps, ctx.has_bias = eps, bias is not None
        return _channel_affine(x, mean, invstd * scale, shift)

    @staticmethod
    def backward(ctx, grad):
        x, weight, mean, invstd, r, d = ctx.saved_tensors
        scale = r if weight is None else weight * r
        need_affine = weight is not None or ctx.has_bias
        mask = [ctx.needs_input_grad[0], need_affine, need_affine]
        gx, gscale, gshift = torch.ops.aten.native_batch_norm_backward(
            grad, x, scale, None, None, mean, invstd, True, ctx.eps, mask
        )
        gw = None if weight is None else torch.addcmul(gscale * r, gshift, d).to(weight.dtype)
        gb = gshift if ctx.has_bias else None
        return gx, gw, gb, None, None, None, None, None


def _channel_affine(x: Tensor, mean: Tensor, alpha: Tensor, shift: Tensor) -> Tensor:
    """``(x - mean) * alpha + shift`` per channel, with BatchNorm's inference kernel where it is exact.

    BatchNorm's normalize step is ``x * a + (shift - mean * a)`` with ``a = invstd * weight``; its inference kernel
    with ``running_var = 1`` and ``eps = 0`` computes exactly that for ``weight = a`` (same kernel, same rounding as
    BatchNorm training, any memory format). CUDA: the same native kernel (cuDNN is bypassed).
    """
    ones = torch.ones_like(mean)
    return torch.native_batch_norm(x, alpha, shift, mean, ones, False, 0.0, 0.0)[0]


def _fused_batch_renorm(x, running_mean, running_var, weight, bias, momentum, eps, rmax, dmax, prior=None):
    """Training step with one statistics pass: BatchNorm's statistics kernel (which also updates the running
    statistics, exactly as BatchNorm does), r and d from ``prior`` (the running statistics before this batch; cloned
    here when not given), then :class:`_BatchNormWithAffine`. The per-channel arithmetic is kept to a few in-place
    ops: for small inputs their dispatch cost, not the passes over x, is what separates this from BatchNorm."""
    with torch.no_grad():
        if prior is None:
            prior = (running_mean.clone(), running_var.clone())
        mean, var = torch.batch_norm_update_stats(x, running_mean, running_var, momentum)
        # BatchNorm's inverse std, 1 / sqrt(var + eps) evaluated in double as its CPU statistics kernel does (so the
        # result is bit for bit BatchNorm's); r = sigma_B / sigma and d as in renorm_correction.
        invstd = var.double().add_(eps).rsqrt_().to(var.dtype)
        inv_sigma = torch.rsqrt(prior[1] + eps)
        r = _clip(inv_sigma.div(invstd), rmax, inverse=True)
        d = _clip(torch.sub(mean, prior[0]).mul_(inv_sigma), dmax, inverse=False)
    return _BatchNormWithAffine.apply(x, weight, bias, mean, invstd, r, d, eps)


def _composite_batch_renorm(x, running_mean, running_var, weight, bias, momentum, eps, rmax, dmax):
    """The same step from public ops (statistics, then ``F.batch_norm`` with the folded affine): torch.compile
    traces this one, and it is the reference the fused path is tested against."""
    batch_mean, batch_var = batch_moments(x)
    r, d = renorm_correction(batch_mean, batch_var, running_mean, running_var, eps, rmax, dmax)
    if weight is None:
        scale, shift = r, d if bias is None else bias + d
    else:
        scale = weight * r
        shift = weight * d if bias is None else bias + weight * d
    return F.batch_norm(x, running_mean, running_var, scale, shift, True, momentum, eps)


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
    """Batch Renormalization (Ioffe 2017), with BatchNorm's buffers and momentum convention.

    Training: ``y = weight * ((x - mu_B) / sigma_B * r + d) + bias`` with r, d from :func:`renorm_correction`
    (computed from the running statistics *before* this batch updates them, no gradient through r or d).
    Inference (or ``training`` with no running statistics): plain BatchNorm, ``y = weight * (x - mu) / sigma + bias``.

    Implementation: r and d are per-channel constants, so a training step is one BatchNorm step with weight
    ``weight * r`` and bias ``bias + weight * d``. The fused path (eager CPU/CUDA, the default there) runs BatchNorm's
    statistics kernel once (it also updates the running statistics: ``running_var`` tracks the unbiased variance,
    exactly as BatchNorm), BatchNorm's normalize kernel and BatchNorm's backward kernel (:class:`_BatchNormWithAffine`).
    The composite path (``fused=False``, and always under torch.compile) calls ``F.batch_norm`` with the folded
    affine after a separate statistics pass. Limits that are the numbers ``rmax=1, dmax=0`` call ``F.batch_norm``
    directly. Either way ``rmax=1, dmax=0`` gives exactly ``F.batch_norm``. The running sigma is
    ``sqrt(running_var + eps)`` (BatchNorm-compatible state; see README "Deviations").
    Half inputs: statistics in float32; half ``weight``/``bias`` (a ``.half()`` module) are used in float32; the
    output has x's dtype.

    Shapes: x (N, C, *); running_mean, running_var, weight, bias (C,) or None. Returns x's shape and dtype.
    """
    pdtype = _param_dtype(x)
    weight, bias = _as_param(weight, pdtype), _as_param(bias, pdtype)
    use_renorm = training and running_mean is not None and running_var is not None
    if not use_renorm:
        return F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum or 0.0, eps)
    if momentum is None:
        raise ValueError(
            "batch_renorm: momentum must be a float in training with running statistics "
            "(for a cumulative average pass 1 / num_batches_tracked, as BatchRenorm*d does)"
        )
    return _batch_renorm_step(x, running_mean, running_var, weight, bias, momentum, eps, rmax, dmax, fused=fused)


def _batch_renorm_step(x, running_mean, running_var, weight, bias, momentum, eps, rmax, dmax, prior=None, fused=None):
    """One training step of :func:`batch_renorm` with running statistics (the modules call this directly and pass
    ``prior``, their copy of the running statistics before the step)."""
    pdtype = _param_dtype(x)
    weight, bias = _as_param(weight, pdtype), _as_param(bias, pdtype)
    if _is_identity(rmax, dmax):
        return F.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)
    if fused is None:
        fused = _fused_device(x) and running_mean.dtype == pdtype and running_var.dtype == pdtype
    if fused:
        return _fused_batch_renorm(x, running_mean, running_var, weight, bias, momentum, eps, rmax, dmax, prior)
    return _composite_batch_renorm(x, running_mean, running_var, weight, bias, momentum, eps, rmax, dmax)


# --------------------------------------------------------------------------------------------------
# Switchable normalization
# --------------------------------------------------------------------------------------------------
def switchable_norm(
    x: Tensor,
    mean_weight: Tensor,
    var_weight: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.9,
    eps: float = 1e-5,
    using_bn: bool = True,
    using_moving_average: bool = True,
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
    in place as ``running = momentum * running + (1 - momentum) * batch`` (official convention: ``momentum`` weighs
    the *old* value); without moving average the buffers accumulate sums. In eval the running buffers are used.
    Statistics are computed in float32 for half inputs; the output keeps x's dtype.

    Shapes: x (N, C, *) with spatial size > 1; weight, bias, running_mean, running_var (C,).
    """
    if x.dim() < 3:
        raise ValueError(f"switchable_norm: expected input (N, C, *spatial) with >= 3 dims, got {x.dim()}D")
    n, c = x.shape[:2]
    spatial = x.shape[2:].numel()
    if spatial < 2:
        raise ValueError(
            f"switchable_norm: instance statistics need more than 1 spatial value per channel, got {spatial}"
        )
    xs = _stats_dtype(x)
    mean_in, var_in = moments(xs, tuple(range(2, x.dim())), correction=1)  # (N, C)
    second = var_in + mean_in.square()
    mean_ln = mean_in.mean(1, keepdim=True)
    var_ln = second.mean(1, keepdim=True) - mean_ln.square()
    means, variances = [mean_in, mean_ln], [var_in, var_ln]
    if using_bn:
        if training or running_mean is None or running_var is None:
            mean_bn = mean_in.mean(0, keepdim=True)
            var_bn = second.mean(0, keepdim=True) - mean_bn.square()
            if training and running_mean is not None and running_var is not None:
                with torch.no_grad():
                    if using_moving_average:
                        running_mean.mul_(momentum).add_((1 - momentum) * mean_bn.reshape(c).to(running_mean))
                        running_var.mul_(momentum).add_((1 - momentum) * var_bn.reshape(c).to(running_var))
                    else:
                        running_mean.add_(mean_bn.reshape(c).to(running_mean))
                        running_var.add_((mean_bn.square() + var_bn).reshape(c).to(running_var))
        else:
            mean_bn = running_mean.reshape(1, c).to(xs.dtype)
            var_bn = running_var.reshape(1, c).to(xs.dtype)
        means.append(mean_bn)
        variances.append(var_bn)
    mw = torch.softmax(mean_weight.to(xs.dtype), 0)
    vw = torch.softmax(var_weight.to(xs.dtype), 0)
    mean = sum(w * m for w, m in zip(mw, means))
    var = sum(w * v for w, v in zip(vw, variances))
    # Normalize once as x * scale + shift with (N, C) coefficients: one pass, keeps x's memory format.
    scale = torch.rsqrt(var + eps)
    if weight is not None:
        scale = scale * weight.to(xs.dtype)
    shift = -mean * scale
    if bias is not None:
        shift = shift + bias.to(xs.dtype)
    shape = (n, c) + (1,) * (x.dim() - 2)
    return torch.addcmul(shift.reshape(shape), xs, scale.reshape(shape)).to(x.dtype)


# --------------------------------------------------------------------------------------------------
# Weight standardization
# --------------------------------------------------------------------------------------------------
def _filter_moments(weight: Tensor, where: str) -> tuple[Tensor, Tensor]:
    if weight.dim() < 2:
        raise ValueError(
            f"{where}: expected a weight (C_out, C_in/groups, *kernel) with >= 2 dims, got {weight.dim()}D"
        )
    return moments(weight, tuple(range(1, weight.dim())), keepdim=True)


def standardize_weight(weight: Tensor, eps: float = 1e-5) -> Tensor:
    """Weight Standardization (Qiao et al. 2019): each output filter to zero mean and unit variance.

    ``W_hat_o = (W_o - mean(W_o)) / sqrt(var(W_o) + eps)`` with the biased variance over all entries of the filter.
    Gradients flow through the mean and the variance.

    Shapes: weight (C_out, C_in/groups, *kernel) -> same shape and dtype.
    """
    mean, var = _filter_moments(weight, "standardize_weight")
    return ((_stats_dtype(weight) - mean) * torch.rsqrt(var + eps)).to(weight.dtype)


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

    Shapes: weight (C_out, C_in/groups, *kernel); alpha (C_out,) or None (= ones) -> weight's shape and dtype.
    """
    if gamma <= 0:
        raise ValueError(f"pws_weight: gamma must be > 0, got {gamma}")
    mean, var = _filter_moments(weight, "pws_weight")
    n = fan if fan is not None else weight[0].numel()
    g = gamma * 2.0 / n if relative_gamma else gamma
    w_hat = (_stats_dtype(weight) - mean) * torch.rsqrt(var + g) * math.sqrt(2.0 / n)
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

    ``eps`` keeps the gradient finite at ``s = 0``. Shape: any; the vector axis is ``dim``.
    """
    sq = s.square().sum(dim, keepdim=True)
    return s * (sq / (1.0 + sq)) * torch.rsqrt(sq + eps)
