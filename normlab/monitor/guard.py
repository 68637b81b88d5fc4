"""Rescue a collapsing run: roll back to a snapshot from before the trouble, lower the learning rate, go on.

:class:`CollapseGuard` takes the optimizer step in the training loop (``guard.step(loss)`` instead of
``optimizer.step()``). Every ``every`` steps it keeps an in-memory snapshot of the model, the optimizer, the
learning-rate schedulers, the GradScaler, the monitor and the random number generators. When the loss or a gradient
is non-finite, the monitor's alarm fires (at once, or once the trouble it foretells is confirmed: ``confirm``), or
the loss climbs back towards its starting value (``loss_climb``), it restores the newest snapshot taken at least
``margin`` steps before the trouble began, multiplies the learning rate by ``lr_factor`` (the schedulers keep
working from the lowered rate), and lets training go on; after ``max_rescues`` rescues it gives up with
:class:`RunCollapsed`. A loop that takes the optimizer step itself (Lightning:
:class:`normlab.integrations.lightning.VarianceMonitorCallback` with ``guard=``) calls
:meth:`CollapseGuard.after_step` after it instead.
"""

from __future__ import annotations

import copy
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from normlab.monitor.collapse import CHANCE, LEARNED, MIN_WINDOWS, window_mean
from normlab.monitor.optim_step import learning_rates, optimizer_step

__all__ = ["CollapseGuard", "DismissedAlarm", "Rescue", "RunCollapsed", "LOSS_WINDOW"]


class RunCollapsed(RuntimeError):
    """Raised by :meth:`CollapseGuard.step` when the run still collapses after ``max_rescues`` rescues.

    Attributes:
        kind: the last trouble: ``"non_finite"`` (a non-finite loss or gradient), ``"alarm"`` (the monitor's alarm,
            acted on at once), ``"loss_climb"``, ``"dead"`` (no learning since a waiting alarm) or ``"external"``
            (:meth:`CollapseGuard.rescue`).
        alarm: whether a monitor alarm was involved (acted on at once, or waiting for the trouble that came).
    """

    def __init__(self, message: str, alarm: bool = False, kind: str = "non_finite") -> None:
        super().__init__(message)
        self.alarm, self.kind = alarm, kind


@dataclass(frozen=True)
class Rescue:
    """One rescue of a :class:`CollapseGuard` (``guard.rescues``).

    Attributes:
        step: the guard's step when the trouble was seen.
        reason: the trouble, in words (a non-finite loss or gradient, the monitor's alarm, a loss climb, no learning
            since an alarm, or the caller's reason to :meth:`CollapseGuard.rescue`; "after the monitor alarm ..."
            when it came while an alarm waited).
        onset: the step the trouble was dated to.
        restored_step: the step of the snapshot the run went back to.
        steps_lost: the steps thrown away (``step - restored_step``).
        lr_before: the learning rate of the first parameter group before the rescue.
        lr_after: the same after the rescue (lowered by the guard's ``lr_factor``).

    Example:
        >>> model = nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> guard = CollapseGuard(model, opt, every=1)
        >>> for scale in (1.0, 1.0, float("nan")):       # the third loss is NaN: the run is rolled back
        ...     opt.zero_grad()
        ...     loss = model(torch.randn(8, 4)).square().mean() * scale
        ...     loss.backward()
        ...     took_step = guard.step(loss)
        >>> rescue = guard.rescues[0]
        >>> rescue.reason, rescue.restored_step, rescue.lr_after
        ('non-finite loss (nan) at step 2', 1, 0.05)
    """

    step: int
    reason: str
    onset: int
    restored_step: int
    steps_lost: int
    lr_before: float
    lr_after: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DismissedAlarm:
    """A monitor alarm that :class:`CollapseGuard` with ``confirm`` did not act on (``guard.dismissed``): no
    non-finite loss or gradient and no loss climb followed within ``confirm`` steps, so the run went on unchanged.

    Attributes:
        step: the alarm's step.
        reason: the alarm, in words.
        dismissed_at: the guard's step when the wait ended.

    Example:
        >>> DismissedAlarm(step=40, reason="monitor alarm: ...", dismissed_at=51).to_dict()["dismissed_at"]
        51
    """

    step: int
    reason: str
    dismissed_at: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Snapshot:
    step: int
    state: dict[str, Any]

    def to_dict(self) -> dict:
        """Tensors and plain values (``torch.save``, and ``torch.load(weights_only=True)`` reads it back)."""
        return {"step": self.step, "state": {**self.state, "loss_trend": self.state["loss_trend"].to_dict()}}

    @classmethod
    def from_dict(cls, d: dict) -> _Snapshot:
        """The inverse of :meth:`to_dict`."""
        state = dict(d["state"])
        state["loss_trend"] = _LossTrend.from_dict(state.get("loss_trend") or {})
        return cls(int(d["step"]), state)


