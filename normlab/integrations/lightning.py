"""The variance monitor as a Lightning callback: ``Trainer(callbacks=[VarianceMonitorCallback(every=10)])``.

The callback attaches a :class:`~normlab.monitor.VarianceMonitor` to the LightningModule when fitting starts and
records through Lightning's hooks: ``on_before_optimizer_step`` snapshots the weights before the first optimizer
step of a training batch, ``on_train_batch_end`` records once the batch's steps are done. So

- **gradient accumulation** is handled: one monitor step per optimizer step (the activations of the step's first
  micro-batch are recorded), none for the micro-batches in between;
- **several optimizers** (manual optimization) are handled: one monitor step per training batch, whose update
  ratios cover every optimizer step taken in it;
- **mixed precision with a GradScaler** (``16-mixed``) is handled: a step the scaler skips (inf gradients; its
  scale drops) is recorded as no update;
- **DDP** (``ddp``, ``ddp_spawn``, ...) is handled: each rank records its own replica (its shard of the batch),
  scalars are logged from rank 0, and an alarm on any rank stops every rank;
- strategies that shard or wrap parameters (FSDP, DeepSpeed, model parallel, multi-device XLA) are refused at
  ``setup``: no rank holds whole kernels to measure.

With ``guard=True`` (or a dict of :class:`~normlab.monitor.CollapseGuard` arguments) the callback also rescues the
run, in a single process: on a non-finite loss or gradient after an optimizer step, or a loss climbing back towards
its start (the guard's defaults: the monitor's alarm alone is trouble only when one of these follows within
``confirm`` steps, and the rollback then goes back to before the alarm) it restores the newest in-memory snapshot
from before the trouble (module, optimizer, LR schedulers, GradScaler,
monitor, RNG), lowers the learning rate and lets the trainer go on; after ``max_rescues`` rescues it puts the module
back on that snapshot, warns and stops the trainer (``trainer.should_stop``, as ``EarlyStopping`` does). Under DDP
it is refused at ``setup``: the rollbacks are not synchronised across ranks.

Scalars go to the module's loggers from rank 0 (``logger.log_metrics`` at the monitor's step; tags as in
:mod:`normlab.integrations.tensorboard`: ``output_var/<layer>``, ``shift/<layer>``, ...);
``callback.monitor.records`` holds every record. Lightning
checkpoints carry the monitor's state (step counter, alarm baselines). Needs ``pip install 'normlab[lightning]'``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from normlab.integrations.tensorboard import scalar_tags
from normlab.monitor import CollapseGuard, RecordSchedule, VarianceMonitor
from normlab.monitor.guard import RunCollapsed
from normlab.monitor.optim_step import scaler_skipped

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
    from lightning.pytorch.utilities import rank_zero_warn
except ImportError:  # pragma: no cover - the extra is not installed
    raise ModuleNotFoundError(
        "Lightning is not installed: pip install 'normlab[lightning]'", name="lightning"
    ) from None

__all__ = ["VarianceMonitorCallback", "SUPPORTED_STRATEGIES"]

#: The Lightning strategy classes the callback accepts at ``setup``, ``SingleDeviceStrategy`` and ``DDPStrategy``
#: (``ddp``, ``ddp_spawn``, ...), and their subclasses. Strategies that shard or wrap parameters (FSDP,
#: DeepSpeed, model parallel, multi-device XLA) are refused: no rank holds whole kernels to measure.
SUPPORTED_STRATEGIES = (SingleDeviceStrategy, DDPStrategy)


def _grad_scale(trainer: pl.Trainer) -> float | None:
    """The scale of the precision plugin's GradScaler (16-mixed), or None without one."""
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    return float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None


def _scaler(trainer: pl.Trainer):
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


def _loss(outputs):
    """The loss of a training step's outputs (a tensor, or a dict with "loss"), None when there is none."""
    if isinstance(outputs, Mapping):
        outputs = outputs.get("loss")
    return outputs if isinstance(outputs, torch.Tensor | float) else None


def _guard_kwargs(guard) -> dict | None:
    if guard is None or guard is False:
        return None
    if guard is True:
        return {}
    if not isinstance(guard, Mapping):
        raise TypeError(
            f"VarianceMonitorCallback: guard must be True, False or a dict of CollapseGuard arguments, got "
            f"{type(guard).__name__}"
        )
    bad = sorted(set(guard) & {"model", "optimizer", "monitor", "schedulers", "scaler"})
    if bad:
        raise ValueError(f"VarianceMonitorCallback: guard: {bad} are taken from the trainer, do not pass them")
    return dict(guard)


