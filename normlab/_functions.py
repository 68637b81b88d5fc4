"""The machinery behind :mod:`normlab.functional` (private): the autograd Functions with explicit backward passes
(:class:`_BatchNormWithAffine` for batch renormalization, :class:`_SwitchableNormFn` for switchable normalization),
the CPU layout dispatch of their per-(n, c) statistics kernels, and the training steps of switchable normalization.
torch keeps its layers' autograd Functions apart from ``torch.nn.functional`` in the same way
(``torch/nn/modules/_functions.py``). This module sits below ``normlab.functional`` (which imports it): it uses
only :mod:`normlab._dispatch`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._dispatch import (
    all_finite,
    as_param,
    batched_backward,
    centered_moments,
    channels_last_format,
    clip,
    count_into,
    forward_ad_active,
    guarded_update,
    param_dtype,
    plain_eager,
    recomputing,
    same_layout,
    static_numel,
    stats_dtype,
    stats_value,
    writes_in_place,
)

__all__ = [
    "group_norm_weight",
    "instance_norm_in_layout",
    "is_identity",
    "takes_fused",
    "momentum_update",
    "batchnorm_step",
    "fused_batch_renorm",
    "switchable_forward",
]


# --------------------------------------------------------------------------------------------------
# Batch renormalization: the fused step
# --------------------------------------------------------------------------------------------------
def is_identity(rmax: float | Tensor, dmax: float | Tensor) -> bool:
    """True when the limits are the numbers rmax=1, dmax=0 (then r = 1, d = 0: the layer is BatchNorm)."""
    return not isinstance(rmax, Tensor) and not isinstance(dmax, Tensor) and rmax == 1 and dmax == 0


def takes_fused(x: Tensor, running_mean: Tensor, running_var: Tensor) -> bool:
    """Whether :func:`normlab.functional.batch_renorm_train` takes the fused path by default for these tensors: eager
    (:func:`plain_eager`), outside forward-mode AD (BatchNorm's statistics kernel has no forward derivative), with
    running statistics in the parameters' dtype."""
    pdtype = param_dtype(x)
    return plain_eager(x) and not forward_ad_active() and running_mean.dtype == pdtype and running_var.dtype == pdtype


def _affine_forward(x, weight, bias, mean, invstd, r, d):
    if weight is None:
        scale, shift = r, d if bias is None else bias + d
    else:
        scale = weight * r
        shift = weight * d if bias is None else torch.addcmul(bias, weight, d)
    return _channel_affine(x, mean, invstd * scale, shift)


class _BatchNormWithAffine(torch.autograd.Function):
    """BatchNorm with precomputed batch statistics and the per-channel affine ``weight * r``, ``bias + weight * d``.

    Forward: ``y = (x - mean) * invstd * (weight * r) + (bias + weight * d)`` in one pass of BatchNorm's own
    normalize kernel. Backward: BatchNorm's backward kernel (``native_batch_norm_backward`` with the saved mean and
    inverse std, as in BatchNorm training), then ``dL/dweight = dL/dscale * r + dL/dshift * d``, ``dL/dbias =
    dL/dshift``. r and d are constants (no gradient). The backward is built from differentiable ops, so double
    backward works as for BatchNorm. This is the form with ``ctx`` in ``forward``: ``Function.apply`` binds the
    arguments of the separate form (:class:`_BatchNormWithAffineFunc`, which torch.func needs) with
    ``inspect.signature`` on every call, which costs more than the kernels at small shapes.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, r, d, eps):
        ctx.save_for_backward(x, weight, mean, invstd, r, d)
        ctx.eps, ctx.has_bias = eps, bias is not None
        return _affine_forward(x, weight, bias, mean, invstd, r, d)

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


class _BatchNormWithAffineFunc(torch.autograd.Function):
    """:class:`_BatchNormWithAffine` in the separate form (``setup_context``) that torch.func.grad/jacrev/vmap and
    functional_call can run; the same backward."""

    @staticmethod
    def forward(x, weight, bias, mean, invstd, r, d, eps):
        return _affine_forward(x, weight, bias, mean, invstd, r, d)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, mean, invstd, r, d, eps = inputs
        ctx.save_for_backward(x, weight, mean, invstd, r, d)
        ctx.eps, ctx.has_bias = eps, bias is not None

    backward = _BatchNormWithAffine.backward


def _channel_affine(x: Tensor, mean: Tensor, alpha: Tensor, shift: Tensor) -> Tensor:
    """``(x - mean) * alpha + shift`` per channel, with BatchNorm's inference kernel where it is exact.

    BatchNorm's normalize step is ``x * a + (shift - mean * a)`` with ``a = invstd * weight``; its inference kernel
    with ``running_var = 1`` and ``eps = 0`` computes exactly that for ``weight = a`` (same kernel, same rounding as
    BatchNorm training, any memory format). CUDA: the same native kernel (cuDNN is bypassed).
    """
    if x.dim() == 5 and channels_last_format(x) is not None:  # the inference kernel has no fast channels_last_3d
        shape = (1, -1, 1, 1, 1)  # path on the CPU (3-4x slower than this elementwise pass there)
        beta = torch.addcmul(shift, mean, alpha, value=-1)
        return torch.addcmul(beta.reshape(shape), x, alpha.reshape(shape))
    return torch.native_batch_norm(x, alpha, shift, mean, _ones_like(mean), False, 0.0, 0.0)[0]


_ONES: dict = {}


def _ones_like(t: Tensor) -> Tensor:
    """``torch.ones_like(t)`` for a (C,) tensor, kept per size, dtype and device in eager outside torch.func (one op
    fewer per step; never written: the inference kernel only reads its running variance)."""
    if not writes_in_place():
        return torch.ones_like(t)
    key = (t.shape, t.dtype, t.device)
    ones = _ONES.get(key)
    if ones is None:
        ones = _ONES[key] = torch.ones_like(t)
    return ones


def momentum_update(running_mean, running_var, batch_mean, batch_var, count: int, momentum):
    """BatchNorm's update, out of place: ``(1 - momentum) * running + momentum * batch``, with the unbiased batch
    variance (``count / (count - 1)``) for ``running_var``. ``momentum``: a float or a 0-dim tensor."""
    with torch.no_grad():
        unbiased = batch_var * (count / (count - 1))
        new_mean = running_mean * (1 - momentum) + (batch_mean * momentum).to(running_mean.dtype)
        new_var = running_var * (1 - momentum) + (unbiased * momentum).to(running_var.dtype)
    return new_mean, new_var


def batchnorm_step(x, running_mean, running_var, weight, bias, momentum: float, eps):
    """The limits ``rmax=1, dmax=0`` (r = 1, d = 0): BatchNorm's own training call, bit for bit (16 dispatched ops
    in a layer's step instead of 33). Pure: the kernel updates copies of the running statistics, which are returned
    (autograd saves the tensors the kernel gets, so they must not be the buffers a caller then writes).
    Returns ``(y, new_running_mean, new_running_var)``."""
    pdtype = param_dtype(x)
    weight, bias = as_param(weight, pdtype), as_param(bias, pdtype)
    with torch.no_grad():
        new = running_mean.clone(), running_var.clone()
    y = torch.batch_norm(x, weight, bias, *new, True, momentum, eps, torch.backends.cudnn.enabled)
    return y, new[0], new[1]


def fused_batch_renorm(x, running_mean, running_var, weight, bias, momentum, eps, rmax, dmax):
    """Training step with one statistics pass: BatchNorm's statistics kernel (which also computes the updated running
    statistics, exactly as BatchNorm does, into copies), r and d from ``running_mean``/``running_var`` (the
    statistics before this batch, left unchanged), then :class:`_BatchNormWithAffine`. The per-channel arithmetic is
    kept to a few in-place ops: for small inputs their dispatch cost, not the passes over x, is what separates this
    from BatchNorm. For the inputs :func:`takes_fused` accepts; ``momentum`` a float or a 0-dim tensor (the
    cumulative average's factor: then the kernel gives the batch's statistics and the average is taken here).
    Returns ``(y, new_running_mean, new_running_var)``."""
    pdtype = param_dtype(x)
    weight, bias = as_param(weight, pdtype), as_param(bias, pdtype)
    with torch.no_grad():
        cumulative = isinstance(momentum, Tensor)
        if cumulative:
            new = torch.zeros_like(running_mean), torch.zeros_like(running_var)
        else:
            new = running_mean.clone(), running_var.clone()
        mean, var = torch.batch_norm_update_stats(x, *new, 1.0 if cumulative else momentum)
        if cumulative:
            new = tuple(torch.add(b * momentum, r * (1 - momentum)) for b, r in zip(new, (running_mean, running_var)))
        # BatchNorm's inverse std, 1 / sqrt(var + eps) evaluated in double as its CPU statistics kernel does (so the
        # result is bit for bit BatchNorm's); r = sigma_B / sigma and d as in renorm_correction.
        invstd = var.double().add(eps).rsqrt_().to(var.dtype)  # not in place: var.double() is var for float64
        inv_sigma = torch.rsqrt(running_var + eps)
        r = clip(inv_sigma.div(invstd), rmax, inverse=True)
        d = clip(torch.sub(mean, running_mean).mul_(inv_sigma), dmax, inverse=False)
    fn = _BatchNormWithAffineFunc if torch._C._are_functorch_transforms_active() else _BatchNormWithAffine
    return fn.apply(x, weight, bias, mean, invstd, r, d, eps), new[0], new[1]


# --------------------------------------------------------------------------------------------------
# Switchable normalization
# --------------------------------------------------------------------------------------------------
def _sn_mix(mu: Tensor, var_in: Tensor, mean_weight: Tensor, var_weight: Tensor, bn_stats):
    """Mixed (N, C) mean and variance of switchable normalization from the instance statistics.

    ``bn_stats``: None (batch statistics, derived here), False (no BN component) or ``(mean_bn, var_bn)`` (1, C)
    (the running statistics in eval). Returns ``(mean, var, parts)`` with ``parts = (means, variances, mw, vw)``:
    the component statistics (IN, LN[, BN]) and the softmax weights.
    """
    second = var_in + mu.square()
    mean_ln = mu.mean(1, keepdim=True)
    var_ln = second.mean(1, keepdim=True) - mean_ln.square()
    means, variances = [mu, mean_ln], [var_in, var_ln]
    if bn_stats is not False:
        if bn_stats is None and mu.shape[0] == 0:  # an empty batch has no BN statistics: zeros (constants), so the
            bn_stats = (mu.new_zeros((1, mu.shape[1])),) * 2  # logits' gradients are 0 (BatchNorm's: 0), not NaN
        elif bn_stats is None:
            mean_bn = mu.mean(0, keepdim=True)
            bn_stats = (mean_bn, second.mean(0, keepdim=True) - mean_bn.square())
        means.append(bn_stats[0])
        variances.append(bn_stats[1])
    mw = torch.softmax(mean_weight.to(mu.dtype), 0)
    vw = torch.softmax(var_weight.to(mu.dtype), 0)
    mean = sum(w * m for w, m in zip(mw, means))
    var = sum(w * v for w, v in zip(vw, variances))
    return mean, var, (means, variances, mw, vw)


@torch.no_grad()
def _sn_update_running(running, batch, momentum, using_moving_average: bool, where: str) -> Tensor:
    """BatchNorm's convention: ``running = (1 - momentum) * running + momentum * batch``, ``momentum=None`` the
    cumulative average ``1 / num_batches_tracked`` (or sums without moving average: batch means and E[x^2]).
    ``running``: ``(running_mean, running_var)`` or ``(running_mean, running_var, num_batches_tracked)``. A
    non-finite batch leaves the buffers unchanged (tensor ops only); returns whether the batch statistics were finite
    (a 0-dim bool tensor)."""
    running_mean, running_var = running[:2]
    c = running_mean.numel()
    mean_bn, var_bn = batch
    if mean_bn.dim() != 1 or mean_bn.requires_grad:  # the composite path's (1, C) statistics (the fused path's: (C,))
        mean_bn, var_bn = (stats_value(t.detach(), running_mean, where).reshape(c) for t in batch)
    finite = all_finite(mean_bn, var_bn)
    values = []
    if len(running) == 3:  # the step counter, advanced by a finite batch only
        count = running[2] + finite.to(running[2].dtype)
        values.append(count)
        if momentum is None:
            momentum = count.to(running_mean.dtype).clamp_min(1).reciprocal()
    if momentum is None:
        raise ValueError(f"{where}: momentum=None (cumulative average) needs num_batches_tracked; got None")
    if using_moving_average:  # lerp(running, batch, momentum) = (1 - momentum) * running + momentum * batch
        new_mean = torch.lerp(running_mean, mean_bn.to(running_mean), momentum)
        new_var = torch.lerp(running_var, var_bn.to(running_var), momentum)
    else:
        new_mean = running_mean + mean_bn.to(running_mean)
        new_var = running_var + (mean_bn.square() + var_bn).to(running_var)
    guarded_update(running, [new_mean, new_var, *values], finite)
    return finite


def _sn_bn_stats(using_bn, training, running_mean, running_var, c: int, dtype):
    """What :func:`_sn_mix` takes as ``bn_stats`` (see there)."""
    if not using_bn:
        return False
    if training or running_mean is None or running_var is None:
        return None
    return running_mean.reshape(1, c).to(dtype), running_var.reshape(1, c).to(dtype)


def _switchable_composite(x, mean_weight, var_weight, weight, bias, bn_stats, eps):
    """Switchable normalization from differentiable torch ops (the reference for the fused path, what
    torch.compile traces, and what double backward differentiates). Returns ``(y in float32/64, batch BN stats or
    None)``."""
    xs = stats_dtype(x)
    dims = tuple(range(2, x.dim()))
    count = x.shape[2:].numel()
    mu, var_in = (t.squeeze(dims) for t in centered_moments(xs, dims, count, 1))  # (N, C), as moments() computes
    mean, var, (means, variances, _, _) = _sn_mix(mu, var_in, mean_weight, var_weight, bn_stats)
    scale = torch.rsqrt(var + eps)
    if weight is not None:
        scale = scale * weight.to(xs.dtype)
    shift = -mean * scale
    if bias is not None:
        shift = shift + bias.to(xs.dtype)
    shape = x.shape[:2] + (1,) * (x.dim() - 2)
    # One pass as x * scale + shift with (N, C) coefficients; keeps x's memory format.
    batch = (means[2], variances[2]) if bn_stats is None else None
    return torch.addcmul(shift.reshape(shape), xs, scale.reshape(shape)), batch


def _instance_layout(x: Tensor) -> str:
    """Which kernels compute per-(n, c) statistics of ``x`` fastest: ``rows`` (CPU, contiguous: each (n, c) is one
    contiguous row, BatchNorm's kernels on the (1, N*C, L) view), ``samples`` (CPU, channels_last: BatchNorm's
    kernels per sample), ``generic`` (any other device or layout: plain reductions)."""
    if x.device.type != "cpu":
        return "generic"
    if x.is_contiguous():
        return "rows"
    return "samples" if channels_last_format(x) is not None else "generic"


_CONSTANTS: dict = {}


def _constant(value: float, n: int, like: Tensor) -> Tensor:
    """A (n,) tensor filled with ``value`` (``n = 0``: empty), kept per value, size, dtype and device: the eager
    kernels below only read it (BatchNorm's inference kernel reads its running statistics), so one copy serves
    every call (two ops fewer per call than building it)."""
    key = (value, n, like.dtype, like.device)
    found = _CONSTANTS.get(key)
    if found is None:
        found = _CONSTANTS[key] = torch.full((n,), value, dtype=like.dtype, device=like.device)
    return found


def group_norm_weight(weight: Tensor | None, bias: Tensor | None, x: Tensor) -> Tensor | None:
    """The ``weight`` to give torch's group norm: ``weight``, or ones when only ``bias`` is given (torch's
    ``native_group_norm`` backward fails with "tensor does not have a device" for a bias without a weight; a
    weight of ones, which needs no gradient, computes the same output and gradients)."""
    if weight is not None or bias is None:
        return weight
    if writes_in_place():  # eager: the kept constant (read only)
        return _constant(1.0, bias.numel(), bias)
    return torch.ones_like(bias)


def _instance_stats(x: Tensor, layout: str, count: int) -> tuple[Tensor, Tensor]:
    """Per-(n, c) mean and unbiased variance of ``x`` (N, C, *) over its ``count`` spatial values, both (N, C),
    two-pass (centred: exact for large means)."""
    n, c = x.shape[:2]
    if layout == "samples":  # BatchNorm's channels_last statistics kernel, one sample at a time
        stats = [torch.batch_norm_update_stats(x[i : i + 1], None, None, 0.0) for i in range(n)]
        var = torch.stack([v for _, v in stats]).mul_(count / (count - 1))
        return torch.stack([m for m, _ in stats]), var
    dims = tuple(range(2, x.dim()))
    mu = x.mean(dims, keepdim=True)
    var = torch.linalg.vector_norm(x - mu, dim=dims).square_().div_(count - 1)
    return mu.view(n, c), var


def _instance_dots(g: Tensor, x: Tensor, mu: Tensor, layout: str) -> tuple[Tensor, Tensor]:
    """Per-(n, c) sums ``sum(g)`` and ``sum(g * (x - mu))`` over the spatial dims, both (N, C). On CPU this is
    BatchNorm's backward reduction (centred dot product and sum in one pass, no temporary)."""
    n, c = x.shape[:2]
    mask = [False, True, True]
    if layout == "rows":
        flat = (1, n * c, -1)
        ones = _constant(1.0, n * c, mu)
        _, dot, total = torch.ops.aten.native_batch_norm_backward(
            g.view(flat), x.view(flat), None, None, None, mu.view(-1), ones, True, 0.0, mask
        )
        return total.view(n, c), dot.view(n, c)
    if layout == "samples":
        ones = _constant(1.0, c, mu)
        parts = [
            torch.ops.aten.native_batch_norm_backward(
                g[i : i + 1], x[i : i + 1], None, None, None, mu[i], ones, True, 0.0, mask
            )
            for i in range(n)
        ]
        return torch.stack([p[2] for p in parts]), torch.stack([p[1] for p in parts])
    dims = tuple(range(2, x.dim()))
    centered = x - mu.view(x.shape[:2] + (1,) * len(dims))
    return g.sum(dims), (g * centered).sum(dims)