@dataclass
class _Armed:
    """``confirm``: a monitor alarm waiting for its trouble (onset: the alarm's step; since: the guard's step when
    it was seen; snapshot: the one a rollback restores)."""

    onset: int
    reason: str
    since: int
    snapshot: _Snapshot

    def to_dict(self, kept: Sequence[_Snapshot]) -> dict:
        """The waiting alarm; its snapshot by step when it is one of ``kept``, else whole."""
        pinned = None if any(s is self.snapshot for s in kept) else self.snapshot.to_dict()
        return {
            "onset": self.onset,
            "reason": self.reason,
            "since": self.since,
            "step": self.snapshot.step,
            "pinned": pinned,
        }

    @classmethod
    def from_dict(cls, d: dict, kept: Sequence[_Snapshot]) -> _Armed:
        """The inverse of :meth:`to_dict`, its snapshot found again among ``kept``."""
        if d.get("pinned") is not None:
            snap = _Snapshot.from_dict(d["pinned"])
        else:
            snap = next(s for s in kept if s.step == int(d["step"]))
        return cls(int(d["onset"]), str(d["reason"]), int(d["since"]), snap)


#: The steps the guard averages the loss over (the loss climb and the dead-network test).
LOSS_WINDOW = 10
# the library's collapse definition (normlab.monitor.collapse): learned below LEARNED x the reference, at chance
# at CHANCE x chance or above, dead after MIN_WINDOWS windows that never learned
LEARNED_FRACTION, AT_CHANCE, DEAD_AFTER = LEARNED, CHANCE, MIN_WINDOWS


@dataclass
class _LossTrend:
    """The running loss statistics the guard reads: the last LOSS_WINDOW losses, the first full-window mean, the
    best (lowest) full-window mean so far, the number of losses seen."""

    recent: deque = field(default_factory=lambda: deque(maxlen=LOSS_WINDOW))
    first: float | None = None
    best: float | None = None
    seen: int = 0

    def update(self, value: float) -> float | None:
        """Add one finite loss; returns the full-window mean (None until LOSS_WINDOW losses were seen)."""
        self.recent.append(value)
        self.seen += 1
        if len(self.recent) < LOSS_WINDOW:
            return None
        mean = window_mean(self.recent)
        self.first = mean if self.first is None else self.first
        self.best = mean if self.best is None else min(self.best, mean)
        return mean

    def reference(self, chance: float | None) -> float | None:
        """The loss the run starts from: ``chance`` when known, else the first full-window mean."""
        return self.first if chance is None else chance

    def learned(self, chance: float | None) -> bool:
        """The best full-window mean fell below LEARNED_FRACTION x the reference."""
        ref = self.reference(chance)
        return ref is not None and self.best is not None and self.best < LEARNED_FRACTION * ref

    def climbed(self, mean: float, fraction: float, chance: float | None = None) -> bool:
        """The run had learned and its mean is back ``fraction`` of the way from the best to the reference."""
        if not self.learned(chance):
            return False
        return mean >= self.best + fraction * (self.reference(chance) - self.best)

    def dead(self, mean: float | None, chance: float) -> bool:
        """The collapse tracker's dead network: DEAD_AFTER windows seen, never learned, the mean at chance."""
        seen_enough = self.seen >= DEAD_AFTER * LOSS_WINDOW
        return seen_enough and mean is not None and not self.learned(chance) and mean >= AT_CHANCE * chance

    def to_dict(self) -> dict:
        return {"recent": list(self.recent), "first": self.first, "best": self.best, "seen": self.seen}

    @classmethod
    def from_dict(cls, d: dict) -> _LossTrend:
        """The inverse of :meth:`to_dict`; missing keys (a state from before the trend was saved) start empty."""
        recent = deque((float(v) for v in d.get("recent", [])), maxlen=LOSS_WINDOW)
        return cls(recent, d.get("first"), d.get("best"), int(d.get("seen", 0)))

    def copy(self) -> _LossTrend:
        return _LossTrend.from_dict(self.to_dict())


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


