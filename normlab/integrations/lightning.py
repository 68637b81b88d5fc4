"""The variance monitor as a Lightning callback: ``Trainer(callbacks=[VarianceMonitorCallback(every=10)])``.

When training starts the callback attaches a :class:`~normlab.monitor.VarianceMonitor` (and, with ``guard``, a
:class:`~normlab.monitor.CollapseGuard`) to the trainer's optimizer, as a plain PyTorch loop does
(``VarianceMonitor(model, optimizer=opt)``): Lightning's own ``optimizer.step()`` is a monitor step, seen after the
step's closure (forward and backward) ran; the loss reaches the monitor and the guard from ``on_before_backward``. So

- **gradient accumulation** is handled: one monitor step per optimizer step (the activations of the step's first
  micro-batch are recorded; the observed loss is the sum of the micro-batches' losses Lightning divided by their
  number: their mean);
- **several optimizers** (manual optimization): the monitor follows the first one; a monitor step is one step of
  it, and its update ratios are that step's;
- **mixed precision with a GradScaler** (``16-mixed``) is handled: a step the scaler skips (inf gradients) is
  recorded as a step without an update;
- **DDP** (``ddp``, ``ddp_spawn``, ...) is handled: each rank records its own replica (its shard of the batch),
  scalars are logged from rank 0, and an alarm on any rank stops every rank;
- strategies that shard or wrap parameters (FSDP, DeepSpeed, model parallel, multi-device XLA) are refused at
  ``setup``: no rank holds whole kernels to measure.

With ``guard=True`` (or a dict of :class:`~normlab.monitor.CollapseGuard` keyword arguments: ``snapshots``,
``rescue``, ``criteria``) the callback also rescues the run, in a single process with one optimizer: on a failure
(:mod:`normlab.monitor.collapse`: a non-finite loss or gradient, an exploded loss, a return to chance) or a monitor
alarm that a failure confirms, the guard restores the newest snapshot from before the trouble (module, optimizer, LR
schedulers, GradScaler, monitor, RNG), lowers the learning rate and lets the trainer go on; after ``max_rescues``
rescues it puts the module back on that snapshot, warns and stops the trainer (``trainer.should_stop``, as
``EarlyStopping`` does): its ``on_give_up`` is ``"stop"``. Under DDP it is refused at ``setup`` (Lightning's DDP
is not tested with the guard here; a plain PyTorch DDP loop is).

Scalars go to the module's loggers from rank 0 (``logger.log_metrics`` at the monitor's step; tags as in
:mod:`normlab.integrations.tensorboard`: ``output_var/<layer>``, ``shift/<layer>``, ...);
``callback.monitor.records`` holds every record. Lightning
checkpoints carry the monitor's state (step counter, alarm baselines). Needs ``pip install 'normlab[lightning]'``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from normlab.integrations.tensorboard import scalar_tags
from normlab.monitor import CollapseGuard, RecordSchedule, RescueOptions, VarianceMonitor
from normlab.monitor.optim_step import step_hooks

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


def _scaler(trainer: pl.Trainer):
    """The precision plugin's enabled GradScaler (16-mixed), or None."""
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


_TAKEN = ("model", "optimizer", "monitor", "schedulers", "scaler")


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
    bad = sorted(set(guard) & set(_TAKEN))
    if bad:
        raise ValueError(f"VarianceMonitorCallback: guard: {bad} are taken from the trainer, do not pass them")
    return dict(guard)


