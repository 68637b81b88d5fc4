"""Test-set evaluation in eval mode (running statistics) and in train mode (batch statistics)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from normlab.runner.data.datasets import ArrayDataset

__all__ = ["evaluate", "evaluate_train_mode", "TRAIN_MODE_SAMPLES"]

TRAIN_MODE_SAMPLES = 500  # test samples of the train-mode evaluation (it runs at the training batch size)


@torch.no_grad()
def evaluate(model: nn.Module, ds: ArrayDataset, device: torch.device, batch_size: int = 512) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` in eval mode on all of ``ds``."""
    model.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, len(ds), batch_size):
        x, y = ds.batch(torch.arange(start, min(start + batch_size, len(ds))))
        out = model(x.to(device))
        y = y.to(device)
        loss_sum += F.cross_entropy(out, y, reduction="sum").item()
        correct += (out.argmax(1) == y).sum().item()
    return loss_sum / len(ds), correct / len(ds)


@torch.no_grad()
def evaluate_train_mode(
    model: nn.Module, ds: ArrayDataset, device: torch.device, batch_size: int, max_samples: int = TRAIN_MODE_SAMPLES
) -> float:
    """Accuracy of ``model`` in train mode (normalization by the statistics of each batch of ``batch_size`` test
    samples, as in training) on the first ``max_samples`` test samples, in whole batches.

    A copy of the model runs, so running statistics and step counters of the model are untouched. For a model
    whose layers behave the same in both modes (no BatchNorm family, no dropout) this equals the eval-mode
    accuracy on the same samples. Returns None when the test set holds less than one batch.
    """
    n = min(len(ds), max_samples) // batch_size * batch_size
    if n == 0:
        return None
    net = copy.deepcopy(model).train()
    correct = 0
    for start in range(0, n, batch_size):
        x, y = ds.batch(torch.arange(start, start + batch_size))
        correct += (net(x.to(device)).argmax(1) == y.to(device)).sum().item()
    return correct / n
