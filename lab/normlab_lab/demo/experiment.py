"""``normlab-lab demo`` (what ``make demo`` runs): the seeds' phenomena on MNIST-1D in about 4.5 minutes on 2 cores.

Four sections, each a grid under ``<out>/<section>/`` (the training runs of all sections share one process pool):

a. ``lr_sweep``: the paper's plain net in 1-D at batch 128 with none / BN / BRN / GN / SN / WN / WS+GN / PWS (with
   the default gamma 1e-3 and with gamma 1e-2) across learning rates, the monitor recording every 10th step;
b. ``batch_size``: BN / BRN / GN / SN / PWS at batch 128, 4 and 2 with the learning rate scaled linearly with the
   batch size and equal epochs, test accuracy with running statistics (eval mode) next to batch statistics
   (train mode);
c. ``collapse``: the collapse diagnosis at the paper's width, the monitor recording every step of the first steps
   of none / BN / PWS at the collapsing learning rate (alarm, lead time in steps, the two terms of the output
   variance, Figures 1(a), 1(b), the shift and the output variance per layer), the regime warning (the regime rule),
   the false-alarm count over every monitored run of the demo, and ``guard``: the guarded twins, the unnormalized
   runs of (c) again with a :class:`~normlab.monitor.CollapseGuard` (``guard=True``), beside their unguarded runs,
   and ``guard_dead``: the same with ``guard_dead=True`` (``--guard-dead``: the guard also measures against chance);
d. the cost of one training step per normalization, timed side by side.

The protocol (:data:`PROTOCOL`) was fixed from pilot runs on other seeds before the demo's own seeds ran;
``lab/docs/reproduction.md`` records both. ``quick=True`` runs a seconds-long version that only checks the pipeline.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from normlab.runner.bench import step_times
from normlab.runner.data.datasets import get_dataset
from normlab.runner.data.mnist1d import load_mnist1d
from normlab.runner.experiments.compare import COMPARE, comparison
from normlab.runner.grid.estimate import step_seconds
from normlab.runner.grid.execute import GridRun, default_workers, plan_grid, run_cells
from normlab.runner.grid.spec import GridSpec, expand_grid
from normlab.runner.io import atomic_write_json
from normlab_lab import PROG
from normlab_lab.demo.claims import collect_evidence
from normlab_lab.demo.report import render_demo_report

__all__ = [
    "DemoProtocol",
    "PROTOCOL",
    "QUICK_PROTOCOL",
    "REPORT_S",
    "after_runs_seconds",
    "demo_sections",
    "milestone_epochs",
    "plan_demo",
    "run_demo",
]


@dataclass(frozen=True)
class DemoProtocol:
    """Every number of the demo in one place (printed at the top of its report)."""

    num_samples: int = 25_000  # MNIST-1D: 20,000 train / 5,000 test
    seeds: tuple[int, ...] = (0, 1, 2)
    # (a) learning-rate sweep at batch 128
    lr_width: float = 0.25
    lr_norms: tuple[str, ...] = ("none", "bn", "brn", "gn", "sn", "wn", "ws+gn", "pws", "pws:gamma=0.01")
    lrs: tuple[float, ...] = (0.02, 0.1, 0.2)
    lr_steps: int = 120
    lr_evals: int = 3
    monitor_every: int = 10
    # (c) collapse diagnosis: the paper's width, monitor every step over the first steps
    collapse_width: float = 0.5
    collapse_norms: tuple[str, ...] = ("none", "bn", "pws", "pws:gamma=0.01")
    collapse_lr: float = 0.1
    collapse_steps: int = 100
    # (c) guarded twins: section (c)'s runs of guard_norm (same width, lr, steps, monitor) with guard=True, on
    # guard_seeds (the rule was fixed before any guarded run: every demo seed of the unnormalized net); and the same
    # runs with guard_dead=True (lab/docs/monitor_calibration.md, round 5: fixed before they ran)
    guard_norm: str = "none"
    guard_seeds: tuple[int, ...] = (0, 1, 2)
    # (b) batch size, lr scaled linearly, equal epochs on a subset
    batch_width: float = 0.25
    batch_norms: tuple[str, ...] = ("bn", "brn", "gn", "sn", "pws")
    batch_sizes: tuple[int, ...] = (128, 4, 2)
    base_lr: float = 0.05
    batch_num_train: int = 2000  # 0: every training sample
    batch_max_steps: int = 0  # 0: no cap on the steps of an epoch
    batch_monitor_every: int = 50
    # (d) cost of a training step
    cost_batch_sizes: tuple[int, ...] = (128, 2)
    cost_repeats: int = 3
    cost_iters: int = 6
    # the full reproduction (``normlab-lab reproduce``): epochs per section (the step caps above then cap each epoch;
    # 0 = no cap), the lr schedule (x ``lr_decay`` after each fraction of a section's epochs) and (b)'s lr scaling
    lr_epochs: int = 1
    collapse_epochs: int = 1
    batch_epochs: int = 1
    milestones: tuple[float, ...] = ()
    lr_decay: float = 0.1
    batch_lr_scaling: str = "linear"
    batch_evals: int = 1


PROTOCOL = DemoProtocol()
QUICK_PROTOCOL = DemoProtocol(
    num_samples=2000,
    seeds=(0,),
    lr_width=0.125,
    lr_norms=("none", "bn", "pws"),
    lrs=(0.02, 0.1),
    lr_steps=8,
    lr_evals=2,
    collapse_width=0.125,
    collapse_norms=("none", "pws"),
    collapse_steps=6,
    guard_seeds=(0,),
    batch_width=0.125,
    batch_norms=("bn", "gn"),
    batch_sizes=(64, 4),
    batch_num_train=128,
    cost_batch_sizes=(32,),
    cost_repeats=1,
    cost_iters=1,
)


def milestone_epochs(p: DemoProtocol, epochs: int) -> tuple[int, ...]:
    """The epochs after which a section of ``epochs`` epochs decays its learning rate: ``p.milestones`` (fractions
    of the section's epochs) rounded, each at least 1 and before the last epoch; () without a schedule."""
    if epochs < 2:
        return ()
    return tuple(sorted({min(epochs - 1, max(1, round(f * epochs))) for f in p.milestones}))


def _schedule(p: DemoProtocol, epochs: int) -> dict[str, Any]:
    """The TrainConfig fields of a section's lr schedule (none in the quick demo, so its cells stay as they were)."""
    ms = milestone_epochs(p, epochs)
    return {"milestones": ms, "lr_gamma": p.lr_decay} if ms else {}


def demo_sections(p: DemoProtocol = PROTOCOL) -> dict[str, GridSpec]:
    """The grids of sections (a), (c), (c)'s two kinds of guarded twins and (b), all on MNIST-1D with the plain net
    in 1-D: comparisons as a user asks normlab for one (:func:`normlab.runner.experiments.compare.comparison`), with
    the demo's protocol. No run stops before its last step but on a non-finite loss (``stop_on="non_finite"``): the
    claims read what a collapsing run does afterwards (a return to chance, a recovery)."""
    data = {"num_samples": p.num_samples}
    dense = {"monitor_dense_steps": p.collapse_steps} if p.collapse_epochs > 1 else {}
    net = {"model": "plain1d", "data": "mnist1d", "seeds": p.seeds, "stop_on": "non_finite", "batch_sizes": (128,)}
    lr_sweep = comparison(
        **net,
        norms=p.lr_norms,
        lrs=p.lrs,
        epochs=p.lr_epochs,
        width=p.lr_width,
        max_steps_per_epoch=p.lr_steps or None,
        monitor_every=p.monitor_every,
        evals_per_epoch=p.lr_evals,
        **data,
        **_schedule(p, p.lr_epochs),
    )
    collapse = comparison(
        **net,
        norms=p.collapse_norms,
        lrs=(p.collapse_lr,),
        epochs=p.collapse_epochs,
        width=p.collapse_width,
        max_steps_per_epoch=None if dense else p.collapse_steps,
        monitor_every=p.monitor_every if dense else 1,
        evals_per_epoch=1,
        **data,
        **dense,
        **_schedule(p, p.collapse_epochs),
    )
    guard = dataclasses.replace(
        collapse,
        norms=(p.guard_norm,),
        seeds=p.guard_seeds,
        train_kwargs={**collapse.train_kwargs, "guard": True},
    )
    guard_dead = dataclasses.replace(guard, train_kwargs={**guard.train_kwargs, "guard_dead": True})
    batch = comparison(
        **{**net, "batch_sizes": p.batch_sizes},
        norms=p.batch_norms,
        lrs=(p.base_lr,),
        epochs=p.batch_epochs,
        width=p.batch_width,
        layout="cross",
        lr_scaling=p.batch_lr_scaling,
        max_steps_per_epoch=p.batch_max_steps or None,
        monitor_every=p.batch_monitor_every,
        eval_train_mode=True,
        evals_per_epoch=p.batch_evals,
        **data,
        **({"num_train": p.batch_num_train} if p.batch_num_train else {}),
        **_schedule(p, p.batch_epochs),
    )
    return {"lr_sweep": lr_sweep, "collapse": collapse, "guard": guard, "guard_dead": guard_dead, "batch_size": batch}


def _step_cost(p: DemoProtocol, out: Path) -> dict[str, Any]:
    """Seconds per training step of every norm of section (a), timed side by side, at each cost batch size."""
    norms = tuple(dict.fromkeys(n.split(":")[0] for n in p.lr_norms))
    result = {"width": p.lr_width, "repeats": p.cost_repeats, "iters": p.cost_iters, "by_batch": {}}
    for bs in p.cost_batch_sizes:
        result["by_batch"][str(bs)] = step_times(
            norms,
            dataset="mnist1d",
            model="plain1d",
            width=p.lr_width,
            batch_size=bs,
            repeats=p.cost_repeats,
            iters=p.cost_iters,
            threads=1,
            data_dir=str(out / "data"),
            num_samples=p.num_samples,
        )
    atomic_write_json(out / "step_cost.json", result)
    return result


REPORT_S = 9.0  # seconds of the evidence and the report after section (d) (measured once, see below)


def after_runs_seconds(p: DemoProtocol) -> float:
    """Estimated seconds of the demo's work after its training runs, in this process: section (d)'s steps (each
    norm's step timed here at each cost batch size, times the steps :func:`~normlab.runner.bench.step_times` takes:
    2 warm-up steps and ``cost_repeats x cost_iters``) and the evidence and report (:data:`REPORT_S`, measured once:
    lab/docs/estimate_calibration.md)."""
    norms = tuple(dict.fromkeys(n.split(":")[0] for n in p.lr_norms))
    spec = comparison(
        "plain1d",
        "mnist1d",
        norms=norms,
        lrs=(0.1,),
        batch_sizes=p.cost_batch_sizes,
        seeds=(p.seeds[0],),
        epochs=1,
        width=p.lr_width,
        layout="cross",
        monitor_every=0,
        stop_on="non_finite",
        num_samples=p.num_samples,
    )
    steps = 2 + p.cost_repeats * p.cost_iters
    return REPORT_S + sum(steps * step_seconds(c.config) for c in expand_grid(spec))


def plan_demo(out: Path, p: DemoProtocol, workers: int = 1) -> dict[str, GridRun]:
    """Generate the data once, by ``workers`` processes, before the grid's workers start, and plan every section's
    grid under ``out`` (read only)."""
    load_mnist1d(p.num_samples, out / "data", workers=workers)
    get_dataset("mnist1d", out / "data", num_samples=p.num_samples)
    return {k: plan_grid(COMPARE, spec, out / k, data_cache=out / "data") for k, spec in demo_sections(p).items()}


def run_demo(
    out_dir: str | os.PathLike,
    *,
    quick: bool = False,
    protocol: DemoProtocol | None = None,
    mode: str | None = None,
    workers: int | None = None,
    threads: int | None = None,
    progress: bool = True,
    backend: str = "process",
    address: str | None = None,
    announce: Callable[[list[GridRun], float], float | None] | None = None,
) -> dict[str, Any]:
    """Run (or resume) the demo into ``out_dir`` and write its report; returns ``{"protocol", "quick", "mode",
    "sections", "cost", "evidence"}`` (the sections' results dicts; the evidence the claims' verdicts take from the
    runs' files, :func:`~normlab_lab.demo.claims.collect_evidence`).

    ``protocol`` replaces :data:`PROTOCOL` (``normlab-lab reproduce`` passes its own; ``mode`` names it in the report:
    ``"demo"``, ``"quick"``, ``"full"`` or ``"smoke"``); ``announce(grids)`` is called on the planned grids before
    anything is written (it prints the estimate and returns it in seconds, the progress line's first ETA; it may
    refuse; the second argument: :func:`after_runs_seconds`, the work after the runs, which it adds to the estimate);
    ``backend`` / ``address``: see
    :func:`~normlab.runner.grid.execute.run_cells`."""
    p = protocol or (QUICK_PROTOCOL if quick else PROTOCOL)
    mode = mode or ("quick" if quick else "demo")
    out = Path(out_dir)
    grids = plan_demo(out, p, workers=int(workers or default_workers()) if backend == "process" else 1)
    after_s = after_runs_seconds(p) if announce is not None else None
    estimate_s = announce(list(grids.values()), after_s) if announce is not None else None
    for grid in grids.values():
        grid.start()
    command = "demo" if mode in ("demo", "quick") else "reproduce"
    print(
        f"{PROG} {command}: "
        f"{sum(len(g.cells) for g in grids.values())} training runs on MNIST-1D "
        f"({p.num_samples} samples), seeds {list(p.seeds)} -> {out}",
        file=sys.stderr,
    )
    run_cells(
        list(grids.values()),
        workers=workers,
        threads=threads,
        progress=progress,
        backend=backend,
        address=address,
        estimate_s=estimate_s,
        after_s=after_s,
        label=f"{PROG} {command}",
    )
    demo = {
        "protocol": dataclasses.asdict(p),
        "quick": quick or mode in ("quick", "smoke"),
        "mode": mode,
        "sections": {k: g.finish(render=False) for k, g in grids.items()},
        "cost": _step_cost(p, out),
    }
    demo["evidence"] = collect_evidence(out, demo["sections"])
    atomic_write_json(out / "demo.json", demo)
    render_demo_report(demo, out, fresh=True)
    return demo
