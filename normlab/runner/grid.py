"""Grids of training runs: comparison name x learning rate x batch size x seed.

A :class:`GridSpec` describes the grid; :func:`expand_grid` turns it into :class:`Cell` objects, one
:func:`~normlab.runner.train.train` call each, written to ``<out>/runs/<cell id>/``. :func:`run_grid` runs the
cells (in worker processes when ``workers > 1``), skips cells that already have a ``summary.json`` (a half-trained
cell resumes from its checkpoint inside ``train``), writes ``results.json`` after every finished cell and renders
the report at the end.

Comparison names are resolved by :func:`normlab.nn.resolve_comparison` (``bn``, ``pws``, ``ws+gn``, ...).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from normlab.nn import resolve_comparison

from .checks import check_grid
from .config import TrainConfig
from .errors import UsageError
from .io import atomic_write_json
from .report import render_report
from .results import collect_results, write_results
from .train import train

__all__ = ["GridSpec", "Cell", "expand_grid", "run_grid", "DEFAULT_NORMS", "LAYOUTS", "LR_SCALINGS",
           "default_workers"]

DEFAULT_NORMS = ("none", "bn", "brn", "gn", "sn", "wn", "ws", "pws")
LAYOUTS = ("product", "cross")
LR_SCALINGS = ("none", "linear", "sqrt")


def _fmt_num(x: float) -> str:
    """Compact, filesystem-safe number for cell ids (0.05 -> 0.05, 1e-3 -> 0.001)."""
    return f"{x:g}".replace("+", "")


@dataclass(frozen=True)
class Cell:
    """One training run of a grid: comparison ``name`` at (``lr``, ``batch_size``, ``seed``) and its config."""

    name: str
    lr: float
    batch_size: int
    seed: int
    config: TrainConfig

    @property
    def cell_id(self) -> str:
        return f"{self.name}_lr{_fmt_num(self.lr)}_bs{self.batch_size}_s{self.seed}"


def _unique(what: str, seq: Sequence) -> tuple:
    seq = tuple(seq)
    if not seq:
        raise UsageError(f"GridSpec: {what} must not be empty")
    if len(set(seq)) != len(seq):
        raise UsageError(f"GridSpec: {what} has duplicates: {list(seq)}")
    return seq


@dataclass
class GridSpec:
    """A comparison grid.

    ``layout="product"`` runs every (norm, lr, batch size, seed); ``"cross"`` runs a learning-rate sweep at
    ``base_batch_size`` plus a batch-size sweep at ``base_lr`` (defaults: the first value of each list).
    ``lr_scaling`` (``none``, ``linear``, ``sqrt``) scales a cell's learning rate by ``batch_size /
    base_batch_size`` (or its square root); the unscaled lr stays the cell's grid coordinate. ``train_kwargs`` are
    further :class:`~normlab.runner.config.TrainConfig` fields shared by every cell.
    """

    norms: Sequence[str] = DEFAULT_NORMS
    lrs: Sequence[float] = (0.05,)
    batch_sizes: Sequence[int] = (64,)
    seeds: Sequence[int] = (0,)
    epochs: int = 10
    dataset: str = "digits"
    model: str = "plain"
    width: float = 1.0
    layout: str = "product"
    base_lr: float | None = None
    base_batch_size: int | None = None
    lr_scaling: str = "none"
    target_acc: float | None = None
    max_steps_per_epoch: int | None = None
    train_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.norms = _unique("norms", (str(n).strip().lower() for n in self.norms))
        self.lrs = _unique("lrs", (float(x) for x in self.lrs))
        self.batch_sizes = _unique("batch_sizes", (int(x) for x in self.batch_sizes))
        self.seeds = _unique("seeds", (int(x) for x in self.seeds))
        for n in self.norms:
            try:
                resolve_comparison(n)
            except ValueError as e:
                raise UsageError(str(e)) from None
        self._check_values()
        self.base_lr = float(self.lrs[0] if self.base_lr is None else self.base_lr)
        self.base_batch_size = int(self.batch_sizes[0] if self.base_batch_size is None else self.base_batch_size)
        if self.layout == "cross" and self.base_lr not in self.lrs:
            raise UsageError(f"GridSpec: base_lr {self.base_lr} is not in lrs {list(self.lrs)}")
        if self.layout == "cross" and self.base_batch_size not in self.batch_sizes:
            raise UsageError(f"GridSpec: base_batch_size {self.base_batch_size} is not in batch_sizes "
                             f"{list(self.batch_sizes)}")

    def _check_values(self) -> None:
        if any(not (lr > 0 and math.isfinite(lr)) for lr in self.lrs):
            raise UsageError(f"GridSpec: lrs must be positive finite numbers, got {list(self.lrs)}")
        if any(b < 1 for b in self.batch_sizes):
            raise UsageError(f"GridSpec: batch_sizes must be >= 1, got {list(self.batch_sizes)}")
        if any(s < 0 for s in self.seeds):
            raise UsageError(f"GridSpec: seeds must be >= 0, got {list(self.seeds)}")
        if self.epochs < 1:
            raise UsageError(f"GridSpec: epochs must be >= 1, got {self.epochs}")
        if self.layout not in LAYOUTS:
            raise UsageError(f"GridSpec: layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.lr_scaling not in LR_SCALINGS:
            raise UsageError(f"GridSpec: lr_scaling must be one of {', '.join(LR_SCALINGS)}, got {self.lr_scaling!r}")
        if self.base_batch_size is not None and int(self.base_batch_size) < 1:
            raise UsageError(f"GridSpec: base_batch_size must be >= 1, got {self.base_batch_size}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("norms", "lrs", "batch_sizes", "seeds"):
            d[k] = list(d[k])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GridSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def points(self) -> list[tuple[float, int]]:
        """The (lr, batch size) points of the grid, in run order."""
        if self.layout == "product":
            return list(itertools.product(self.lrs, self.batch_sizes))
        pts = [(lr, self.base_batch_size) for lr in self.lrs]
        return pts + [(self.base_lr, b) for b in self.batch_sizes if b != self.base_batch_size]

    def cell_lr(self, lr: float, batch_size: int) -> float:
        """Learning rate actually used by a cell at grid point (lr, batch_size)."""
        ratio = batch_size / self.base_batch_size
        return lr * {"linear": ratio, "sqrt": math.sqrt(ratio)}.get(self.lr_scaling, 1.0)


def expand_grid(spec: GridSpec) -> list[Cell]:
    """All cells of ``spec``: one per (comparison name, grid point, seed), each with its :class:`TrainConfig`."""
    cells = []
    for name in spec.norms:
        norm, conv = resolve_comparison(name)
        for (lr, bs), seed in itertools.product(spec.points(), spec.seeds):
            cfg = TrainConfig.from_dict({
                **spec.train_kwargs, "dataset": spec.dataset, "model": spec.model, "norm": norm, "conv": conv,
                "width": spec.width, "lr": spec.cell_lr(lr, bs), "batch_size": bs, "epochs": spec.epochs,
                "seed": seed, "target_acc": spec.target_acc, "max_steps_per_epoch": spec.max_steps_per_epoch,
            })
            cells.append(Cell(name=name, lr=lr, batch_size=bs, seed=seed, config=cfg))
    return cells


def _cell_done(cell_dir: Path, cell: Cell) -> dict[str, Any] | None:
    """The cell's summary if ``summary.json`` exists (checked against the cell's config), else None."""
    path = cell_dir / "summary.json"
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"run_grid: {path} is unreadable ({e}); move the cell directory away to rerun it") from None
    diff = cell.config.differences(summary.get("config", {}))
    if diff:
        raise UsageError(f"run_grid: cell {cell.cell_id} in {cell_dir.parent.parent} was run with a different "
                         f"config ({', '.join(diff)}); use another output directory")
    return summary


def _with_data_cache(cells: list[Cell], out: Path) -> list[Cell]:
    """Generated data sets (mnist1d) without a --data-dir are cached once for the grid, in ``out/data``."""
    cache = str(out / "data")
    return [dataclasses.replace(c, config=dataclasses.replace(c.config, data_dir=cache))
            if c.config.dataset == "mnist1d" and c.config.data_dir is None else c for c in cells]


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


class _GridProgress:
    """Records finished cells: results.json after each one, a progress bar with the last cell's accuracy."""

    def __init__(self, spec: GridSpec, cells: list[Cell], summaries: dict, out: Path, progress: bool):
        from tqdm.auto import tqdm

        self.spec, self.cells, self.summaries, self.out = spec, cells, summaries, out
        self.bar = tqdm(total=len(cells), initial=len(summaries), desc="grid", unit="run", disable=not progress,
                        file=sys.stderr, dynamic_ncols=True)

    def done(self, cell: Cell, summary: dict[str, Any]) -> None:
        self.summaries[cell.cell_id] = summary
        finished = [(c, self.summaries[c.cell_id]) for c in self.cells if c.cell_id in self.summaries]
        write_results(collect_results(self.spec, finished, complete=False), self.out)
        self.bar.update(1)
        acc = summary.get("final_test_acc")
        flag = " COLLAPSED" if summary.get("collapsed") else ""
        self.bar.set_postfix_str(f"last {cell.cell_id}: acc {'n/a' if acc is None else f'{acc:.3f}'}{flag}")


