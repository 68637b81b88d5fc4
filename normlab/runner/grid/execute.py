"""The grid engine: runs the cells of any experiment, in this process, a pool of worker processes or on Ray;
resumable, one output directory per grid.

An experiment is a spec plus a training function (:class:`Experiment`): the normalization comparison
(:mod:`normlab.runner.experiments.compare`, each cell one :func:`~normlab.runner.training.train.train` call) is one;
any other (a spec on :class:`~normlab.runner.grid.spec.DictSpec`, a training function of one cell) runs through the
same code.
:func:`plan_grid` reads an output directory (read only): the grid recorded there merged with the new spec, the
cells, which of them are done (a ``summary.json`` written by the same configuration); :meth:`GridRun.start` writes
the directory's record; :func:`run_cells` runs the remaining cells of any number of planned grids through one
pool, the most expensive first, writing each grid's ``results.json`` after every finished cell;
:meth:`GridRun.finish` writes the final results and the report. :func:`run_experiment` does all of it for one grid
and is the one owner of the directory's lock (:func:`normlab.runner.lock.out_lock`); callers of the parts hold it
themselves.

**One output directory, one grid (the union).** The spec file (``grid.json``, ``capsules.json``) records the grid
of an output directory and the cells ever requested there. A later run with other list values (names, learning
rates, seeds, ...) but the same settings otherwise adds to that grid: its cells are trained, and
``results.json``/``results.md`` hold every requested cell finished so far, so rerunning with a subset never drops
finished cells from the report. A run with other settings is refused in one line: use another directory.

**Workers die with their parent** (:mod:`normlab.runner.grid.pool`), and a resumed run (which takes the
directory's lock) never trains a cell that another live process is training.

**Backends.** ``backend="process"`` (the default) runs cells in this process or a pool of local worker processes;
``backend="ray"`` runs each cell as a Ray task, on a local Ray or a cluster (:mod:`normlab.runner.grid.ray_backend`).
Both write the same files in the same places, so either resumes a grid the other started. A cell that raises is
recorded as failed with its error (``results.json`` ``failed``) and the other cells go on; :func:`run_cells` then
raises :class:`CellsFailed`, and a rerun retries the failed cells.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from normlab.runner.errors import RunError, UsageError, error_line
from normlab.runner.grid.pool import default_workers, run_jobs
from normlab.runner.grid.progress import GridProgress
from normlab.runner.grid.results import read_summary
from normlab.runner.grid.spec import DictSpec
from normlab.runner.io import atomic_write_json, remove_stale_temps
from normlab.runner.lock import out_lock

__all__ = [
    "Experiment",
    "GridRun",
    "plan_grid",
    "run_cells",
    "run_experiment",
    "default_workers",
    "merge_grid",
    "CellsFailed",
    "BACKENDS",
]

#: Where the cells run, ``"process"`` (this process or a pool of worker processes) or ``"ray"`` (Ray tasks).
BACKENDS = ("process", "ray")


class CellsFailed(RunError):
    """Some cells raised; each is recorded with its error in ``results.json`` (``failed``), the others finished."""


@dataclass(frozen=True)
class Experiment:
    """What the grid engine needs of an experiment: a spec and a training function, plus how to read them.

    Args:
        name: the command that runs it (``compare``, ``capsules``): the lock's holder and the log's prefix.
        spec_file: the directory's record of the grid (``grid.json``).
        spec_type: a :class:`~normlab.runner.grid.spec.DictSpec` dataclass whose ``LIST_FIELDS`` a later run may extend.
        expand: ``expand(spec, data_cache) -> cells``, each config built and validated once (generated data sets
            are cached in ``data_cache``); a cell has ``cell_id`` and ``config`` (``config.differences(saved)``,
            ``config.device``).
        train: ``train(config, out_dir) -> summary``, importable (worker processes, Ray tasks); it writes
            ``out_dir/summary.json``.
        collect: ``collect(spec, pairs, complete=, failed=, **extra) -> results`` from ``(cell, summary)`` pairs.
        render: ``render(results, out)`` writes the report.
        check: refuses cells that cannot run, before anything is written (one line).
        cost: a cell's relative cost: the most expensive start first.
        describe: the progress bar's text for a finished cell's summary.
        noun, label: what the log calls a cell, and how its lines begin.
        command: the command line that runs it, which claims its output directory
            (:func:`~normlab.runner.lock.out_lock`; default ``normlab <name>``).
    """

    name: str
    spec_file: str
    spec_type: type[DictSpec]
    expand: Callable[[Any, Path], list]
    train: Callable[[Any, str], dict[str, Any]]
    collect: Callable[..., dict[str, Any]]
    render: Callable[[dict[str, Any], Path], Any]
    check: Callable[[list], None]
    cost: Callable[[Any], float]
    describe: Callable[[dict[str, Any]], str]
    noun: str = "runs"
    label: str = "normlab"
    command: str | None = None

    def claim(self) -> str:
        """The command line that claims the experiment's output directories."""
        return self.command or f"normlab {self.name}"


