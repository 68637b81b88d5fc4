"""Pure tensor functions behind the normlab layers (the ``torch.nn.functional`` of normlab).

Every function here is stateless except where it takes running-statistics buffers explicitly and updates
them in place (as ``torch.nn.functional.batch_norm`` does). Each docstring states the formula it implements;
``docs/design.md`` gives the sources.

Shapes use N = batch, C = channels, ``*`` = any number of spatial dimensions.
"""

from __future__ import annotations

import contextlib
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

    Example:
        >>> x = torch.full((16,), 300.0, dtype=torch.float16) * torch.tensor([1.0, -1.0]).repeat(8).half()
        >>> mean, var = moments(x, 0)
        >>> var.item(), var.dtype          # the float16 variance would overflow (65504)
        (90000.0, torch.float32)
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
    y = (_stats_dtype(x) - mean) * torch.rsqrt(var + eps)
    if weight is not None or bias is not None:
        shape = (1, -1) + (1,) * len(dims)
        if weight is not None:
            y = y * weight.reshape(shape).to(y.dtype)
        if bias is not None:
            y = y + bias.reshape(shape).to(y.dtype)
    return y.to(x.dtype)


def _instance_recomputing() -> bool:
    """True while autograd runs a backward pass: a forward then is activation checkpointing's recomputation
    (``torch.utils.checkpoint``, reentrant or not), which must not update the running statistics a second time."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def _instance_can_sync() -> bool:
    """True when a host synchronisation is allowed (eager, not torch.compile / torch.export / jit.trace)."""
    return not torch.compiler.is_compiling() and not torch.jit.is_tracing()


def _instance_stats_value(t: Tensor, buffer: Tensor, where: str) -> Tensor:
    """``t`` (detached statistics) at the functorch level of the running ``buffer`` it will be written into: the
    grad wrappers of ``torch.func.grad`` are peeled (it then updates the buffers it captures, as torch's
    InstanceNorm does). Under ``vmap`` of a plain buffer the statistics differ per mapped sample, so no single
    update exists: an error, as torch's BatchNorm/InstanceNorm give (buffers batched by ensembling are updated)."""
    ft = torch._C._functorch
    if torch.compiler.is_compiling():
        return t
    floor = ft.maybe_get_level(buffer) if ft.is_functorch_wrapped_tensor(buffer) else -1
    while ft.is_functorch_wrapped_tensor(t) and ft.maybe_get_level(t) > floor:
        if ft.is_batchedtensor(t):
            raise RuntimeError(
                f"{where}: under torch.func.vmap a training step would update running_mean/running_var from "
                "per-sample batches; call .eval() (running statistics) or disable the running statistics"
            )
        if not ft.is_gradtrackingtensor(t):
            break
        t = ft.get_unwrapped(t)
    return t


@torch.no_grad()
def _instance_guarded_update(buffers: Sequence[Tensor], values: Sequence[Tensor], finite: Tensor) -> None:
    """``buffer <- value`` where ``finite`` (a 0-dim bool tensor) holds, else unchanged: tensor ops only (no host
    synchronisation or data-dependent branch, so torch.compile and torch.export protect the buffers as eager does)."""
    for buf, new in zip(buffers, values):
        new = torch.where(finite, new.to(buf.dtype), buf)
        with _instance_outside_transforms(buf, new):
            buf.copy_(new)


def _instance_outside_transforms(buf: Tensor, new: Tensor):
    """A context without torch.func's transforms for writing a plain value into a plain buffer (torch.func.grad
    refuses writes to captured tensors), else a no-op."""
    ft = torch._C._functorch
    if torch.compiler.is_compiling() or not torch._C._are_functorch_transforms_active():
        return contextlib.nullcontext()
    if ft.is_functorch_wrapped_tensor(buf) or ft.is_batchedtensor(new):  # batched buffers (ensembling): vmap writes
        return contextlib.nullcontext()
    return torch._C._DisableFuncTorch()


