"""Batch Renormalization (Ioffe 2017, arXiv 1702.03275) as drop-in replacements for ``nn.BatchNorm*d``.

Training, per channel c (``r`` and ``d`` carry no gradient)::

    sigma_B = sqrt(var_B + eps)                      (biased batch variance, eps inside the sqrt)
    sigma   = sqrt(running_var + eps)
    r = clip(sigma_B / sigma, 1/rmax, rmax)          d = clip((mu_B - running_mean) / sigma, -dmax, dmax)
    y = weight * ((x - mu_B) / sigma_B * r + d) + bias

Inference is plain BatchNorm inference. ``rmax=1, dmax=0`` is exactly BatchNorm. r and d are per-channel constants,
so a training step is one BatchNorm step with weight ``weight * r`` and bias ``bias + weight * d``: one statistics
pass, BatchNorm's normalize kernel, BatchNorm's backward kernel.

API (the arguments are on each class):

* ``BatchRenorm2d(64)``: the paper's schedule (:class:`RenormSchedule` defaults: identity for 5k steps, then
  linear to rmax=3 at 40k and dmax=5 at 25k steps), driven by ``num_batches_tracked``.
* ``BatchRenorm2d(64, rmax=3.0, dmax=5.0)``: constant limits (a missing one means "no correction":
  rmax 1 or dmax 0).
* ``BatchRenorm2d(64, schedule=RenormSchedule(warmup_steps=1000, ...))`` or any picklable callable
  ``step -> (rmax, dmax)``.

State: exactly BatchNorm's keys (``weight``, ``bias``, ``running_mean``, ``running_var``, ``num_batches_tracked``),
so BatchNorm checkpoints load into BatchRenorm and back. ``running_var`` holds the unbiased variance as in BatchNorm
and the running sigma is ``sqrt(running_var + eps)`` (the paper's moving average of sigma is not stored).
``num_batches_tracked`` is the schedule's step counter (the step of a batch is the count before that batch).

The classes derive from ``torch.nn.modules.batchnorm._BatchNorm`` (as timm's ``BatchNormAct2d`` does), so the
tools that look for a BatchNorm find them: ``torch.optim.swa_utils.update_bn`` re-estimates their statistics
exactly (BatchNorm's training output while it runs, then ``num_batches_tracked``, the schedule's step, put back),
``norm_eval``-style freezing, FSDP's mixed precision and no-weight-decay rules treat them as BatchNorms. The tools
that would rebuild them as a plain BatchNorm (``SyncBatchNorm.convert_sync_batchnorm``, timm's
``convert_sync_batchnorm``/``convert_splitbn_model``/``freeze_batch_norm_2d``) stop with a ``TypeError`` naming what
to call instead, :meth:`SyncBatchRenorm.convert_sync_batchrenorm` for the first. The rules:
``normlab/nn/_bn_tools.py``; tool by tool: ``docs/batchnorm_tools.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from string import Template

import torch
import torch.distributed as dist
import torch.fx
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from .. import functional as NF
from .._checks import check_number, is_number
from .._dispatch import fx_node, layer_step, param_dtype
from .._functions import momentum_update
from ._bn_tools import BatchNormTools, reestimating
from ._docs import fill
from ._float32_stats import Float32StatsModule
from ._non_finite import SkippedBatches
from ._recompute import eager_checkpoint_active, report_misses
from ._renorm_step import Spec, check_input, factor, renorm_forward, renorm_step
from ._sync_convert import to_sync_batchrenorm

torch.fx.wrap("layer_step")  # torch.fx.symbolic_trace records the layer as this one call (see forward)
torch.fx.wrap("renorm_forward")  # ... and traces a layer at the root of the trace as this one call

__all__ = ["RenormSchedule", "BatchRenorm1d", "BatchRenorm2d", "BatchRenorm3d", "SyncBatchRenorm", "BATCH_RENORM_TYPES"]


@dataclasses.dataclass(frozen=True)
class RenormSchedule:
    """The paper's rmax/dmax schedule as a picklable callable ``step -> (rmax, dmax)``.

    ``rmax = 1`` and ``dmax = 0`` for ``step <= warmup_steps``; then each rises linearly and reaches its final value
    at ``rmax_steps`` (resp. ``dmax_steps``), constant afterwards:
    ``rmax(step) = 1 + (rmax - 1) * clamp((step - warmup_steps) / (rmax_steps - warmup_steps), 0, 1)``
    (if ``rmax_steps == warmup_steps`` the value jumps to ``rmax`` at that step). Same for dmax from 0.

    ``step`` may be a Python int (returns floats) or an integer tensor such as ``num_batches_tracked`` (returns
    float64 scalar tensors on its device, without a host synchronisation). A frozen dataclass: equal by value,
    hashable, picklable; the constructor takes the fields in this order.

    Attributes:
        warmup_steps: the steps with ``rmax = 1, dmax = 0`` (plain BatchNorm). Default: 5000.
        rmax: the final limit of r (>= 1, finite). Default: 3.0.
        rmax_steps: the step at which ``rmax`` is reached (>= ``warmup_steps``). Default: 40000.
        dmax: the final limit of d (>= 0, finite). Default: 5.0.
        dmax_steps: the step at which ``dmax`` is reached (>= ``warmup_steps``). Default: 25000.

    Example:
        >>> schedule = RenormSchedule(warmup_steps=100, rmax=3.0, rmax_steps=300, dmax=5.0, dmax_steps=200)
        >>> schedule(0), schedule(200), schedule(1000)
        ((1.0, 0.0), (2.0, 5.0), (3.0, 5.0))
        >>> BatchRenorm2d(8, schedule=schedule).schedule(150)
        (1.5, 2.5)
    """

    warmup_steps: int = 5000
    rmax: float = 3.0
    rmax_steps: int = 40000
    dmax: float = 5.0
    dmax_steps: int = 25000

    def __post_init__(self) -> None:
        where = "RenormSchedule"
        for name in ("warmup_steps", "rmax_steps", "dmax_steps"):
            value = getattr(self, name)
            check_number(where, name, value, integer=True, low=0)
        for name, value in (("rmax_steps", self.rmax_steps), ("dmax_steps", self.dmax_steps)):
            if value < self.warmup_steps:
                raise ValueError(f"{where}: {name} must be >= warmup_steps={self.warmup_steps}, got {value}")
        _check_limits(where, self.rmax, self.dmax)
        if math.isinf(self.rmax) or math.isinf(self.dmax):
            raise ValueError(f"{where}: rmax and dmax must be finite, got rmax={self.rmax}, dmax={self.dmax}")
        object.__setattr__(self, "rmax", float(self.rmax))  # frozen: the numbers are stored as floats, once
        object.__setattr__(self, "dmax", float(self.dmax))

    @classmethod
    def scaled(cls, end_step: int, rmax: float = 3.0, dmax: float = 5.0) -> RenormSchedule:
        """The paper's schedule compressed to reach its final limits at ``end_step`` instead of 40k steps.

        Keeps the paper's proportions: warm-up until ``end_step / 8`` (5k of 40k), dmax reached at
        ``5/8 * end_step`` (25k of 40k), rmax at ``end_step``. ``scaled(40000)`` is the paper's schedule.
        For short runs (the experiment runner uses half the run's steps).
        """
        check_number("RenormSchedule.scaled", "end_step", end_step, integer=True, low=0)
        return cls(end_step // 8, rmax, end_step, dmax, (5 * end_step) // 8)

    def _fraction(self, step, end: int):
        span = end - self.warmup_steps
        if span == 0:
            return 1.0 if step >= end else 0.0
        return min(max((step - self.warmup_steps) / span, 0.0), 1.0)

    def __call__(self, step: int | Tensor):
        """Return ``(rmax, dmax)`` for a step (0-based: the number of batches already trained on)."""
        if isinstance(step, torch.fx.Proxy):  # traced: Python-number constants (no tensor tied to a device)
            s = step.to(torch.float64)
            return self._ramp(s, 1.0, self.rmax, self.rmax_steps), self._ramp(s, 0.0, self.dmax, self.dmax_steps)
        if isinstance(step, Tensor):
            if self.rmax_steps > self.warmup_steps and self.dmax_steps > self.warmup_steps:
                return self._ramps(step)
            s = step.to(torch.float64)
            return self._ramp(s, 1.0, self.rmax, self.rmax_steps), self._ramp(s, 0.0, self.dmax, self.dmax_steps)
        rmax = 1.0 + (self.rmax - 1.0) * self._fraction(step, self.rmax_steps)
        dmax = self.dmax * self._fraction(step, self.dmax_steps)
        return rmax, dmax

    def _ramps(self, step: Tensor) -> tuple[Tensor, Tensor]:
        """Both limits at the integer step tensor ``step`` in one ``clamp(slope * step + base, start, end)`` over
        the stacked pair (rmax, dmax): four tensor ops for both (the arithmetic of :meth:`_ramp`, bit for bit:
        ``step * slope`` then ``+ base`` in float64), no host read. Both spans must be > 0."""
        base, slope, low, high = _ramp_constants(self, step.device)
        # not addcmul (it rounds once); out of place: vmap has no batching rule for clamp_, and a selective-checkpoint
        # policy that saves mul would see its cached output mutated
        return torch.add(torch.mul(step, slope), base).clamp(low, high).unbind()

    def _ramp(self, s: Tensor, start: float, end: float, end_step: int) -> Tensor:
        """``start -> end`` linearly over (warmup_steps, end_step] at the float64 step tensor ``s``, as
        ``clamp(a * s + b, start, end)``: three tensor ops, no host read (the value a Python step gives, up to
        float64 rounding)."""
        span = end_step - self.warmup_steps
        if span == 0:
            return torch.where(s >= end_step, end, start)
        slope = (end - start) / span
        return s.mul(slope).add(start - slope * self.warmup_steps).clamp(start, end)  # out of place: see _ramps


_RAMP_CONSTANTS: dict = {}


def _ramp_constants(schedule: RenormSchedule, device: torch.device) -> tuple[Tensor, ...]:
    """``(base, slope, low, high)`` of :meth:`RenormSchedule._ramps` as float64 (2,) tensors on ``device``, built
    once per schedule and device in eager (never written to); under torch.compile built in the graph."""
    key = (schedule, device)
    found = None if torch.compiler.is_compiling() else _RAMP_CONSTANTS.get(key)
    if found is None:
        slopes = [
            (end - start) / (end_step - schedule.warmup_steps)
            for start, end, end_step in (
                (1.0, schedule.rmax, schedule.rmax_steps),
                (0.0, schedule.dmax, schedule.dmax_steps),
            )
        ]
        rows = (
            [1.0 - slopes[0] * schedule.warmup_steps, 0.0 - slopes[1] * schedule.warmup_steps],
            slopes,
            [1.0, 0.0],
            [schedule.rmax, schedule.dmax],
        )
        found = tuple(torch.tensor(row, dtype=torch.float64, device=device) for row in rows)
        if not torch.compiler.is_compiling():
            _RAMP_CONSTANTS[key] = found
    return found


def _check_limits(where: str, rmax, dmax) -> None:
    if not is_number(rmax) or math.isnan(rmax) or rmax < 1:
        raise ValueError(f"{where}: rmax must be a number >= 1, got {rmax!r}")
    if not is_number(dmax) or math.isnan(dmax) or dmax < 0:
        raise ValueError(f"{where}: dmax must be a number >= 0, got {dmax!r}")


# The docstring of the public classes: one text, filled in per class ($name, $torch_name, $input, ...).
_DOC = Template(r"""Batch Renormalization (Ioffe 2017) over $input input; a drop-in for ``$torch_name``.

    With the default schedule the layer is plain BatchNorm for its first 5,000 training steps (the paper's warm-up,
    counted by ``num_batches_tracked``) and renormalizes only after that: for a short fine-tune use
    ``schedule=RenormSchedule.scaled(n)`` (the schedule compressed to n steps) or constant ``rmax``/``dmax``.

    .. math::
        y = \gamma \left(\frac{x - \mu_B}{\sigma_B} r + d\right) + \beta, \quad
        r = \mathrm{clip}_{[1/r_{max},\, r_{max}]}\left(\frac{\sigma_B}{\sigma}\right), \quad
        d = \mathrm{clip}_{[-d_{max},\, d_{max}]}\left(\frac{\mu_B - \mu}{\sigma}\right)

    in training, per channel: :math:`\mu_B` and :math:`\sigma_B = \sqrt{\mathrm{Var}_B[x] + \epsilon}` are the
    batch mean and standard deviation (biased variance), :math:`\mu` and :math:`\sigma = \sqrt{\mathrm{running\_var}
    + \epsilon}` the running statistics before this batch updates them, and no gradient flows through r and d.
    In eval mode it is BatchNorm inference with the running statistics; with ``rmax=1, dmax=0`` it computes
    ``$torch_name``. A training step costs one BatchNorm step (r and d are per-channel constants folded into the
    affine, see :func:`normlab.functional.batch_renorm`).$details

    The limits rmax and dmax come from a schedule evaluated at ``num_batches_tracked``, by default the paper's
    :class:`RenormSchedule` (identity for 5k steps, then linear to rmax=3 at 40k and dmax=5 at 25k steps), or are
    constants (``rmax=3.0, dmax=5.0``). The ``state_dict`` keys are BatchNorm's (``weight``, ``bias``,
    ``running_mean``, ``running_var``, ``num_batches_tracked``), so BatchNorm checkpoints load into the layer and back;
    ``running_var`` is the unbiased variance, as in BatchNorm.

    Args:
        num_features: C, the number of channels (dim 1 of the input).
        eps: added to the variance inside the square root (> 0). Default: 1e-5.
        momentum: the running-statistics update factor, BatchNorm's convention (weight of the new value);
            ``None``: cumulative average. Default: 0.1.
        affine: learn a per-channel ``weight`` (init 1) and ``bias`` (init 0). Default: True.
        track_running_stats: keep running statistics. Without them there is nothing to renormalize against: the
            layer is BatchNorm with batch statistics in training and eval, and a ``schedule`` or limits other than
            ``rmax=1, dmax=0`` raise ``ValueError``. Default: True.$process_group
        device: the device of the parameters and buffers. Default: None (torch's default device).
        dtype: the dtype of the parameters and buffers. Default: None (torch's default dtype).
        bias: with ``affine``, learn ``bias`` too (keyword-only). Default: True.
        rmax: constant limit of r, >= 1 (``inf``: no clipping; keyword-only). Default: None (the schedule; 1 if
            only ``dmax`` is given).
        dmax: constant limit of d, >= 0 (``inf``: no clipping; keyword-only). Default: None (the schedule; 0 if
            only ``rmax`` is given).
        schedule: a picklable callable ``step -> (rmax, dmax)`` evaluated at ``num_batches_tracked``, such as
            :class:`RenormSchedule` (keyword-only; not together with ``rmax``/``dmax``). Default: None, which is
            ``RenormSchedule()`` when neither ``rmax`` nor ``dmax`` is given.
        check_finite: a training batch whose updated running statistics would not be finite (NaN/inf in the
            input, or a variance that overflows) leaves them and the step counter unchanged and is counted in the
            non-persistent buffer ``skipped_batches``, with tensor ops only (no host synchronisation, eager and
            compiled; the output carries the NaN); ``.eval()`` or :func:`normlab.nn.skipped_batches` report the
            count as a ``RuntimeWarning``: the non-finite policy of every normlab layer (``docs/design.md``,
            "Non-finite batches"). False: no check (a non-finite batch enters the running statistics, as in
            ``nn.BatchNorm``) (keyword-only). Default: True.

    Shape:
        - Input: $input
        - Output: the same shape, dtype and memory format as the input. float16/bfloat16 inputs get their
          statistics in float32; after ``.half()`` the running statistics stay float32.

    Note:
        Under ``torch.utils.checkpoint`` (reentrant or not, nested, any selective policy, early stop on or off;
        timm's ``set_grad_checkpointing``, Hugging Face's ``gradient_checkpointing_enable``, torch's composable
        ``checkpoint(module)``, autograd-Function checkpoints) a recomputation repeats the step of the forward at
        its position in the region it recomputes (whatever the input values, however many forwards come before the
        backward): the gradients are the un-checkpointed ones and the running statistics and
        ``num_batches_tracked`` advance once per genuine forward; a recomputation that finds no record (the layer
        called more often than in the forward, a training forward inside a backward pass) updates nothing and is
        reported at ``.eval()`` (``docs/design.md``, 5c). Also exact under torch.compile (``fullgraph=True``, over
        checkpointed models too; a module compiled on its own inside an eager checkpoint runs the layer's step
        eagerly), torch.export, torch.jit.trace, ``torch.fx.symbolic_trace`` (one call node; a schedule that cannot
        be traced is refused), torch.func (grad, vmap, functional_call, jvp, jacfwd), forward-mode AD and on the
        meta device, each tested against torch's BatchNorm or the plain eager run. An empty batch (N = 0) returns
        BatchNorm's empty output and leaves the running statistics and ``num_batches_tracked`` unchanged.

    Example:
$example
    """)


_doc = functools.partial(fill, _DOC, optional=("details", "process_group"))


class _AllReduceSum(torch.autograd.Function):
    """Differentiable SUM all-reduce: the gradient of every rank's input is the sum of all ranks' gradients."""

    @staticmethod
    def forward(ctx, tensor: Tensor, group) -> Tensor:
        ctx.group = group
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class _BatchRenorm(BatchNormTools, SkippedBatches, Float32StatsModule, _BatchNorm):
    """Shared implementation of :class:`BatchRenorm1d`/``2d``/``3d`` and :class:`SyncBatchRenorm`.

    Subclasses set ``_expected_dims`` and ``_shape_text``; their docstrings are ``_DOC`` filled in per class.
    """

    _normlab_norm = True  # marks a normalization layer (no weight decay in normlab.nn.param_groups)
    _expected_dims: tuple[int, ...] = ()
    _shape_text = ""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device=None,
        dtype=None,
        *,
        bias: bool = True,
        rmax: float | None = None,
        dmax: float | None = None,
        schedule: Callable | None = None,
        check_finite: bool = True,
    ) -> None:
        where = type(self).__name__
        check_number(where, "num_features", num_features, integer=True, low=1)
        check_number(where, "eps", eps, low=0, low_open=True)
        if momentum is not None and (not is_number(momentum) or not 0 <= momentum <= 1):
            raise ValueError(f"{where}: momentum must be in [0, 1] or None, got {momentum!r}")
        explicit = schedule is not None or rmax is not None or dmax is not None
        if schedule is not None:
            if rmax is not None or dmax is not None:
                raise ValueError(f"{where}: give either schedule or rmax/dmax, not both")
            if not callable(schedule):
                raise ValueError(f"{where}: schedule must be callable step -> (rmax, dmax), got {schedule!r}")
        elif rmax is not None or dmax is not None:
            rmax = 1.0 if rmax is None else rmax
            dmax = 0.0 if dmax is None else dmax
            _check_limits(where, rmax, dmax)
            rmax, dmax = float(rmax), float(dmax)
        else:
            schedule = RenormSchedule()
        if not track_running_stats and explicit and (schedule is not None or rmax > 1 or dmax > 0):
            raise ValueError(
                f"{where}: rmax/dmax/schedule need running statistics to renormalize against; "
                f"got track_running_stats=False (use nn.BatchNorm or drop rmax/dmax/schedule)"
            )
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, bias=bias)
        self.schedule = schedule
        self.rmax = rmax
        self.dmax = dmax
        self.check_finite = bool(check_finite)
        self._init_skipped(device)

    def reset_running_stats(self) -> None:
        """BatchNorm's reset (running statistics and ``num_batches_tracked``), and the ``skipped_batches`` count."""
        super().reset_running_stats()
        self._reset_skipped()

    # ------------------------------------------------------------------ checks
    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() not in self._expected_dims:
            raise ValueError(f"{type(self).__name__}: expected {self._shape_text}, got {input.dim()}D input")

    # ------------------------------------------------------------------ limits
    def renorm_limits(self, step: int | Tensor | None = None):
        """``(rmax, dmax)`` used for the batch at ``step`` (default: the next training batch); ``(1.0, 0.0)``
        (BatchNorm) while ``update_bn`` re-estimates the running statistics."""
        if reestimating(self):
            return 1.0, 0.0
        if self.schedule is None:
            return self.rmax, self.dmax
        if step is None:
            step = self.num_batches_tracked if self.num_batches_tracked is not None else 0
        return self.schedule(step)

    def _updating(self) -> bool:
        return (
            self.training
            and self.track_running_stats
            and self.running_mean is not None
            and self.running_var is not None
            and self.num_batches_tracked is not None
        )

    def _spec(self) -> Spec:
        return Spec(
            type(self).__name__,
            self.num_features,
            self._expected_dims,
            self._shape_text,
            self.training,
            self.track_running_stats,
            self.momentum,
            self.eps,
            self.check_finite,
        )

    def _step_limits(self, input) -> tuple:
        """The limits of a training step (unused otherwise): constants, or the schedule at ``num_batches_tracked``
        (tensors, never read back). Under ``torch.fx`` tracing the schedule is traced on the buffer's node, so the
        graph evaluates it at every call; a schedule that cannot be traced is refused."""
        traced = isinstance(input, torch.fx.Proxy) and self.num_batches_tracked is not None
        if not traced and not self._updating():
            return 1.0, 0.0
        if self.schedule is None or not traced:  # traced in eval too: one set of nodes in both modes' graphs
            return self.renorm_limits()
        tracer = input.tracer
        path = tracer.path_of_module(self)
        step = tracer.create_proxy("get_attr", f"{path}.num_batches_tracked" if path else "num_batches_tracked", (), {})
        try:
            return self.schedule(step)
        except Exception as e:  # noqa: BLE001 - whatever the schedule raises on a Proxy
            raise TypeError(
                f"{type(self).__name__}: torch.fx cannot trace its schedule {self.schedule!r} ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); use RenormSchedule, constant rmax/dmax or a schedule "
                "in tensor ops, or keep the layer a leaf module of the tracer"
            ) from e

    # ------------------------------------------------------------------ forward
    def forward(self, input: Tensor) -> Tensor:
        """Input (N, C, *) -> output of the same shape, dtype and memory format.

        The layer evaluates its limits and makes one call, ``normlab.nn._renorm_step.renorm_forward``, with its
        parameters, buffers and settings: eval is BatchNorm's own call; a training step takes the prior (the running
        statistics, or in a checkpoint recomputation the recorded forward's), runs
        :func:`normlab.functional.batch_renorm_train` and commits the new running statistics. Eager, compiled and
        recomputed steps run this same call. ``torch.fx.symbolic_trace`` of a model that holds the layer records
        one node, ``layer_step(layer, x)``, which runs the step when the graph runs, in the mode and with the
        settings the layer has then (as the ``call_module`` node of a torch BatchNorm); a layer traced on its own
        is traced through as one ``renorm_forward`` node. torch.compile tracing a training layer inside an eager
        activation checkpoint (a module compiled on its own, checkpointed from outside) leaves the step to eager
        execution, where the checkpoint's recomputation finds its record."""
        if fx_node(self, input):
            return layer_step(self, input)
        if torch.compiler.is_compiling() and self.training and eager_checkpoint_active():
            return _step_outside_the_graph(self, input)
        return self._forward_step(input)

    def _forward_step(self, input: Tensor) -> Tensor:
        """The training or eval step of :meth:`forward` (what a torch.fx graph's ``layer_step`` node runs)."""
        rmax, dmax = self._step_limits(input)
        return renorm_forward(
            input,
            self.weight,
            self.bias,
            self.running_mean,
            self.running_var,
            self.num_batches_tracked,
            self.skipped_batches,
            rmax,
            dmax,
            self._spec(),
        )

    def _report_skipped(self, name: str | None = None) -> int:
        """The skipped-batches report, and the checkpoint recomputations that found no record (both deferred
        warnings: one host read each, at ``.eval()`` or :func:`normlab.nn.skipped_batches`)."""
        count = super()._report_skipped(name)
        buf = self._buffers.get("running_mean")
        if buf is not None and buf.device.type != "meta" and not torch._C._functorch.is_functorch_wrapped_tensor(buf):
            report_misses(buf, self._layer_name(name))
        return count

    def extra_repr(self) -> str:
        limits = f"schedule={self.schedule!r}" if self.schedule is not None else f"rmax={self.rmax}, dmax={self.dmax}"
        return f"{super().extra_repr()}, {limits}"


@torch.compiler.disable(
    reason="a BatchRenorm compiled inside an eager torch.utils.checkpoint region runs its training step eagerly, "
    "where the recomputation can repeat it exactly; compile the model that calls checkpoint instead"
)
def _step_outside_the_graph(layer: _BatchRenorm, input: Tensor) -> Tensor:
    """The layer's step run eagerly from a compiled graph: torch.compile traced the layer inside an eager activation
    checkpoint (a module compiled on its own, wrapped by ``torch.utils.checkpoint``), whose recomputation reruns the
    compiled graph, where no record can be found: the step's update would run twice and the recomputation would
    renormalize against the updated statistics. Run eagerly, the step finds its record (``normlab/nn/_recompute.py``).
    With ``fullgraph=True`` torch.compile refuses, naming this reason."""
    return layer._forward_step(input)


class BatchRenorm1d(_BatchRenorm):
    __doc__ = _doc(
        input="(N, C) or (N, C, L)",
        torch_name="nn.BatchNorm1d",
        example="""
>>> m = BatchRenorm1d(16, rmax=3.0, dmax=5.0)
>>> m(torch.randn(8, 16, 40)).shape
torch.Size([8, 16, 40])
""",
    )

    _expected_dims = (2, 3)
    _shape_text = "2D or 3D input (N, C) or (N, C, L)"


class BatchRenorm2d(_BatchRenorm):
    __doc__ = _doc(
        input="(N, C, H, W)",
        torch_name="nn.BatchNorm2d",
        example="""
>>> m = BatchRenorm2d(64, schedule=RenormSchedule.scaled(10_000))   # the paper's schedule over 10k steps
>>> m(torch.randn(2, 64, 8, 8)).shape
torch.Size([2, 64, 8, 8])
""",
    )

    _expected_dims = (4,)
    _shape_text = "4D input (N, C, H, W)"


class BatchRenorm3d(_BatchRenorm):
    __doc__ = _doc(
        input="(N, C, D, H, W)",
        torch_name="nn.BatchNorm3d",
        example="""
>>> BatchRenorm3d(4, rmax=2.0)(torch.randn(2, 4, 3, 5, 5)).shape
torch.Size([2, 4, 3, 5, 5])
""",
    )

    _expected_dims = (5,)
    _shape_text = "5D input (N, C, D, H, W)"


class SyncBatchRenorm(_BatchRenorm):
    __doc__ = _doc(
        input="(N, C, *)",
        torch_name="nn.SyncBatchNorm",
        details="""

    With statistics over all ranks of a ``torch.distributed`` process group: in training with an initialized
    group of more than one rank, each rank computes per-channel count, sum and sum of squares (float64, from
    float32 two-pass local moments), one differentiable SUM all-reduce merges them weighted by count (batch sizes
    may differ per rank), and the gradients are those of the global batch (each rank receives the gradient of its
    own slice; parameter gradients are the rank's share, which DDP then averages). r and d come from the global
    statistics, so they and the running statistics (unbiased with ``N_global / (N_global - 1)``) are identical on
    every rank. Works with gloo (CPU) and NCCL. Otherwise (no process group, world size 1, eval) it is the
    single-process layer for any (N, C, *) input. :meth:`convert_sync_batchrenorm` converts a model's BatchRenorm
    layers (torch's ``SyncBatchNorm.convert_sync_batchnorm`` would turn them into plain ``SyncBatchNorm``).""",
        process_group="""
        process_group: the ranks whose statistics are merged (torch's ``SyncBatchNorm`` argument, at its
            position). Default: None (the whole world).""",
        example="""
>>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), BatchRenorm2d(8))
>>> model = SyncBatchRenorm.convert_sync_batchrenorm(model)   # before wrapping it in DDP
>>> type(model[1]).__name__
'SyncBatchRenorm'
""",
    )

    _expected_dims = tuple(range(2, 9))
    _shape_text = "at least 2D input (N, C, *)"

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group=None,
        device=None,
        dtype=None,
        *,
        bias: bool = True,
        rmax: float | None = None,
        dmax: float | None = None,
        schedule: Callable | None = None,
        check_finite: bool = True,
    ) -> None:
        super().__init__(
            num_features,
            eps,
            momentum,
            affine,
            track_running_stats,
            device,
            dtype,
            bias=bias,
            rmax=rmax,
            dmax=dmax,
            schedule=schedule,
            check_finite=check_finite,
        )
        self.process_group = process_group

    def _world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def _forward_step(self, input: Tensor) -> Tensor:
        """Input (N, C, *) -> output of the same shape and dtype: the single-process step, or the synchronized one
        (what :meth:`forward` runs, and a torch.fx graph's ``layer_step`` node when the graph runs)."""
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        if not bn_training or self._world_size() == 1:
            return super()._forward_step(input)
        if isinstance(input, torch.fx.Proxy):
            raise TypeError(
                f"{type(self).__name__}: torch.fx cannot trace the synchronized step ({self._world_size()} ranks); "
                "trace the model in a single process or keep the layer a leaf module of the tracer"
            )
        spec = self._spec()
        check_input(input, spec, bn_training, local=False)
        c = self.num_features
        count = input.numel() // c
        if count > 0:
            mean, var = NF.moments(input, (0,) + tuple(range(2, input.dim())))
            mean, var = mean.double(), var.double()
        else:  # an empty slice on this rank still joins the collectives, the backward all-reduce included: the
            # zeros are a sum over the empty input, so they carry its autograd graph as the other ranks' moments do
            mean = var = input.sum((0,) + tuple(range(2, input.dim()))).double()
        local = torch.cat([count * mean, count * (var + mean.square()), mean.new_full((1,), float(count))])
        total = _AllReduceSum.apply(local, self.process_group or dist.group.WORLD)
        n = float(total[-1].item())  # the global count (a shape, summed over ranks): the one host read here
        if n <= 1:
            raise ValueError(
                f"{type(self).__name__}: expected more than 1 value per channel when training, got {int(n)} "
                f"over all ranks"
            )
        g_mean = total[:c] / n
        g_var = (total[c : 2 * c] / n - g_mean.square()).clamp_min(0.0)
        r = d = None
        if self._updating():
            r, d = self._sync_correction(input, g_mean.detach(), g_var.detach(), int(n), spec)

        # y = x * a + b with a = weight * r / sigma_B, b = bias + weight * d - mean * a (per channel, float64).
        a = torch.rsqrt(g_var + self.eps)
        b = torch.zeros_like(a) if d is None else d
        if r is not None:
            a = a * r
        if self.weight is not None:
            w = self.weight.double()
            a, b = a * w, b * w
        if self.bias is not None:
            b = b + self.bias.double()
        b = b - g_mean * a
        comp = param_dtype(input)
        shape = (1, c) + (1,) * (input.dim() - 2)
        out = torch.addcmul(b.to(comp).reshape(shape), input.to(comp), a.to(comp).reshape(shape))
        return out.to(input.dtype)

    def _sync_correction(self, input: Tensor, mean: Tensor, var: Tensor, n: int, spec: Spec):
        """r and d from the global statistics (identical on every rank) through the layer's one training step
        (:func:`normlab.nn._renorm_step.renorm_step`: the prior and limits, or a recorded forward's in a checkpoint
        recomputation; the guarded update with the global count, so every rank skips a non-finite batch together)."""
        state = (self.running_mean, self.running_var, self.num_batches_tracked, self.skipped_batches)

        def correction(prior, limits):
            new = momentum_update(*prior, mean, var, n, factor(spec, state))
            return NF.renorm_correction(mean, var, *prior, self.eps, *limits), new

        return renorm_step(input, state, self.renorm_limits(), spec, correction)

    @classmethod
    def convert_sync_batchrenorm(
        cls, module: torch.nn.Module, process_group=None, *, batchnorm: bool = False
    ) -> torch.nn.Module:
        """Replace every BatchRenorm layer in ``module`` by its synchronized version, computing what it computed.

        Like ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``: the new layer takes the same settings and *shares*
        the old one's parameter and buffer tensors (optimizers built before the conversion stay valid).
        :class:`BatchRenorm1d`/``2d``/``3d`` become :class:`SyncBatchRenorm`; timm's NormAct version
        :class:`~normlab.integrations.timm.BatchRenormAct2d` becomes
        :class:`~normlab.integrations.timm.SyncBatchRenormAct` with the same ``drop`` and ``act`` modules; a
        subclass with its own forward is left as it is and named in one ``UserWarning``
        (``normlab/nn/_sync_convert.py``). A layer registered under several names is replaced by one new layer.
        With ``batchnorm=True`` torch's BatchNorms become ``nn.SyncBatchNorm`` too (timm's ``BatchNormAct2d``:
        ``SyncBatchNormAct``), by torch's and timm's own converters, which refuse a model with BatchRenorm.
        Returns the converted module (a new object if ``module`` itself is a converted layer).
        """
        return to_sync_batchrenorm(
            module, process_group, cls, (BatchRenorm1d, BatchRenorm2d, BatchRenorm3d), _BatchRenorm, batchnorm
        )


#: The batch renormalization layers, for ``isinstance``: :class:`BatchRenorm1d`, :class:`BatchRenorm2d`,
#: :class:`BatchRenorm3d` and :class:`SyncBatchRenorm`; their subclasses (the timm NormAct versions of
#: :mod:`normlab.integrations.timm`) are instances too.
BATCH_RENORM_TYPES = (BatchRenorm1d, BatchRenorm2d, BatchRenorm3d, SyncBatchRenorm)