def _cell_done(cell_dir: Path, cell) -> dict[str, Any] | None:
    """The cell's summary if ``summary.json`` exists (checked against the cell's config), else None."""
    summary = read_summary(cell_dir)
    if summary is None:
        return None
    diff = cell.config.differences(summary.get("config", {}))
    if diff:
        raise UsageError(
            f"cell {cell.cell_id} in {cell_dir.parent.parent} was run with a different config "
            f"({', '.join(diff)}); use another output directory"
        )
    return summary


@dataclass
class GridRun:
    """A planned grid: its experiment, spec, output directory, cells and the summaries of the finished ones.

    ``cells`` are every cell requested in ``out`` (see the module docstring); ``wanted`` the ids this run is asked
    to train (None: all of them); ``failures`` the error line of each cell that raised in this run; ``extra``
    further arguments of the experiment's ``collect`` (every results.json written carries them).
    """

    experiment: Experiment
    spec: Any
    out: Path
    cells: list
    summaries: dict[str, dict[str, Any]]
    wanted: frozenset[str] | None = None
    failures: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def missing(self) -> list:
        """Cells without a finished summary."""
        return [c for c in self.cells if c.cell_id not in self.summaries]

    def todo(self) -> list:
        """Unfinished cells that this run trains."""
        return [c for c in self.missing() if self.wanted is None or c.cell_id in self.wanted]

    def cell_dir(self, cell) -> Path:
        return self.out / "runs" / cell.cell_id

    def start(self) -> None:
        """Make ``runs/``, remove the temporary files of killed writers, record the grid in its spec file."""
        (self.out / "runs").mkdir(parents=True, exist_ok=True)
        for d in [self.out, *(self.cell_dir(c) for c in self.cells)]:
            remove_stale_temps(d)
        atomic_write_json(
            self.out / self.experiment.spec_file,
            {**self.spec.to_dict(), "requested_cells": sorted(c.cell_id for c in self.cells)},
            indent=2,
        )

    def record(self, cell, summary: dict[str, Any]) -> None:
        """Keep a finished cell; results.json then holds every cell finished so far."""
        self.summaries[cell.cell_id] = summary
        atomic_write_json(self.out / "results.json", self.results(complete=False))

    def record_failure(self, cell, error: str) -> None:
        """Keep the error of a cell that raised; results.json lists it under ``failed``."""
        self.failures[cell.cell_id] = error
        atomic_write_json(self.out / "results.json", self.results(complete=False))

    def results(self, complete: bool = True, **extra) -> dict[str, Any]:
        pairs = [(c, self.summaries[c.cell_id]) for c in self.cells if c.cell_id in self.summaries]
        failed = [(c, self.failures[c.cell_id]) for c in self.cells if c.cell_id in self.failures]
        return self.experiment.collect(self.spec, pairs, complete=complete, failed=failed, **{**self.extra, **extra})

    def finish(self, render: bool = True, **extra) -> dict[str, Any]:
        """Write the final results.json (and the report) and return the results; ``extra`` goes to ``collect``."""
        results = self.results(complete=not self.missing(), **extra)
        atomic_write_json(self.out / "results.json", results)
        if render:
            self.experiment.render(results, self.out)
        return results


def _previous_grid(experiment: Experiment, out: Path) -> tuple[Any, set[str] | None] | None:
    """The grid recorded in ``out``'s spec file and the cell ids requested there (None: every cell), if any."""
    path = out / experiment.spec_file
    if not os.path.lexists(path):
        return None
    try:
        d = json.loads(path.read_text())
        requested = d.pop("requested_cells", None)
        spec = experiment.spec_type.from_dict(d)
    except (OSError, UnicodeDecodeError, ValueError, TypeError, AttributeError) as e:
        raise UsageError(
            f"{path} is not a normlab grid ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e})"
            f"; move it away or use another output directory"
        ) from None
    return spec, set(requested) if isinstance(requested, list) else None