# --------------------------------------------------------------------------------------------------
# Batch renormalization
# --------------------------------------------------------------------------------------------------
def batch_moments(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-channel batch mean and biased variance of ``x`` (N, C, *) over all dims but 1, without gradient.

    Uses the statistics kernel behind BatchNorm (one fused pass, any memory format), which is several times faster
    on CPU than a generic reduction; under torch.compile, torch.jit.trace and torch.func transforms (that kernel has
    no fake-tensor implementation nor batching rule) the two-pass :func:`moments`, which the compiler fuses. Half
    inputs are reduced in float32; results are float32 (or float64) (C,).

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
        xs = _stats_dtype(x.detach())
        if _plain_eager(x):
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
        return _clip(r, rmax, inverse=True, in_place=False), _clip(d, dmax, inverse=False, in_place=False)


def _clip(t: Tensor, limit: float | Tensor, inverse: bool, in_place: bool = True) -> Tensor:
    """``t`` clipped (in place for a number limit unless ``in_place=False``: vmap has no batching rule for
    ``clamp_``) to ``[1/limit, limit]`` (``inverse``) or ``[-limit, limit]``."""
    if isinstance(limit, Tensor):
        limit = limit.to(t)
        return torch.clamp(t, limit.reciprocal() if inverse else -limit, limit)
    if not in_place:
        return torch.clamp(t, 1.0 / limit if inverse else -limit, limit)
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


def _plain_eager(x: Tensor) -> bool:
    """Batch renormalization's fused-path test: eager CPU/CUDA, and none of torch.compile, torch.jit.trace or a
    torch.func transform (grad, vmap, jacrev, ...), which need plain differentiable aten ops without host
    synchronisation (the composite path). The meta device is not eager either (shapes only)."""
    if not _fused_device(x) or torch.jit.is_tracing():
        return False
    return torch._C._functorch.peek_interpreter_stack() is None


class _BatchNormWithAffine(torch.autograd.Function):
    """BatchNorm with precomputed batch statistics and the per-channel affine ``weight * r``, ``bias + weight * d``.

    Forward: ``y = (x - mean) * invstd * (weight * r) + (bias + weight * d)`` in one pass of BatchNorm's own
    normalize kernel. Backward: BatchNorm's backward kernel (``native_batch_norm_backward`` with the saved mean and
    inverse std, as in BatchNorm training), then ``dL/dweight = dL/dscale * r + dL/dshift * d``, ``dL/dbias =
    dL/dshift``. r and d are constants (no gradient). The backward is built from differentiable ops, so double
    backward works as for BatchNorm.
    """

    @staticmethod
    def forward(x, weight, bias, mean, invstd, r, d, eps):
        if weight is None:
            scale, shift = r, d if bias is None else bias + d
        else:
            scale = weight * r
            shift = weight * d if bias is None else torch.addcmul(bias, weight, d)
        return _channel_affine(x, mean, invstd * scale, shift)

    @staticmethod
    def setup_context(ctx, inputs, output):  # the separate form torch.func.grad/jacrev/functional_call can run
        x, weight, bias, mean, invstd, r, d, eps = inputs
        ctx.save_for_backward(x, weight, mean, invstd, r, d)
        ctx.eps, ctx.has_bias = eps, bias is not None

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
    ops: for small inputs their dispatch cost, not the passes over x, is what separates this from BatchNorm.
    Returns ``(y, (batch_mean, batch_var))``."""
    with torch.no_grad():
        if prior is None:
            prior = (running_mean.clone(), running_var.clone())
        mean, var = torch.batch_norm_update_stats(x, running_mean, running_var, momentum)
        # BatchNorm's inverse std, 1 / sqrt(var + eps) evaluated in double as its CPU statistics kernel does (so the
        # result is bit for bit BatchNorm's); r = sigma_B / sigma and d as in renorm_correction.
        invstd = var.double().add(eps).rsqrt_().to(var.dtype)  # not in place: var.double() is var for float64
        inv_sigma = torch.rsqrt(prior[1] + eps)
        r = _clip(inv_sigma.div(invstd), rmax, inverse=True)
        d = _clip(torch.sub(mean, prior[0]).mul_(inv_sigma), dmax, inverse=False)
    return _BatchNormWithAffine.apply(x, weight, bias, mean, invstd, r, d, eps), (mean, var)


def _composite_batch_renorm(x, running_mean, running_var, weight, bias, momentum, eps, rmax, dmax, prior=None):
    """The same step from public ops: statistics, r and d from ``prior`` (clones of the running statistics before
    the step), ``F.batch_norm`` with batch statistics and the folded affine, then the running statistics are updated
    explicitly. torch.compile, torch.jit.trace and torch.func trace this one, and it is the reference the fused path
    is tested against. ``F.batch_norm`` never sees the running buffers: a compiled graph that read them after an
    in-place update inside ``F.batch_norm`` would compute r and d from the updated statistics. ``momentum`` may be a
    tensor (the cumulative average ``1 / num_batches_tracked`` without a host sync). Returns
    ``(y, (batch_mean, batch_var))``."""
    batch_mean, batch_var = batch_moments(x)
    if prior is None:
        prior = _snapshot(running_mean, running_var)
    r, d = renorm_correction(batch_mean, batch_var, prior[0], prior[1], eps, rmax, dmax)
    if weight is None:
        scale, shift = r, d if bias is None else bias + d
    else:
        scale = weight * r
        shift = weight * d if bias is None else bias + weight * d
    y = F.batch_norm(x, None, None, scale, shift, True, 0.0, eps)
    _update_running(running_mean, running_var, batch_mean, batch_var, x.numel() // x.shape[1], momentum)
    return y, (batch_mean, batch_var)


def _snapshot(running_mean: Tensor, running_var: Tensor) -> tuple[Tensor, Tensor]:
    """Copies of the running statistics before a step updates them (one ``torch.stack`` under torch.compile).

    Under torch.compile the partitioner may recompute cheap ops of the forward in the backward, and it treats module
    buffers as free to save: a ``clone`` of a buffer would be recomputed in the backward from the buffer the step has
    updated in place by then, so r and d (the weight gradient needs d) would come from the new statistics. A
    concatenation is not in its recomputation allowlist, so the snapshot itself is what it saves. Eager: two clones
    (fewer dispatched ops).
    """
    with torch.no_grad():
        same = running_mean.dtype == running_var.dtype and running_mean.shape == running_var.shape
        if not (same and torch.compiler.is_compiling()):
            return running_mean.clone(), running_var.clone()
        both = torch.stack([running_mean, running_var])
        return both[0], both[1]


def _update_running(running_mean, running_var, batch_mean, batch_var, count: int, momentum) -> None:
    """BatchNorm's update in place: ``running = (1 - momentum) * running + momentum * batch``, with the unbiased
    batch variance (``count / (count - 1)``) for ``running_var``."""
    with torch.no_grad():
        unbiased = batch_var * (count / (count - 1))
        running_mean.mul_(1 - momentum).add_((batch_mean * momentum).to(running_mean.dtype))
        running_var.mul_(1 - momentum).add_((unbiased * momentum).to(running_var.dtype))


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
    exactly as BatchNorm), BatchNorm's normalize kernel and BatchNorm's backward kernel (an autograd Function that calls
    them with the folded affine).
    The composite path (``fused=False``, and always under torch.compile, torch.jit.trace and torch.func transforms)
    calls ``F.batch_norm`` with batch statistics and the folded affine after a separate statistics pass, then updates
    the running statistics explicitly. Limits that are the numbers ``rmax=1, dmax=0`` call ``F.batch_norm``
    directly. Either way ``rmax=1, dmax=0`` gives exactly ``F.batch_norm``. The running sigma is
    ``sqrt(running_var + eps)`` (BatchNorm-compatible state; see README "Deviations").
    Half inputs: statistics in float32; half ``weight``/``bias`` (a ``.half()`` module) are used in float32; the
    output has x's dtype.

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
    if x.numel() == 0:  # BatchNorm's empty output (with a gradient path to weight and bias); nothing to update
        return F.batch_norm(x, None, None, weight, bias, True, 0.0, eps)
    return _batch_renorm_step(x, running_mean, running_var, weight, bias, momentum, eps, rmax, dmax, fused=fused)[0]


def _batch_renorm_step(x, running_mean, running_var, weight, bias, momentum, eps, rmax, dmax, prior=None, fused=None):
    """One training step of :func:`batch_renorm` with running statistics (the modules call this directly and pass
    ``prior``, their copy of the running statistics before the step). Returns ``(y, stats)``: the batch mean and
    biased variance, or None for the identity limits (then it is ``F.batch_norm`` itself)."""
    pdtype = _param_dtype(x)
    weight, bias = _as_param(weight, pdtype), _as_param(bias, pdtype)
    if _is_identity(rmax, dmax) and not isinstance(momentum, Tensor):
        return F.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps), None
    if fused is None:
        fused = _takes_fused(x, running_mean, running_var)
    if fused and not isinstance(momentum, Tensor):
        return _fused_batch_renorm(x, running_mean, running_var, weight, bias, momentum, eps, rmax, dmax, prior)
    return _composite_batch_renorm(x, running_mean, running_var, weight, bias, momentum, eps, rmax, dmax, prior)


def _takes_fused(x: Tensor, running_mean: Tensor, running_var: Tensor) -> bool:
    """Whether :func:`_batch_renorm_step` takes the fused path by default for these tensors."""
    pdtype = _param_dtype(x)
    return _plain_eager(x) and running_mean.dtype == pdtype and running_var.dtype == pdtype


def _step_moments(x: Tensor, running_mean: Tensor, running_var: Tensor) -> tuple[Tensor, Tensor]:
    """The batch mean and biased variance exactly as :func:`_batch_renorm_step` computes them with these running
    buffers (bit for bit: the key that matches a checkpoint recomputation to its original forward)."""
    if not _takes_fused(x, running_mean, running_var):
        return batch_moments(x)
    with torch.no_grad():  # the fused path's kernel call; momentum 0 leaves the copies as they are
        return torch.batch_norm_update_stats(x.detach(), running_mean.clone(), running_var.clone(), 0.0)


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
        if bn_stats is None:
            mean_bn = mu.mean(0, keepdim=True)
            bn_stats = (mean_bn, second.mean(0, keepdim=True) - mean_bn.square())
        means.append(bn_stats[0])
        variances.append(bn_stats[1])
    mw = torch.softmax(mean_weight.to(mu.dtype), 0)
    vw = torch.softmax(var_weight.to(mu.dtype), 0)
    if torch.is_grad_enabled() or mw.device.type != "cpu" or not _sn_fused_ok(mu):  # differentiable / traceable
        mean = sum(w * m for w, m in zip(mw, means))
        var = sum(w * v for w, v in zip(vw, variances))
    else:  # inside the fused Function: the same sums with Python-float weights (fewer dispatched ops)
        a, b = mw.tolist(), vw.tolist()
        mean, var = means[0] * a[0], variances[0] * b[0]
        for k in range(1, len(means)):
            mean.add_(means[k], alpha=a[k])
            var.add_(variances[k], alpha=b[k])
    return mean, var, (means, variances, mw, vw)


def _scalars(w: Tensor):
    """The softmax weights as Python floats on CPU (scalar arithmetic dispatches fewer ops), 0-dim tensors elsewhere
    (no device synchronisation)."""
    return w.tolist() if w.device.type == "cpu" else w.unbind()


def _sn_mix_backward(d_mean: Tensor, d_var: Tensor, parts, batch_bn: bool):
    """Backward of :func:`_sn_mix`: gradients of ``(mu, var_in, mean_weight, var_weight)`` from those of the mixed
    mean and variance (all (N, C) but the logits).

    With the softmax weights a (means) and b (variances), ``rows(X)`` the mean over channels (N, 1) and ``cols(X)``
    the mean over the batch (1, C): ``mean = a0 mu + a1 rows(mu) + a2 cols(mu)`` is self-adjoint in mu, and
    ``var = b0 q + b1 rows(q) + b2 cols(q) - (b0 mu^2 + b1 rows(mu)^2 + b2 cols(mu)^2)`` with
    ``q = var_in + mu^2``, so::

        d var_in = b0 d_var + b1 rows(d_var) + b2 cols(d_var)
        d mu     = a0 d_mean + a1 rows(d_mean) + a2 cols(d_mean)
                   + 2 b1 (mu - mean_ln) rows(d_var) + 2 b2 (mu - mean_bn) cols(d_var)
        d logits = softmax backward of g_k = sum(d_mean * mean_k)  (resp. d_var, variances)

    The BN terms only with batch statistics (``batch_bn``); running statistics are constants.
    """
    means, variances, mw, vw = parts
    mu = means[0]
    a, b = _scalars(mw), _scalars(vw)
    rows_m, rows_v = d_mean.mean(1, keepdim=True), d_var.mean(1, keepdim=True)
    d_var_in = torch.add(d_var * b[0], rows_v, alpha=b[1])
    d_mu = torch.add(d_mean * a[0], rows_m, alpha=a[1]).addcmul_(mu - means[1], rows_v, value=2 * b[1])
    if batch_bn:
        cols_m, cols_v = d_mean.mean(0, keepdim=True), d_var.mean(0, keepdim=True)
        d_var_in.add_(cols_v, alpha=b[2])
        d_mu.add_(cols_m, alpha=a[2]).addcmul_(mu - means[2], cols_v, value=2 * b[2])
    n, c = mu.shape
    reduced_m, reduced_v = [d_mean, rows_m * c], [d_var, rows_v * c]
    if len(means) == 3:
        reduced_m.append(d_mean.sum(0, keepdim=True))
        reduced_v.append(d_var.sum(0, keepdim=True))
    # g_k = sum(d_mean * mean_k) with the broadcast summed first: (N, C) . (N, C), (N, 1) . (N, 1), (1, C) . (1, C)
    g_mw = torch.stack([torch.vdot(r.flatten(), m.flatten()) for r, m in zip(reduced_m, means)])
    g_vw = torch.stack([torch.vdot(r.flatten(), v.flatten()) for r, v in zip(reduced_v, variances)])
    d_mw = torch._softmax_backward_data(g_mw, mw, 0, mw.dtype)
    d_vw = torch._softmax_backward_data(g_vw, vw, 0, vw.dtype)
    return d_mu, d_var_in, d_mw, d_vw


@torch.no_grad()
def _sn_update_running(running_mean, running_var, batch, momentum: float, using_moving_average: bool,
                       where: str = "switchable_norm") -> Tensor:
    """Official convention: ``running = momentum * running + (1 - momentum) * batch`` (or sums without moving
    average: batch means and E[x^2]). A non-finite batch leaves the buffers unchanged (tensor ops only); returns
    whether the batch statistics were finite (a 0-dim bool tensor)."""
    c = running_mean.numel()
    mean_bn, var_bn = (_instance_stats_value(t.detach(), running_mean, where).reshape(c) for t in batch)
    finite = torch.isfinite(torch.cat([mean_bn, var_bn])).all()
    if using_moving_average:  # lerp(batch, running, momentum) = momentum * running + (1 - momentum) * batch
        new_mean = torch.lerp(mean_bn.to(running_mean), running_mean, momentum)
        new_var = torch.lerp(var_bn.to(running_var), running_var, momentum)
    else:
        new_mean = running_mean + mean_bn.to(running_mean)
        new_var = running_var + (mean_bn.square() + var_bn).to(running_var)
    _instance_guarded_update((running_mean, running_var), (new_mean, new_var), finite)
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
    xs = _stats_dtype(x)
    mu, var_in = moments(xs, tuple(range(2, x.dim())), correction=1)  # (N, C)
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
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    return "samples" if fmt is not None and x.is_contiguous(memory_format=fmt) else "generic"


def _instance_stats(x: Tensor, layout: str) -> tuple[Tensor, Tensor]:
    """Per-(n, c) mean and biased variance of ``x`` (N, C, *) over the spatial dims, both (N, C), two-pass."""
    n, c = x.shape[:2]
    if layout == "samples":  # BatchNorm's channels_last statistics kernel, one sample at a time
        stats = [torch.batch_norm_update_stats(x[i : i + 1], None, None, 0.0) for i in range(n)]
        return torch.stack([m for m, _ in stats]), torch.stack([v for _, v in stats])
    dims = tuple(range(2, x.dim()))
    if layout == "generic" and x.device.type != "cpu":
        var, mu = torch.var_mean(x, dims, correction=0)
        return mu, var
    mu = x.mean(dims)
    centered = x - mu.reshape(x.shape[:2] + (1,) * len(dims))
    var = torch.linalg.vector_norm(centered, dim=dims).square_().div_(x[0, 0].numel())
    return mu, var


def _instance_dots(g: Tensor, x: Tensor, mu: Tensor, layout: str) -> tuple[Tensor, Tensor]:
    """Per-(n, c) sums ``sum(g)`` and ``sum(g * (x - mu))`` over the spatial dims, both (N, C). On CPU this is
    BatchNorm's backward reduction (centred dot product and sum in one pass, no temporary)."""
    n, c = x.shape[:2]
    mask = [False, True, True]
    if layout == "rows":
        ones = torch.ones(n * c, dtype=mu.dtype)
        _, dot, total = torch.ops.aten.native_batch_norm_backward(
            g.reshape(1, n * c, -1), x.reshape(1, n * c, -1), None, None, None, mu.reshape(-1), ones, True, 0.0, mask
        )
        return total.reshape(n, c), dot.reshape(n, c)
    if layout == "samples":
        ones = torch.ones(c, dtype=mu.dtype)
        parts = [torch.ops.aten.native_batch_norm_backward(
            g[i : i + 1], x[i : i + 1], None, None, None, mu[i], ones, True, 0.0, mask) for i in range(n)]
        return torch.stack([p[2] for p in parts]), torch.stack([p[1] for p in parts])
    dims = tuple(range(2, x.dim()))
    centered = x - mu.reshape(x.shape[:2] + (1,) * len(dims))
    return g.sum(dims), (g * centered).sum(dims)


def _instance_affine(x: Tensor, scale: Tensor, shift: Tensor, layout: str) -> Tensor:
    """``x * scale + shift`` with (N, C) coefficients, in x's memory format (CPU rows: BatchNorm's normalize
    kernel on the (1, N*C, L) view, with running_var 1 and eps 0 it is exactly this affine)."""
    n, c = x.shape[:2]
    if layout == "rows":  # written through a (1, N*C, L) view into y, which is returned: y is not a view
        zeros = torch.zeros(n * c, dtype=scale.dtype)
        ones = torch.ones(n * c, dtype=scale.dtype)
        y, flat, unused = torch.empty_like(x), (1, n * c, -1), scale.new_empty(0)
        torch.ops.aten.native_batch_norm.out(
            x.view(flat), scale.reshape(-1), shift.reshape(-1), zeros, ones, False, 0.0, 0.0,
            out=y.view(flat), save_mean=unused, save_invstd=unused,
        )
        return y
    shape = (n, c) + (1,) * (x.dim() - 2)
    return torch.addcmul(shift.reshape(shape), x, scale.reshape(shape))


def _same_layout(g: Tensor, x: Tensor) -> Tensor:
    """``g`` in ``x``'s memory format (the fused kernels read both with the same strides)."""
    if x.is_contiguous():
        return g.contiguous()
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    return g.contiguous(memory_format=fmt) if fmt is not None else g


class _SwitchableNormFn(torch.autograd.Function):
    """Switchable normalization with an explicit backward (see :func:`switchable_norm` for the formula).

    Forward: one statistics pass for the per-(n, c) mean and variance (LN and BN statistics are their averages), the
    (N, C)-sized mixture, one normalize pass ``x * scale + shift``. Backward, with ``G1 = sum_hw(g)`` and
    ``G2 = sum_hw(g * (x - mu))`` from one reduction pass (``s = rsqrt(var + eps)``, ``scale = s * weight``)::

        dL/dscale = G2 + (mu - mean) * G1        dL/dmean = -scale * G1        dL/dbias = sum_n(G1)
        dL/dweight = sum_n(dL/dscale * s)        dL/dvar = -dL/dscale * weight * s^3 / 2
        (dL/dmu, dL/dvar_in, dL/dlogits) = _sn_mix_backward(dL/dmean, dL/dvar)
        dL/dx = g * scale + dL/dmu / S + dL/dvar_in * 2 (x - mu) / (S - 1)        (one pass)

    Double backward (``create_graph=True``) differentiates the composite formula instead. Outputs: y (never a
    view, so in-place ops on it work) and, with batch BN statistics, their (1, C) mean and variance (no gradient;
    the caller updates the running statistics with them), else two None.
    """

    @staticmethod
    def forward(ctx, x, mean_weight, var_weight, weight, bias, bn_mean, bn_var, cfg):
        eps, using_bn = cfg
        xs, layout = _stats_dtype(x), _instance_layout(x)
        mu, var = _instance_stats(xs, layout)
        count = x[0, 0].numel()
        bn_stats = False if not using_bn else (None if bn_mean is None else (bn_mean, bn_var))
        mean, var_mix, parts = _sn_mix(mu, var.mul_(count / (count - 1)), mean_weight, var_weight, bn_stats)
        s = torch.rsqrt(var_mix.add_(eps))
        scale = s if weight is None else s * weight.to(xs.dtype)
        shift = torch.mul(mean, scale).neg_()
        if bias is not None:
            shift = shift.add_(bias.to(xs.dtype))
        ctx.save_for_backward(x, mean_weight, var_weight, weight, bias, bn_mean, bn_var)
        ctx.stats = (mean, s, scale, parts, bn_stats is None)
        ctx.cfg, ctx.layout = cfg, layout
        y = _instance_affine(xs, scale, shift, layout).to(x.dtype)
        if bn_stats is not None:
            return y, None, None
        batch = (parts[0][2], parts[1][2])
        ctx.mark_non_differentiable(*batch)
        ctx.set_materialize_grads(False)  # no zero gradients built for the statistics
        return (y,) + batch

    @staticmethod
    def backward(ctx, grad, *_batch_stats):
        if grad is None:  # only the (non-differentiable) statistics were differentiated
            return (None,) * 8
        if torch.is_grad_enabled():
            return _switchable_double_backward(ctx, grad)
        x, mean_weight, var_weight, weight, bias = ctx.saved_tensors[:5]
        mean, s, scale, parts, batch_bn = ctx.stats
        mu, layout, count = parts[0][0], ctx.layout, x[0, 0].numel()
        xs = _stats_dtype(x)
        g = _same_layout(grad, x).to(xs.dtype)
        g1, g2 = _instance_dots(g, xs, mu, layout)
        d_scale = torch.addcmul(g2, mu - mean, g1)
        d_mean = torch.mul(scale, g1).neg_()
        d_s = d_scale if weight is None else d_scale * weight.to(xs.dtype)
        d_var = d_s.mul_(s.pow(3)).mul_(-0.5)
        d_mu, d_var_in, d_mw, d_vw = _sn_mix_backward(d_mean, d_var, parts, batch_bn)
        gx = None
        if ctx.needs_input_grad[0]:
            a = d_var_in.mul_(2.0 / (count - 1))
            b = torch.addcmul(d_mu.div_(count), a, mu, value=-1.0)
            spatial = (1,) * (x.dim() - 2)
            gx = _instance_affine(xs, a, b, layout).addcmul_(g, scale.reshape(scale.shape + spatial)).to(x.dtype)
        d_w = None if weight is None else (d_scale * s).sum(0).to(weight.dtype)
        d_b = None if bias is None else g1.sum(0).to(bias.dtype)
        return gx, d_mw.to(mean_weight.dtype), d_vw.to(var_weight.dtype), d_w, d_b, None, None, None


def _switchable_double_backward(ctx, grad):
    """Backward with ``create_graph=True``: the gradient of the composite formula, itself differentiable."""
    x, mean_weight, var_weight, weight, bias, bn_mean, bn_var = ctx.saved_tensors
    eps, using_bn = ctx.cfg[:2]
    bn_stats = False if not using_bn else (None if bn_mean is None else (bn_mean, bn_var))
    inputs = [t for t in (x, mean_weight, var_weight, weight, bias) if t is not None and t.requires_grad]
    y, _ = _switchable_composite(x, mean_weight, var_weight, weight, bias, bn_stats, eps)
    found = torch.autograd.grad(y.to(x.dtype), inputs, grad, create_graph=True, allow_unused=True)
    by_id = {id(t): g for t, g in zip(inputs, found)}
    return tuple(by_id.get(id(t)) if t is not None else None for t in (x, mean_weight, var_weight, weight, bias)) + (
        None, None, None)


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
    in place as ``running = momentum * running + (1 - momentum) * batch`` (official convention: ``momentum`` weighs
    the *old* value); without moving average the buffers accumulate sums. In eval the running buffers are used.
    Statistics are computed in float32 for half inputs; the output keeps x's dtype and memory format.

    Implementation: eager on CPU/CUDA (``fused`` None or True) an autograd Function with an explicit backward:
    one statistics pass and one normalize pass forward, one reduction pass and one final pass backward,
    BatchNorm's CPU kernels doing the passes; its output is never a view (in-place ops such as
    ``relu_`` work). ``fused=False`` (and torch.compile/torch.export, jit.trace, torch.func transforms, the meta
    device, empty inputs) use the composite formula from differentiable ops.

    Running statistics: a batch whose BN statistics are not finite leaves them unchanged (tensor ops, also when
    compiled); an empty batch (N = 0) and the recomputation of activation checkpointing do not update them.

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
        momentum: the weight of the OLD running value (official convention). Default: 0.9.
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
    return _sn_forward(x, mean_weight, var_weight, weight, bias, running_mean, running_var, training, momentum, eps,
                       using_bn, using_moving_average, fused)[0]


