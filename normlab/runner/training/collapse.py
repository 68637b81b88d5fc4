"""When has a training run collapsed? Judged from its training-loss trace, as a user experiences it.

A run has collapsed when (first match, in step order):

- ``non_finite``: its training loss becomes NaN or infinite (step: that step);
- ``returned_to_chance``: its smoothed training loss, after having been below ``LEARNED`` x ln(C), comes back to
  ``CHANCE`` x ln(C) or above, i.e. within 5 % of the loss of a constant uniform prediction (or worse). Step: the
  first step of the window whose mean crossed (the earliest step the crossing can be attributed to);
- ``never_left_chance``: at the end of a run of at least ``MIN_WINDOWS`` windows its smoothed loss has never been
  below ``LEARNED`` x ln(C) and is back at (or still at) ``CHANCE`` x ln(C) or above: a dead network, which never
  learned. Step: None (there is no moment of collapse to warn before). Shorter runs are too short to call dead.

The smoothed loss is the mean over the last ``window`` steps, ``window = max(10, ceil(1024 / batch_size))``: about
a thousand samples, so that one unlucky small batch is not read as a collapse.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["CHANCE", "LEARNED", "MIN_WINDOWS", "CollapseTracker", "classify_trace", "loss_window"]

CHANCE = 0.95  # smoothed loss >= 0.95 ln(C): back at (within 5 % of) chance, or worse
LEARNED = 0.80  # smoothed loss < 0.80 ln(C): the net has learned something
MIN_WINDOWS = 4  # a run is judged dead only after this many loss windows
KINDS = ("non_finite", "returned_to_chance", "never_left_chance")


def loss_window(batch_size: int) -> int:
    """Steps averaged by the smoothed loss: about 1,024 samples, at least 10 steps."""
    return max(10, math.ceil(1024 / batch_size))


@dataclass
class CollapseTracker:
    """Feed the training loss step by step (:meth:`update`); :meth:`finish` at the end of the run.

    ``kind``/``step`` hold the first collapse found (``kind`` None while healthy).
    """

    num_classes: int
    window: int = 10
    kind: str | None = None
    step: int | None = None
    learned: bool = False
    left_chance: bool = False

    def __post_init__(self) -> None:
        if self.num_classes < 2 or self.window < 1:
            raise ValueError(
                f"CollapseTracker: need num_classes >= 2 and window >= 1, got {self.num_classes}, {self.window}"
            )
        self._recent: deque[float] = deque(maxlen=self.window)
        self._sum = 0.0
        self._steps = 0
        self.chance_loss = math.log(self.num_classes)

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
        if len(self._recent) == self.window:
            self._sum -= self._recent[0]
        self._recent.append(loss)
        self._sum += loss
        smoothed = self._sum / len(self._recent)
        self.left_chance = self.left_chance or smoothed < CHANCE * self.chance_loss
        if self.learned and len(self._recent) == self.window and smoothed >= CHANCE * self.chance_loss:
            self.kind, self.step = "returned_to_chance", step - self.window + 1
            return self.kind
        self.learned = self.learned or smoothed < LEARNED * self.chance_loss
        return None

    def finish(self) -> str | None:
        """End of the run: a run that never learned and ends at chance has collapsed (a dead network)."""
        at_chance = bool(self._recent) and self._sum / len(self._recent) >= CHANCE * self.chance_loss
        if self.kind is None and self._steps >= MIN_WINDOWS * self.window and not self.learned and at_chance:
            self.kind, self.step = "never_left_chance", None
        return self.kind


def classify_trace(
    losses: Iterable[float | None], num_classes: int, window: int = 10, finished: bool = True
) -> tuple[str | None, int | None]:
    """``(kind, step)`` of a whole loss trace (``finished``: the run ended there), ``(None, None)`` if healthy."""
    tracker = CollapseTracker(num_classes, window)
    for loss in losses:
        if tracker.update(loss) is not None:
            break
    if finished:
        tracker.finish()
    return tracker.kind, tracker.step