def _run_pool(todo: list[Cell], runs: Path, workers: int, threads: int, record: _GridProgress) -> None:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(threads,)) as pool:
        futures = {pool.submit(_run_cell, c.config, str(runs / c.cell_id)): c for c in todo}
        try:
            for f in as_completed(futures):
                record.done(futures[f], f.result())
        except BaseException:
            # a failed cell (or Ctrl-C) stops the grid: queued cells are cancelled, running ones resume next time
            pool.shutdown(wait=False, cancel_futures=True)
            raise


def _run_cells(todo: list[Cell], runs: Path, workers: int, threads: int | None, record: _GridProgress) -> None:
    saved = torch.get_num_threads()
    try:
        if workers == 1:
            if threads:
                torch.set_num_threads(int(threads))
            for c in todo:
                record.done(c, _run_cell(c.config, str(runs / c.cell_id)))
        else:
            _run_pool(todo, runs, workers, int(threads or 1), record)
    finally:
        torch.set_num_threads(saved)
        record.bar.close()


def run_grid(
    spec: GridSpec,
    out_dir: str | os.PathLike,
    *,
    workers: int | None = None,
    progress: bool = True,
    check: bool = True,
    render: bool = True,
    threads: int | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run (or resume) every cell of ``spec`` under ``out_dir/runs``; write results.json and the report.

    Cells with a matching ``summary.json`` are not rerun. ``workers > 1`` runs cells in that many spawned processes
    with ``threads`` torch threads each (default 1); ``workers`` defaults to the number of usable cores, capped by
    the number of cells left. One worker runs the cells in this process. Returns the results dict.
    """
    out = Path(out_dir)
    runs = out / "runs"
    cells = _with_data_cache(expand_grid(spec), out)
    say = log or (lambda s: print(s, file=sys.stderr))
    if check:
        check_grid(cells)
    summaries = {c.cell_id: s for c in cells if (s := _cell_done(runs / c.cell_id, c)) is not None}
    todo = [c for c in cells if c.cell_id not in summaries]
    if summaries:
        say(f"normlab: {len(summaries)} of {len(cells)} cells already done (skipped)")
    runs.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "grid.json", spec.to_dict(), indent=2)
    n_workers = default_workers() if workers in (None, 0) else int(workers)
    n_workers = max(1, min(n_workers, len(todo))) if todo else 1
    t0 = time.perf_counter()
    _run_cells(todo, runs, n_workers, threads, _GridProgress(spec, cells, summaries, out, progress))
    if todo:
        say(f"normlab: ran {len(todo)} cells with {n_workers} worker(s) in {time.perf_counter() - t0:.1f} s")
    results = collect_results(spec, [(c, summaries[c.cell_id]) for c in cells])
    write_results(results, out)
    if render:
        render_report(results, out)
    return results