def _instance_affine(x: Tensor, scale: Tensor, shift: Tensor, layout: str) -> Tensor:
    """``x * scale + shift`` with (N, C) coefficients, in x's memory format; never a view (in-place ops on the
    Function's output work). CPU rows: BatchNorm's normalize kernel on the (1, N*C, L) view, with running_var 1
    and eps 0 it is exactly this affine."""
    n, c = x.shape[:2]
    if layout == "rows":
        flat = (1, n * c, -1)
        zeros, ones, unused = _constant(0.0, n * c, scale), _constant(1.0, n * c, scale), _constant(0.0, 0, scale)
        y = torch.empty_like(x)  # written through a (1, N*C, L) view, returned whole: not a view for autograd
        torch.native_batch_norm(
            x.view(flat),
            scale.view(-1),
            shift.view(-1),
            zeros,
            ones,
            False,
            0.0,
            0.0,
            out=(y.view(flat), unused, unused),
        )
        return y
    shape = (n, c) + (1,) * (x.dim() - 2)
    return torch.addcmul(shift.view(shape), x, scale.view(shape))


def _mix(weights: Tensor, parts: list[Tensor]) -> Tensor:
    """``sum_k weights[k] * parts[k]`` broadcast to (N, C); the weights stay 0-dim tensors (never read back)."""
    w = weights.unbind()
    out = torch.mul(parts[0], w[0])
    for part, wk in zip(parts[1:], w[1:]):
        out.addcmul_(part, wk)
    return out


