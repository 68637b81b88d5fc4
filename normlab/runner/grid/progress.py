"""A grid's progress as one line a person can read: runs done, runs remaining and the estimated time left.

On a terminal the line is rewritten in place (carriage return) after each finished run; elsewhere (a log file, a
pipe, CI) each finished run prints one plain line, so a log reads top to bottom. The ETA weighs the runs by their
relative cost (the grid engine's ``Experiment.cost``): the wall time so far times the cost still to run over the
cost finished in this session; before the first run finishes it is the estimate given at the start, if any. Work
that follows the runs (``after_s``: a report, a timed section) is added to it until it is done.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO

__all__ = ["GridProgress", "format_duration"]


def format_duration(seconds: float | None) -> str:
    """``"n/a"``, ``"45 s"``, ``"12 min"`` or ``"1 h 05 min"``."""
    if seconds is None:
        return "n/a"
    if seconds < 60:
        return f"{max(0, round(seconds))} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


class GridProgress:
    """Runs done / remaining and the ETA of a batch of runs, printed after each finished run.

    Args:
        costs: the relative cost of each run still to do (in any unit; only ratios matter).
        done: runs already finished before this session (counted as done, not in the ETA).
        label: how each line begins (``normlab compare``).
        noun: what a run is called (``runs``).
        enabled: False prints nothing.
        estimate_s: the estimated seconds of the whole batch, shown as the ETA until a run finishes (``after_s``
            included).
        after_s: the estimated seconds of the work after the last run, part of every later ETA.
        stream: where to print (default ``sys.stderr``); a terminal gets one line rewritten in place.

    Example::

        >>> import io
        >>> out = io.StringIO()
        >>> p = GridProgress([1.0, 1.0], label="normlab compare", stream=out)
        >>> p.update("bn_lr0.1_bs128_s0", "acc 0.912")
        >>> "1 remaining" in out.getvalue()
        True
    """

    def __init__(
        self,
        costs: list[float],
        *,
        done: int = 0,
        label: str = "normlab",
        noun: str = "runs",
        enabled: bool = True,
        estimate_s: float | None = None,
        after_s: float | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.remaining_costs = list(costs)
        self.total = done + len(costs)
        self.done = done
        self.cost_done = 0.0
        self.label, self.noun, self.enabled, self.estimate_s = label, noun, enabled, estimate_s
        self.after_s = after_s or 0.0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self._wrote = False

    def eta_s(self) -> float | None:
        """Seconds left: elapsed x remaining cost / finished cost, plus the work after the runs (the start's estimate
        before a run finished)."""
        left = sum(self.remaining_costs)
        if left <= 0:
            return self.after_s
        if self.cost_done <= 0:
            return self.estimate_s
        return (time.perf_counter() - self.t0) * left / self.cost_done + self.after_s

    def line(self, last: str = "") -> str:
        """The progress line: ``label: 12/45 runs done, 33 remaining, ETA 14 min (last: ...)``."""
        left = self.total - self.done
        text = (
            f"{self.label}: {self.done}/{self.total} {self.noun} done, {left} remaining, "
            f"ETA {format_duration(self.eta_s())}"
        )
        return f"{text} (last: {last})" if last else text

    def update(self, run_id: str, text: str, cost: float | None = None) -> None:
        """One run finished (``cost``: its relative cost, default the mean of those left); print the line."""
        if cost is None:
            cost = sum(self.remaining_costs) / len(self.remaining_costs) if self.remaining_costs else 0.0
        if cost in self.remaining_costs:
            self.remaining_costs.remove(cost)
        elif self.remaining_costs:
            self.remaining_costs.pop()
        self.done += 1
        self.cost_done += cost
        if not self.enabled:
            return
        line = self.line(f"{run_id}: {text}")
        if self.tty:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            self.stream.write("\r" + line[:width].ljust(width))
            self._wrote = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the in-place line on a terminal (a newline); nothing in a log."""
        if self._wrote:
            self.stream.write("\n")
            self.stream.flush()
            self._wrote = False