def merge_grid(previous: DictSpec | None, spec: DictSpec, where: Path) -> DictSpec:
    """The grid of a directory that holds ``previous`` once ``spec`` is added (the union of the list fields).

    Raises:
        UsageError: ``previous`` differs from ``spec`` in anything but its list fields (``spec.settings()``).
    """
    if previous is None:
        return spec
    old, new = previous.settings(), spec.settings()
    diff = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if diff:
        raise UsageError(
            f"{where} holds a grid run with a different config ({'; '.join(diff)}); rerun with its "
            f"settings to extend it, or use another output directory for a new grid"
        )
    lists = {k: list(dict.fromkeys([*getattr(previous, k), *getattr(spec, k)])) for k in spec.LIST_FIELDS}
    newer = {k: v for k, v in spec.to_dict().items() if k in spec.NEWER_FIELDS}
    return type(spec).from_dict({**previous.to_dict(), **lists, **newer})


def plan_grid(
    experiment: Experiment, spec: DictSpec, out_dir: str | os.PathLike, data_cache: str | os.PathLike | None = None
) -> GridRun:
    """Read ``out_dir`` (nothing is written): merge ``spec`` into the grid recorded there, expand the merged grid
    once, check the cells of ``spec`` (``experiment.check``) and collect the finished ones.

    The returned run trains the cells of ``spec`` and reports every requested cell; :meth:`GridRun.start` writes
    the directory's record. Call both under :func:`~normlab.runner.lock.out_lock` (see :func:`run_experiment`).
    """
    out = Path(out_dir)
    prev = _previous_grid(experiment, out)
    merged = merge_grid(prev[0] if prev else None, spec, out)
    cache = Path(data_cache) if data_cache is not None else out / "data"
    every = experiment.expand(merged, cache)
    ids = [c.cell_id for c in every]
    same = merged.to_dict() == spec.to_dict()  # a first run or a resume: spec's cells are the merged grid's
    wanted = frozenset(ids) if same else frozenset(c.cell_id for c in experiment.expand(spec, cache))
    before = set()
    if prev:  # the cells requested there before (a record without the list: every cell of its grid)
        before = prev[1] if prev[1] is not None else {c.cell_id for c in experiment.expand(prev[0], cache)}
    cells = [c for c in every if c.cell_id in wanted | before]
    experiment.check([c for c in cells if c.cell_id in wanted])
    summaries = {c.cell_id: s for c in cells if (s := _cell_done(out / "runs" / c.cell_id, c)) is not None}
    return GridRun(experiment, merged, out, cells, summaries, wanted)


def _raise_failures(grids: Sequence[GridRun]) -> None:
    errors = [(cid, err) for g in grids for cid, err in g.failures.items()]
    if errors:
        cid, err = errors[0]
        raise CellsFailed(
            f"{len(errors)} run(s) failed (first: {cid}: {err}); every error is in results.json "
            f"under 'failed'; rerun the same command to retry them"
        )