class _SwitchableNormFn(torch.autograd.Function):
    """Switchable normalization with an explicit backward (see :func:`switchable_norm` for the formula).

    Forward: one statistics pass for the per-(n, c) mean ``mu`` and unbiased variance ``var_in``; the LN (N, 1) and
    BN (C,) statistics are means of ``(mu, var_in + mu^2)`` over channels and over the batch; the (N, C) mixtures
    ``mean = sum_k a_k mean_k``, ``var = sum_k b_k var_k`` (softmax weights a, b); one normalize pass
    ``y = x * scale + shift`` with ``s = rsqrt(var + eps)``, ``scale = s * weight``, ``shift = bias - mean * scale``.

    Backward, with ``G1 = sum_hw(g)`` and ``G2 = sum_hw(g * (x - mu))`` from one reduction pass, ``rows`` the mean
    over channels (N, 1) and ``cols`` the mean over the batch (C,)::

        dL/dscale = G2 + (mu - mean) G1      dL/dmean = -scale G1      dL/dvar = -dL/dscale weight s^3 / 2
        dL/dvar_in = b0 dL/dvar + b1 rows(dL/dvar) + b2 cols(dL/dvar)
        dL/dmu     = a0 dL/dmean + a1 rows(dL/dmean) + a2 cols(dL/dmean)
                     + 2 b1 (mu - mean_ln) rows(dL/dvar) + 2 b2 (mu - mean_bn) cols(dL/dvar)
        dL/dlogits = softmax backward of g_k = sum(dL/dmean * mean_k) (resp. dL/dvar, var_k)
        dL/dx = g scale + dL/dmu / S + dL/dvar_in 2 (x - mu) / (S - 1)                (one pass)
        dL/dweight = sum_n(dL/dscale s)      dL/dbias = sum_n(G1)

    (the BN terms of dL/dmu and dL/dvar_in only with batch statistics: running statistics are constants; S the
    spatial size). Double backward (``create_graph=True``) and batched gradients (``is_grads_batched=True``,
    ``jacobian(vectorize=True)``: the backward runs under vmap, which the kernels' ``out=`` forms have no batching rule
    for) differentiate the composite formula instead. Outputs: y
    (never a view, so in-place ops on it work) and, with batch BN statistics, their (C,) mean and variance (no
    gradient; the caller updates the running statistics with them), else two None.
    """

    @staticmethod
    def forward(ctx, x, mean_weight, var_weight, weight, bias, bn_mean, bn_var, cfg):
        eps, using_bn = cfg
        xs, layout = stats_dtype(x), _instance_layout(x)
        mu, var_in = _instance_stats(xs, layout, static_numel(x, 2))
        dtype = mu.dtype
        # LN (N, 1) and BN (C,) statistics from the per-(n, c) mean and second moment var_in + mu^2
        pair = torch.stack([mu, torch.addcmul(var_in, mu, mu)])
        ln_mean, ln_sq = pair.mean(2, keepdim=True).unbind()
        means, variances = [mu, ln_mean], [var_in, torch.addcmul(ln_sq, ln_mean, ln_mean, value=-1)]
        batch_bn = using_bn and bn_mean is None
        if batch_bn:
            bn_mean, bn_sq = pair.mean(1).unbind()
            bn_var = torch.addcmul(bn_sq, bn_mean, bn_mean, value=-1)
        if using_bn:
            means.append(as_param(bn_mean, dtype))
            variances.append(as_param(bn_var, dtype))
        mw, vw = torch.softmax(as_param(mean_weight, dtype), 0), torch.softmax(as_param(var_weight, dtype), 0)
        mean, s = _mix(mw, means), _mix(vw, variances).add_(eps).rsqrt_()
        scale = s if weight is None else s * as_param(weight, dtype)
        shift = (
            torch.mul(mean, scale).neg_()
            if bias is None
            else torch.addcmul(as_param(bias, dtype), mean, scale, value=-1)
        )
        ctx.save_for_backward(x, mean_weight, var_weight, weight, bias)
        ctx.stats = (mean, s, scale, means, variances, mw, vw, batch_bn)
        ctx.cfg, ctx.layout = cfg, layout
        y = as_param(_instance_affine(xs, scale, shift, layout), x.dtype)
        if not batch_bn:
            ctx.running = (bn_mean, bn_var)
            return y, None, None
        ctx.running = (None, None)
        ctx.mark_non_differentiable(bn_mean, bn_var)
        ctx.set_materialize_grads(False)  # no zero gradients built for the statistics
        return y, bn_mean, bn_var

    @staticmethod
    def backward(ctx, grad, *_batch_stats):
        if grad is None:  # only the (non-differentiable) statistics were differentiated
            return (None,) * 8
        if torch.is_grad_enabled() or batched_backward(grad):
            return _switchable_double_backward(ctx, grad)  # create_graph=True, or batched gradients (vmap)
        x, mean_weight, var_weight, weight, bias = ctx.saved_tensors
        mean, s, scale, means, variances, mw, vw, batch_bn = ctx.stats
        mu, layout, count = means[0], ctx.layout, static_numel(x, 2)
        xs = stats_dtype(x)
        g = as_param(same_layout(grad, x), xs.dtype)
        g1, g2 = _instance_dots(g, xs, mu, layout)
        d_scale = torch.addcmul(g2, mu - mean, g1)
        d_mean = torch.mul(scale, g1).neg_()
        d_var = torch.mul(d_scale, scale).mul_(s.square()).mul_(-0.5)  # scale s^2 = weight s^3
        d_mu, d_var_in, d_mw, d_vw = _mix_backward(d_mean, d_var, means, variances, mw, vw, batch_bn)
        gx = None
        if ctx.needs_input_grad[0]:
            a = d_var_in.mul_(2.0 / (count - 1))
            b = torch.addcmul(d_mu.div_(count), a, mu, value=-1.0)
            spatial = (1,) * (x.dim() - 2)
            gx = _instance_affine(xs, a, b, layout).addcmul_(g, scale.view(scale.shape + spatial))
            gx = as_param(gx, x.dtype)
        d_w = None if weight is None else as_param((d_scale * s).sum(0), weight.dtype)
        d_b = None if bias is None else as_param(g1.sum(0), bias.dtype)
        return gx, as_param(d_mw, mean_weight.dtype), as_param(d_vw, var_weight.dtype), d_w, d_b, None, None, None


