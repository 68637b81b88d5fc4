"""When and what :class:`~normlab.monitor.VarianceMonitor` records: :class:`RecordSchedule` (its ``every``) and
:class:`RecordOptions` (its ``recording``), and what a sink is (:func:`check_sink`).

A schedule decides the recording steps, as Cockpit's ``track_schedule`` does for its quantities; the options decide
which layers and which forwards a recording step keeps. Both are small frozen dataclasses that check their values
when made, so a wrong value fails where it was written.
"""

from __future__ import annotations

from dataclasses import dataclass

from normlab._checks import check_number, is_int

__all__ = ["RecordSchedule", "RecordOptions", "check_sink"]


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
