"""Instance normalization modules built on :func:`normlab.functional.instance_norm`.

``InstanceNorm1d/2d/3d`` take the constructor arguments of ``torch.nn.InstanceNorm1d/2d/3d`` (torch 2.13's
keyword ``bias=`` included) and keep their ``state_dict`` keys (``weight``, ``bias``, ``running_mean``,
``running_var``, ``num_batches_tracked``), so a torch checkpoint loads unchanged. The forward is one call of
``instance_norm_step``; ``torch.fx.symbolic_trace`` records the layer as one node that runs it in the layer's mode
when the graph runs (as torch's ``call_module``). Differences from torch:

- statistics of float16/bfloat16 inputs are computed in float32 (values around 1e4 stay finite), by
  :func:`normlab.functional.instance_norm`; float32/float64 inputs use torch's fused group-norm kernel with one
  channel per group (same formula, faster; see ``benchmarks/bench_norms.py``);
- channels_last (and channels_last_3d) inputs give outputs in the same memory format (torch's CPU kernel copies
  them to a contiguous tensor and returns that); from 65536 values per sample they are normalized in their own
  layout, without a layout copy (smaller ones go through a contiguous copy, which costs less there);
- with ``track_running_stats`` the running statistics come from the statistics of the normalize pass (no second
  pass over the input);
- a channel-count mismatch is an error even with ``affine=False`` (torch only warns);
- tf.contrib-style ``center`` (learn ``bias``) and ``scale`` (learn ``weight``) can be chosen separately.
- with ``track_running_stats``, ``momentum=None`` means a cumulative average (as BatchNorm; torch's InstanceNorm
  silently skips the update) and ``num_batches_tracked`` counts the updates; running statistics stay float32 after
  ``.half()``, and a non-finite batch leaves them unchanged (tensor ops, no host synchronisation, eager and
  compiled; counted in ``skipped_batches`` and reported as a RuntimeWarning at ``.eval()``: the policy of every
  normlab layer, ``docs/design.md`` "Non-finite batches"), as does an empty batch;
  activation checkpointing updates them once.
"""

from __future__ import annotations

import functools
from string import Template

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from normlab import functional as NF

from .._checks import check_number
from .._dispatch import (
    HALF,
    all_finite,
    channels_last_format,
    count_into,
    forward_ad_active,
    fx_node,
    guarded_update,
    layer_step,
    param_dtype,
    plain_eager,
    recomputing,
    static_numel,
    stats_value,
)
from .._functions import group_norm_weight, instance_norm_in_layout
from ._docs import fill
from ._float32_stats import Float32StatsModule
from ._non_finite import SkippedBatches

__all__ = ["InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d"]

torch.fx.wrap("layer_step")  # torch.fx.symbolic_trace records the layer as this one call (see forward)
torch.fx.wrap("instance_norm_step")  # ... and traces a layer at the root of the trace as this one call

_IN_LAYOUT_MIN_SAMPLE = 1 << 16
"""Values per sample (C * spatial) from which a channels_last / channels_last_3d input is normalized in its own
layout (no copies, but about 30 more dispatched ops and per-sample kernel calls); smaller ones go through a
contiguous copy, which costs less there. The crossover measured on a CPU, one thread (``benchmarks/RESULTS.md``,
issue 25, third round): the copy is cheaper up to (2, 64, 28, 28) and (16, 32, 16, 16), the in-layout route from
(2, 64, 32, 32), 2.5-3.5x faster there and above."""


