"""Run the cells of one or several grids: in this process or in a pool of worker processes, resumable.

:func:`prepare_grid` expands a :class:`~normlab.runner.grid.GridSpec` into ``<out>/runs/<cell id>/`` and finds the
cells that are already done (a ``summary.json`` written by the same configuration); :func:`run_cells` runs the
remaining cells of any number of prepared grids through one pool, the most expensive first, writing each grid's
``results.json`` after every finished cell; :meth:`GridRun.finish` writes the final results and the report.
:func:`run_grid` does all three for one grid.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .checks import check_grid
from .config import TrainConfig
from .errors import UsageError
from .grid import Cell, GridSpec, expand_grid
from .io import atomic_write_json
from .report import render_report
from .results import collect_results, write_results
from .train import train

__all__ = ["GridRun", "prepare_grid", "run_cells", "run_grid", "default_workers"]

_TRAIN_SIZE = {"digits": 1437, "cifar10": 50_000}


def _cell_done(cell_dir: Path, cell: Cell) -> dict[str, Any] | None:
    """The cell's summary if ``summary.json`` exists (checked against the cell's config), else None."""
    path = cell_dir / "summary.json"
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{path} is unreadable ({e}); move the cell directory away to rerun it") from None
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
    cfg = cell.config
    n = cfg.num_train or _TRAIN_SIZE.get(cfg.dataset, 0.8 * (cfg.num_samples or 25_000))
    steps = min(n // cfg.batch_size, cfg.max_steps_per_epoch or n) * cfg.epochs
    return steps * (12 + cfg.batch_size)


@dataclass
class GridRun:
    """A prepared grid: its spec, output directory, cells and the summaries of the finished ones."""

    spec: GridSpec
    out: Path
    cells: list[Cell]
    summaries: dict[str, dict[str, Any]]

    def todo(self) -> list[Cell]:
        return [c for c in self.cells if c.cell_id not in self.summaries]

    def cell_dir(self, cell: Cell) -> Path:
        return self.out / "runs" / cell.cell_id

    def record(self, cell: Cell, summary: dict[str, Any]) -> None:
        """Keep a finished cell; results.json then holds every cell finished so far."""
        self.summaries[cell.cell_id] = summary
        write_results(self.results(complete=False), self.out)

    def results(self, complete: bool = True) -> dict[str, Any]:
        pairs = [(c, self.summaries[c.cell_id]) for c in self.cells if c.cell_id in self.summaries]
        return collect_results(self.spec, pairs, complete=complete)

    def finish(self, render: bool = True) -> dict[str, Any]:
        """Write the final results.json (and results.md with plots) and return the results."""
        results = self.results(complete=not self.todo())
        write_results(results, self.out)
        if render:
            render_report(results, self.out)
        return results


def prepare_grid(spec: GridSpec, out_dir: str | os.PathLike, check: bool = True,
                 data_cache: str | os.PathLike | None = None) -> GridRun:
    """Expand ``spec`` into ``out_dir`` (grid.json), check its cells and collect those already done."""
    out = Path(out_dir)
    cells = _with_data_cache(expand_grid(spec), Path(data_cache) if data_cache is not None else out / "data")
    if check:
        check_grid(cells)
    summaries = {c.cell_id: s for c in cells if (s := _cell_done(out / "runs" / c.cell_id, c)) is not None}
    (out / "runs").mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "grid.json", spec.to_dict(), indent=2)
    return GridRun(spec, out, cells, summaries)


def _init_worker(threads: int) -> None:
    torch.set_num_threads(threads)


def _run_cell(config: TrainConfig, out_dir: str) -> dict[str, Any]:
    """Worker entry: one train() call; returns the summary."""
    return train(config, out_dir, progress=False)


def default_workers() -> int:
    """Number of CPU cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


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


def _pool(jobs: list[tuple[GridRun, Cell]], workers: int, threads: int, done: Callable) -> None:
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(threads,)) as pool:
        futures = {pool.submit(_run_cell, c.config, str(g.cell_dir(c))): (g, c) for g, c in jobs}
        try:
            for f in as_completed(futures):
                done(*futures[f], f.result())
        except BaseException:
            # a failed cell (or Ctrl-C) stops the run: queued cells are cancelled, running ones resume next time
            pool.shutdown(wait=False, cancel_futures=True)
            raise


def run_cells(grids: Sequence[GridRun], *, workers: int | None = None, threads: int | None = None,
              progress: bool = True, log: Callable[[str], None] | None = None) -> None:
    """Run every unfinished cell of ``grids``, the most expensive first, in ``workers`` processes (default: one
    per usable core; 1 runs them in this process) with ``threads`` torch threads each (default 1 in a pool)."""
    say = log or (lambda s: print(s, file=sys.stderr))
    jobs = sorted(((g, c) for g in grids for c in g.todo()), key=lambda gc: -_cost(gc[1]))
    total, done_before = sum(len(g.cells) for g in grids), sum(len(g.summaries) for g in grids)
    if done_before:
        say(f"normlab: {done_before} of {total} runs already done (skipped)")
    n = max(1, min(default_workers() if workers in (None, 0) else int(workers), len(jobs)))
    bar, t0, saved = _Progress(total, done_before, progress), time.perf_counter(), torch.get_num_threads()

    def done(grid: GridRun, cell: Cell, summary: dict[str, Any]) -> None:
        grid.record(cell, summary)
        bar.update(cell, summary)

    try:
        if n == 1:
            if threads:
                torch.set_num_threads(int(threads))
            for g, c in jobs:
                done(g, c, _run_cell(c.config, str(g.cell_dir(c))))
        else:
            _pool(jobs, n, int(threads or 1), done)
    finally:
        torch.set_num_threads(saved)
        bar.bar.close()
    if jobs:
        say(f"normlab: ran {len(jobs)} runs with {n} worker(s) in {time.perf_counter() - t0:.1f} s")


def run_grid(spec: GridSpec, out_dir: str | os.PathLike, *, workers: int | None = None, progress: bool = True,
             check: bool = True, render: bool = True, threads: int | None = None,
             log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run (or resume) every cell of ``spec`` under ``out_dir/runs``; write results.json and the report.

    Cells with a matching ``summary.json`` are not rerun; a half-trained cell resumes from its checkpoint.
    Returns the results dict.
    """
    grid = prepare_grid(spec, out_dir, check=check)
    run_cells([grid], workers=workers, threads=threads, progress=progress, log=log)
    return grid.finish(render=render)
