"""What the grid commands print before they start: the runs to train and the estimated time
(:func:`normlab.runner.grid.estimate.plan_text`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from normlab.runner.grid.estimate import plan_text
from normlab.runner.grid.execute import GridRun
from normlab.runner.grid.pool import default_workers

__all__ = ["announce_grids"]


def announce_grids(
    command: str,
    grids: Sequence[GridRun],
    workers: int,
    address: str | None = None,
    after_s: float | None = None,
    prog: str = "normlab",
) -> float:
    """Print ``<prog> <command>: N runs to train: about M min ...`` for the unfinished cells of ``grids`` (the
    runs' steps, evaluations and monitor, :mod:`~normlab.runner.grid.estimate`, and ``after_s``: the seconds of the
    work after the runs); returns the estimate in seconds (the progress line's ETA until the first run finishes)."""
    cells = [c for g in grids for c in g.cells if c.cell_id in (g.wanted or {c.cell_id})]
    todo = [c for g in grids for c in g.todo()]
    text, minutes = plan_text(cells, todo, workers or default_workers(), remote=address is not None, after_s=after_s)
    print(f"{prog} {command}: {text} (estimated before it starts)", file=sys.stderr)
    return 60.0 * minutes