class VarianceMonitorCallback(pl.Callback):
    """Record variance-transmission statistics of a LightningModule every ``every`` optimizer steps, and optionally
    rescue a failing run (``guard``).

    Args:
        every: record on monitor steps 0, every, 2 * every, ... (a monitor step is a step of the trainer's first
            optimizer), or a :class:`~normlab.monitor.RecordSchedule` (a dense start).
        stop_on_alarm: stop the trainer (``trainer.should_stop``) when the collapse warning fires (with ``guard``,
            an alarm is a rescue instead; only an alarm the guard leaves standing stops the trainer).
        log: log the recorded scalars through the module's logger.
        jsonl: write every record to this path when fitting ends (``normlab monitor PATH`` draws the figures).
        guard: True, or a dict of :class:`~normlab.monitor.CollapseGuard` keyword arguments (``snapshots``,
            ``rescue``, ``criteria``): the guard watches the optimizer's steps and rolls the module, the optimizer,
            the LR schedulers (``configure_optimizers``), the GradScaler (``16-mixed``), the monitor and the RNG back
            to a snapshot from before the trouble, with a lower learning rate (the schedulers go on from it). After
            ``max_rescues`` rescues the module is put back on that snapshot, a warning says why and the trainer stops
            (``callback.gave_up`` holds the message). One process and one optimizer only. ``trainer.global_step``
            keeps counting the steps taken, the rolled-back ones included.
        tensorboard: a log directory or a ``SummaryWriter``: the monitor's records and events are also written
            there (:class:`~normlab.integrations.tensorboard.MonitorBoard`, by rank 0 only).
        **monitor_kwargs: further :class:`~normlab.monitor.VarianceMonitor` arguments (``rules``, ``probes``,
            ``recording``). The loss of each backward reaches the rules as ``ctx.loss``.

    Attributes:
        monitor: the :class:`~normlab.monitor.VarianceMonitor` of the current (or last) fit, None before training
            starts.
        guard: the :class:`~normlab.monitor.CollapseGuard` of the current (or last) fit (``guard.rescues`` lists
            the rescues), None without ``guard`` or before training starts.
        gave_up: the guard's message when it gave up and stopped the trainer, else None.

    Example:
        >>> from normlab.monitor import SnapshotOptions
        >>> callback = VarianceMonitorCallback(every=10, stop_on_alarm=True)
        >>> callback.monitor is None        # attached when pl.Trainer(callbacks=[callback]).fit(module) starts
        True
        >>> guarded = VarianceMonitorCallback(every=1, guard={"snapshots": SnapshotOptions(every=20)})
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
        self._deferred = False  # 16-mixed: the step's listeners wait for the GradScaler's update (on_train_batch_end)
        self._records = 0  # len(monitor.records) when the batch started
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
                f"VarianceMonitorCallback: guard runs in one process only under Lightning (world size "
                f"{trainer.world_size}); drop guard= or train on one device"
            )
        self.monitor, self.guard, self.gave_up = None, None, None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The monitor and the guard are made here, attached to the trainer's optimizer: the optimizers,
        schedulers and a resumed checkpoint's states exist by now."""
        if not trainer.optimizers:
            raise ValueError("VarianceMonitorCallback: the trainer has no optimizer to follow")
        opt = trainer.optimizers[0]
        self.monitor = VarianceMonitor(pl_module, every=self.every, optimizer=opt, **self.monitor_kwargs)
        if self.tensorboard is not None and trainer.global_rank == 0:  # one writer per event directory: rank 0's
            from normlab.integrations.tensorboard import MonitorBoard

            self.monitor.add_sink(MonitorBoard(self.tensorboard))
        if self._state is not None:
            self.monitor.load_state_dict(self._state)
            self._state = None
        if self.guard_kwargs is not None:
            self._make_guard(trainer, pl_module, opt)

    def _make_guard(self, trainer: pl.Trainer, pl_module: pl.LightningModule, opt) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"VarianceMonitorCallback: guard needs exactly one optimizer, the trainer has "
                f"{len(trainer.optimizers)}; drop guard= or use one optimizer"
            )
        kwargs = dict(self.guard_kwargs)  # Lightning cannot catch an exception out of its optimizer step: "stop"
        kwargs["rescue"] = dataclasses.replace(kwargs.get("rescue") or RescueOptions(), on_give_up="stop")
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        self.guard = CollapseGuard(
            pl_module, opt, self.monitor, schedulers=schedulers, scaler=_scaler(trainer), **kwargs
        )
        if self._guard_state is not None:
            self.guard.load_state_dict(self._guard_state)
            self._guard_state = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        if self.monitor is not None:
            self._records = len(self.monitor.records)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss) -> None:
        """The loss as it enters backward (16-mixed: scaled by the GradScaler, divided back here) is the step's
        loss for the monitor's rules and the guard."""
        if self.monitor is None:
            return
        scaler = _scaler(trainer)
        self.monitor.observe_loss(loss.detach() if scaler is None else loss.detach() / scaler.get_scale())

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        """16-mixed: Lightning's GradScaler steps the optimizer (or skips the step) and updates its scale next; the
        monitor and the guard see the step once that is done (:meth:`StepHooks.defer
        <normlab.monitor.optim_step.StepHooks.defer>`)."""
        if self.monitor is not None and optimizer is self.monitor.optimizer and _scaler(trainer) is not None:
            step_hooks(optimizer).defer()
            self._deferred = True

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch: Any, batch_idx: int
    ) -> None:
        mon = self.monitor
        if mon is None:
            return
        if self._deferred:  # the step (or the step the GradScaler skipped) is seen now, after the scale's update
            self._deferred = False
            step_hooks(mon.optimizer).finish()
        recorded = len(mon.records) > self._records
        if recorded and self.log_scalars and trainer.is_global_zero:
            values = {tag: v for rec in mon.records[self._records :] for tag, v in scalar_tags(rec).items()}
            for logger in pl_module.loggers:  # at the monitor's step: the record's own x coordinate
                logger.log_metrics(values, step=mon.current_step - 1)
        if self.guard is not None:
            self._guard_news(trainer)
        if recorded and self.stop_on_alarm:
            if trainer.strategy.reduce_boolean_decision(mon.alarm is not None, all=False):
                if not trainer.should_stop:
                    rank_zero_warn(f"VarianceMonitorCallback: {mon.alarm or 'an alarm on another rank'}; stopping")
                trainer.should_stop = True

    def _guard_news(self, trainer: pl.Trainer) -> None:
        """What the guard did in this batch's step: a rescue (warned), or giving up (warned, stop)."""
        guard = self.guard
        if guard.gave_up is not None and self.gave_up is None:
            self.gave_up = guard.gave_up
            rank_zero_warn(f"VarianceMonitorCallback: {self.gave_up}; stopping")
            trainer.should_stop = True
        elif guard.rolled_back:
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
            self.monitor.close()  # detached from the optimizer; the records stay
        if stage == "fit" and self.guard is not None:
            self.guard.close()  # the snapshots of the module go; guard.rescues stays

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
