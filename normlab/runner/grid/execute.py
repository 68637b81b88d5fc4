"""Run the cells of one or several grids: in this process or in a pool of worker processes, resumable.

:func:`prepare_grid` expands a :class:`~normlab.runner.grid.spec.GridSpec` into ``<out>/runs/<cell id>/`` and finds the
cells that are already done (a ``summary.json`` written by the same configuration); :func:`run_cells` runs the
remaining cells of any number of prepared grids through one pool, the most expensive first, writing each grid's
``results.json`` after every finished cell; :meth:`GridRun.finish` writes the final results and the report.
:func:`run_grid` does all three for one grid, holding the lock of the output directory
(:func:`normlab.runner.lock.out_lock`); callers of :func:`prepare_grid` hold it themselves.

**One output directory, one grid (the union).** ``grid.json`` records the grid of an output directory and the
cells ever requested there. A later run with other names, learning rates, batch sizes or seeds but the same
settings otherwise (epochs, data, model, width, layout, run options) adds to that grid: its cells are trained,
and ``results.json``/``results.md`` hold every requested cell finished so far, so rerunning with a subset never
drops finished cells from the report. A run with other settings is refused in one line: use another directory.

**Workers die with their parent** (:mod:`normlab.runner.grid.pool`), and a resumed run (which takes the directory's
lock) never trains a cell that another live process is training.

**Backends.** ``backend="process"`` (the default) runs cells in this process or a pool of local worker processes;
``backend="ray"`` runs each cell as a Ray task, on a local Ray or a cluster (:mod:`normlab.runner.grid.ray_backend`).
Both write the same files in the same places, so either resumes a grid the other started. A cell that raises is
recorded as failed with its error (``results.json`` ``failed``) and the other cells go on; :func:`run_cells` then
raises :class:`CellsFailed`, and a rerun retries the failed cells.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from normlab.runner.errors import RunError, UsageError, error_line
from normlab.runner.grid.estimate import cell_steps
from normlab.runner.grid.pool import default_workers, run_jobs
from normlab.runner.grid.report import render_report
from normlab.runner.grid.results import collect_results, read_summary, write_results
from normlab.runner.grid.spec import Cell, GridSpec, expand_grid
from normlab.runner.io import atomic_write_json, remove_stale_temps, to_jsonable
from normlab.runner.lock import out_lock
from normlab.runner.training.checks import check_grid
from normlab.runner.training.config import RESUME_FREE, TrainConfig
from normlab.runner.training.train import train

__all__ = ["GridRun", "prepare_grid", "run_cells", "run_grid", "default_workers", "merge_grid", "CellsFailed",
           "BACKENDS"]

BACKENDS = ("process", "ray")


class CellsFailed(RunError):
    """Some cells raised; each is recorded with its error in ``results.json`` (``failed``), the others finished."""


def _cell_done(cell_dir: Path, cell: Cell) -> dict[str, Any] | None:
    """The cell's summary if ``summary.json`` exists (checked against the cell's config), else None."""
    summary = read_summary(cell_dir)
    if summary is None:
        return None
    diff = cell.config.differences(summary.get("config", {}))
    if diff:
        raise UsageError(f"cell {cell.cell_id} in {cell_dir.parent.parent} was run with a different config "
                         f"({', '.join(diff)}); use another output directory")
    return summary


def _with_data_cache(cells: list[Cell], cache: Path) -> list[Cell]:
    """Generated data sets (mnist1d) without a data directory are cached once, in ``cache``."""
    return [dataclasses.replace(c, config=dataclasses.replace(c.config, data_dir=str(cache)))
            if c.config.dataset == "mnist1d" and c.config.data_dir is None else c for c in cells]


def _cost(cell: Cell) -> float:
    """Rough CPU cost of a cell (steps x per-step cost growing with the batch): the pool starts the largest first."""
    return cell_steps(cell.config) * (12 + cell.config.batch_size)


@dataclass
class GridRun:
    """A prepared grid: its spec, output directory, cells and the summaries of the finished ones.

    ``cells`` are every cell requested in ``out`` (see the module docstring); ``wanted`` the ids this run is asked
    to train (None: all of them); ``failures`` the error line of each cell that raised in this run.
    """

    spec: GridSpec
    out: Path
    cells: list[Cell]
    summaries: dict[str, dict[str, Any]]
    wanted: frozenset[str] | None = None
    failures: dict[str, str] = field(default_factory=dict)

    def missing(self) -> list[Cell]:
        """Cells without a finished summary."""
        return [c for c in self.cells if c.cell_id not in self.summaries]

    def todo(self) -> list[Cell]:
        """Unfinished cells that this run trains."""
        return [c for c in self.missing() if self.wanted is None or c.cell_id in self.wanted]

    def cell_dir(self, cell: Cell) -> Path:
        return self.out / "runs" / cell.cell_id

    def record(self, cell: Cell, summary: dict[str, Any]) -> None:
        """Keep a finished cell; results.json then holds every cell finished so far."""
        self.summaries[cell.cell_id] = summary
        write_results(self.results(complete=False), self.out)

    def record_failure(self, cell: Cell, error: str) -> None:
        """Keep the error of a cell that raised; results.json lists it under ``failed``."""
        self.failures[cell.cell_id] = error
        write_results(self.results(complete=False), self.out)

    def results(self, complete: bool = True) -> dict[str, Any]:
        pairs = [(c, self.summaries[c.cell_id]) for c in self.cells if c.cell_id in self.summaries]
        failed = [(c, self.failures[c.cell_id]) for c in self.cells if c.cell_id in self.failures]
        return collect_results(self.spec, pairs, complete=complete, failed=failed)

    def finish(self, render: bool = True) -> dict[str, Any]:
        """Write the final results.json (and results.md with plots) and return the results."""
        results = self.results(complete=not self.missing())
        write_results(results, self.out)
        if render:
            render_report(results, self.out)
        return results


def _previous_grid(out: Path) -> tuple[GridSpec, set[str] | None] | None:
    """The grid recorded in ``out/grid.json`` and the cell ids requested there (None: every cell), if any."""
    path = out / "grid.json"
    if not os.path.lexists(path):
        return None
    try:
        d = json.loads(path.read_text())
        spec = GridSpec.from_dict(d)
    except (OSError, UnicodeDecodeError, ValueError, TypeError, AttributeError) as e:
        raise UsageError(f"{path} is not a normlab grid ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e})"
                         f"; move it away or use another output directory") from None
    requested = d.get("requested_cells")
    return spec, set(requested) if isinstance(requested, list) else None


def _settings(spec: GridSpec) -> dict[str, Any]:
    """What must agree between grids that share a directory: every field but the lists and RESUME_FREE options
    (as JSON values, the run options flattened in)."""
    d = to_jsonable({k: v for k, v in spec.to_dict().items() if k not in GridSpec.LIST_FIELDS})
    d.update({k: v for k, v in d.pop("train_kwargs").items() if k not in RESUME_FREE})
    if spec.layout == "product":
        d.pop("base_lr")  # only a report coordinate in a product grid
        if spec.lr_scaling == "none":
            d.pop("base_batch_size")
    return d


def merge_grid(previous: GridSpec | None, spec: GridSpec, where: Path) -> GridSpec:
    """The grid of a directory that holds ``previous`` once ``spec`` is added (the union of the lists).

    Raises:
        UsageError: ``previous`` differs from ``spec`` in anything but names, learning rates, batch sizes and seeds.
    """
    if previous is None:
        return spec
    old, new = _settings(previous), _settings(spec)
    diff = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if diff:
        raise UsageError(f"{where} holds a grid run with a different config ({'; '.join(diff)}); rerun with its "
                         f"settings to extend it, or use another output directory for a new grid")
    lists = {k: list(dict.fromkeys([*getattr(previous, k), *getattr(spec, k)])) for k in GridSpec.LIST_FIELDS}
    return GridSpec.from_dict({**previous.to_dict(), **lists, "train_kwargs": dict(spec.train_kwargs)})


def prepare_grid(spec: GridSpec, out_dir: str | os.PathLike, check: bool = True,
                 data_cache: str | os.PathLike | None = None) -> GridRun:
    """Expand ``spec`` into ``out_dir`` (grid.json), check its cells and collect those already done.

    A grid already in ``out_dir`` is extended (:func:`merge_grid`): the returned run trains the cells of ``spec``
    and reports every requested cell. Call it under :func:`~normlab.runner.lock.out_lock` (it removes the
    temporary files of killed writers).
    """
    out = Path(out_dir)
    prev = _previous_grid(out)
    merged = merge_grid(prev[0] if prev else None, spec, out)
    cache = Path(data_cache) if data_cache is not None else out / "data"
    wanted = frozenset(c.cell_id for c in expand_grid(spec))
    before = (prev[1] if prev[1] is not None else {c.cell_id for c in expand_grid(prev[0])}) if prev else set()
    cells = _with_data_cache([c for c in expand_grid(merged) if c.cell_id in wanted | before], cache)
    if check:
        check_grid([c for c in cells if c.cell_id in wanted])
    summaries = {c.cell_id: s for c in cells if (s := _cell_done(out / "runs" / c.cell_id, c)) is not None}
    (out / "runs").mkdir(parents=True, exist_ok=True)
    for d in [out, *(out / "runs" / c.cell_id for c in cells)]:
        remove_stale_temps(d)
    atomic_write_json(out / "grid.json", {**merged.to_dict(), "requested_cells": sorted(c.cell_id for c in cells)},
                      indent=2)
    return GridRun(merged, out, cells, summaries, wanted)


def _run_cell(config: TrainConfig, out_dir: str) -> dict[str, Any]:
    """Worker entry: one train() call; returns the summary."""
    return train(config, out_dir, progress=False)


class _Progress:
    def __init__(self, total: int, done: int, enabled: bool):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=done, desc="runs", unit="run", disable=not enabled, file=sys.stderr,
                        dynamic_ncols=True)

    def update(self, cell: Cell, summary: dict[str, Any]) -> None:
        acc = summary.get("final_test_acc")
        flag = f" COLLAPSED ({summary.get('collapse_reason')})" if summary.get("collapsed") else ""
        self.bar.update(1)
        self.bar.set_postfix_str(f"last {cell.cell_id}: acc {'n/a' if acc is None else f'{acc:.3f}'}{flag}")

    def failed(self, cell: Cell, error: str) -> None:
        self.bar.update(1)
        self.bar.set_postfix_str(f"last {cell.cell_id}: FAILED ({error})")


def _raise_failures(grids: Sequence[GridRun]) -> None:
    errors = [(cid, err) for g in grids for cid, err in g.failures.items()]
    if errors:
        cid, err = errors[0]
        raise CellsFailed(f"{len(errors)} run(s) failed (first: {cid}: {err}); every error is in results.json "
                          f"under 'failed'; rerun the same command to retry them")


def run_cells(grids: Sequence[GridRun], *, workers: int | None = None, threads: int | None = None,
              progress: bool = True, log: Callable[[str], None] | None = None, backend: str = "process",
              address: str | None = None) -> None:
    """Run every unfinished cell of ``grids``, the most expensive first, with ``threads`` torch threads each
    (default 1 in a pool or on Ray).

    ``backend="process"``: in ``workers`` processes (default: one per usable core; 1 runs them in this process).
    ``backend="ray"``: as Ray tasks on the cluster at ``address``, or on a local Ray with ``workers`` x
    ``threads`` CPUs (default: every usable core); see :mod:`normlab.runner.grid.ray_backend`.

    Raises:
        CellsFailed: after the other cells finished, when some cells raised (each is in results.json).
    """
    if backend not in BACKENDS:
        raise UsageError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    say = log or (lambda s: print(s, file=sys.stderr))
    jobs = sorted(((g, c) for g in grids for c in g.todo()), key=lambda gc: -_cost(gc[1]))
    done_before = sum(len(g.summaries) for g in grids)
    total = done_before + len(jobs)
    if done_before:
        say(f"normlab: {done_before} of {total} runs already done (skipped)")
    bar, t0 = _Progress(total, done_before, progress), time.perf_counter()

    def done(grid: GridRun, cell: Cell, summary: dict[str, Any]) -> None:
        grid.record(cell, summary)
        bar.update(cell, summary)

    def failed(grid: GridRun, cell: Cell, error: str) -> None:
        grid.record_failure(cell, error)
        bar.failed(cell, error)

    try:
        if backend == "ray" and jobs:
            from normlab.runner.grid.ray_backend import run_on_ray

            cpus = run_on_ray(jobs, threads=int(threads or 1), done=done, failed=failed, address=address,
                              num_cpus=int(workers or default_workers()) * int(threads or 1))
            where = f"Ray tasks ({cpus:g} CPUs)"
        else:
            n = run_jobs([(_run_cell, (c.config, str(g.cell_dir(c)))) for g, c in jobs],
                         workers=default_workers() if workers in (None, 0) else int(workers), threads=threads,
                         on_done=lambda i, summary: done(*jobs[i], summary),
                         on_error=lambda i, e: failed(*jobs[i], error_line(e, with_type=True)))
            where = f"{n} worker(s)"
    finally:
        bar.bar.close()
    if jobs:
        say(f"normlab: ran {len(jobs)} runs with {where} in {time.perf_counter() - t0:.1f} s")
    _raise_failures(grids)


def run_grid(spec: GridSpec, out_dir: str | os.PathLike, *, workers: int | None = None, progress: bool = True,
             check: bool = True, render: bool = True, threads: int | None = None,
             log: Callable[[str], None] | None = None, backend: str = "process",
             address: str | None = None) -> dict[str, Any]:
    """Run (or resume) every cell of ``spec`` under ``out_dir/runs``; write results.json and the report.

    Cells with a matching ``summary.json`` are not rerun; a half-trained cell resumes from its checkpoint; a grid
    already in ``out_dir`` is extended (see the module docstring). ``backend``/``address``: see :func:`run_cells`.
    Holds the directory's lock throughout. Returns the results dict.

    Raises:
        CellsFailed: some cells raised; the report of the others is written first.
    """
    with out_lock(out_dir, "compare", option="out_dir"):
        grid = prepare_grid(spec, out_dir, check=check)
        try:
            run_cells([grid], workers=workers, threads=threads, progress=progress, log=log, backend=backend,
                      address=address)
        except CellsFailed:
            grid.finish(render=render)
            raise
        return grid.finish(render=render)
