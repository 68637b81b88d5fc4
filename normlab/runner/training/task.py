"""What a run minimizes and what it reports: the loss and the metric of a
:class:`~normlab.runner.training.config.TrainConfig`, resolved by name (:func:`normlab.runner.factories.resolve`).

A loss is ``loss(output, target) -> scalar tensor``, the mean over the batch (``cross_entropy``, ``mse``, or a
``pkg.module:function`` such as ``torch.nn.functional:l1_loss``). A metric is ``metric(output, target) -> scalar``,
the mean over the batch of a score per sample (``accuracy``: the fraction of argmax predictions equal to the integer
target; ``none``: no metric, the runs report their loss only; or a ``pkg.module:function``). The trainer adds them up
over a window of steps and over the test set as sums over samples (:meth:`Task.loss_sum`, :meth:`Task.metric_sum`),
so every sample weighs the same whatever the batch size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from normlab.runner.factories import resolve

__all__ = ["Task", "make_task", "accuracy"]


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The fraction of samples whose highest output is their integer target.

    Shape: output (N, C) logits, target (N,) class indices; a 0-d tensor.

    Example:
        >>> accuracy(torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 0]))
        tensor(0.5000)
    """
    return (output.argmax(1) == target).float().mean()


_LOSSES: dict[str, Callable] = {"cross_entropy": F.cross_entropy, "mse": F.mse_loss}
_METRICS: dict[str, Callable | None] = {"accuracy": accuracy, "none": None}


@dataclass(frozen=True)
class Task:
    """The loss and the metric of a run, by name (``loss``, ``metric``) and as callables (``loss_fn``,
    ``metric_fn``; None for the metric ``none``)."""

    loss: str
    metric: str
    loss_fn: Callable
    metric_fn: Callable | None

    def loss_sum(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss summed over the samples of a batch (cross-entropy summed exactly; others mean x batch size)."""
        if self.loss == "cross_entropy":
            return F.cross_entropy(output, target, reduction="sum")
        return self.loss_fn(output, target) * len(target)

    def metric_sum(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
        """The metric summed over the samples of a batch (accuracy: the number right), or None without a metric."""
        if self.metric_fn is None:
            return None
        if self.metric == "accuracy":
            return (output.argmax(1) == target).sum()
        return torch.as_tensor(self.metric_fn(output, target)).detach().double() * len(target)

    def chance_loss(self, num_classes: int | None) -> float | None:
        """The loss of a constant uniform prediction, ``ln C``, for cross-entropy over C known classes (the
        collapse tracker's reference, :mod:`normlab.monitor.collapse`); None otherwise."""
        if self.loss == "cross_entropy" and num_classes and num_classes > 1:
            return math.log(num_classes)
        return None


def make_task(loss: str, metric: str) -> Task:
    """The :class:`Task` of a config's ``loss`` and ``metric`` names (:func:`~normlab.runner.factories.resolve`)."""
    lf, mf = resolve("loss", loss), resolve("metric", metric)
    return Task(loss, metric, _LOSSES[loss] if lf.builtin else lf.fn, _METRICS[metric] if mf.builtin else mf.fn)