# The docstring of the public classes: one text, filled in per dimension ($input, $over, $memory, $example, ...).
_DOC = Template(r"""Instance normalization over $input inputs: per sample and channel over $over.

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \gamma + \beta

    with the mean and biased variance over $over of each sample and channel, computed in float32 for
    float16/bfloat16 inputs. A drop-in for ``torch.nn.InstanceNorm$dim`` (same constructor arguments and
    ``state_dict`` keys) that rejects a channel-count mismatch even with ``affine=False`` and can learn ``bias``
    (``center``) and ``weight`` (``scale``) separately, tf.contrib style.$memory
    With ``track_running_stats`` the running statistics are used in eval mode; a non-finite batch leaves them
    unchanged and is counted in the non-persistent buffer ``skipped_batches`` (no host synchronisation; a
    RuntimeWarning at ``.eval()`` or from :func:`normlab.nn.skipped_batches`; the policy of every normlab layer,
    ``docs/design.md`` "Non-finite batches").

    Args:
        num_features: C, the number of channels (dim 1 of the input, dim 0 of an unbatched one).
        eps: added to the variance inside the square root (> 0). Default: 1e-5.
        momentum: the running-statistics update factor, BatchNorm's convention (weight of the new value);
            ``None``: cumulative average (torch's InstanceNorm silently skips the update). Default: 0.1.
        affine: learn ``weight`` (init 1) and ``bias`` (init 0); the default of ``center`` and ``scale``.
            Default: False.
        track_running_stats: keep running statistics of the per-instance mean and unbiased variance (float32
            after ``.half()``) and use them in eval mode. Default: False.
        device: the device of the parameters and buffers. Default: None (torch's default device).
        dtype: the dtype of the parameters and buffers. Default: None (torch's default dtype).
        bias: with ``affine``, learn ``bias`` too (keyword-only, as torch 2.13's ``nn.InstanceNorm$dim``:
            ``affine=True, bias=False`` learns ``weight`` only). Default: True.
        center: learn ``bias`` (keyword-only). Default: None (``affine and bias``).
        scale: learn ``weight`` (keyword-only). Default: None (``affine``).

    Shape:
        - Input: $input or unbatched $unbatched
        - Output: the same shape, dtype and memory format as the input.

    Example:
$example
    """)


_doc = functools.partial(fill, _DOC, optional=("memory",))


class _InstanceNorm(SkippedBatches, Float32StatsModule):
    """Shared implementation; subclasses set ``_spatial_dims`` (1, 2 or 3) and ``_layout``."""

    _normlab_norm = True
    _spatial_dims = 2
    _layout = "(N, C, H, W)"

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = False,
        track_running_stats: bool = False,
        device=None,
        dtype=None,
        *,
        bias: bool = True,
        center: bool | None = None,
        scale: bool | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        check_number(name, "num_features", num_features, integer=True, low=1)
        if not eps > 0:
            raise ValueError(f"{name}: eps must be > 0, got {eps}")
        if momentum is not None and not 0.0 <= momentum <= 1.0:
            raise ValueError(f"{name}: momentum must be in [0, 1] or None (cumulative average), got {momentum}")
        if center and not bias:
            raise ValueError(f"{name}: center=True learns a bias, which bias=False leaves out; give one of them")
        factory = {"device": device, "dtype": dtype}
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.center = (affine and bool(bias)) if center is None else bool(center)
        self.scale = affine if scale is None else bool(scale)
        self.affine = self.scale  # torch's meaning: a weight is learned (and a bias unless bias=False)
        self.track_running_stats = track_running_stats
        self._init_state(factory)

    def _init_state(self, factory: dict) -> None:
        """The parameters (``weight`` with ``scale``, ``bias`` with ``center``) and, with ``track_running_stats``,
        torch's running-statistics buffers and the ``skipped_batches`` count."""
        c, device = self.num_features, factory["device"]
        self.register_parameter("weight", nn.Parameter(torch.ones(c, **factory)) if self.scale else None)
        self.register_parameter("bias", nn.Parameter(torch.zeros(c, **factory)) if self.center else None)
        if self.track_running_stats:
            self.register_buffer("running_mean", torch.zeros(c, **factory))
            self.register_buffer("running_var", torch.ones(c, **factory))
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device))
            self._init_skipped(device)
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
            self.register_buffer("skipped_batches", None, persistent=False)

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            self.running_mean.zero_()
            self.running_var.fill_(1)
            self.num_batches_tracked.zero_()
            self._reset_skipped()

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, center={self.center}, "
            f"scale={self.scale}, track_running_stats={self.track_running_stats}"
        )

    def forward(self, x: Tensor) -> Tensor:
        """x: (N, C, *spatial) or unbatched (C, *spatial) -> same shape, dtype and memory format: one call of
        ``instance_norm_step`` (the input checks, the step and the running statistics). ``torch.fx.symbolic_trace``
        records one node, ``layer_step(layer, x)``, which runs ``_forward_step`` when the graph runs (in the mode the
        layer is in then, as a BatchNorm's ``call_module``)."""
        return layer_step(self, x) if fx_node(self, x) else self._forward_step(x)

    def _forward_step(self, x: Tensor) -> Tensor:
        return instance_norm_step(
            x,
            self.weight,
            self.bias,
            self.running_mean,
            self.running_var,
            (self.num_batches_tracked, self.skipped_batches) if self.track_running_stats else None,
            training=self.training,
            momentum=self.momentum,
            eps=self.eps,
            layer=(self.num_features, self._spatial_dims, self._layout, type(self).__name__),
        )


