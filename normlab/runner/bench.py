"""The cost of one training step per normalization, timed side by side (``normlab bench --steps``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from normlab.nn import resolve_comparison
from normlab.runner.data.datasets import get_dataset
from normlab.runner.errors import UsageError
from normlab.runner.grid.spec import DEFAULT_NORMS
from normlab.runner.models import build_model

__all__ = ["step_times"]


def _timed_steps(net: torch.nn.Module, opt: torch.optim.Optimizer, x, y, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return (time.perf_counter() - t0) / n


def step_times(
    norms: Sequence[str] = DEFAULT_NORMS,
    *,
    dataset: str = "digits",
    model: str = "plain",
    width: float = 0.25,
    batch_size: int = 64,
    repeats: int = 7,
    iters: int = 5,
    threads: int | None = 1,
    data_dir: str | None = None,
    num_samples: int | None = None,
) -> dict[str, dict[str, float]]:
    """Seconds per SGD training step (forward, backward, update) of ``model`` with each norm, interleaved.

    Every repeat times ``iters`` steps of every norm in an order rotated by one per repeat, so slow phases of a
    shared machine hit all norms alike. Returns ``{name: {"median_s", "min_s", "ratio_to_pws"?}}`` (median over
    repeats). The same batch is used for every step (data loading is not timed). ``data_dir`` and ``num_samples``
    are passed to :func:`~normlab.runner.data.datasets.get_dataset` (the mnist1d cache and size).
    """
    if threads:
        torch.set_num_threads(int(threads))
    train_ds, _test, info = get_dataset(dataset, data_dir, num_samples=num_samples)
    if batch_size > len(train_ds):
        raise UsageError(f"batch size {batch_size} is larger than the {dataset} training set ({len(train_ds)})")
    x, y = train_ds.batch(torch.arange(batch_size))
    nets = {}
    for name in norms:
        norm, conv = resolve_comparison(name)
        torch.manual_seed(0)
        net = build_model(model, norm, conv, info["in_channels"], info["num_classes"], info["input_shape"], width)
        nets[name] = (net.train(), torch.optim.SGD(net.parameters(), lr=1e-4, momentum=0.9))
    for name in norms:  # warm-up
        _timed_steps(*nets[name], x, y, 2)
    samples: dict[str, list[float]] = {n: [] for n in norms}
    order = list(norms)
    for r in range(repeats):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            samples[name].append(_timed_steps(*nets[name], x, y, iters))
    out = {n: {"median_s": statistics.median(v), "min_s": min(v)} for n, v in samples.items()}
    if "pws" in out:
        for v in out.values():
            v["ratio_to_pws"] = v["median_s"] / out["pws"]["median_s"]
    return out
