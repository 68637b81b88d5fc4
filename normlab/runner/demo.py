"""``normlab demo`` (what ``make demo`` runs): the seeds' phenomena on MNIST-1D in about five minutes on 2 cores.

Four sections, each a grid under ``<out>/<section>/`` (the training runs of all sections share one process pool):

a. ``lr_sweep``: the paper's plain net in 1-D at batch 128 with none / BN / BRN / GN / SN / WN / WS+GN / PWS across
   learning rates, the monitor recording every other step over the first 100 steps (and every 10th after);
b. ``batch_size``: BN / BRN / GN / SN / PWS at batch 128, 4 and 2 with the learning rate scaled linearly with the
   batch size and equal epochs, test accuracy with running statistics (eval mode) next to batch statistics
   (train mode);
c. the collapse diagnosis: the monitor's records of the section-(a) runs at the collapsing learning rate (alarm,
   lead time in steps, the two terms of the output variance, Figures 1(a), 1(b) and the output variance per layer)
   and the false-alarm count over every monitored run of the demo;
d. the cost of one training step per normalization, timed side by side.

The protocol (:data:`PROTOCOL`) was fixed from pilot runs on other seeds before the demo's own seeds ran;
``docs/reproduction.md`` records both. ``quick=True`` runs a seconds-long version that only checks the pipeline.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .bench import step_times
from .data import get_dataset
from .execute import GridRun, prepare_grid, run_cells
from .grid import GridSpec
from .io import atomic_write_json

__all__ = ["DemoProtocol", "PROTOCOL", "QUICK_PROTOCOL", "demo_sections", "run_demo"]


@dataclass(frozen=True)
class DemoProtocol:
    """Every number of the demo in one place (printed at the top of its report)."""

    num_samples: int = 25_000  # MNIST-1D: 20,000 train / 5,000 test
    width: float = 0.25
    seeds: tuple[int, ...] = (0, 1, 2)
    lr_norms: tuple[str, ...] = ("none", "bn", "brn", "gn", "sn", "wn", "ws+gn", "pws", "pws:gamma=0.01")
    lrs: tuple[float, ...] = (0.02, 0.1)
    lr_epochs: int = 1
    lr_evals_per_epoch: int = 4
    collapse_lr: float = 0.1
    monitor_every: int = 10
    monitor_dense_steps: int = 100
    monitor_dense_every: int = 2
    batch_norms: tuple[str, ...] = ("bn", "brn", "gn", "sn", "pws")
    batch_sizes: tuple[int, ...] = (128, 4, 2)
    base_lr: float = 0.05
    batch_num_train: int = 4000
    batch_epochs: int = 1
    batch_evals_per_epoch: int = 4
    batch_monitor_every: int = 50
    cost_batch_size: int = 128
    cost_repeats: int = 5
    cost_iters: int = 3
    max_steps_per_epoch: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


PROTOCOL = DemoProtocol()
QUICK_PROTOCOL = DemoProtocol(
    num_samples=2000, width=0.125, seeds=(0,), lr_norms=("none", "bn", "pws"), lrs=(0.02, 0.1), lr_evals_per_epoch=2,
    monitor_dense_steps=6, batch_norms=("bn", "gn"), batch_sizes=(64, 4), batch_num_train=256,
    batch_evals_per_epoch=2, cost_batch_size=32, cost_repeats=1, cost_iters=1, max_steps_per_epoch=8,
)


def demo_sections(p: DemoProtocol = PROTOCOL) -> dict[str, GridSpec]:
    """The grids of sections (a) and (b)."""
    common = {"num_samples": p.num_samples, "evals_per_epoch": p.lr_evals_per_epoch, "monitor_every":
              p.monitor_every, "monitor_dense_steps": p.monitor_dense_steps,
              "monitor_dense_every": p.monitor_dense_every}
    lr_sweep = GridSpec(norms=p.lr_norms, lrs=p.lrs, batch_sizes=(128,), seeds=p.seeds, epochs=p.lr_epochs,
                        dataset="mnist1d", model="plain1d", width=p.width, max_steps_per_epoch=p.max_steps_per_epoch,
                        train_kwargs=common)
    batch = GridSpec(norms=p.batch_norms, lrs=(p.base_lr,), batch_sizes=p.batch_sizes, seeds=p.seeds,
                     epochs=p.batch_epochs, dataset="mnist1d", model="plain1d", width=p.width, layout="cross",
                     lr_scaling="linear", max_steps_per_epoch=p.max_steps_per_epoch,
                     train_kwargs={**common, "num_train": p.batch_num_train, "eval_train_mode": True,
                                   "evals_per_epoch": p.batch_evals_per_epoch, "monitor_every": p.batch_monitor_every,
                                   "monitor_dense_steps": 0})
    return {"lr_sweep": lr_sweep, "batch_size": batch}


def _step_cost(p: DemoProtocol, out: Path) -> dict[str, Any]:
    norms = tuple(dict.fromkeys(n.split(":")[0] for n in p.lr_norms))
    times = step_times(norms, dataset="mnist1d", model="plain1d", width=p.width, batch_size=p.cost_batch_size,
                       repeats=p.cost_repeats, iters=p.cost_iters, threads=1, data_dir=out / "data",
                       num_samples=p.num_samples)
    result = {"batch_size": p.cost_batch_size, "width": p.width, "repeats": p.cost_repeats, "iters": p.cost_iters,
              "times": times}
    atomic_write_json(out / "step_cost.json", result)
    return result


def run_demo(out_dir: str | os.PathLike, *, quick: bool = False, workers: int | None = None,
             threads: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Run (or resume) the demo into ``out_dir`` and write its report; returns ``{"protocol", "sections",
    "cost"}`` (the sections' results dicts)."""
    from .demo_report import render_demo_report

    p = QUICK_PROTOCOL if quick else PROTOCOL
    out = Path(out_dir)
    get_dataset("mnist1d", out / "data", num_samples=p.num_samples)  # generate once, before the workers start
    grids: dict[str, GridRun] = {k: prepare_grid(spec, out / k, data_cache=out / "data")
                                 for k, spec in demo_sections(p).items()}
    print(f"normlab demo: {sum(len(g.cells) for g in grids.values())} training runs on MNIST-1D "
          f"({p.num_samples} samples), plain1d width {p.width:g}, seeds {list(p.seeds)} -> {out}", file=sys.stderr)
    run_cells(list(grids.values()), workers=workers, threads=threads, progress=progress)
    demo = {"protocol": dataclasses.asdict(p), "quick": quick,
            "sections": {k: g.finish(render=False) for k, g in grids.items()}, "cost": _step_cost(p, out)}
    atomic_write_json(out / "demo.json", demo)
    render_demo_report(demo, out)
    return demo