def _mix_backward(d_mean, d_var, means, variances, mw, vw, batch_bn: bool):
    """Gradients of ``(mu, var_in, mean_weight, var_weight)`` from those of the mixed (N, C) mean and variance (the
    formulas of :class:`_SwitchableNormFn`). ``rows(X)`` (N, 1) and ``cols(X)`` (C,) of both gradients come from
    one stack; the logit gradient of component k is ``sum(d_mean * mean_k)`` with the broadcast summed first."""
    n, c = d_mean.shape
    mu = means[0]
    a, b = mw.unbind(), vw.unbind()
    d = torch.stack([d_mean, d_var])  # (2, N, C)
    rows = d.mean(2, keepdim=True)  # (2, N, 1)
    rows_m, rows_v = rows.unbind()
    d_var_in = torch.mul(d_var, b[0]).addcmul_(rows_v, b[1])
    d_mu = torch.mul(d_mean, a[0]).addcmul_(rows_m, a[1]).addcmul_(mu - means[1], rows_v * b[1], value=2)
    logits = [
        torch.mul(d, torch.stack([mu, variances[0]])).sum((1, 2)),
        torch.mul(rows, torch.stack([means[1], variances[1]])).sum((1, 2)).mul_(c),
    ]
    if len(means) == 3:
        cols = d.mean(1)  # (2, C)
        logits.append(torch.mul(cols, torch.stack([means[2], variances[2]])).sum(1).mul_(n))
        if batch_bn:
            cols_m, cols_v = cols.unbind()
            d_var_in.addcmul_(cols_v, b[2])
            d_mu.addcmul_(cols_m, a[2]).addcmul_(mu - means[2], cols_v * b[2], value=2)
    g_mw, g_vw = torch.stack(logits, 1).unbind()
    d_mw = torch._softmax_backward_data(g_mw, mw, 0, mw.dtype)
    d_vw = torch._softmax_backward_data(g_vw, vw, 0, vw.dtype)
    return d_mu, d_var_in, d_mw, d_vw


