"""How a training run fails: the one failure taxonomy of normlab, judged from the per-step training losses.

:func:`~normlab.monitor.label_collapse` (a finished run, after the fact) and :class:`~normlab.monitor.CollapseGuard`
(a live run, which it rolls back) read the same definition: a :class:`CollapseTracker` fed one loss per step, with
the thresholds of one :class:`CollapseCriteria`. The kinds (:data:`KINDS`), first match in step order:

- ``non_finite``: the loss (or, for the guard, a gradient) is NaN or infinite. Step: that step.
- ``exploded``: the smoothed loss is ``exploded`` (10) times the reference or more, whether or not the run learned
  first. The reference is the larger of the chance loss and the loss the run started from, so a run that starts above
  chance is measured from its start. Step: the first step of the window whose own loss was that high.
- ``returned_to_chance``: after the run learned (its smoothed loss below ``learned`` (0.8) x the reference), the
  smoothed loss is back at ``at_chance`` (0.95) x the reference or above: at chance (within 5 %), or above it
  (short of an explosion). Step: the first step of the window whose mean crossed.
- ``never_left_chance``: at the end of a run of at least ``min_windows`` (4) windows, the smoothed loss has never
  been below ``learned`` x the reference and is at ``at_chance`` x the reference or above: a net that never learned.
  Step: None (there is no moment of failure). The guard uses the same test on a live run, after ``min_windows``
  windows, only to confirm a monitor alarm that waits for its trouble, and only with a known chance loss (against a
  start standing in for chance, a slow learner would be rolled back too).
- ``alarm`` (the guard only): a monitor alarm acted on by itself; ``external``: trouble the caller reported
  (:meth:`~normlab.monitor.CollapseGuard.report`). Any kind that follows a monitor alarm within the guard's
  ``confirm`` steps *confirms* it: the failure is then dated to the alarm (``Failure.after``).

The reference is ``chance_loss`` (``ln C`` for C classes: the loss of a constant uniform prediction) when known.
Without it, chance is estimated by the loss of the run's first step: the loss of the initial weights, before any
update, which for a classifier at a standard initialisation is about ``ln C``. A run that starts near its best (a
fine-tune) should pass its chance loss, or its start would count as chance; so should a run whose first batch is too
small to show its start (a batch of one under a mean squared error: pass the targets' variance). A reference <= 0
(a loss that can be negative) leaves only the ``non_finite`` test.

The smoothed loss is the mean of the last ``window`` losses, in steps (``CollapseCriteria(window=10)``) or in
examples (``CollapseCriteria.over_examples(batch_size)``: about 1,024 examples, at least 10 steps), so that one
unlucky small batch is not read as a collapse; every count of steps here (``min_windows`` windows) follows it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace

__all__ = [
    "KINDS",
    "LOSS_KINDS",
    "WINDOW_EXAMPLES",
    "CollapseCriteria",
    "Failure",
    "CollapseLabel",
    "CollapseTracker",
    "label_collapse",
    "window_mean",
    "confirmed",
]

#: The examples the smoothed loss averages by default with
#: :meth:`~normlab.monitor.CollapseCriteria.over_examples` (the window of
#: ``normlab train``): about this many, at least 10 steps.
WINDOW_EXAMPLES = 1024
#: The kinds of failure the losses alone show (:func:`~normlab.monitor.label_collapse`), in the order they are tested.
LOSS_KINDS = ("non_finite", "exploded", "returned_to_chance", "never_left_chance")
#: All kinds of failure, :data:`LOSS_KINDS` and then those only :class:`~normlab.monitor.CollapseGuard` sees (a
#: monitor alarm acted on by itself, trouble the caller reported).
KINDS = LOSS_KINDS + ("alarm", "external")


@dataclass(frozen=True)
class CollapseCriteria:
    """The thresholds of the failure taxonomy (module docstring): the one place they are defined.

    Attributes:
        chance_loss: the loss of a constant uniform prediction (``ln C``; ``ln V`` for a language model over V
            tokens), or None: estimated by the loss of the first step.
        window: steps averaged by the smoothed loss (int >= 1). Default 10; :meth:`over_examples` sets it from a
            number of examples.
        learned: the run has learned once its smoothed loss is below this fraction of the reference. Default 0.8.
        at_chance: the smoothed loss is at chance from this fraction of the reference on. Default 0.95.
        exploded: the smoothed loss has exploded from this multiple of the reference on. Default 10.
        min_windows: a run is judged never to have learned only after this many windows. Default 4.

    Example:
        >>> c = CollapseCriteria.over_examples(batch_size=64, chance_loss=2.3)
        >>> c.window, c.dead_after
        (16, 64)
        >>> CollapseCriteria(window=0)
        Traceback (most recent call last):
        ...
        ValueError: CollapseCriteria: window must be an int >= 1, got 0
    """

    chance_loss: float | None = None
    window: int = 10
    learned: float = 0.80
    at_chance: float = 0.95
    exploded: float = 10.0
    min_windows: int = 4

    def __post_init__(self) -> None:
        where, c = "CollapseCriteria", self.chance_loss
        if c is not None and (isinstance(c, bool) or not isinstance(c, int | float) or not 0 < c < math.inf):
            raise ValueError(f"{where}: chance_loss must be None or a finite number > 0, got {c!r}")
        for name in ("window", "min_windows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: {name} must be an int >= 1, got {value!r}")
        if not (_number(self.learned) and 0 < self.learned < self.at_chance):
            raise ValueError(f"{where}: learned must be a number in (0, at_chance), got {self.learned!r}")
        if not (_number(self.at_chance) and self.at_chance < self.exploded):
            raise ValueError(f"{where}: at_chance must be a number below exploded, got {self.at_chance!r}")
        if not (_number(self.exploded) and 1 < self.exploded < math.inf):
            raise ValueError(f"{where}: exploded must be a finite number > 1, got {self.exploded!r}")

    @classmethod
    def over_examples(cls, batch_size: int, examples: int = WINDOW_EXAMPLES, **kwargs) -> CollapseCriteria:
        """Criteria whose window holds about ``examples`` examples at ``batch_size`` examples a step, and at least
        10 steps: ``window = max(10, ceil(examples / batch_size))``. ``kwargs``: the other attributes."""
        for name, value in (("batch_size", batch_size), ("examples", examples)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CollapseCriteria.over_examples: {name} must be an int >= 1, got {value!r}")
        return cls(window=max(10, math.ceil(examples / batch_size)), **kwargs)

    @property
    def dead_after(self) -> int:
        """The steps a run is watched before it can be judged never to have learned (``min_windows * window``)."""
        return self.min_windows * self.window

    def describe(self, examples: int | None = None) -> str:
        """The definition in one sentence, from these values (help texts and reports quote this, never restate it).
        ``examples``: the window is :meth:`over_examples` with that many examples (the sentence then says so instead
        of naming a number of steps).

        Example:
            >>> print(CollapseCriteria().describe())  # doctest: +NORMALIZE_WHITESPACE
            a run fails when its loss (or a gradient) becomes non-finite, when its 10-step mean loss reaches 10 x the
            reference (exploded), when after having been below 0.8 x the reference it comes back to 0.95 x the
            reference or above (returned to chance), or when after 40 steps it has never been below 0.8 x the
            reference and ends at 0.95 x it or above (never learned); the reference is chance (estimated by the
            first step's loss when unknown), for an explosion the larger of chance and the starting loss
        """
        mean, watched = f"{self.window}-step mean loss", f"{self.dead_after} steps"
        if examples is not None:
            mean = f"mean loss over about {examples:,} examples (at least 10 steps)"
            watched = f"{self.min_windows} such windows"
        return (
            f"a run fails when its loss (or a gradient) becomes non-finite, when its {mean} reaches "
            f"{self.exploded:g} x the reference (exploded), when after having been below {self.learned:g} x the "
            f"reference it comes back to {self.at_chance:g} x the reference or above (returned to chance), or when "
            f"after {watched} it has never been below {self.learned:g} x the reference and ends at {self.at_chance:g} "
            "x it or above (never learned); the reference is chance (estimated by the first step's loss when unknown), "
            "for an explosion the larger of chance and the starting loss"
        )


def _number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


@dataclass(frozen=True)
class Failure:
    """One failure of a run: its kind, when it began and what was measured; :attr:`message` says it in one line.

    Attributes:
        kind: one of :data:`~normlab.monitor.collapse.KINDS`.
        step: the step it is dated to (None for ``never_left_chance``, which has no moment).
        value: the smoothed loss that showed it (``non_finite``: the loss, None for a gradient).
        reference: chance, or the starting loss (``estimated``): standing in for an unknown chance, or, for
            ``exploded``, a start above the known chance.
        estimated: the reference is the first step's loss, not a known chance loss.
        best: the lowest smoothed loss before it.
        window: steps of the smoothed loss.
        what: ``"loss"`` or ``"gradient"`` (``non_finite``); the alarm or the caller's reason (``alarm``,
            ``external``).
        after: the monitor alarm this failure confirms (it came within the guard's ``confirm`` steps), or None.
        chance: the known chance loss, or None (unknown, or not a failure of the losses).

    Example:
        >>> f = Failure("exploded", 15, value=7.3e5, reference=2.773, window=10)
        >>> f.message
        'loss exploded from step 15: 10-step mean 7.3e+05, 2.6e+05 x chance (2.773)'
        >>> Failure("returned_to_chance", 28, value=2.2, reference=2.303, best=0.5, window=10).message
        'loss back at chance from step 28: 10-step mean 2.2, chance 2.303, best 0.5'
    """

    kind: str
    step: int | None
    value: float | None = None
    reference: float | None = None
    estimated: bool = False
    best: float | None = None
    window: int | None = None
    what: str = "loss"
    after: str | None = None
    chance: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Failure: kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def message(self) -> str:
        """The failure in one line, with the words that fit its numbers ("at chance", "above chance", ...)."""
        text = _MESSAGES[self.kind](self)
        return text if self.after is None else f"{text}, after the {self.after}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> Failure:
        """The inverse of ``to_dict``."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def __str__(self) -> str:
        return self.message


def _ref(f: Failure) -> str:
    if not f.estimated:
        return f"chance ({f.reference:.4g})"
    if f.chance is None:
        return f"its starting loss ({f.reference:.4g}, standing in for chance)"
    return f"its starting loss ({f.reference:.4g}, above chance {f.chance:.4g})"


def _exploded(f: Failure) -> str:
    return (
        f"loss exploded from step {f.step}: {f.window}-step mean {f.value:.3g}, {f.value / f.reference:.2g} x {_ref(f)}"
    )


def _returned(f: Failure) -> str:
    where = "at" if f.value < 1.05 * f.reference else "above"
    ref = "its starting loss (standing in for chance)" if f.estimated else "chance"
    ratio = "" if where == "at" else f" ({f.value / f.reference:.2g} x)"
    return (
        f"loss back {where} {'chance' if not f.estimated else 'its start'} from step {f.step}: {f.window}-step mean "
        f"{f.value:.4g}{ratio}, {ref} {f.reference:.4g}, best {f.best:.4g}"
    )


def _never(f: Failure) -> str:
    where = "at" if f.value < 1.05 * f.reference else "above"
    return f"never learned: its {f.window}-step mean {f.value:.4g} is {where} {_ref(f)}, its best {f.best:.4g}"


def _non_finite(f: Failure) -> str:
    if f.what == "gradient":
        return f"non-finite gradient at step {f.step}"
    return f"non-finite loss ({f.value}) at step {f.step}"


_MESSAGES = {
    "non_finite": _non_finite,
    "exploded": _exploded,
    "returned_to_chance": _returned,
    "never_left_chance": _never,
    "alarm": lambda f: f"monitor alarm: {f.what}",
    "external": lambda f: f.what,
}


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
        collapsed: the run failed.
        step: the step the failure is dated to (None for a healthy run and for ``never_left_chance``).
        kind: one of :data:`~normlab.monitor.collapse.LOSS_KINDS`, or None for a healthy run.
        failure: the :class:`Failure` (its ``message`` says it in words), or None; not compared by ``==``.

    Example:
        >>> label = label_collapse([2.3, 1.0, float("inf")], CollapseCriteria(chance_loss=2.3, window=1))
        >>> label.collapsed, label.step, label.kind, label.failure.message
        (True, 2, 'non_finite', 'non-finite loss (inf) at step 2')
    """

    collapsed: bool
    step: int | None
    kind: str | None
    failure: Failure | None = field(default=None, compare=False, repr=False)


class CollapseTracker:
    """Feed the training loss step by step (:meth:`update`); :meth:`finish` at the end of the run.

    Args:
        criteria: the :class:`CollapseCriteria` (None: the defaults, chance estimated).

    ``failure`` holds the first failure found (``kind``/``step`` its kind and step; None while healthy); ``learned``:
    the smoothed loss has been below ``learned`` x the reference.

    Example:
        >>> tracker = CollapseTracker(CollapseCriteria(chance_loss=math.log(10), window=2))
        >>> [tracker.update(v) is not None for v in (2.3, 1.0, 1.0, 2.3, 2.3)]
        [False, False, False, False, True]
        >>> tracker.kind, tracker.step
        ('returned_to_chance', 3)
    """

    def __init__(self, criteria: CollapseCriteria | None = None) -> None:
        if criteria is None:
            criteria = CollapseCriteria()
        if not isinstance(criteria, CollapseCriteria):
            raise TypeError(f"CollapseTracker: criteria must be a CollapseCriteria, got {type(criteria).__name__}")
        self.criteria = criteria
        self.failure: Failure | None = None
        self.learned = False
        self.start: float | None = None  # the first step's loss
        self.best: float | None = None  # the lowest full-window mean
        self.seen = 0  # losses fed
        self._recent: deque[tuple[int, float]] = deque(maxlen=criteria.window)
        self._next = 0  # the step of the next loss when update gets none

    @property
    def kind(self) -> str | None:
        return None if self.failure is None else self.failure.kind

    @property
    def step(self) -> int | None:
        return None if self.failure is None else self.failure.step

    @property
    def reference(self) -> float | None:
        """Chance, or the starting loss standing in for it (None before the first loss)."""
        c = self.criteria.chance_loss
        return c if c is not None else self.start

    def _explosion_reference(self) -> float | None:
        c, s = self.criteria.chance_loss, self.start
        return s if c is None else (c if s is None else max(c, s))

    def smoothed(self) -> float | None:
        """The mean of the losses in the current window (None before the first loss).

        Computed from the window itself on each call (:func:`window_mean`), never from a running sum, which one huge
        finite loss (1e23) would ruin for the rest of the run.
        """
        return window_mean(v for _, v in self._recent) if self._recent else None

    def update(self, loss: float | None, step: int | None = None) -> Failure | None:
        """Record the loss of the next step (None or non-finite for a failed step); ``step``: its step number
        (default: one after the last). Returns the failure the moment one is found, else None."""
        step = self._next if step is None else int(step)
        self._next, self.seen = step + 1, self.seen + 1
        if self.failure is not None:
            return None
        if loss is None or not math.isfinite(loss):
            self.failure = Failure("non_finite", step, value=None if loss is None else float(loss))
            return self.failure
        self.start = float(loss) if self.start is None else self.start
        self._recent.append((step, float(loss)))
        if len(self._recent) < self.criteria.window:
            return None
        self.failure = self._judge(self.smoothed())
        return self.failure

    def _judge(self, mean: float) -> Failure | None:
        """The failure a full window with mean ``mean`` shows (exploded, returned to chance), else None."""
        c, ref, high = self.criteria, self.reference, self._explosion_reference()
        if ref is None or ref <= 0 or high <= 0:
            return None
        common = dict(value=mean, best=self.best, window=c.window, chance=c.chance_loss)
        if mean >= c.exploded * high:
            first = next(s for s, v in self._recent if v >= c.exploded * high)
            from_start = c.chance_loss is None or high > c.chance_loss  # the start, unknown chance or above it
            return Failure("exploded", first, reference=high, estimated=from_start, **common)
        if self.learned and mean >= c.at_chance * ref:
            return Failure(
                "returned_to_chance", self._recent[0][0], reference=ref, estimated=c.chance_loss is None, **common
            )
        self.best = mean if self.best is None else min(self.best, mean)
        self.learned = self.learned or mean < c.learned * ref
        return None

    def at_chance(self) -> bool:
        """The current smoothed loss is at ``at_chance`` x the reference or above."""
        ref, mean = self.reference, self.smoothed()
        return ref is not None and ref > 0 and mean is not None and mean >= self.criteria.at_chance * ref

    def never_learned(self) -> Failure | None:
        """``never_left_chance`` so far: at least ``dead_after`` losses seen, never learned, at chance now (the
        guard's test on a live run; :meth:`finish` uses it at the end of a run). Else None."""
        c = self.criteria
        if self.failure is not None or self.seen < c.dead_after or self.learned or not self.at_chance():
            return None
        mean = self.smoothed()
        best = mean if self.best is None else self.best
        return Failure(
            "never_left_chance",
            None,
            mean,
            self.reference,
            c.chance_loss is None,
            best=best,
            window=c.window,
            chance=c.chance_loss,
        )

    def finish(self) -> Failure | None:
        """End of the run: a run that never learned and ends at chance has failed (``never_left_chance``)."""
        if self.failure is None:
            self.failure = self.never_learned()
        return self.failure

    def state_dict(self) -> dict:
        """The tracker as plain Python values (the guard's snapshots carry it)."""
        return {
            "failure": None if self.failure is None else self.failure.to_dict(),
            "learned": self.learned,
            "start": self.start,
            "best": self.best,
            "seen": self.seen,
            "recent": [list(p) for p in self._recent],
            "next": self._next,
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict` (the criteria stay this tracker's)."""
        failure = state.get("failure")
        self.failure = None if failure is None else Failure.from_dict(failure)
        self.learned, self.start, self.best = bool(state["learned"]), state["start"], state["best"]
        self.seen, self._next = int(state["seen"]), int(state["next"])
        self._recent = deque(((int(s), float(v)) for s, v in state["recent"]), maxlen=self.criteria.window)

    def copy(self) -> CollapseTracker:
        other = CollapseTracker(self.criteria)
        other.load_state_dict(self.state_dict())
        return other


def label_collapse(
    losses: Iterable[float | None], criteria: CollapseCriteria | None = None, finished: bool = True
) -> CollapseLabel:
    """Label a run from its per-step training losses alone (module docstring).

    Args:
        losses: the training loss of each step, in order (None or non-finite for a failed step).
        criteria: the :class:`CollapseCriteria` (None: the defaults; chance estimated by the first loss).
        finished: the run ended at the last loss (the never-learned test runs only then).

    Returns:
        a :class:`CollapseLabel`.

    Example:
        >>> c = CollapseCriteria(chance_loss=2.3, window=1)
        >>> label_collapse([2.3, 1.2, 0.9, float("nan")], c)
        CollapseLabel(collapsed=True, step=3, kind='non_finite')
        >>> label_collapse([2.3, 1.2, 0.9, 0.8], c)
        CollapseLabel(collapsed=False, step=None, kind=None)
        >>> label_collapse([3.0, 1.3e3, 1e4, 2.8e4], CollapseCriteria(window=2)).failure.message
        'loss exploded from step 1: 2-step mean 652, 2.2e+02 x its starting loss (3, standing in for chance)'
    """
    tracker = CollapseTracker(criteria)
    for loss in losses:
        if tracker.update(loss) is not None:
            break
    if finished:
        tracker.finish()
    f = tracker.failure
    return CollapseLabel(f is not None, None if f is None else f.step, None if f is None else f.kind, f)


def confirmed(failure: Failure, alarm: str) -> Failure:
    """``failure`` confirming the monitor alarm ``alarm`` (its words; the guard dates it to the alarm)."""
    return replace(failure, after=alarm)
