"""How long a grid will take here, measured before it starts (``normlab compare`` says it, and asks for ``--yes``
past :data:`CONFIRM_MINUTES`).

The estimate is ``sum over cells of steps x seconds per step / workers``: the steps of a cell are its epochs times
its steps per epoch (capped by ``max_steps_per_epoch``); the seconds per step are timed here, once per distinct
(model, norm, conv, width, batch size, data set), as the median of a few SGD steps on random input with one torch
thread (what a pool worker uses). Evaluation passes and the monitor add to that, so the figure is a lower bound
of the order of the real time, not a promise.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from normlab.runner.data.datasets import DATASET_CLASSES, INPUT_SHAPES
from normlab.runner.grid.spec import Cell
from normlab.runner.training.config import TrainConfig, resolve_device

__all__ = ["CONFIRM_MINUTES", "cell_steps", "step_seconds", "estimate_minutes", "plan_text"]

CONFIRM_MINUTES = 15.0  # a grid estimated longer than this starts only with --yes
TRAIN_SIZES = {"digits": 1437, "cifar10": 50_000}  # training-set sizes; mnist1d: 80 % of num_samples


def cell_steps(cfg: TrainConfig) -> int:
    """Optimizer steps of one run: epochs x steps per epoch (``max_steps_per_epoch`` caps the latter)."""
    n = cfg.num_train or TRAIN_SIZES.get(cfg.dataset, int(0.8 * (cfg.num_samples or 25_000)))
    per_epoch = max(1, n // cfg.batch_size)
    if cfg.max_steps_per_epoch:
        per_epoch = min(per_epoch, cfg.max_steps_per_epoch)
    return per_epoch * cfg.epochs


def step_seconds(cfg: TrainConfig, repeats: int = 2) -> float:
    """Median seconds of one SGD step of ``cfg``'s model at its batch size on its device (one torch thread on the
    CPU), random input."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dev = resolve_device(cfg.device)
        shape = INPUT_SHAPES[cfg.dataset]
        model = cfg.make_model().to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=1e-6)
        x = torch.randn(cfg.batch_size, *shape, device=dev)
        y = torch.randint(0, DATASET_CLASSES[cfg.dataset], (cfg.batch_size,), device=dev)
        times = []
        for _ in range(repeats + 1):  # the first step warms up (allocations, one-time initialisation)
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])
    finally:
        torch.set_num_threads(threads)


def estimate_minutes(cells: Sequence[Cell], workers: int) -> float:
    """Estimated wall-clock minutes to train ``cells`` with ``workers`` parallel workers (see the module doc)."""
    timed: dict[tuple, float] = {}
    total = 0.0
    for cell in cells:
        c = cell.config
        key = (
            c.model,
            c.norm,
            c.conv,
            repr(c.conv_kwargs),
            repr(c.model_kwargs),
            c.width,
            c.batch_size,
            c.dataset,
            c.device,
        )
        if key not in timed:
            timed[key] = step_seconds(c)
        total += cell_steps(c) * timed[key]
    return total / max(1, min(workers, len(cells))) / 60.0


def plan_text(cells: Sequence[Cell], todo: Sequence[Cell], workers: int, remote: bool = False) -> tuple[str, float]:
    """What a command prints before it starts, and the estimate in minutes: ``"12 runs to train (3 already done):
    about 9 min with 2 worker(s) here"`` (``remote``: on a Ray cluster, timed here)."""
    minutes = estimate_minutes(todo, workers) if todo else 0.0
    where = "on the Ray cluster (timed here)" if remote else f"with {max(1, min(workers, len(todo)))} worker(s) here"
    done = f", {len(cells) - len(todo)} already done" if len(todo) < len(cells) else ""
    runs = f"{len(todo)} run" + ("s" if len(todo) != 1 else "")
    return f"{runs} to train{done}: about {minutes:.0f} min {where}", minutes