def _switchable_double_backward(ctx, grad):
    """Backward with ``create_graph=True`` or under vmap: the gradient of the composite formula (differentiable
    itself with ``create_graph``; plain ops with batching rules)."""
    x, mean_weight, var_weight, weight, bias = ctx.saved_tensors
    bn_mean, bn_var = ctx.running
    eps, using_bn = ctx.cfg[:2]
    bn_stats = False if not using_bn else (None if bn_mean is None else (bn_mean.view(1, -1), bn_var.view(1, -1)))
    tensors = (x, mean_weight, var_weight, weight, bias)
    return _composite_grads(
        lambda: _switchable_composite(x, mean_weight, var_weight, weight, bias, bn_stats, eps)[0].to(x.dtype),
        tensors,
        grad,
    ) + (None, None, None)


def _composite_grads(forward, tensors, grad) -> tuple:
    """The gradients of ``forward()`` (a recomputation from differentiable ops) for each of ``tensors`` that requires
    grad (None for the others), given the output's ``grad``; with a graph when the caller's backward builds one."""
    create = torch.is_grad_enabled()
    inputs = [t for t in tensors if t is not None and t.requires_grad]
    with torch.enable_grad():
        found = torch.autograd.grad(forward(), inputs, grad, create_graph=create, allow_unused=True)
    by_id = {id(t): g for t, g in zip(inputs, found)}
    return tuple(None if t is None else by_id.get(id(t)) for t in tensors)