def _cpu_times() -> float:
    """CPU seconds of this process and its finished children (the worker processes)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _run_jobs(
    jobs: list,
    done: Callable,
    failed: Callable,
    *,
    workers: int | None,
    threads: int | None,
    backend: str,
    address: str | None,
) -> tuple[float, str]:
    """Run ``jobs`` ((grid, cell) pairs) on ``backend``; returns (workers or Ray CPUs, where they ran)."""
    if backend == "ray" and jobs:
        from normlab.runner.grid.ray_backend import run_on_ray

        cpus = run_on_ray(
            jobs,
            threads=int(threads or 1),
            done=done,
            failed=failed,
            address=address,
            num_cpus=int(workers or default_workers()) * int(threads or 1),
        )
        return cpus, f"Ray tasks ({cpus:g} CPUs)"
    n = run_jobs(
        [(g.experiment.train, (c.config, str(g.cell_dir(c)))) for g, c in jobs],
        workers=default_workers() if workers in (None, 0) else int(workers),
        threads=threads,
        on_done=lambda i, summary: done(*jobs[i], summary),
        on_error=lambda i, e: failed(*jobs[i], error_line(e, with_type=True)),
    )
    return n, f"{n} worker(s)"


def run_cells(
    grids: Sequence[GridRun],
    *,
    workers: int | None = None,
    threads: int | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    backend: str = "process",
    address: str | None = None,
    estimate_s: float | None = None,
    after_s: float | None = None,
    label: str | None = None,
) -> dict[str, Any]:
    """Run every unfinished cell of ``grids``, the most expensive first, with ``threads`` torch threads each
    (default 1 in a pool or on Ray).

    ``backend="process"``: in ``workers`` processes (default: one per usable core; 1 runs them in this process).
    ``backend="ray"``: as Ray tasks on the cluster at ``address``, or on a local Ray with ``workers`` x
    ``threads`` CPUs (default: every usable core); see :mod:`normlab.runner.grid.ray_backend`.
    ``progress``: after each finished cell, one line with the runs done, remaining and the ETA
    (:class:`~normlab.runner.grid.progress.GridProgress`; ``estimate_s`` is the ETA until the first cell finishes,
    ``after_s`` the seconds of the caller's work after the cells, part of every ETA, ``label`` begins the line,
    default the experiment's).

    Returns:
        ``{"cells_run", "workers", "wall_s", "cpu_s"}`` of this call (workers: Ray's CPUs on Ray).

    Raises:
        CellsFailed: after the other cells finished, when some cells raised (each is in results.json).
    """
    if backend not in BACKENDS:
        raise UsageError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    first = grids[0].experiment
    say = log or (lambda s: print(s, file=sys.stderr))
    jobs = sorted(((g, c) for g in grids for c in g.todo()), key=lambda gc: -gc[0].experiment.cost(gc[1]))
    done_before = sum(len(g.summaries) for g in grids)
    total = done_before + len(jobs)
    if done_before:
        say(f"{first.label}: {done_before} of {total} {first.noun} already done (skipped)")
    bar = GridProgress(
        [g.experiment.cost(c) for g, c in jobs],
        done=done_before,
        label=first.label if label is None else label,
        noun=first.noun,
        enabled=progress,
        estimate_s=estimate_s,
        after_s=after_s,
    )
    t0, cpu0 = time.perf_counter(), _cpu_times()

    def name(grid: GridRun, cell) -> str:  # several grids run together may share cell ids
        return f"{grid.out.name}/{cell.cell_id}" if len(grids) > 1 else cell.cell_id

    def done(grid: GridRun, cell, summary: dict[str, Any]) -> None:
        grid.record(cell, summary)
        bar.update(name(grid, cell), grid.experiment.describe(summary), grid.experiment.cost(cell))

    def failed(grid: GridRun, cell, error: str) -> None:
        grid.record_failure(cell, error)
        bar.update(name(grid, cell), f"FAILED ({error})", grid.experiment.cost(cell))

    try:
        n, where = _run_jobs(jobs, done, failed, workers=workers, threads=threads, backend=backend, address=address)
    finally:
        bar.close()
    ran = {"cells_run": len(jobs), "workers": n, "wall_s": time.perf_counter() - t0, "cpu_s": _cpu_times() - cpu0}
    if jobs:
        say(f"{first.label}: ran {len(jobs)} {first.noun} with {where} in {ran['wall_s']:.1f} s")
    _raise_failures(grids)
    return ran


def run_experiment(
    experiment: Experiment,
    spec: DictSpec,
    out_dir: str | os.PathLike,
    *,
    render: bool = True,
    announce: Callable[[GridRun], None] | None = None,
    extras: Callable[[GridRun, dict[str, Any]], dict[str, Any]] | None = None,
    option: str = "out_dir",
    command: str | None = None,
    **run: Any,
) -> dict[str, Any]:
    """Run (or resume) every cell of ``spec`` under ``out_dir/runs``; write results.json and the report.

    Holds the directory's lock throughout (the one place that takes it for a grid). Cells with a matching
    ``summary.json`` are not rerun; a grid already in ``out_dir`` is extended (see the module docstring).
    ``announce(grid)`` is called on the planned grid before anything is written (it may refuse with a
    :class:`~normlab.runner.errors.UsageError`); ``extras(grid, ran)`` returns further ``collect`` arguments from
    what :func:`run_cells` returned; ``option`` names ``out_dir`` in messages; ``command`` claims ``out_dir``
    (default ``experiment.claim()``: a directory of another command, or with files of the user's, is refused);
    ``run``: the arguments of :func:`run_cells`. Returns the results dict.

    Raises:
        CellsFailed: some cells raised; the report of the others is written first.
    """
    claim = command or experiment.claim()
    with out_lock(out_dir, experiment.name, option=option, claim=claim, record=experiment.spec_file):
        grid = plan_grid(experiment, spec, out_dir)
        if announce is not None:
            announce(grid)
        grid.start()
        try:
            ran = run_cells([grid], **run)
        except CellsFailed:
            grid.finish(render=render)
            raise
        return grid.finish(render=render, **(extras(grid, ran) if extras is not None else {}))
