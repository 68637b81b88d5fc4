"""Test-set evaluation in eval mode (running statistics) and in train mode (batch statistics), by the run's loss and
metric (:class:`~normlab.runner.training.task.Task`; cross-entropy and accuracy without one)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from normlab.runner.data.datasets import ArrayDataset
from normlab.runner.training.task import Task, make_task

__all__ = ["evaluate", "evaluate_train_mode", "TRAIN_MODE_SAMPLES"]

TRAIN_MODE_SAMPLES = 500  # test samples of the train-mode evaluation (it runs at the training batch size)


_DEFAULT = make_task("cross_entropy", "accuracy")


@torch.no_grad()
def evaluate(
    model: nn.Module, ds: ArrayDataset, device: torch.device, task: Task = _DEFAULT, batch_size: int = 512
) -> tuple[float, float | None]:
    """Mean loss and metric (None without one) of ``model`` in eval mode on all of ``ds``."""
    model.eval()
    loss_sum, right = 0.0, 0.0
    for start in range(0, len(ds), batch_size):
        x, y = ds.batch(torch.arange(start, min(start + batch_size, len(ds))))
        out = model(x.to(device))
        y = y.to(device)
        loss_sum += task.loss_sum(out, y).item()
        part = task.metric_sum(out, y)
        right = None if part is None else right + part.item()
    return loss_sum / len(ds), None if right is None else right / len(ds)


@torch.no_grad()
def evaluate_train_mode(
    model: nn.Module,
    ds: ArrayDataset,
    device: torch.device,
    batch_size: int,
    max_samples: int = TRAIN_MODE_SAMPLES,
    task: Task = _DEFAULT,
) -> float | None:
    """The metric (accuracy by default) of ``model`` in train mode (normalization by the statistics of each batch
    of ``batch_size`` test samples, as in training) on the first ``max_samples`` test samples, in whole batches.

    A copy of the model runs, so running statistics and step counters of the model are untouched. For a model
    whose layers behave the same in both modes (no BatchNorm family, no dropout) this equals the eval-mode
    accuracy on the same samples. Returns None when the test set holds less than one batch, or without a metric.
    """
    n = min(len(ds), max_samples) // batch_size * batch_size
    if n == 0 or task.metric_fn is None:
        return None
    net = copy.deepcopy(model).train()
    right = 0.0
    for start in range(0, n, batch_size):
        x, y = ds.batch(torch.arange(start, start + batch_size))
        right += task.metric_sum(net(x.to(device)), y.to(device)).item()
    return right / n