def _sn_fused_ok(x: Tensor) -> bool:
    """Whether :class:`_SwitchableNormFn` may run: eager on CPU/CUDA with a non-empty input. torch.compile,
    torch.export, jit.trace, torch.func transforms, forward-mode AD (the Function has no ``jvp``; every op of the
    composite formula has a forward derivative), other devices (meta) and empty inputs take the composite path."""
    return static_numel(x) > 0 and plain_eager(x) and not forward_ad_active()


def _sn_check(x: Tensor, where: str, layer) -> None:
    """The input checks: a layer's (``layer = (num_features, spatial_dims, layout)``) or the functional's (None)."""
    if layer is not None:
        num_features, k, layout = layer
        if x.dim() != k + 2:
            raise ValueError(f"{where}: expected {k + 2}D input {layout}, got {x.dim()}D input")
        if x.shape[1] != num_features:
            raise ValueError(f"{where}: expected {num_features} channels (num_features), got {x.shape[1]}")
        if x.shape[2:].numel() < 2:
            raise ValueError(
                f"{where}: instance statistics need more than 1 spatial value per channel, got input of shape "
                f"{tuple(x.shape)}"
            )
        return
    if x.dim() < 3:
        raise ValueError(f"{where}: expected input (N, C, *spatial) with >= 3 dims, got {x.dim()}D")
    spatial = x.shape[2:].numel()
    if spatial < 2:
        raise ValueError(f"{where}: instance statistics need more than 1 spatial value per channel, got {spatial}")