def instance_norm_step(x, weight, bias, running_mean, running_var, counters, *, training, momentum, eps, layer):
    """The forward of :class:`InstanceNorm1d`/``2d``/``3d``: the input checks, the normalization and (training with
    running statistics) their update, from tensors and constants only. ``counters``:
    ``(num_batches_tracked, skipped_batches)`` with running statistics, else None; ``layer``:
    ``(num_features, spatial_dims, layout, name)``."""
    if _check_input(x, layer):  # unbatched (C, *spatial)
        x = x.unsqueeze(0)
        step = instance_norm_step(
            x,
            weight,
            bias,
            running_mean,
            running_var,
            counters,
            training=training,
            momentum=momentum,
            eps=eps,
            layer=layer,
        )
        return step.squeeze(0)
    if training or running_mean is None:
        if x.shape[2:].numel() < 2:
            raise ValueError(
                f"{layer[3]}: expected more than 1 spatial value per channel when using instance statistics, got "
                f"input of shape {tuple(x.shape)}"
            )
        track = training and running_mean is not None
        y, stats = _normalize_with_instance_stats(x, weight, bias, eps, track)
        if track and static_numel(x, 0, 1) > 0 and not recomputing():  # not an empty batch, nor a recomputation
            finite = _update_running_stats(x, stats, running_mean, running_var, counters[0], momentum, layer[3])
            count_into(counters[1], ~finite)
        return y
    return _normalize_with_running_stats(x, weight, bias, running_mean, running_var, eps)


def _check_input(x: Tensor, layer) -> bool:
    """Validate ``x``; return True when it is unbatched (C, *spatial)."""
    num_features, k, layout, name = layer
    if x.dim() not in (k + 1, k + 2):
        raise ValueError(f"{name}: expected {k + 2}D input {layout} (or {k + 1}D unbatched), got {x.dim()}D input")
    unbatched = x.dim() == k + 1
    channels = x.shape[0] if unbatched else x.shape[1]
    if channels != num_features:
        raise ValueError(f"{name}: expected {num_features} channels (num_features), got {channels}")
    return unbatched