def _sn_fused_ok(x: Tensor) -> bool:
    """Whether :class:`_SwitchableNormFn` may run: eager on CPU/CUDA with a non-empty input. torch.compile,
    torch.export, jit.trace, torch.func transforms, other devices (meta) and empty inputs take the composite path."""
    return (
        x.device.type in ("cpu", "cuda")
        and x.numel() > 0
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and not torch._C._are_functorch_transforms_active()
    )


def _sn_forward(x, mean_weight, var_weight, weight, bias, running_mean, running_var, training, momentum, eps,
                using_bn, using_moving_average, fused, where="switchable_norm"):
    """:func:`switchable_norm`, returning ``(y, finite)``: ``finite`` is None without a running-statistics update
    (eval, no BN, no buffers, an empty batch, checkpointing's recomputation), else a 0-dim bool tensor telling
    whether the batch statistics were finite (if not, the buffers were left unchanged)."""
    if x.dim() < 3:
        raise ValueError(f"{where}: expected input (N, C, *spatial) with >= 3 dims, got {x.dim()}D")
    n, c = x.shape[:2]
    spatial = x.shape[2:].numel()
    if spatial < 2:
        raise ValueError(f"{where}: instance statistics need more than 1 spatial value per channel, got {spatial}")
    has_running = running_mean is not None and running_var is not None
    update = training and using_bn and has_running and n > 0 and not _instance_recomputing()
    bn_stats = _sn_bn_stats(using_bn, training, running_mean, running_var, c, _stats_dtype(x).dtype)
    if fused is None:
        fused = _sn_fused_ok(x)
    if fused:
        bn_mean, bn_var = bn_stats if isinstance(bn_stats, tuple) else (None, None)
        y, *batch = _SwitchableNormFn.apply(x, mean_weight, var_weight, weight, bias, bn_mean, bn_var, (eps, using_bn))
        batch = None if batch[0] is None else batch
    else:
        y, batch = _switchable_composite(x, mean_weight, var_weight, weight, bias, bn_stats, eps)
        y = y.to(x.dtype)
    finite = None
    if update and batch is not None:
        finite = _sn_update_running(running_mean, running_var, batch, momentum, using_moving_average, where)
    return y, finite


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
    x = _stats_dtype(s)
    sq = x.square().sum(dim, keepdim=True)
    return (x * (sq / (1.0 + sq)) * torch.rsqrt(sq + eps)).to(s.dtype)
