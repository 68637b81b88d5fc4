"""The normalization comparison as an experiment of the grid engine: a :class:`~normlab.runner.grid.spec.GridSpec`
and :func:`~normlab.runner.training.train.train` for each of its cells (``normlab compare``).

:data:`COMPARE` tells :mod:`normlab.runner.grid.execute` how to expand, check, train, collect and report such a
grid; :func:`run_grid` runs one into an output directory.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from normlab.runner.grid.estimate import cell_steps
from normlab.runner.grid.execute import Experiment, GridRun, run_experiment
from normlab.runner.grid.report import render_report
from normlab.runner.grid.results import collect_results
from normlab.runner.grid.spec import Cell, GridSpec, expand_grid
from normlab.runner.training.checks import check_grid
from normlab.runner.training.train import train

__all__ = ["COMPARE", "run_grid", "train_cell"]


def train_cell(config, out_dir: str) -> dict[str, Any]:
    """One cell: a :func:`~normlab.runner.training.train.train` call without its progress bar; the summary."""
    return train(config, out_dir, progress=False)


def _cost(cell: Cell) -> float:
    """Rough CPU cost of a cell (steps x per-step cost growing with the batch): the pool starts the largest first."""
    return cell_steps(cell.config) * (12 + cell.config.batch_size)


def _describe(summary: dict[str, Any]) -> str:
    acc = summary.get("final_test_acc")
    flag = f" COLLAPSED ({summary.get('collapse_reason')})" if summary.get("collapsed") else ""
    return f"test acc {'n/a' if acc is None else f'{100 * acc:.1f} %'}{flag}"  # percent, as the summaries


#: The normalization comparison as an experiment of the grid engine (``normlab compare``).
COMPARE = Experiment(
    name="compare",
    spec_file="grid.json",
    spec_type=GridSpec,
    expand=expand_grid,
    train=train_cell,
    collect=collect_results,
    render=render_report,
    check=check_grid,
    cost=_cost,
    describe=_describe,
)


def run_grid(
    spec: GridSpec,
    out_dir: str | os.PathLike,
    *,
    workers: int | None = None,
    progress: bool = True,
    render: bool = True,
    threads: int | None = None,
    log: Callable[[str], None] | None = None,
    backend: str = "process",
    address: str | None = None,
    announce: Callable[[GridRun], None] | None = None,
    option: str = "out_dir",
) -> dict[str, Any]:
    """Run (or resume) every cell of ``spec`` under ``out_dir/runs``; write results.json and the report.

    Cells with a matching ``summary.json`` are not rerun; a half-trained cell resumes from its checkpoint; a grid
    already in ``out_dir`` is extended. ``backend``/``address``: see :func:`~normlab.runner.grid.execute.run_cells`;
    ``announce``/``option``: see :func:`~normlab.runner.grid.execute.run_experiment`, which holds the directory's
    lock throughout. Returns the results dict.

    Raises:
        CellsFailed: some cells raised; the report of the others is written first.
    """
    return run_experiment(
        COMPARE,
        spec,
        out_dir,
        render=render,
        announce=announce,
        option=option,
        workers=workers,
        threads=threads,
        progress=progress,
        log=log,
        backend=backend,
        address=address,
    )