def _normalize_with_instance_stats(x: Tensor, weight, bias, eps: float, track: bool) -> tuple[Tensor, tuple | None]:
    """The output and, when ``track`` and the route computes them anyway, the per-(n, c) mean and unbiased variance
    for the running statistics (else None: :func:`_update_running_stats` takes its own pass).

    Routes, decided here once: float16/bfloat16 (statistics in float32) :func:`normlab.functional.instance_norm`;
    eager float32/float64 contiguous input: torch's fused group-norm kernel with one channel per group
    (``native_group_norm``, faster than torch's own instance norm on the CPU, exact double backward), whose mean and
    inverse std give the running statistics (a smaller channels_last sample, see ``_IN_LAYOUT_MIN_SAMPLE``: on a
    contiguous copy, the output returned in the input's layout); eager channels_last / channels_last_3d with at least
    ``_IN_LAYOUT_MIN_SAMPLE`` values per sample: :func:`normlab._functions.instance_norm_in_layout` in the input's
    layout (no layout copy); torch.compile (non-empty input): :func:`_compiled_instance_norm`; torch.export,
    jit.trace, torch.func, forward-mode AD, the meta device and empty inputs: group norm on a contiguous copy (torch's
    CPU channels_last group norm computes the variance as E[x^2] - E[x]^2 and loses all precision for large means),
    the output returned in the input's memory format."""
    if x.dtype in HALF:
        return NF.instance_norm(x, weight, bias, eps), None
    if torch.compiler.is_compiling() and static_numel(x) > 0:
        return _compiled_instance_norm(x, weight, bias, eps, track)
    fmt, c = channels_last_format(x), x.shape[1]
    gn_weight = group_norm_weight(weight, bias, x)
    if not plain_eager(x) or static_numel(x) == 0 or forward_ad_active():
        if fmt is None:
            return F.group_norm(x, c, gn_weight, bias, eps), None
        return F.group_norm(x.contiguous(), c, gn_weight, bias, eps).contiguous(memory_format=fmt), None
    if fmt is not None and static_numel(x, 1) >= _IN_LAYOUT_MIN_SAMPLE:
        y, mean, var = instance_norm_in_layout(x, weight, bias, eps)
        return y, (mean, var)
    n, count = x.shape[0], static_numel(x, 2)
    y, mean, rstd = torch.native_group_norm(x.contiguous(), gn_weight, bias, n, c, count, c, eps)
    if fmt is not None:
        y = y.contiguous(memory_format=fmt)
    if not track:
        return y, None
    with torch.no_grad():  # the unbiased variance from group norm's 1 / sqrt(var + eps)
        var = rstd.detach().pow(-2).sub_(eps).mul_(count / (count - 1))
    return y, (mean.detach(), var)


def _compiled_instance_norm(x: Tensor, weight, bias, eps: float, track: bool) -> tuple[Tensor, tuple | None]:
    """The route under torch.compile, in the arithmetic torch's ``F.instance_norm`` compiles to (BatchNorm's
    decomposition on the (1, N*C, *) view: ``torch.var_mean``, then ``(x - mean) * rsqrt(var + eps)`` and the
    affine). Contiguous input: ``F.instance_norm`` itself, so the compiled kernels are torch's, and the running
    statistics' update takes the same ``var_mean`` call on the same view, which the compiler merges with the one
    inside (no pass of its own). channels_last: the same arithmetic written on ``x`` as it is, with no layout copy
    (torch's copies the input to contiguous and returns a contiguous output). (Group norm's decomposition, the
    eager route's kernel, takes one more pass over the input and recomputes its statistics in the backward.)"""
    n, c, count = x.shape[0], x.shape[1], static_numel(x, 2)
    if channels_last_format(x) is None:
        y = F.instance_norm(x.contiguous(), None, None, weight, bias, True, 0.0, eps)
        view = x.contiguous().view(1, n * c, *x.shape[2:])
        dims = [0] + list(range(2, x.dim()))
    else:
        y, view, dims = None, x, list(range(2, x.dim()))
    if y is None or track:
        var, mean = torch.var_mean(view, dims, correction=0, keepdim=True)
    if y is None:
        y = (x - mean) * torch.rsqrt(var + eps)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        y = y if weight is None else y * weight.reshape(shape)
        y = y if bias is None else y + bias.reshape(shape)
    if not track:
        return y, None
    with torch.no_grad():  # the per-(n, c) mean and unbiased variance for the running statistics
        return y, (mean.detach().reshape(n, c), var.detach().reshape(n, c) * (count / (count - 1)))