def switchable_forward(
    x,
    mean_weight,
    var_weight,
    weight,
    bias,
    running_mean,
    running_var,
    training,
    momentum,
    eps,
    using_bn,
    using_moving_average,
    fused,
    where="switchable_norm",
    counters=None,
    layer=None,
):
    """:func:`normlab.functional.switchable_norm` (which calls this), and the layers' whole forward with their name
    as ``where``, their ``(num_features, spatial_dims, layout)`` as ``layer`` (the input checks) and their
    ``(num_batches_tracked, skipped_batches)`` as ``counters``: one call with tensors and constants only, so that
    torch.fx traces a layer as one node (``torch.fx.wrap``). A non-finite batch leaves the running statistics
    unchanged (tensor ops; the non-finite policy of :mod:`normlab._dispatch`) and is counted in ``skipped_batches``.
    The output has x's dtype and memory format."""
    _sn_check(x, where, layer)
    has_running = running_mean is not None and running_var is not None
    update = training and using_bn and has_running and static_numel(x, 0, 1) > 0 and not recomputing()
    if fused is None:
        fused = _sn_fused_ok(x)
    if fused:
        eval_bn = using_bn and not training and has_running
        bn_mean, bn_var = (running_mean, running_var) if eval_bn else (None, None)
        y, *batch = _SwitchableNormFn.apply(x, mean_weight, var_weight, weight, bias, bn_mean, bn_var, (eps, using_bn))
        batch = None if batch[0] is None else batch
    else:
        bn_stats = _sn_bn_stats(using_bn, training, running_mean, running_var, x.shape[1], stats_dtype(x).dtype)
        y, batch = _switchable_composite(x, mean_weight, var_weight, weight, bias, bn_stats, eps)
        y = y.to(x.dtype)
    if update and batch is not None:
        running = (running_mean, running_var) if counters is None else (running_mean, running_var, counters[0])
        finite = _sn_update_running(running, batch, momentum, using_moving_average, where)
        if counters is not None:
            count_into(counters[1], ~finite)
    fmt = channels_last_format(x)
    return y if fmt is None else y.contiguous(memory_format=fmt)