class VarianceMonitorCallback(pl.Callback):
    """Record variance-transmission statistics of a LightningModule every ``every`` optimizer steps, and optionally
    rescue a collapsing run (``guard``).

    Args:
        every: record on monitor steps 0, every, 2 * every, ... (a monitor step is a training batch in which the
            optimizer stepped), or a :class:`~normlab.monitor.RecordSchedule` (a dense start).
        stop_on_alarm: stop the trainer (``trainer.should_stop``) when the collapse warning fires (with ``guard``,
            an alarm is a rescue instead; only an alarm the guard leaves standing stops the trainer).
        log: log the recorded scalars through the module's logger.
        jsonl: write every record to this path when fitting ends (``normlab monitor PATH`` draws the figures).
        guard: True, or a dict of :class:`~normlab.monitor.CollapseGuard` arguments (``every``, ``keep``,
            ``margin``, ``lr_factor``, ``max_rescues``, ``check_grads``): after each optimizer step, a new monitor
            alarm, a non-finite loss or a non-finite gradient rolls the module, the optimizer, the LR schedulers
            (``configure_optimizers``), the GradScaler (``16-mixed``), the monitor and the RNG back to a snapshot from
            before the trouble and multiplies the learning rate by ``lr_factor`` (the schedulers go on from the
            lowered rate). After ``max_rescues`` rescues the module is put back on that snapshot, a warning says why
            and the trainer stops (``callback.gave_up`` holds the message). One process and one optimizer only.
            ``trainer.global_step`` keeps counting the steps taken, the rolled-back ones included.
        tensorboard: a log directory or a ``SummaryWriter``: the monitor's records and events are also written
            there (:class:`~normlab.integrations.tensorboard.MonitorBoard`, by rank 0 only).
        **monitor_kwargs: further :class:`~normlab.monitor.VarianceMonitor` arguments (``rules``, ``probes``,
            ``recording``). The training step's loss (its output, or its ``"loss"``) reaches the rules as
            ``ctx.loss``.

    Attributes:
        monitor: the :class:`~normlab.monitor.VarianceMonitor` of the current (or last) fit, None before.
        guard: the :class:`~normlab.monitor.CollapseGuard` of the current (or last) fit (``guard.rescues`` lists
            the rescues), None without ``guard`` or before training starts.
        gave_up: the guard's message when it gave up and stopped the trainer, else None.

    Example:
        >>> callback = VarianceMonitorCallback(every=10, stop_on_alarm=True)
        >>> callback.monitor is None        # attached when pl.Trainer(callbacks=[callback]).fit(module) starts
        True
        >>> guarded = VarianceMonitorCallback(every=1, guard={"every": 20, "max_rescues": 3})
        >>> guarded.guard is None           # pl.Trainer(callbacks=[guarded]).fit(module): guarded.guard.rescues
        True
    """

    def __init__(
        self,
        every: int | RecordSchedule = 10,
        stop_on_alarm: bool = False,
        log: bool = True,
        jsonl: str | os.PathLike | None = None,
        guard: bool | Mapping[str, Any] | None = None,
        tensorboard: str | os.PathLike | Any | None = None,
        **monitor_kwargs: Any,
    ) -> None:
        super().__init__()
        self.every, self.stop_on_alarm, self.log_scalars, self.jsonl = every, stop_on_alarm, log, jsonl
        self.tensorboard = tensorboard
        self.monitor_kwargs = monitor_kwargs
        self.guard_kwargs = _guard_kwargs(guard)
        self.monitor: VarianceMonitor | None = None
        self.guard: CollapseGuard | None = None
        self.gave_up: str | None = None
        self._stepping = False
        self._scale: float | None = None
        self._state: dict | None = None
        self._guard_state: dict | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        if not isinstance(strategy, SUPPORTED_STRATEGIES):
            raise ValueError(
                f"VarianceMonitorCallback: strategy {type(strategy).__name__} is not supported (it "
                f"shards or wraps the parameters, so no rank holds whole kernels); use a single device "
                f"or DDP"
            )
        if self.guard_kwargs is not None and trainer.world_size > 1:
            raise ValueError(
                f"VarianceMonitorCallback: guard runs in one process only (its rollbacks are not synchronised "
                f"across DDP ranks; world size {trainer.world_size}); drop guard= or train on one device"
            )
        self.monitor = VarianceMonitor(pl_module, every=self.every, **self.monitor_kwargs)
        if self.tensorboard is not None and trainer.global_rank == 0:  # one writer per event directory: rank 0's
            from normlab.integrations.tensorboard import MonitorBoard

            self.monitor.add_sink(MonitorBoard(self.tensorboard))
        if self._state is not None:
            self.monitor.load_state_dict(self._state)
            self._state = None
        self._stepping = False
        self.guard, self.gave_up = None, None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The guard is made here: the optimizers, schedulers and a resumed checkpoint's states exist by now."""
        if self.guard_kwargs is None or self.monitor is None:
            return
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"VarianceMonitorCallback: guard needs exactly one optimizer, the trainer has "
                f"{len(trainer.optimizers)}; drop guard= or use one optimizer"
            )
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        self.guard = CollapseGuard(
            pl_module,
            trainer.optimizers[0],
            self.monitor,
            schedulers=schedulers,
            scaler=_scaler(trainer),
            **self.guard_kwargs,
        )
        if self._guard_state is not None:
            self.guard.load_state_dict(self._guard_state)
            self._guard_state = None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        if self.monitor is not None and not self._stepping:
            self.monitor.before_update(optimizer)
            self._stepping = True
            self._scale = _grad_scale(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch: Any, batch_idx: int
    ) -> None:
        mon = self.monitor
        if mon is None or not self._stepping:  # a micro-batch of gradient accumulation: no step yet
            return
        self._stepping = False
        recording = mon.is_recording
        before = len(mon.records)
        scale = _grad_scale(trainer)  # a GradScaler lowers its scale when it skips a step (inf gradients)
        mon.after_update(stepped=not scaler_skipped(self._scale, scale), loss=_loss(outputs))
        if recording and self.log_scalars and trainer.is_global_zero:
            values = {tag: v for rec in mon.records[before:] for tag, v in scalar_tags(rec).items()}
            for logger in pl_module.loggers:  # at the monitor's step: the record's own x coordinate
                logger.log_metrics(values, step=mon.current_step - 1)
        if self.guard is not None and not trainer.should_stop:
            self._guard_step(trainer, outputs)
        if recording and self.stop_on_alarm:
            if trainer.strategy.reduce_boolean_decision(mon.alarm is not None, all=False):
                if not trainer.should_stop:
                    rank_zero_warn(f"VarianceMonitorCallback: {mon.alarm or 'an alarm on another rank'}; stopping")
                trainer.should_stop = True

    def _guard_step(self, trainer: pl.Trainer, outputs) -> None:
        """The guard's look at the step just taken: a rescue (warned), or giving up (rolled back, warned, stop)."""
        guard = self.guard
        try:
            if guard.after_step(_loss(outputs)):
                return
        except RunCollapsed as e:
            restored = guard.roll_back()
            self.gave_up = f"{e}; the module is back on its state of guard step {restored}"
            rank_zero_warn(f"VarianceMonitorCallback: {self.gave_up}; stopping")
            trainer.should_stop = True
            return
        r = guard.rescues[-1]
        rank_zero_warn(
            f"VarianceMonitorCallback: rescue {len(guard.rescues)}: {r.reason}; back to guard step "
            f"{r.restored_step}, learning rate {r.lr_before:g} -> {r.lr_after:g}"
        )

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is not None and self.jsonl is not None and trainer.is_global_zero:
            self.monitor.to_jsonl(self.jsonl)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.monitor is not None:
            self.monitor.close()  # hooks removed; the records stay
        if stage == "fit" and self.guard is not None:
            self.guard.release()  # the in-memory copies of the module; guard.rescues stays

    def state_dict(self) -> dict[str, Any]:
        state = {"monitor": self.monitor.state_dict()} if self.monitor is not None else {}
        if self.guard is not None:
            state["guard"] = self.guard.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("monitor")
        if state is not None and self.monitor is not None:
            self.monitor.load_state_dict(state)
        else:
            self._state = state
        self._guard_state = state_dict.get("guard")  # applied when the guard is made (on_train_start)