@torch.no_grad()
def _update_running_stats(x, stats, running_mean, running_var, num_batches_tracked, momentum, name: str) -> Tensor:
    """torch's convention: running <- (1 - momentum) * running + momentum * mean over the batch of the per-instance
    mean / unbiased variance (momentum=None: cumulative average), from ``stats`` (the per-(n, c) mean and unbiased
    variance) or, when None, a statistics pass over ``x``. Tensor ops only (no host synchronisation): a non-finite
    batch leaves the statistics and ``num_batches_tracked`` unchanged, also when compiled. Returns whether the batch
    statistics were finite (0-dim bool tensor)."""
    if stats is None:
        dims = tuple(range(2, x.dim()))
        stats = NF.moments(x.detach(), dims, correction=1)  # (N, C), float32 for half inputs
    mean, var = stats
    batch_mean = stats_value(mean.mean(0), running_mean, name)
    batch_var = stats_value(var.mean(0), running_var, name)
    finite = all_finite(batch_mean, batch_var)
    count = num_batches_tracked + finite.to(num_batches_tracked.dtype)
    factor = 1.0 / count.clamp_min(1).to(running_mean.dtype) if momentum is None else momentum
    new_mean = running_mean.lerp(batch_mean.to(running_mean.dtype), factor)
    new_var = running_var.lerp(batch_var.to(running_var.dtype), factor)
    guarded_update((running_mean, running_var, num_batches_tracked), (new_mean, new_var, count), finite)
    return finite


def _normalize_with_running_stats(x: Tensor, weight, bias, running_mean, running_var, eps: float) -> Tensor:
    shape = (1, -1) + (1,) * (x.dim() - 2)
    stats_dtype = param_dtype(x)
    scale = torch.rsqrt(running_var.to(stats_dtype) + eps)
    shift = -running_mean.to(stats_dtype) * scale
    if weight is not None:
        scale = scale * weight.to(stats_dtype)
        shift = shift * weight.to(stats_dtype)
    if bias is not None:
        shift = shift + bias.to(stats_dtype)
    y = x.to(stats_dtype) * scale.reshape(shape) + shift.reshape(shape)
    return y.to(x.dtype)


class InstanceNorm1d(_InstanceNorm):
    __doc__ = _doc(
        input="(N, C, L)",
        unbatched="(C, L)",
        over="L",
        dim="1d",
        example="""
>>> InstanceNorm1d(16, affine=True)(torch.randn(8, 16, 40)).shape
torch.Size([8, 16, 40])
""",
    )

    _spatial_dims = 1
    _layout = "(N, C, L)"


class InstanceNorm2d(_InstanceNorm):
    __doc__ = _doc(
        input="(N, C, H, W)",
        unbatched="(C, H, W)",
        over="H, W",
        dim="2d",
        memory=" channels_last inputs give channels_last outputs (torch's CPU kernel returns contiguous ones).",
        example="""
>>> x = torch.randn(2, 64, 32, 32).to(memory_format=torch.channels_last)
>>> InstanceNorm2d(64)(x).is_contiguous(memory_format=torch.channels_last)
True
""",
    )

    _spatial_dims = 2
    _layout = "(N, C, H, W)"


class InstanceNorm3d(_InstanceNorm):
    __doc__ = _doc(
        input="(N, C, D, H, W)",
        unbatched="(C, D, H, W)",
        over="D, H, W",
        dim="3d",
        memory=" channels_last_3d inputs give channels_last_3d outputs.",
        example="""
>>> InstanceNorm3d(4)(torch.randn(2, 4, 3, 5, 5)).shape
torch.Size([2, 4, 3, 5, 5])
""",
    )

    _spatial_dims = 3
    _layout = "(N, C, D, H, W)"