# --------------------------------------------------------------------------------------------------
# Instance normalization of channels_last inputs
# --------------------------------------------------------------------------------------------------
class _InstanceNormFn(torch.autograd.Function):
    """Instance normalization of a channels_last / channels_last_3d float32/float64 input in its own layout.

    torch's instance and group norm kernels need a contiguous copy of a channels_last input (and torch's CPU
    channels_last group norm computes the variance as E[x^2] - E[x]^2, which loses all precision for large means),
    so this Function reuses the per-(n, c) kernels of :class:`_SwitchableNormFn`: one statistics pass (BatchNorm's
    channels_last statistics kernel per sample on the CPU, centred), ``y = x * scale + shift`` with
    ``s = rsqrt(var + eps)`` (biased variance), ``scale = s * weight``, ``shift = bias - mean * scale``. Backward with
    ``G1 = sum_hw(g)``, ``G2 = sum_hw(g * (x - mean))`` from one reduction pass (S spatial values)::

        dL/dx = scale * (g - G1 / S - (x - mean) * s^2 * G2 / S)        (one pass)
        dL/dweight = sum_n(G2 * s)        dL/dbias = sum_n(G1)

    Double backward (``create_graph=True``) and batched gradients differentiate torch's group norm on a contiguous
    copy instead. Outputs:
    y (x's layout, never a view) and the per-(n, c) mean and unbiased variance (no gradient; for the running
    statistics, so that tracking needs no second pass).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        layout, count = _instance_layout(x), static_numel(x, 2)
        mean, var = _instance_stats(x, layout, count)  # unbiased variance (the running statistics' convention)
        s = torch.mul(var, (count - 1) / count).add_(eps).rsqrt_()
        scale = s if weight is None else s * as_param(weight, x.dtype)
        shift = (
            torch.mul(mean, scale).neg_()
            if bias is None
            else torch.addcmul(as_param(bias, x.dtype), mean, scale, value=-1)
        )
        ctx.save_for_backward(x, weight, bias)
        ctx.stats, ctx.eps, ctx.layout = (mean, s, scale), eps, layout
        ctx.mark_non_differentiable(mean, var)
        ctx.set_materialize_grads(False)
        return _instance_affine(x, scale, shift, layout), mean, var

    @staticmethod
    def backward(ctx, grad, *_stats):
        if grad is None:  # only the (non-differentiable) statistics were differentiated
            return None, None, None, None
        x, weight, bias = ctx.saved_tensors
        if torch.is_grad_enabled() or batched_backward(grad):  # create_graph=True or batched gradients (vmap): the
            # gradient of group norm, itself differentiable and batchable
            c, eps = x.shape[1], ctx.eps
            forward = lambda: torch.group_norm(x.contiguous(), c, group_norm_weight(weight, bias, x), bias, eps)  # noqa: E731
            return _composite_grads(forward, (x, weight, bias), grad) + (None,)
        mean, s, scale = ctx.stats
        layout, count = ctx.layout, static_numel(x, 2)
        g = same_layout(grad, x)
        g1, g2 = _instance_dots(g, x, mean, layout)
        gx = None
        if ctx.needs_input_grad[0]:
            a = torch.mul(scale, s.square()).mul_(g2).mul_(-1.0 / count)  # coefficient of x
            b = torch.mul(scale, g1).mul_(-1.0 / count).addcmul_(a, mean, value=-1)
            spatial = (1,) * (x.dim() - 2)
            gx = _instance_affine(x, a, b, layout).addcmul_(g, scale.view(scale.shape + spatial))
        d_w = None if weight is None else as_param((g2 * s).sum(0), weight.dtype)
        d_b = None if bias is None else as_param(g1.sum(0), bias.dtype)
        return gx, d_w, d_b, None


def instance_norm_in_layout(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float):
    """Instance normalization of a channels_last / channels_last_3d float32/float64 input in its own layout
    (:class:`_InstanceNormFn`, eager): returns ``(y, mean, var)``, the output and the per-(n, c) mean and unbiased
    variance (no gradient)."""
    return _InstanceNormFn.apply(x, weight, bias, eps)
