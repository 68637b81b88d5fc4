"""When has a training run collapsed? Judged from its per-step training losses alone, as a user experiences it.

This is the library's one definition of a collapse: the runner's collapse tracker, the guard's chance-based tests
and the collapse benchmark all read it. A run has collapsed when (first match, in step order):

- ``non_finite``: its training loss becomes NaN or infinite (step: that step);
- ``returned_to_chance``: its smoothed training loss, after having been below ``LEARNED`` x the reference loss, comes
  back to ``CHANCE`` x the reference or above (within 5 % of it, or worse). Step: the first step of the window whose
  mean crossed (the earliest step the crossing can be attributed to). The reference is ``chance_loss`` (``ln C`` for
  C classes: the loss of a constant uniform prediction) when known; without it, the first full-window mean (the
  loss the run started from) and the kind is ``diverged``;
- ``never_left_chance`` (only with ``chance_loss``): at the end of a run of at least ``MIN_WINDOWS`` windows its
  smoothed loss has never been below ``LEARNED`` x ``chance_loss`` and is at ``CHANCE`` x ``chance_loss`` or above:
  a dead network, which never learned. Step: None (there is no moment of collapse to warn before). Shorter runs are
  too short to call dead.

The smoothed loss is the mean over the last ``window`` steps; :func:`~normlab.monitor.collapse.loss_window` gives
``max(10, ceil(1024 / batch_size))``: about a thousand samples, so that one unlucky small batch is not read as a
collapse.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "CHANCE",
    "LEARNED",
    "MIN_WINDOWS",
    "KINDS",
    "CollapseLabel",
    "CollapseTracker",
    "label_collapse",
    "loss_window",
    "window_mean",
]

CHANCE = 0.95  # smoothed loss >= 0.95 x reference: back at (within 5 % of) chance, or worse
LEARNED = 0.80  # smoothed loss < 0.80 x reference: the net has learned something
MIN_WINDOWS = 4  # a run is judged dead only after this many loss windows
KINDS = ("non_finite", "returned_to_chance", "diverged", "never_left_chance")


def loss_window(batch_size: int) -> int:
    """Steps averaged by the smoothed loss: about 1,024 samples, at least 10 steps.

    Example:
        >>> loss_window(32), loss_window(512)
        (32, 10)
    """
    return max(10, math.ceil(1024 / batch_size))


def window_mean(values: Iterable[float]) -> float:
    """The mean of a window of finite losses, computed from the values themselves.

    ``math.fsum`` of ``v / n``: exactly rounded, so one huge loss (1e23) among ordinary ones neither swallows them
    nor, once it has left the window, leaves a residue behind (a running sum does both); and no overflow, since the
    sum of ``v / n`` is at most the largest ``|v|``.

    Example:
        >>> window_mean([2.3, 1e24, 2.3]) > 3e23, window_mean([2.3, 2.3])
        (True, 2.3)
    """
    values = list(values)
    if not values:
        raise ValueError("window_mean: expected at least one loss, got an empty window")
    n = len(values)
    return math.fsum(v / n for v in values)


@dataclass(frozen=True)
class CollapseLabel:
    """The label of a run (:func:`~normlab.monitor.label_collapse`).

    Attributes:
        collapsed: the run collapsed.
        step: the step the collapse is dated to (None for a healthy run and for ``never_left_chance``).
        kind: one of ``KINDS``, or None for a healthy run.

    Example:
        >>> label = label_collapse([2.3, 1.0, float("inf")], chance_loss=2.3, window=1)
        >>> label.collapsed, label.step, label.kind
        (True, 2, 'non_finite')
    """

    collapsed: bool
    step: int | None
    kind: str | None


class CollapseTracker:
    """Feed the training loss step by step (:meth:`update`); :meth:`finish` at the end of the run.

    Args:
        chance_loss: the loss of a constant uniform prediction (``ln C``), or None (the reference is then the
            first full-window mean and a return to it is ``diverged``; no dead-network test).
        window: steps of the smoothed loss (int >= 1).

    ``kind``/``step`` hold the first collapse found (``kind`` None while healthy); ``learned``: the smoothed loss
    has been below ``LEARNED`` x the reference.

    Example:
        >>> tracker = CollapseTracker(chance_loss=math.log(10), window=2)
        >>> [tracker.update(v) for v in (2.3, 1.0, 1.0, 2.3, 2.3)]
        [None, None, None, None, 'returned_to_chance']
        >>> tracker.step
        3
    """

    def __init__(self, chance_loss: float | None = None, window: int = 10) -> None:
        if chance_loss is not None and not (isinstance(chance_loss, int | float) and 0 < chance_loss < math.inf):
            raise ValueError(f"CollapseTracker: chance_loss must be None or a finite number > 0, got {chance_loss!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"CollapseTracker: window must be an int >= 1, got {window!r}")
        self.chance_loss = None if chance_loss is None else float(chance_loss)
        self.window = window
        self.kind: str | None = None
        self.step: int | None = None
        self.learned = False
        self.reference: float | None = self.chance_loss
        self._recent: deque[float] = deque(maxlen=window)
        self._steps = 0

    def smoothed(self) -> float | None:
        """The mean of the losses in the current window (None before the first loss).

        Computed from the window itself on each call (:func:`window_mean`), never from a running sum, which one huge
        finite loss (1e23) would ruin for the rest of the run.
        """
        return window_mean(self._recent) if self._recent else None

    def update(self, loss: float | None) -> str | None:
        """Record the loss of the next step (None or non-finite for a failed step); returns the collapse kind
        the moment one is found, else None."""
        step = self._steps
        self._steps += 1
        if self.kind is not None:
            return None
        if loss is None or not math.isfinite(loss):
            self.kind, self.step = "non_finite", step
            return self.kind
        self._recent.append(float(loss))
        full = len(self._recent) == self.window
        smoothed = self.smoothed()
        if self.reference is None:
            if not full:
                return None
            self.reference = smoothed  # no chance loss: the loss the run started from
        if self.learned and full and smoothed >= CHANCE * self.reference:
            self.kind = "returned_to_chance" if self.chance_loss is not None else "diverged"
            self.step = step - self.window + 1
            return self.kind
        self.learned = self.learned or smoothed < LEARNED * self.reference
        return None

    def at_chance(self) -> bool:
        """The current smoothed loss is at ``CHANCE`` x ``chance_loss`` or above (False without ``chance_loss``)."""
        if self.chance_loss is None or not self._recent:
            return False
        return self.smoothed() >= CHANCE * self.chance_loss

    def finish(self) -> str | None:
        """End of the run: with ``chance_loss``, a run that never learned and ends at chance has collapsed (a dead
        network)."""
        long_enough = self._steps >= MIN_WINDOWS * self.window
        if self.kind is None and long_enough and not self.learned and self.at_chance():
            self.kind, self.step = "never_left_chance", None
        return self.kind


def label_collapse(
    losses: Iterable[float | None], chance_loss: float | None = None, window: int = 10, finished: bool = True
) -> CollapseLabel:
    """Label a run from its per-step training losses alone (module docstring).

    Args:
        losses: the training loss of each step, in order (None or non-finite for a failed step).
        chance_loss: the loss of a constant uniform prediction (``ln C`` for C classes; ``ln V`` for a language
            model over V tokens), or None.
        window: steps of the smoothed loss (:func:`~normlab.monitor.collapse.loss_window`).
        finished: the run ended at the last loss (the dead-network test runs only then).

    Returns:
        a :class:`CollapseLabel`.

    Example:
        >>> label_collapse([2.3, 1.2, 0.9, float("nan")], chance_loss=2.3, window=1)
        CollapseLabel(collapsed=True, step=3, kind='non_finite')
        >>> label_collapse([2.3, 1.2, 0.9, 0.8], chance_loss=2.3, window=1)
        CollapseLabel(collapsed=False, step=None, kind=None)
    """
    tracker = CollapseTracker(chance_loss, window)
    for loss in losses:
        if tracker.update(loss) is not None:
            break
    if finished:
        tracker.finish()
    return CollapseLabel(tracker.kind is not None, tracker.step, tracker.kind)
