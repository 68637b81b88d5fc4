"""The lab's one step-by-step training loop: the collapse benchmark's runs (collection and guard check) and the
collapse study's (``lab/scripts/collapse_study.py``) all train through :func:`train_steps`.

Why not normlab's own loop (:func:`normlab.runner.training.train.train`)? It trains epochs of a data set with
evaluations, checkpoints and its own optimizer; these studies need every step's loss, gradient norm and monitor
records, each under its own optimizer, learning-rate schedule and stopping rule, the optimizer watched by a
:class:`~normlab.monitor.VarianceMonitor` and perhaps a :class:`~normlab.monitor.CollapseGuard` (both attach to it:
its own ``optimizer.step()`` is their step). What differs between them is passed in; the order of the work in a step
is the same for all:

    for t in range(steps):
        before(t)                                  # False stops the run (before this step)
        x, y = next(batches)
        loss = loss_fn(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        result = step(t, loss)                     # the optimizer step and what the study measures around it
        after(t, loss, result)                     # False stops the run (after this step)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["train_steps", "flat_cross_entropy"]


def flat_cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position: ``(N, C)`` logits, or ``(N, T, C)`` for a sequence model's tokens."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def train_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    step: Callable[[int, torch.Tensor], Any],
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = flat_cross_entropy,
    before: Callable[[int], bool] | None = None,
    after: Callable[[int, torch.Tensor, Any], bool] | None = None,
) -> int:
    """Train ``model`` for at most ``steps`` steps (the loop of the module docstring); returns the steps taken.

    Args:
        model: the network; its output goes to ``loss_fn`` with the batch's targets.
        optimizer: its gradients are zeroed (set to None) before each backward pass.
        batches: an endless iterator of ``(x, y)`` training batches.
        steps: the most steps to run.
        step: ``step(t, loss)`` after the backward pass: takes the optimizer step (``optimizer.step()``; under a
            guard ``guard.observe_loss(loss)`` first, and ``guard.rolled_back`` after it says whether the step was
            thrown away) and returns what the caller's ``after`` reads.
        loss_fn: ``loss_fn(output, y)``, default :func:`flat_cross_entropy`.
        before: ``before(t)`` before the batch is drawn; False ends the run without step ``t``.
        after: ``after(t, loss, result)`` with ``step``'s result; False ends the run after step ``t``.

    An exception raised by a callback (e.g. :class:`~normlab.monitor.RunCollapsed` out of a guarded
    ``optimizer.step()``) ends the run and reaches the caller.
    """
    taken = 0
    for t in range(steps):
        if before is not None and not before(t):
            break
        x, y = next(batches)
        loss = loss_fn(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        result = step(t, loss)
        taken = t + 1
        if after is not None and not after(t, loss, result):
            break
    return taken
