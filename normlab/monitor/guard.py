"""Rescue a failing run: roll back to a snapshot from before the trouble, lower the learning rate, go on.

:class:`CollapseGuard` attaches to the optimizer (its step hooks, as the monitor's: :mod:`normlab.monitor.optim_step`),
so the loop keeps its own ``optimizer.step()``. Every step it keeps the step's loss (``observe_loss``) and, before
the update, whether a gradient was non-finite, on the device. Every ``check_every`` steps, and at every snapshot, it
reads them back in one transfer (on several ranks: one collective, the same on every rank) and feeds the losses to the
failure taxonomy's tracker (:mod:`normlab.monitor.collapse`: non-finite, exploded, back to chance). Trouble is a
failure, or the monitor's alarm once a failure confirms it (``confirm``). The guard then restores the newest snapshot
taken at least ``margin`` steps before the trouble's onset, multiplies the learning rate by ``lr_factor`` and lets
training go on; after ``max_rescues`` rescues it gives up (:class:`RunCollapsed`, or ``on_give_up="stop"``).
Snapshots are taken every ``every`` steps after a check found no trouble, in host memory by default, or on disk
(:mod:`normlab.monitor.snapshots`). Under FSDP2 (``fully_shard``) each rank snapshots and restores its own shards of
the model and of the optimizer state, never the whole model (:mod:`normlab.monitor.shards`).

The trade-off of the checks: trouble is seen up to ``check_every - 1`` steps after its step, and those steps are thrown
away with it; the restore undoes the bad step however late it is seen. In exchange a step makes no host read-back
(and on several ranks no collective) of the guard's: on a GPU the step queue never drains for it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn

from normlab._dispatch import HALF
from normlab.monitor.collapse import CollapseCriteria, CollapseTracker, Failure
from normlab.monitor.optim_step import learning_rates, step_hooks
from normlab.monitor.options import RescueOptions, SnapshotOptions
from normlab.monitor.ranks import is_dtensor
from normlab.monitor.shards import check_sharding, largest_rank_bytes, rebuild_model_state, rebuild_optimizer_state
from normlab.monitor.snapshots import cpu_copy, make_store, rng_state, set_rng_state
from normlab.monitor.watch import Seen, StepLog, world_size

__all__ = ["CollapseGuard", "DismissedAlarm", "Rescue", "RunCollapsed", "snapshot_interval"]


class RunCollapsed(RuntimeError):
    """Raised out of ``optimizer.step()`` when the run still fails after ``max_rescues`` rescues.

    Attributes:
        failure: the last trouble (:class:`~normlab.monitor.collapse.Failure`).
        kind: its kind (:data:`~normlab.monitor.collapse.KINDS`).
        alarm: whether a monitor alarm was involved (acted on at once, or confirmed by the failure).
    """

    def __init__(self, message: str, failure: Failure) -> None:
        super().__init__(message)
        self.failure, self.kind = failure, failure.kind
        self.alarm = failure.kind == "alarm" or failure.after is not None


@dataclass(frozen=True)
class Rescue:
    """One rescue of a :class:`CollapseGuard` (``guard.rescues``).

    Attributes:
        step: the last step the check that saw the trouble covered.
        kind: the trouble's kind (:data:`~normlab.monitor.collapse.KINDS`).
        reason: the trouble, in words (:attr:`Failure.message <normlab.monitor.Failure.message>`).
        onset: the step the trouble was dated to (a confirmed alarm's step, when earlier).
        restored_step: the step of the snapshot the run went back to.
        steps_lost: the optimizer steps thrown away (``step + 1 - restored_step``), the bad ones included.
        lr_before: the learning rate of the first parameter group before the rescue.
        lr_after: the same after the rescue (lowered by ``lr_factor``).

    Example:
        >>> model = nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> guard = CollapseGuard(model, opt, snapshots=SnapshotOptions(every=1), rescue=RescueOptions(check_every=1))
        >>> for scale in (1.0, 1.0, float("nan")):       # the third loss is NaN: the run is rolled back
        ...     opt.zero_grad()
        ...     loss = model(torch.randn(8, 4)).square().mean() * scale
        ...     loss.backward(); guard.observe_loss(loss); opt.step()
        >>> rescue = guard.rescues[0]
        >>> rescue.reason, rescue.restored_step, rescue.lr_after  # the snapshots reach a window back: 6 apart
        ('non-finite loss (nan) at step 2', 0, 0.05)
    """

    step: int
    kind: str
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
    """A monitor alarm no failure followed within ``confirm`` steps (``guard.dismissed``): the run went on unchanged.

    Attributes:
        step: the alarm's step.
        reason: the alarm, in words.
        dismissed_at: the guard's step count when the wait ended.

    Example:
        >>> DismissedAlarm(step=40, reason="collapse warning at step 40: ...", dismissed_at=51).to_dict()["step"]
        40
    """

    step: int
    reason: str
    dismissed_at: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Snap:
    """A snapshot's index entry: its key in the store, its step and the learning-rate factor it was taken at; on
    several ranks also its size as every rank counts it (:func:`~normlab.monitor.shards.largest_rank_bytes`)."""

    key: int
    step: int
    lr_scale: float
    size: int | None = None


@dataclass
class _Armed:
    """``confirm``: a monitor alarm waiting for its trouble (onset: the alarm's step; snap: the snapshot a rollback
    for it restores, kept - pinned - until the wait ends)."""

    onset: int
    words: str
    snap: _Snap


class CollapseGuard:
    """Watch the optimizer's steps and roll the run back, with a lower learning rate, when it fails.

    Trouble (module docstring) is any failure of :mod:`normlab.monitor.collapse` in the observed losses (non-finite,
    exploded, back to chance; with a known chance loss also a net that never learned, while an alarm waits), a
    non-finite gradient, or a new ``monitor.alarm`` (the first :class:`~normlab.monitor.Event` of severity
    ``"alarm"``, whichever rule raised it). An alarm waits up to ``confirm`` steps for a failure: one that follows is
    dated to the alarm and rolls back to before it; otherwise the alarm is dismissed (``guard.dismissed``) and the
    run goes on unchanged, so a false alarm does not change a healthy run. With a known ``chance_loss`` the wait also
    lasts while the run has not learned, and a run that never learns confirms it.

    A step without trouble is exactly the optimizer's step: a healthy run is not changed, only copied every
    ``every`` steps. On several ranks (DDP, FSDP2 - DTensor parameters sharded ``Shard(d)`` or replicated on a mesh
    of every rank, tensor parallelism too) every rank must have a guard with the same options; trouble on any rank
    (its loss, its gradient shards, its monitor's alarm) rolls every rank back to the same step at the same learning
    rate, decided in one collective per check. FSDP1, ``_StridedShard`` and ``Partial`` parameters and meshes of only
    some ranks are refused in one line (:func:`~normlab.monitor.shards.check_sharding`).

    Args:
        model: the module being trained (its ``state_dict`` is snapshotted).
        optimizer: its optimizer; the guard attaches to its ``step()``.
        monitor: optional :class:`~normlab.monitor.VarianceMonitor` attached to the same optimizer (its state is
            snapshotted, its alarms watched; an alarm is dated by its step, so make the two together: they then count
            the same steps).
        snapshots: :class:`~normlab.monitor.SnapshotOptions`: interval, how many, where, how large.
        rescue: :class:`~normlab.monitor.RescueOptions`: how often the guard checks, what a rescue does.
        criteria: :class:`~normlab.monitor.collapse.CollapseCriteria`: what counts as a failure (the chance loss,
            the window of the smoothed loss).
        schedulers: learning-rate schedulers stepped by the loop; they go back with the snapshot and their base rates
            are lowered with the optimizer's. Without them the guard keeps the rate in use at the trouble times
            ``lr_factor`` (a schedule the loop steps itself is not rolled back).
        scaler: a ``torch.amp.GradScaler`` (snapshotted; its own skipping handles non-finite gradients). Step it with
            :func:`~normlab.monitor.scaler_step`.

    Attributes:
        rescues: the :class:`Rescue` records, in order.
        dismissed: the :class:`DismissedAlarm` records on the trajectory kept.
        steps: optimizer steps taken so far on the current trajectory (rolled back with the snapshots).
        snapshot_every: the steps between snapshots (:func:`~normlab.monitor.guard.snapshot_interval`):
            ``snapshots.every``, or more when the ``keep`` snapshots taken that often would not reach a whole loss
            window and the margin back.
        rolled_back: the last optimizer step ended in a rollback (the loop may then drop its per-step records).
        gave_up: the message when the guard gave up with ``on_give_up="stop"``, else None.

    Example:
        >>> model = nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> guard = CollapseGuard(model, opt, snapshots=SnapshotOptions(every=5))
        >>> for _ in range(3):
        ...     opt.zero_grad()
        ...     loss = model(torch.randn(8, 4)).square().mean()
        ...     loss.backward(); guard.observe_loss(loss); opt.step()
        >>> guard.steps, guard.rescues
        (3, [])
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        monitor=None,
        *,
        snapshots: SnapshotOptions | None = None,
        rescue: RescueOptions | None = None,
        criteria: CollapseCriteria | None = None,
        schedulers: Sequence[Any] = (),
        scaler=None,
    ) -> None:
        self.snapshot_options, self.options, self.criteria = _check_args(
            model, optimizer, monitor, snapshots, rescue, criteria
        )
        self.model, self.optimizer, self.monitor = model, optimizer, monitor
        self.schedulers, self.scaler = list(schedulers), scaler
        self.margin = self.snapshot_options.every if self.options.margin is None else self.options.margin
        self.snapshot_every = snapshot_interval(self.snapshot_options, self.criteria.window + self.margin)
        self.steps = 0
        self.rescues: list[Rescue] = []
        self.dismissed: list[DismissedAlarm] = []
        self.rolled_back, self.gave_up = False, None
        self.tracker = CollapseTracker(self.criteria)
        self._store = make_store(self.snapshot_options.store, self.snapshot_options.directory)
        self._snaps: list[_Snap] = []  # kept, oldest first
        self._next_key = 0
        self._armed: _Armed | None = None
        self._scale = 1.0  # product of the lr factors so far (a snapshot records the one it was taken at)
        self._seen_alarm = getattr(monitor, "alarm", None)
        self._log, self._grads_finite = StepLog(), None
        self._take_snapshot()
        self._handle = step_hooks(optimizer).add(1, self._before_step, self._after_step)

    # ------------------------------------------------------------------ the steps
    def observe_loss(self, loss) -> None:
        """The training loss of the coming optimizer step (a tensor, kept on its device until the next check, or a
        number the loop has read already); the same as the monitor's ``observe_loss`` (one of them is enough)."""
        step_hooks(self.optimizer).observe_loss(loss)

    def _before_step(self) -> None:
        """Before the update: whether every gradient is finite, as a 0-dim tensor on the device (no read-back)."""
        self._grads_finite = None
        if not self.options.check_grads or self.scaler is not None or self.gave_up is not None:
            return
        grads = [_local(p.grad) for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if grads:  # each rank its own shards (FSDP2): no collective here, the check shares the flags. A norm is
            # non-finite iff a value is (or past 3e38 in float32: trouble too); the fused L2 norm is the fast one
            half = all(g.dtype in HALF for g in grads)
            norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32) if half else torch._foreach_norm(grads)
            device = norms[0].device
            if any(n.device != device for n in norms):  # parameters on several devices
                norms = [n.to(device) for n in norms]
            self._grads_finite = torch.isfinite(torch.stack(norms)).all()

    def _after_step(self, stepped: bool, loss) -> None:
        """After the update (or a step a GradScaler skipped): log the step; check when due; snapshot when due."""
        self.rolled_back = False
        if self.gave_up is not None:
            return
        self._log.add(self.steps, loss, self._grads_finite)
        self._grads_finite = None
        self.steps += 1
        every, check = self.snapshot_every, self.options.check_every
        if self.steps % check == 0 or self.steps % every == 0:
            trouble = self._check()
            if trouble is not None:
                self._rescue(trouble)
            elif self.steps % every == 0:
                self._take_snapshot()

    def _new_alarm(self) -> tuple[int, str] | None:
        """This rank's monitor alarm if the guard has not seen it yet, as ``(step, words)``."""
        alarm = getattr(self.monitor, "alarm", None)
        if alarm is None or alarm is self._seen_alarm:
            return None
        self._seen_alarm = alarm
        return min(int(getattr(alarm, "step", self.steps)), self.steps - 1), str(alarm)

    def _check(self) -> Failure | None:
        """Read what the steps since the last check left (one read; on several ranks one collective) and decide."""
        seen = self._log.read(self._new_alarm())
        return self._decide(seen, self._first_failure(seen))

    def _first_failure(self, seen: Seen) -> Failure | None:
        for step, loss, bad in zip(seen.steps, seen.losses, seen.bad_grads):
            failure = None if loss is None else self.tracker.update(loss, step)
            if failure is not None:
                return failure
            if bad:
                return Failure("non_finite", step, what="gradient")
        return None

    def _decide(self, seen: Seen, failure: Failure | None) -> Failure | None:
        """The trouble to act on now, from this check's failure and alarm and an alarm already waiting."""
        confirm, new = self.options.confirm, seen.alarm
        if confirm is None:
            if new is not None and (failure is None or failure.step is None or new[0] <= failure.step):
                return Failure("alarm", new[0], what=new[1])
            return failure
        if new is not None and self._armed is None:
            self._armed = _Armed(new[0], new[1], self._choose(new[0]))
        armed = self._armed
        if armed is None or (failure is not None and not _follows(failure, armed)):
            return failure  # a failure dated before the alarm is its own trouble (the alarm goes with its steps)
        within = armed.onset + confirm
        if failure is None and self.criteria.chance_loss is not None:  # a net that died at the alarm (chance known:
            failure = self.tracker.never_learned()  # against a start standing in for it, slow learners would go too)
            if failure is None and self._waiting_to_learn():
                return None
        if failure is not None and (failure.step is None or failure.step <= within):
            return replace(failure, after=f"monitor alarm: {armed.words}")
        if self.steps - 1 >= within:  # the wait is over: no failure came
            self.dismissed.append(DismissedAlarm(armed.onset, f"monitor alarm: {armed.words}", self.steps))
            self._armed = None
        return failure

    def _waiting_to_learn(self) -> bool:
        """With a known chance loss an alarm also waits while the run has not learned (it has losses)."""
        t = self.tracker
        return self.criteria.chance_loss is not None and t.seen > 0 and not t.learned

    # ------------------------------------------------------------------ snapshots
    def _take_snapshot(self) -> None:
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedulers": [s.state_dict() for s in self.schedulers],
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "monitor": None if self.monitor is None else self.monitor.state_dict(),
            "rng": rng_state(),
            "tracker": self.tracker.state_dict(),
        }
        self._put(_Snap(self._next_key, self.steps, self._scale), state)

    def _put(self, snap: _Snap, state: dict) -> None:
        """Keep ``state`` (live: DTensors, not local form) as ``snap`` within the bounds. On several ranks the sizes
        are :func:`~normlab.monitor.shards.largest_rank_bytes`, the same on every rank, so all keep, drop and refuse
        the same snapshots; on one process, what the store takes."""
        self._next_key += 1
        limit = self.snapshot_options.max_bytes
        if world_size() > 1:
            snap.size = largest_rank_bytes(state)
            expected = snap.size
            if limit is not None and snap.size > limit:
                self._too_large(snap.size, limit)
        else:  # the same model: about as large as the last one
            expected = self._bytes(self._snaps[-1]) if self._snaps else 0
        self._bound(extra=1, extra_bytes=expected)  # room first: the held snapshots never exceed the bounds
        self._store.put(snap.key, state)
        self._snaps.append(snap)
        size = self._bytes(snap)
        if limit is not None and size > limit:
            self._snaps.pop()
            self._store.drop(snap.key)
            self._too_large(size, limit)
        self._bound()

    @staticmethod
    def _too_large(size: int, limit: int) -> None:
        raise ValueError(
            f"CollapseGuard: one snapshot takes {size} bytes, over snapshots.max_bytes ({limit}); raise it, or "
            "keep the snapshots on disk (SnapshotOptions(store='disk', directory=...))"
        )

    def _bytes(self, snap: _Snap) -> int:
        return self._store.nbytes(snap.key) if snap.size is None else snap.size

    def _bound(self, extra: int = 0, extra_bytes: int = 0) -> None:
        """Drop the oldest kept snapshots (never one a waiting alarm pinned; never the newest, unless room is made
        for ``extra`` more of ``extra_bytes``) beyond ``keep`` and ``max_bytes``."""
        opts, pinned = self.snapshot_options, None if self._armed is None else self._armed.snap
        limit = None if opts.max_bytes is None else opts.max_bytes - extra_bytes
        while len(self._snaps) + extra > opts.keep or (limit is not None and self.nbytes > limit):
            victims = [s for s in (self._snaps if extra else self._snaps[:-1]) if s is not pinned]
            if not victims:
                break
            self._snaps.remove(victims[0])
            self._store.drop(victims[0].key)

    @property
    def nbytes(self) -> int:
        """The bytes the kept snapshots take where the store keeps them (a pinned one included); on several ranks the
        bytes of their tensors on the rank that keeps the most (its shards under FSDP2), the same on every rank."""
        return sum(self._bytes(s) for s in self._available())

    def _available(self) -> list[_Snap]:
        """The snapshots a rollback may use, oldest first: those kept, and the one a waiting alarm pinned."""
        snaps = list(self._snaps)
        if self._armed is not None and all(s is not self._armed.snap for s in snaps):
            snaps.append(self._armed.snap)
        return sorted(snaps, key=lambda s: s.step)

    def _choose(self, onset: int) -> _Snap:
        snaps = self._available()
        before = [s for s in snaps if s.step <= onset - self.margin]
        return before[-1] if before else snaps[0]

    @torch.no_grad()
    def _restore(self, snap: _Snap) -> None:
        s = self._store.get(snap.key)  # DTensors in local form: each rank's shards, put back without a collective
        self.model.load_state_dict(rebuild_model_state(s["model"], self.model))
        optimizer = rebuild_optimizer_state(cpu_copy(s["optimizer"]), self.optimizer)  # a copy: never aliased
        self.optimizer.load_state_dict(optimizer)
        for sched, st in zip(self.schedulers, s["schedulers"]):
            sched.load_state_dict(copy.deepcopy(st))
        if self.scaler is not None:
            self.scaler.load_state_dict(copy.deepcopy(s["scaler"]))
        if self.monitor is not None:
            self.monitor.load_state_dict(copy.deepcopy(s["monitor"]))
            self._seen_alarm = getattr(self.monitor, "alarm", None)
            records = getattr(self.monitor, "records", None)
            if isinstance(records, list):  # the abandoned steps' records go with them
                records[:] = [r for r in records if r.get("step", -1) < self.monitor.current_step]
        set_rng_state(s["rng"])
        self.tracker.load_state_dict(s["tracker"])
        self.dismissed = [d for d in self.dismissed if d.step < snap.step]  # those of the abandoned steps go too
        self.optimizer.zero_grad(set_to_none=True)
        self.steps = snap.step
        self._log.clear()
        self._grads_finite = None

    # ------------------------------------------------------------------ rescue
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
        """Restore the newest snapshot taken at least ``margin`` steps before ``onset`` (default: the last step), or
        the oldest one, without changing the learning rate; returns the step restored. For a run that stops after
        :class:`RunCollapsed` and should end on its last state from before the trouble."""
        return self._roll_back(self.steps - 1 if onset is None else onset, 1.0)

    def _roll_back(self, onset: int, factor: float) -> int:
        """Restore the snapshot for ``onset`` and multiply the learning rates by ``factor``: with ``schedulers`` the
        snapshot's rates (its schedulers are restored with it), else the rates in use before the rollback."""
        if self._armed is not None:  # trouble while an alarm waits is dated to the alarm
            onset = min(onset, self._armed.onset)
        snap = self._choose(onset)
        self._snaps = [s for s in self._available() if s.step <= snap.step]
        self._armed = None
        current = learning_rates(self.optimizer)
        self._restore(snap)
        if self.schedulers:
            self._scale_lr(self._scale / snap.lr_scale)  # relative to the snapshot's rates (their factors)
        else:
            for group, lr in zip(self.optimizer.param_groups, current):
                group["lr"] = lr * factor
        self._bound()
        self.rolled_back = True
        return snap.step

    def report(self, reason: str) -> None:
        """Trouble the caller found outside the steps (a non-finite validation loss): roll back and lower the learning
        rate as for trouble at the last step (dated to an alarm still waiting, if any). On several ranks call it on
        every rank at the same step (it makes no collective call of its own; the ``"dcp"`` store's read is one).

        Raises:
            RunCollapsed: after ``max_rescues`` rescues (``on_give_up="raise"``).

        Example:
            >>> model = nn.Linear(4, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> guard = CollapseGuard(model, opt, snapshots=SnapshotOptions(every=2))
            >>> for _ in range(5):
            ...     opt.zero_grad(); model(torch.randn(8, 4)).square().mean().backward(); opt.step()
            >>> guard.report("non-finite validation loss")
            >>> guard.rescues[0].restored_step, guard.steps, guard.rescues[0].reason  # snapshots 6 apart: step 0
            (0, 0, 'non-finite validation loss')
        """
        if self.gave_up is None:
            self._rescue(Failure("external", self.steps - 1, what=str(reason)))

    def _rescue(self, failure: Failure) -> None:
        armed = self._armed
        onset = self.steps - 1 if failure.step is None else failure.step
        if armed is not None and _follows(failure, armed):  # the trouble a waiting alarm foretold: dated to the alarm
            onset = min(onset, armed.onset)
            failure = failure if failure.after is not None else replace(failure, after=f"monitor alarm: {armed.words}")
        if len(self.rescues) >= self.options.max_rescues:
            self._give_up(failure, onset)
            return
        step, lr_before = self.steps - 1, float(self.optimizer.param_groups[0]["lr"])
        self._scale *= self.options.lr_factor
        restored = self._roll_back(onset, self.options.lr_factor)
        lr_after = float(self.optimizer.param_groups[0]["lr"])
        reason = failure.message
        self.rescues.append(
            Rescue(step, failure.kind, reason, onset, restored, step + 1 - restored, lr_before, lr_after)
        )

    def _give_up(self, failure: Failure, onset: int) -> None:
        lr = float(self.optimizer.param_groups[0]["lr"])
        message = (
            f"CollapseGuard: gave up after {len(self.rescues)} rescue(s): {failure.message}; the learning rate is "
            f"now {lr:g} (see guard.rescues)"
        )
        if self.options.on_give_up == "raise":
            raise RunCollapsed(message, failure)
        restored = self._roll_back(onset, 1.0)
        self.gave_up = f"{message}; back on the state of step {restored}"

    @property
    def lr_scale(self) -> float:
        """The product of the learning-rate factors of the rescues so far (1.0 before any)."""
        return self._scale

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Everything a resumed run needs to go on as if never interrupted: the step counter, the rescues and
        dismissed alarms, the learning-rate factor, the failure tracker, the steps not checked yet (read back here:
        no collective), and with ``snapshots.in_checkpoint`` the snapshots (their tensors in host memory) and an
        alarm waiting for confirmation. Tensors and plain Python values: ``torch.save`` and
        ``torch.load(weights_only=True)``. On several ranks it is the rank's own (its losses, its random generators;
        under FSDP2 its shards, in local form): save one per rank with ``torch.save`` (not through
        ``torch.distributed.checkpoint``, which would keep one rank's copy of a plain tensor) and call this on every
        rank together (the ``"dcp"`` store reads its snapshots back in a collective)."""
        pending = [(s, _plain(loss), None if ok is None else bool(ok)) for s, loss, ok in self._log.entries]
        out = {
            "steps": self.steps,
            "rescues": [r.to_dict() for r in self.rescues],
            "dismissed": [d.to_dict() for d in self.dismissed],
            "lr_scale": self._scale,
            "tracker": self.tracker.state_dict(),
            "pending": pending,
            "gave_up": self.gave_up,
        }
        if self.snapshot_options.in_checkpoint:
            out["snapshots"] = [self._snapshot_dict(s) for s in self._snaps]
            out["armed"] = None if self._armed is None else self._armed_dict()
        return out

    def _snapshot_dict(self, snap: _Snap) -> dict:
        return {"step": snap.step, "lr_scale": snap.lr_scale, "state": cpu_copy(self._store.get(snap.key))}

    def _armed_dict(self) -> dict:
        armed = self._armed
        kept = any(s is armed.snap for s in self._snaps)
        pinned = None if kept else self._snapshot_dict(armed.snap)
        return {"onset": armed.onset, "words": armed.words, "step": armed.snap.step, "pinned": pinned}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` when a run resumes from a checkpoint (after the monitor's own state): the
        counters, the rescues (they count towards ``max_rescues``), the factor, the tracker, the snapshots and a
        waiting alarm. A state without snapshots starts them again with one of the current state. The monitor's
        current alarm counts as seen."""
        if not isinstance(state, dict) or not {"steps", "rescues"} <= set(state):
            raise ValueError(
                "CollapseGuard.load_state_dict: expected a dict from CollapseGuard.state_dict() with "
                f"'steps' and 'rescues', got {type(state).__name__}"
            )
        self.steps = int(state["steps"])
        self.rescues = [Rescue(**r) for r in state["rescues"]]
        self.dismissed = [DismissedAlarm(**d) for d in state.get("dismissed", [])]
        self._scale, self.gave_up = float(state.get("lr_scale", 1.0)), state.get("gave_up")
        if state.get("tracker") is not None:
            self.tracker.load_state_dict(state["tracker"])
        self._log.clear()
        for s, loss, ok in state.get("pending", []):
            self._log.add(int(s), loss, ok)
        self._seen_alarm = getattr(self.monitor, "alarm", None)
        self._drop_snapshots()
        try:
            self._load_snapshots(state.get("snapshots") or [], state.get("armed"))
        except (KeyError, TypeError, ValueError, StopIteration) as e:
            raise ValueError(
                f"CollapseGuard.load_state_dict: malformed snapshots or waiting alarm in the state ({e!r}); "
                "pass a dict from CollapseGuard.state_dict()"
            ) from None

    def _load_snapshots(self, saved: list, armed: dict | None) -> None:
        if not saved:
            self._take_snapshot()
            return
        for d in saved[-self.snapshot_options.keep :]:
            self._put(_Snap(self._next_key, int(d["step"]), float(d["lr_scale"])), self._live(d["state"]))
        if armed is not None:
            if armed.get("pinned") is not None:
                p = armed["pinned"]
                snap = _Snap(self._next_key, int(p["step"]), float(p["lr_scale"]))
                self._next_key += 1
                state = self._live(p["state"])
                snap.size = largest_rank_bytes(state) if world_size() > 1 else None
                self._store.put(snap.key, state)
            else:
                snap = next(s for s in self._snaps if s.step == int(armed["step"]))
            self._armed = _Armed(int(armed["onset"]), str(armed["words"]), snap)

    def _live(self, state: dict) -> dict:
        """A snapshot read from a checkpoint (local form) with its shards as DTensors of the live model's, as taken."""
        model = rebuild_model_state(state["model"], self.model)
        return {**state, "model": model, "optimizer": rebuild_optimizer_state(state["optimizer"], self.optimizer)}

    def _drop_snapshots(self) -> None:
        for s in self._available():
            self._store.drop(s.key)
        self._snaps, self._armed = [], None

    def close(self) -> None:
        """Detach from the optimizer and drop the snapshots once training is over; ``rescues`` and the counters stay."""
        self._handle.remove()
        self._drop_snapshots()
        self._store.close()

    def __repr__(self) -> str:
        return (
            f"CollapseGuard(steps={self.steps}, every={self.snapshot_every}, rescues={len(self.rescues)}, "
            f"lr_factor={self.options.lr_factor})"
        )


def snapshot_interval(options: SnapshotOptions, reach: int) -> int:
    r"""The steps between a guard's snapshots: ``options.every``, or more when the ``options.keep`` snapshots taken that
    often would not reach ``reach`` steps back.

    A failure of the loss is judged when its window of ``criteria.window`` steps has filled and dated to the window's
    first step, and a rollback lands ``margin`` steps before that: the oldest snapshot kept must lie ``reach`` =
    window + margin steps back. ``keep`` snapshots ``e`` steps apart reach at least ``(keep - 1) * e`` back, so

    .. math::
        e = \max\left(\text{every}, \left\lceil \frac{\text{reach}}{\text{keep} - 1} \right\rceil\right)

    (``keep`` = 1: ``every``; one snapshot cannot reach back). The defaults (window 10, margin 50, every 50, keep 3)
    keep ``every``; a window over about 1,000 examples at batch 1 (:meth:`CollapseCriteria.over_examples
    <normlab.monitor.CollapseCriteria.over_examples>`) spaces them 537 steps apart.

    Example:
        >>> snapshot_interval(SnapshotOptions(), reach=60), snapshot_interval(SnapshotOptions(), reach=1074)
        (50, 537)
    """
    if options.keep < 2:
        return options.every
    return max(options.every, math.ceil(reach / (options.keep - 1)))


def _follows(failure: Failure, armed: _Armed) -> bool:
    """``failure`` confirms the waiting alarm: it has no moment (never learned) or is dated to the alarm or later."""
    return failure.step is None or failure.step >= armed.onset


def _plain(loss):
    """A pending loss as a number (read back: :meth:`CollapseGuard.state_dict` is no training step)."""
    return float(loss) if isinstance(loss, torch.Tensor) else loss


def _check_args(model, optimizer, monitor, snapshots, rescue, criteria):
    """The guard's options (defaults for None), its arguments refused in one line when wrong."""
    where = "CollapseGuard"
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{where}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if monitor is not None and getattr(monitor, "optimizer", None) is not optimizer:
        raise ValueError(
            f"{where}: the monitor must follow the guard's optimizer (VarianceMonitor(model, optimizer=opt)), so that "
            "the guard sees its alarm of each step"
        )
    for name, value, cls in (
        ("snapshots", snapshots, SnapshotOptions),
        ("rescue", rescue, RescueOptions),
        ("criteria", criteria, CollapseCriteria),
    ):
        if value is not None and not isinstance(value, cls):
            raise TypeError(f"{where}: {name} must be None or a {cls.__name__}, got {type(value).__name__}")
    params = [*model.parameters(), *(p for g in optimizer.param_groups for p in g["params"])]
    check_sharding(model, params, where)
    return snapshots or SnapshotOptions(), rescue or RescueOptions(), criteria or CollapseCriteria()


def _local(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as this rank holds it: a DTensor's local shard, a plain tensor as it is."""
    return grad.to_local().detach() if is_dtensor(grad) else grad.detach()
