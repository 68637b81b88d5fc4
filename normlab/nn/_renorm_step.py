"""The forward of every BatchRenorm layer as one function of its tensors and settings (private).

:meth:`normlab.nn.batch_renorm._BatchRenorm.forward` evaluates the limits (the schedule at ``num_batches_tracked``)
and calls :func:`renorm_forward` with its parameters, buffers and :class:`Spec`; nothing else. So the eager step,
torch.compile's trace, a checkpoint recomputation and a ``torch.fx`` graph (where :func:`renorm_forward` is one
``call_function`` node whose arguments are the layer's attributes) run the same code. A training step:

1. the layer decides the prior (the running statistics r and d are computed from) and the limits: its buffers and
   the schedule's values, or, when a checkpoint recomputation repeats an earlier forward, that forward's
   (:func:`normlab.nn._recompute.recorded_step`);
2. :func:`normlab.functional.batch_renorm_train` computes the output and the new running statistics (pure);
3. the layer commits them (:func:`commit`): the guarded write of the non-finite policy, the step counter and the
   ``skipped_batches`` count, and nothing for a recomputation.

SyncBatchRenorm's cross-rank step shares 1 and 3 (:func:`renorm_step`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from .. import functional as NF
from .._dispatch import (
    all_finite,
    count_into,
    guarded_update,
    kept_for_backward,
    outside_selective_checkpoint,
    static_numel,
    stats_value,
)
from ._recompute import checkpoint_region, recorded_step

__all__ = ["Spec", "check_input", "commit", "factor", "renorm_forward", "renorm_step"]


class Spec(NamedTuple):
    """A BatchRenorm layer's settings, as :func:`renorm_forward` takes them (constants in a torch.fx graph)."""

    name: str
    num_features: int
    dims: tuple[int, ...]
    shape_text: str
    training: bool
    track_running_stats: bool
    momentum: float | None
    eps: float
    check_finite: bool


def check_input(input: Tensor, spec: Spec, bn_training: bool, local: bool = True) -> None:
    """The layer's input checks, each error naming the layer, the argument and what was expected."""
    where = spec.name
    if not isinstance(input, Tensor):
        raise TypeError(f"{where}: expected a Tensor input, got {type(input).__name__}")
    if input.dim() not in spec.dims:
        raise ValueError(f"{where}: expected {spec.shape_text}, got {input.dim()}D input")
    if static_numel(input, 1, 2) != spec.num_features:
        raise ValueError(
            f"{where}: expected input with num_features={spec.num_features} channels (dim 1), "
            f"got {input.shape[1]} channels (input shape {tuple(input.shape)})"
        )
    if not input.is_floating_point():
        raise TypeError(f"{where}: expected a floating-point input, got {input.dtype}")
    if bn_training and local and static_numel(input) // spec.num_features == 1:
        raise ValueError(
            f"{where}: expected more than 1 value per channel when training, got input shape {tuple(input.shape)}"
        )


def renorm_forward(
    input, weight, bias, running_mean, running_var, num_batches_tracked, skipped_batches, rmax, dmax, spec
):
    """Input (N, C, *) -> output of the same shape, dtype and memory format: eval (or no running statistics, or an
    empty batch) is BatchNorm's own call; a training step is :func:`renorm_step` around
    :func:`normlab.functional.batch_renorm_train` with ``rmax``/``dmax`` (numbers, or tensors from a schedule)."""
    bn_training = spec.training or (running_mean is None and running_var is None)
    check_input(input, spec, bn_training)
    updating = spec.training and spec.track_running_stats
    updating = updating and running_mean is not None and running_var is not None and num_batches_tracked is not None
    if not updating or static_numel(input) == 0:
        # eval, no running statistics, or an empty batch (BatchNorm's empty output; unlike BatchNorm the step counter
        # does not advance: no data, no step of the schedule)
        use_running = not spec.training or spec.track_running_stats
        return NF.batch_renorm(
            input,
            running_mean if use_running else None,
            running_var if use_running else None,
            weight,
            bias,
            bn_training,
            0.0 if spec.momentum is None else spec.momentum,
            spec.eps,
        )
    state = (running_mean, running_var, num_batches_tracked, skipped_batches)

    def step(prior, limits):
        y, *new = NF.batch_renorm_train(input, *prior, weight, bias, factor(spec, state), spec.eps, *limits)
        return y, new

    return renorm_step(input, state, (rmax, dmax), spec, step)


def factor(spec: Spec, state):
    """The update factor of the batch being trained on: ``momentum``, or ``1 / (num_batches_tracked + 1)``
    (cumulative average, BatchNorm's) as a tensor (no host read)."""
    if spec.momentum is None:
        return (state[2] + 1).double().reciprocal()
    return spec.momentum


def renorm_step(input: Tensor, state, limits, spec: Spec, compute: Callable):
    """One training step of a layer: the prior and limits (the buffers and ``limits``, or a recorded forward's in a
    checkpoint recomputation), ``compute(prior, limits) -> (result, new running statistics)``, then :func:`commit`
    (nothing for a recomputation). ``state``: running mean, running var, ``num_batches_tracked``,
    ``skipped_batches``. Returns ``result``."""
    running = state[:2]
    limits = kept_for_backward(limits)  # under torch.compile: the schedule's values at this step, for the backward
    region = checkpoint_region()
    prior, replayed = running, False
    if region is not None:
        prior, limits, replayed = recorded_step(running, limits, region)
    try:
        if region is None:
            result, new = compute(prior, limits)
            commit(state, new, spec)
        else:  # a selective-checkpoint policy does not apply to the step: recomputed, its update not repeated
            with outside_selective_checkpoint():
                result, new = compute(prior, limits)
                if not replayed:
                    commit(state, new, spec)
    except RuntimeError as e:
        if torch._C._functorch.peek_interpreter_stack() is None:
            raise
        raise RuntimeError(
            f"{spec.name}: a training step under a torch.func transform updates running_mean and running_var in "
            "place, so under vmap they must be batched like the input (torch.func.stack_module_state, "
            f"functional_call), as for nn.BatchNorm; or use eval mode or track_running_stats=False ({e})"
        ) from e
    return result


@torch.no_grad()
def commit(state, new, spec: Spec) -> None:
    """The non-finite policy in tensor ops: the running statistics become ``new`` if it is finite, else stay;
    ``num_batches_tracked`` advances by one only for a finite batch, ``skipped_batches`` only for a non-finite one."""
    running_mean, running_var, num_batches_tracked, skipped_batches = state
    if torch._C._are_functorch_transforms_active():  # torch.func.grad: the values below its wrappers
        new = tuple(stats_value(t, b, spec.name) for t, b in zip(new, (running_mean, running_var)))
    if spec.check_finite:
        finite = all_finite(new[0], new[1])
    else:  # no check: the batch enters the running statistics, as in nn.BatchNorm
        finite = torch.ones((), dtype=torch.bool, device=running_mean.device)
    guarded_update((running_mean, running_var), new, finite)
    count_into(num_batches_tracked, finite)
    count_into(skipped_batches, ~finite)