class CollapseGuard:
    """Take the optimizer step, and roll the run back with a lower learning rate when it collapses.

    Trouble is a non-finite ``loss``, a non-finite gradient (checked before the step; with a GradScaler the
    scaler's own skipping handles overflowing float16 gradients, so only the loss is checked), or a new
    ``monitor.alarm`` after the step: the first :class:`~normlab.monitor.Event` of severity ``"alarm"`` that
    one of the monitor's rules raised, whichever rule it is, a user's own included
    (:class:`~normlab.monitor.VarianceMonitor`, or anything with ``step(optimizer, loss=None)``, ``alarm``,
    ``state_dict`` and ``load_state_dict``);
    warnings are not acted on. Or, with ``loss_climb``, a loss that climbs back towards its starting
    value. The trouble is dated to its onset: the alarm's ``step`` for an alarm (the monitor counts the same steps
    as the guard when both start together), the first step of the loss window for a loss climb, the current step
    otherwise. The guard then restores the newest snapshot whose step is at most ``onset - margin``, or the oldest
    one.

    With ``confirm`` the alarm is a warning, not yet trouble: the guard keeps (pins) the snapshot it would restore
    and waits up to ``confirm`` steps. A non-finite loss or gradient or a loss climb in that time is dated to the
    alarm (or to the start of the loss window, if earlier) and restores the snapshot chosen for that onset (the
    pinned one for the alarm); otherwise the alarm is dismissed (``guard.dismissed``) and the run goes on unchanged.
    This is what keeps a false alarm from changing a healthy run.

    A step without trouble is exactly ``optimizer.step()`` (or ``monitor.step(optimizer)``, or
    ``scaler.step(optimizer); scaler.update()``): a healthy run is not changed, only copied every ``every`` steps.

    Args:
        model: the module being trained (its ``state_dict`` is snapshotted).
        optimizer: its optimizer.
        monitor: optional monitor; the guard then steps through ``monitor.step(optimizer, loss=loss)`` (or its
            ``before_update``/``after_update`` around a GradScaler step:
            :func:`~normlab.monitor.optimizer_step`) and watches ``monitor.alarm``.
        every: snapshot interval in steps (a snapshot is also taken at construction, step 0).
        keep: how many snapshots to keep (the oldest is dropped first).
        margin: the snapshot restored is at least this many steps older than the onset (default ``every``).
        lr_factor: each rescue multiplies every parameter group's learning rate (and the schedulers' base rates)
            by this factor, in (0, 1]: with ``schedulers``, the rates of the snapshot restored (the schedulers go
            back with it); without, the rates in use at the trouble (a schedule the loop steps itself, e.g. per
            epoch, is not rolled back, so the loop need not set the rate again).
        max_rescues: rescues allowed; the next trouble raises :class:`RunCollapsed`.
        schedulers: learning-rate schedulers stepped by the training loop; their state is snapshotted and their base
            rates lowered with the optimizer's.
        scaler: a ``torch.amp.GradScaler`` that the guard steps with (snapshotted too).
        check_grads: look for non-finite gradients before each step (one host synchronisation per step).
        confirm: steps to wait, after a monitor alarm, for the trouble it foretells before acting on it (None: act
            on the alarm at once).
        loss_climb: trouble when the mean loss over the last 10 steps, after the run has learned (its best 10-step
            mean below 0.8 x its reference), is back this fraction of the way from its best to its reference, in
            (0, 1]; None: the loss is only checked for non-finite values. Needs the loss passed to :meth:`step`.
        chance_loss: the loss of a constant uniform prediction (``ln C`` for C classes), the reference of
            ``loss_climb`` (None, the default: the first 10-step mean loss). With it, an alarm waiting for
            confirmation also waits while the run has not learned, and is confirmed when the run is dead by the
            collapse tracker's definition (40 steps seen, never below 0.8 x chance, the mean loss at 0.95 x chance
            or above): a network that died at the alarm is rolled back to before it.
        checkpoint_snapshots: :meth:`state_dict` carries the snapshots and an alarm waiting for confirmation, so a
            resumed run goes on exactly as if never interrupted (default); the checkpoint then holds up to
            ``keep + 1`` more copies of the model and optimizer state (about 300 MB for timm's resnet18 with SGD
            momentum). False: the state is counters only and a resumed run starts its snapshots again.

    Attributes:
        rescues: the :class:`Rescue` records, in order.
        dismissed: the :class:`DismissedAlarm` records (``confirm``: alarms that no trouble followed), on the
            trajectory kept (a rollback drops those of the steps it throws away, like the monitor's records).
        steps: optimizer steps taken so far on the current trajectory (rolled back with the snapshots).

    Example:
        >>> model = nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> guard = CollapseGuard(model, opt, every=5)
        >>> for _ in range(3):
        ...     opt.zero_grad()
        ...     loss = model(torch.randn(8, 4)).square().mean()
        ...     loss.backward()
        ...     took_step = guard.step(loss)
        >>> guard.steps, guard.rescues
        (3, [])
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        monitor=None,
        *,
        every: int = 50,
        keep: int = 3,
        margin: int | None = None,
        lr_factor: float = 0.5,
        max_rescues: int = 3,
        schedulers: Sequence[Any] = (),
        scaler=None,
        check_grads: bool = True,
        confirm: int | None = 10,
        loss_climb: float | None = 0.75,
        chance_loss: float | None = None,
        checkpoint_snapshots: bool = True,
    ) -> None:
        self._check_args(model, optimizer, every, keep, margin, lr_factor, max_rescues)
        self._check_confirm(confirm, loss_climb, chance_loss)
        self.model, self.optimizer, self.monitor = model, optimizer, monitor
        self.every, self.keep = every, keep
        self.margin = every if margin is None else margin
        self.lr_factor, self.max_rescues = float(lr_factor), max_rescues
        self.schedulers, self.scaler, self.check_grads = list(schedulers), scaler, check_grads
        self.confirm, self.loss_climb = confirm, None if loss_climb is None else float(loss_climb)
        self.chance_loss = None if chance_loss is None else float(chance_loss)
        if not isinstance(checkpoint_snapshots, bool):
            raise ValueError(f"CollapseGuard: checkpoint_snapshots must be True or False, got {checkpoint_snapshots!r}")
        self.checkpoint_snapshots = checkpoint_snapshots
        self.steps = 0
        self.rescues: list[Rescue] = []
        self.dismissed: list[DismissedAlarm] = []
        self._trend = _LossTrend()
        self._armed: _Armed | None = None  # confirm: the alarm waiting for its trouble
        self._scale = 1.0  # product of the lr factors applied so far (a snapshot records the one it was taken at)
        self._snapshots: deque[_Snapshot] = deque(maxlen=keep)
        self._alarm = getattr(monitor, "alarm", None)
        self._take_snapshot()

    @staticmethod
    def _check_args(model, optimizer, every, keep, margin, lr_factor, max_rescues) -> None:
        where = "CollapseGuard"
        if not isinstance(model, nn.Module):
            raise TypeError(f"{where}: model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{where}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        for name, value, low in (("every", every, 1), ("keep", keep, 1), ("max_rescues", max_rescues, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{where}: {name} must be an int >= {low}, got {value!r}")
        if margin is not None and (isinstance(margin, bool) or not isinstance(margin, int) or margin < 0):
            raise ValueError(f"{where}: margin must be an int >= 0 or None, got {margin!r}")
        if isinstance(lr_factor, bool) or not isinstance(lr_factor, (int, float)) or not 0 < lr_factor <= 1:
            raise ValueError(f"{where}: lr_factor must be a number in (0, 1], got {lr_factor!r}")

    @staticmethod
    def _check_confirm(confirm, loss_climb, chance_loss) -> None:
        if confirm is not None and (isinstance(confirm, bool) or not isinstance(confirm, int) or confirm < 1):
            raise ValueError(f"CollapseGuard: confirm must be an int >= 1 or None, got {confirm!r}")
        if loss_climb is not None and (
            isinstance(loss_climb, bool) or not isinstance(loss_climb, (int, float)) or not 0 < loss_climb <= 1
        ):
            raise ValueError(f"CollapseGuard: loss_climb must be a number in (0, 1] or None, got {loss_climb!r}")
        if chance_loss is not None and (
            isinstance(chance_loss, bool) or not isinstance(chance_loss, (int, float)) or not 0 < chance_loss < math.inf
        ):
            raise ValueError(f"CollapseGuard: chance_loss must be a finite number > 0 or None, got {chance_loss!r}")

    # ------------------------------------------------------------------ step
    def step(self, loss: torch.Tensor | float | None = None) -> bool:
        """Take the optimizer step unless there is trouble; returns True if the step was taken and kept, False if
        the run was rolled back (the gradients are then zeroed; go on with the next batch).

        Raises:
            RunCollapsed: trouble after ``max_rescues`` rescues.
        """
        trouble = self._trouble_before(loss)
        if trouble is not None:
            reason, onset, kind = trouble
            self._rescue(reason, onset, alarm=False, kind=kind)
            return False
        self._optimizer_step(loss)
        return self._after()

    def after_step(self, loss: torch.Tensor | float | None = None) -> bool:
        """The guard for a loop that took the optimizer step itself (Lightning): call right after the step, with the
        step's loss. Same checks as :meth:`step` (a non-finite loss or gradient, a loss climb, a new monitor alarm;
        the monitor is stepped by the loop, not here); on trouble the restore also undoes the step just taken.
        Returns True if the step is kept, False after a rollback.

        Raises:
            RunCollapsed: trouble after ``max_rescues`` rescues.

        Example:
            >>> model = nn.Linear(4, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> guard = CollapseGuard(model, opt, every=1)
            >>> loss = model(torch.randn(8, 4)).square().mean() * float("inf")
            >>> loss.backward(); opt.step()                 # the loop's own step, with non-finite gradients
            >>> guard.after_step(loss), guard.steps, torch.isfinite(model.weight).all().item()
            (False, 0, True)
        """
        trouble = self._trouble_before(loss)
        if trouble is not None:
            reason, onset, kind = trouble
            self._rescue(reason, onset, alarm=False, kind=kind)
            return False
        return self._after()

    def _after(self) -> bool:
        """Count the step just taken; on a new monitor alarm rescue (or, with ``confirm``, pin the snapshot and
        wait); dismiss an alarm whose wait is over; snapshot every ``every`` steps."""
        self.steps += 1
        alarm = getattr(self.monitor, "alarm", None)
        if alarm is not None and alarm is not self._alarm:
            onset = min(int(getattr(alarm, "step", self.steps)), self.steps)
            if self.confirm is None:
                self._rescue(f"monitor alarm: {alarm}", onset, alarm=True, kind="alarm")
                return False
            self._alarm = alarm
            self._armed = _Armed(onset, f"monitor alarm: {alarm}", self.steps, self._choose(onset))
        armed = self._armed
        trend = self._trend  # with chance_loss, wait while the run has not learned (only if it passes its losses)
        waiting_to_learn = self.chance_loss is not None and trend.seen > 0 and not trend.learned(self.chance_loss)
        if armed is not None and self.steps - armed.since >= self.confirm and not waiting_to_learn:
            self.dismissed.append(DismissedAlarm(armed.onset, armed.reason, self.steps))
            self._armed = None
        if self.steps % self.every == 0:
            self._take_snapshot()
        return True

    def _trouble_before(self, loss) -> tuple[str, int, str] | None:
        """(reason, onset, kind) of trouble seen before the step: a non-finite loss or gradient, a loss climb, or
        (``chance_loss``) a dead network while an alarm waits."""
        value = None if loss is None else float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        if value is not None and not math.isfinite(value):
            return f"non-finite loss ({value}) at step {self.steps}", self.steps, "non_finite"
        if self.check_grads and self.scaler is None and not self._grads_finite():
            return f"non-finite gradient at step {self.steps}", self.steps, "non_finite"
        if value is None:
            return None
        trend, chance = self._trend, self.chance_loss
        mean = trend.update(value)
        if self.loss_climb is not None and mean is not None and trend.climbed(mean, self.loss_climb, chance):
            ref = "chance" if chance is not None else "first"
            reason = (
                f"loss climbed back at step {self.steps}: {LOSS_WINDOW}-step mean {mean:.4g}, best {trend.best:.4g}, "
                f"{ref} {trend.reference(chance):.4g}"
            )
            return reason, self.steps - LOSS_WINDOW + 1, "loss_climb"
        if self._armed is not None and chance is not None and trend.dead(mean, chance):
            reason = f"no learning since the alarm: {LOSS_WINDOW}-step mean {mean:.4g} at chance ({chance:.4g})"
            return reason, self.steps, "dead"
        return None

    def _grads_finite(self) -> bool:
        grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return True
        norms = torch._foreach_norm([g.detach() for g in grads])
        return bool(torch.isfinite(torch.stack([n.float() for n in norms])).all())

    def _optimizer_step(self, loss=None) -> None:
        optimizer_step(self.optimizer, self.monitor, self.scaler, loss)

    # -------------------------------------------------------------- snapshots
    def _take_snapshot(self) -> None:
        state = {
            "model": copy.deepcopy(self.model.state_dict()),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "schedulers": [copy.deepcopy(s.state_dict()) for s in self.schedulers],
            "scaler": None if self.scaler is None else copy.deepcopy(self.scaler.state_dict()),
            "monitor": None if self.monitor is None else copy.deepcopy(self.monitor.state_dict()),
            "rng": _rng_state(),
            "lr_scale": self._scale,
            "loss_trend": self._trend.copy(),
        }
        self._snapshots.append(_Snapshot(self.steps, state))

    def _available(self) -> list[_Snapshot]:
        """The snapshots a rollback may use, oldest first: those kept, and the one pinned by a waiting alarm."""
        snaps = list(self._snapshots)
        pinned = None if self._armed is None else self._armed.snapshot
        if pinned is not None and all(s is not pinned for s in snaps):
            snaps.append(pinned)
        return sorted(snaps, key=lambda s: s.step)

    def _choose(self, onset: int) -> _Snapshot:
        snaps = self._available()
        before = [s for s in snaps if s.step <= onset - self.margin]
        return before[-1] if before else snaps[0]

    def _restore(self, snap: _Snapshot) -> None:
        s = snap.state
        self.model.load_state_dict(s["model"])
        self.optimizer.load_state_dict(copy.deepcopy(s["optimizer"]))
        for sched, st in zip(self.schedulers, s["schedulers"]):
            sched.load_state_dict(copy.deepcopy(st))
        if self.scaler is not None:
            self.scaler.load_state_dict(copy.deepcopy(s["scaler"]))
        if self.monitor is not None:
            self.monitor.load_state_dict(copy.deepcopy(s["monitor"]))
            self._alarm = getattr(self.monitor, "alarm", None)
            records = getattr(self.monitor, "records", None)
            if isinstance(records, list):  # the abandoned steps' records go with them
                records[:] = [r for r in records if r.get("step", -1) < self.monitor.current_step]
        _set_rng_state(s["rng"])
        self._trend = s["loss_trend"].copy()
        self.dismissed = [d for d in self.dismissed if d.step < snap.step]  # those of the abandoned steps go with them
        self.optimizer.zero_grad(set_to_none=True)
        self.steps = snap.step

    def _scale_lr(self, ratio: float) -> None:
        """Multiply every group's learning rate (and the schedulers' base rates) by ``ratio``."""
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * ratio
            if "initial_lr" in group:
                group["initial_lr"] = group["initial_lr"] * ratio
        for sched in self.schedulers:
            if hasattr(sched, "base_lrs"):
                sched.base_lrs = [lr * ratio for lr in sched.base_lrs]
            if hasattr(sched, "_last_lr"):
                sched._last_lr = [float(g["lr"]) for g in self.optimizer.param_groups]

    def roll_back(self, onset: int | None = None) -> int:
        """Restore the newest snapshot taken at least ``margin`` steps before ``onset`` (default: the current step),
        or the oldest one, without changing the learning rate; returns the step restored. For a run that stops
        after :class:`RunCollapsed` and should end on its last state from before the trouble."""
        return self._roll_back(onset, 1.0)

    def _roll_back(self, onset: int | None, factor: float) -> int:
        """Restore the snapshot for ``onset`` and multiply the learning rates by ``factor``: with ``schedulers`` the
        snapshot's rates (its schedulers are restored with it), else the rates in use before the rollback (a
        schedule the guard does not own is not rolled back, so its current rate stays)."""
        onset = self.steps if onset is None else onset
        if self._armed is not None:  # trouble while an alarm waits is dated to the alarm
            onset = min(onset, self._armed.onset)
        snap = self._choose(onset)
        kept = [s for s in self._available() if s.step <= snap.step]
        self._armed = None
        current = learning_rates(self.optimizer)
        self._restore(snap)
        if self.schedulers:
            self._scale_lr(self._scale / snap.state["lr_scale"])  # relative to the snapshot's rates (their factors)
        else:
            for group, lr in zip(self.optimizer.param_groups, current):
                group["lr"] = lr * factor
        self._snapshots = deque(kept, maxlen=self.keep)
        return snap.step

    def rescue(self, reason: str) -> None:
        """Trouble seen outside the step (a non-finite validation loss, a check of the caller's): roll back and lower
        the learning rate as for trouble at the current step (dated to an alarm still waiting for confirmation, if
        any). ``reason`` is the trouble in words, kept in the :class:`Rescue`.

        Raises:
            RunCollapsed: after ``max_rescues`` rescues.

        Example:
            >>> model = nn.Linear(4, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> guard = CollapseGuard(model, opt, every=2)
            >>> for _ in range(5):
            ...     opt.zero_grad(); model(torch.randn(8, 4)).square().mean().backward(); _ = guard.step()
            >>> guard.rescue("non-finite validation loss")
            >>> guard.rescues[0].restored_step, guard.steps, guard.rescues[0].reason
            (2, 2, 'non-finite validation loss')
        """
        self._rescue(reason, self.steps, alarm=False, kind="external")

    def _rescue(self, reason: str, onset: int, alarm: bool, kind: str) -> None:
        armed = self._armed
        if armed is not None:  # the trouble a waiting alarm foretold: dated to the alarm
            reason, onset, alarm = f"{reason}, after the {armed.reason}", min(onset, armed.onset), True
        if len(self.rescues) >= self.max_rescues:
            lr = float(self.optimizer.param_groups[0]["lr"])
            raise RunCollapsed(
                f"CollapseGuard: gave up after {len(self.rescues)} rescue(s): {reason}; the learning rate is now "
                f"{lr:g} (see guard.rescues)",
                alarm=alarm,
                kind=kind,
            )
        step = self.steps
        lr_before = float(self.optimizer.param_groups[0]["lr"])
        self._scale *= self.lr_factor
        restored = self._roll_back(onset, self.lr_factor)
        lr_after = float(self.optimizer.param_groups[0]["lr"])
        self.rescues.append(Rescue(step, reason, onset, restored, step - restored, lr_before, lr_after))

    @property
    def lr_scale(self) -> float:
        """The product of the learning-rate factors of the rescues so far (1.0 before any)."""
        return self._scale

    def state_dict(self) -> dict:
        """Everything a resumed run needs to go on as if never interrupted: the step counter, the rescues and
        dismissed alarms so far, the learning-rate factor applied, the loss trend ``loss_climb`` reads, the
        snapshots (copies of the model, optimizer, schedulers, scaler, monitor and RNG states: a checkpoint holding
        this is up to ``keep + 1`` models and optimizers larger) and an alarm still waiting for confirmation (these
        two only with ``checkpoint_snapshots``).
        Tensors and plain Python values: ``torch.save`` and ``torch.load(weights_only=True)``."""
        return {
            "steps": self.steps,
            "rescues": [r.to_dict() for r in self.rescues],
            "dismissed": [d.to_dict() for d in self.dismissed],
            "lr_scale": self._scale,
            "loss_trend": self._trend.to_dict(),
            **(self._snapshot_state() if self.checkpoint_snapshots else {}),
        }

    def _snapshot_state(self) -> dict:
        return {
            "snapshots": [s.to_dict() for s in self._snapshots],
            "armed": None if self._armed is None else self._armed.to_dict(self._snapshots),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` when a run resumes from a checkpoint (after the monitor's own state): the
        counter, the rescues (they count towards ``max_rescues``), the factor, the loss trend, the snapshots and a
        waiting alarm. A state without snapshots (saved before they were) starts them again with one of the current
        state, at ``state["steps"]``, and drops a waiting alarm. The monitor's current alarm counts as seen."""
        if not isinstance(state, dict) or not {"steps", "rescues"} <= set(state):
            raise ValueError(
                "CollapseGuard.load_state_dict: expected a dict from CollapseGuard.state_dict() with "
                f"'steps' and 'rescues', got {type(state).__name__}"
            )
        self.steps = int(state["steps"])
        self.rescues = [Rescue(**r) for r in state["rescues"]]
        self.dismissed = [DismissedAlarm(**d) for d in state.get("dismissed", [])]
        self._trend = _LossTrend.from_dict(state.get("loss_trend") or {})
        self._scale = float(state.get("lr_scale", 1.0))
        self._alarm = getattr(self.monitor, "alarm", None)
        self._snapshots.clear()
        self._armed = None
        saved = state.get("snapshots") or []
        if not saved:
            self._take_snapshot()
            return
        try:
            self._snapshots.extend(_Snapshot.from_dict(s) for s in saved[-self.keep :])
            if state.get("armed") is not None:
                self._armed = _Armed.from_dict(state["armed"], self._snapshots)
        except (KeyError, TypeError, ValueError, StopIteration) as e:
            raise ValueError(
                f"CollapseGuard.load_state_dict: malformed snapshots or waiting alarm in the state ({e!r}); "
                "pass a dict from CollapseGuard.state_dict()"
            ) from None

    def release(self) -> None:
        """Drop the in-memory snapshots (copies of the model, optimizer and schedulers) once training is over;
        ``rescues`` and the counters stay. The guard cannot roll back after this (:meth:`load_state_dict` starts
        the snapshots again)."""
        self._snapshots.clear()
        self._armed = None

    def __repr__(self) -> str:
        return (
            f"CollapseGuard(steps={self.steps}, every={self.every}, rescues={len(self.rescues)}, "
            f"lr_factor={self.lr_factor})"
        )
