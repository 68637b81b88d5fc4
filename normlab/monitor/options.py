"""The options of the monitor and the guard, grouped by what they decide.

:class:`~normlab.monitor.VarianceMonitor`: :class:`RecordSchedule` (its ``every``: the recording steps, as Cockpit's
``track_schedule`` does for its quantities) and :class:`RecordOptions` (its ``recording``: which layers and forwards a
recording step keeps), and what a sink is (:func:`check_sink`). :class:`~normlab.monitor.CollapseGuard`:
:class:`SnapshotOptions` (its ``snapshots``: how often, how many, where, how large) and :class:`RescueOptions` (its
``rescue``: how often it looks, what it does on trouble). What counts as trouble is the failure taxonomy's
:class:`~normlab.monitor.collapse.CollapseCriteria`. All are small frozen dataclasses that check their values when
made, so a wrong value fails where it was written.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from normlab._checks import check_number, is_int

__all__ = ["RecordSchedule", "RecordOptions", "SnapshotOptions", "RescueOptions", "check_sink", "SNAPSHOT_STORES"]

SNAPSHOT_STORES = ("host", "disk", "dcp")


def _int_at_least(owner: str, name: str, value, low: int) -> None:
    check_number(owner, name, value, integer=True, low=low)


@dataclass(frozen=True)
class RecordSchedule:
    r"""The steps a monitor records: every ``every`` steps, and every ``dense_every`` steps during the first
    ``dense_steps``.

    .. math::
        \text{step } s \text{ is recorded} \iff s \bmod \text{every} = 0 \;\lor\;
        (s < \text{dense\_steps} \land s \bmod \text{dense\_every} = 0)

    Step 0 is always recorded (the initial values). The first steps of a run are where a collapse at a high learning
    rate begins, so a dense start sees them without the cost of ``every=1`` for the whole run.

    Attributes:
        every: the recording interval after the dense start (int >= 1). Default: 10.
        dense_steps: how many first steps are recorded densely (int >= 0; 0: no dense start). Default: 0.
        dense_every: the recording interval during the dense start (int >= 1). Default: 1.

    Example:
        >>> schedule = RecordSchedule(every=10, dense_steps=4)
        >>> [s for s in range(25) if schedule.is_due(s)]
        [0, 1, 2, 3, 10, 20]
        >>> RecordSchedule(every=5) == RecordSchedule(5, 0, 1)
        True
    """

    every: int = 10
    dense_steps: int = 0
    dense_every: int = 1

    def __post_init__(self) -> None:
        for name, low in (("every", 1), ("dense_steps", 0), ("dense_every", 1)):
            _int_at_least("RecordSchedule", name, getattr(self, name), low)

    def is_due(self, step: int) -> bool:
        """Whether ``step`` is a recording step."""
        return step % self.every == 0 or (step < self.dense_steps and step % self.dense_every == 0)

    @classmethod
    def of(cls, every: int | RecordSchedule) -> RecordSchedule:
        """``every`` as a schedule: an int ``n`` is ``RecordSchedule(every=n)``, a schedule is returned as is."""
        if isinstance(every, cls):
            return every
        if not is_int(every) or every < 1:
            raise ValueError(f"VarianceMonitor: every must be an int >= 1 or a RecordSchedule, got {every!r}")
        return cls(every)


@dataclass(frozen=True)
class RecordOptions:
    """Which layers and forwards a recording step keeps.

    Attributes:
        include_norm: also record normalization layers (their output variance and input ratio), not only the
            conv/linear layers. Default: True.
        record_eval: also record forwards of modules in eval mode. Default: False (training forwards only, so an
            evaluation pass inside a recording step does not replace the training statistics).

    Example:
        >>> RecordOptions(record_eval=True)
        RecordOptions(include_norm=True, record_eval=True)
    """

    include_norm: bool = True
    record_eval: bool = False

    def __post_init__(self) -> None:
        for name in ("include_norm", "record_eval"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"RecordOptions: {name} must be True or False, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class SnapshotOptions:
    """How :class:`~normlab.monitor.CollapseGuard` keeps the snapshots it rolls back to.

    A snapshot holds the model's and the optimizer's state (and the schedulers', the GradScaler's, the monitor's, the
    random generators' and the failure tracker's). It is taken every ``every`` optimizer steps, after a check found
    no trouble, so every snapshot is one the run can go back to.

    Attributes:
        every: the snapshot interval in optimizer steps (int >= 1; a snapshot is also taken when the guard is made).
            Default: 50, the library's one value of it. A guard whose loss window is longer than the ``keep``
            snapshots would reach takes them further apart
            (:func:`~normlab.monitor.guard.snapshot_interval`, ``CollapseGuard.snapshot_every``).
        keep: how many snapshots to keep, the oldest dropped first (int >= 1). Default: 3.
        store: where they live: ``"host"`` (host memory: pinned when the model is on a CUDA device, filled with
            asynchronous copies), ``"disk"`` (one ``torch.save`` file per snapshot in ``directory``, written
            atomically), ``"dcp"`` (``torch.distributed.checkpoint`` in ``directory``: under DDP one copy of the
            replicated model and optimizer state, written by the ranks together; the guard's ``state_dict`` then reads
            it back on every rank together), or a
            :class:`~normlab.monitor.snapshots.SnapshotStore`. Default: ``"host"``: never a copy on the accelerator.
        directory: the directory of ``"disk"`` and ``"dcp"`` (created if missing; required for them).
        max_bytes: the most bytes the kept snapshots may take (host memory, or disk for ``"disk"``/``"dcp"``),
            or None (``keep`` alone bounds them); the oldest snapshots are dropped to stay under it, and a single
            snapshot larger than it is refused in one line.
        in_checkpoint: :meth:`~normlab.monitor.CollapseGuard.state_dict` carries the snapshots (read back into host
            memory) and an alarm waiting for confirmation, so a run resumed from a checkpoint goes on exactly as if
            never interrupted; the checkpoint then holds up to ``keep + 1`` more copies of the model and optimizer
            state. False: counters only, and a resumed run starts its snapshots again. Default: True.

    Example:
        >>> SnapshotOptions(every=20, store="disk", directory="snapshots").keep
        3
        >>> SnapshotOptions(store="disk")
        Traceback (most recent call last):
        ...
        ValueError: SnapshotOptions: store 'disk' needs a directory, got directory=None
    """

    every: int = 50
    keep: int = 3
    store: Any = "host"
    directory: str | os.PathLike | None = None
    max_bytes: int | None = None
    in_checkpoint: bool = True

    def __post_init__(self) -> None:
        for name in ("every", "keep"):
            _int_at_least("SnapshotOptions", name, getattr(self, name), 1)
        store = self.store
        if isinstance(store, str) and store not in SNAPSHOT_STORES:
            raise ValueError(
                f"SnapshotOptions: store must be one of {SNAPSHOT_STORES} or a SnapshotStore, got {store!r}"
            )
        if not isinstance(store, str) and not all(callable(getattr(store, m, None)) for m in ("put", "get", "drop")):
            raise ValueError(
                f"SnapshotOptions: store must be one of {SNAPSHOT_STORES} or a SnapshotStore, got {store!r}"
            )
        if store in ("disk", "dcp") and self.directory is None:
            raise ValueError(f"SnapshotOptions: store {store!r} needs a directory, got directory=None")
        if self.max_bytes is not None:
            _int_at_least("SnapshotOptions", "max_bytes", self.max_bytes, 1)
        if not isinstance(self.in_checkpoint, bool):
            raise ValueError(f"SnapshotOptions: in_checkpoint must be True or False, got {self.in_checkpoint!r}")


GIVE_UP = ("raise", "stop")


@dataclass(frozen=True)
class RescueOptions:
    """When :class:`~normlab.monitor.CollapseGuard` looks for trouble and what it does about it.

    Attributes:
        check_every: the guard reads what it gathered (each step's loss and non-finite-gradient flag, kept on the
            device until then) every ``check_every`` optimizer steps, and at every snapshot: the one host read-back,
            and under DDP the one collective, of the steps in between. Trouble is seen at most ``check_every - 1``
            steps after it happened; the steps taken meanwhile are thrown away with it (the rollback restores a
            snapshot taken before it, so a bad step is undone however late it is seen). 1: every step (a loop that
            reads its loss every step anyway loses nothing). Default: 10.
        margin: the snapshot restored is at least this many steps older than the trouble's onset (int >= 0; None:
            the snapshot interval).
        lr_factor: each rescue multiplies every parameter group's learning rate (and the schedulers' base rates) by
            this factor, in (0, 1]. Default: 0.5.
        max_rescues: rescues allowed (int >= 0); the next trouble gives up. Default: 3.
        confirm: a monitor alarm is trouble only if a failure (:mod:`normlab.monitor.collapse`) follows within this
            many steps (int >= 1; the rollback then goes back to before the alarm); None: the alarm alone is
            trouble. Default: 10.
        check_grads: also look for non-finite gradients before each step (on the device; with a GradScaler the
            scaler's own skipping handles them). Default: True.
        on_give_up: ``"raise"``: :class:`~normlab.monitor.RunCollapsed` out of ``optimizer.step()``; ``"stop"``: roll
            back to the last snapshot from before the trouble, keep the message in ``guard.gave_up`` and leave the
            later steps alone (a loop that cannot catch the exception: Lightning). Default: ``"raise"``.

    Example:
        >>> RescueOptions(check_every=1, confirm=None).lr_factor
        0.5
    """

    check_every: int = 10
    margin: int | None = None
    lr_factor: float = 0.5
    max_rescues: int = 3
    confirm: int | None = 10
    check_grads: bool = True
    on_give_up: str = "raise"

    def __post_init__(self) -> None:
        where = "RescueOptions"
        _int_at_least(where, "check_every", self.check_every, 1)
        _int_at_least(where, "max_rescues", self.max_rescues, 0)
        if self.margin is not None:
            _int_at_least(where, "margin", self.margin, 0)
        if self.confirm is not None:
            _int_at_least(where, "confirm", self.confirm, 1)
        f = self.lr_factor
        if isinstance(f, bool) or not isinstance(f, int | float) or not (math.isfinite(f) and 0 < f <= 1):
            raise ValueError(f"{where}: lr_factor must be a number in (0, 1], got {f!r}")
        if not isinstance(self.check_grads, bool):
            raise ValueError(f"{where}: check_grads must be True or False, got {self.check_grads!r}")
        if self.on_give_up not in GIVE_UP:
            raise ValueError(f"{where}: on_give_up must be one of {GIVE_UP}, got {self.on_give_up!r}")


def check_sink(sink) -> None:
    """Refuse what :meth:`VarianceMonitor.add_sink <normlab.monitor.VarianceMonitor.add_sink>` cannot use, in one line.

    A sink is a callable (called with every event the monitor keeps) or an object with ``write_records(records,
    mean_updates)`` and/or ``write_event(event)`` (and optionally ``close()``), as
    :class:`~normlab.integrations.tensorboard.MonitorBoard`.
    """
    if callable(sink) or any(callable(getattr(sink, m, None)) for m in ("write_records", "write_event")):
        return
    raise TypeError(
        f"VarianceMonitor.add_sink: sink must be a callable(event) or have write_records/write_event, got "
        f"{type(sink).__name__}"
    )
