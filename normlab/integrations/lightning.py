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

Scalars go to the module's loggers from rank 0 (``logger.log_metrics`` at the monitor's step; tags as in
:mod:`normlab.integrations.tensorboard`: ``output_var/<layer>``, ``shift/<layer>``, ...);
``callback.monitor.records`` holds every record. Lightning
checkpoints carry the monitor's state (step counter, alarm baselines). Needs ``pip install 'normlab[lightning]'``.
"""

from __future__ import annotations

import os
from typing import Any

from normlab.integrations.tensorboard import scalar_tags
from normlab.monitor import VarianceMonitor

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


class VarianceMonitorCallback(pl.Callback):
    """Record variance-transmission statistics of a LightningModule every ``every`` optimizer steps.

    Args:
        every: record on monitor steps 0, every, 2 * every, ... (a monitor step is a training batch in which the
            optimizer stepped).
        stop_on_alarm: stop the trainer (``trainer.should_stop``) when the collapse warning fires.
        log: log the recorded scalars through the module's logger.
        jsonl: write every record to this path when fitting ends (``normlab monitor PATH`` draws the figures).
        **monitor_kwargs: further :class:`~normlab.monitor.VarianceMonitor` arguments (``explode_factor``,
            ``include_norm``, ``tensorboard`` (written by rank 0 only), ...).

    Attributes:
        monitor: the :class:`~normlab.monitor.VarianceMonitor` of the current (or last) fit, None before.

    Example:
        >>> callback = VarianceMonitorCallback(every=10, stop_on_alarm=True)
        >>> callback.monitor is None        # attached when pl.Trainer(callbacks=[callback]).fit(module) starts
        True
    """

    def __init__(
        self,
        every: int = 10,
        stop_on_alarm: bool = False,
        log: bool = True,
        jsonl: str | os.PathLike | None = None,
        **monitor_kwargs: Any,
    ) -> None:
        super().__init__()
        self.every, self.stop_on_alarm, self.log_scalars, self.jsonl = every, stop_on_alarm, log, jsonl
        self.monitor_kwargs = monitor_kwargs
        self.monitor: VarianceMonitor | None = None
        self._stepping = False
        self._scale: float | None = None
        self._state: dict | None = None

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
        kwargs = dict(self.monitor_kwargs)
        if trainer.global_rank != 0:  # one writer per event directory: rank 0's
            kwargs.pop("tensorboard", None)
        self.monitor = VarianceMonitor(pl_module, every=self.every, **kwargs)
        if self._state is not None:
            self.monitor.load_state_dict(self._state)
            self._state = None
        self._stepping = False

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        if self.monitor is not None and not self._stepping:
            self.monitor.before_update()
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
        mon.after_update(stepped=self._scale is None or scale is None or scale >= self._scale)
        if not recording:
            return
        if self.log_scalars and trainer.is_global_zero:
            values = {tag: v for rec in mon.records[before:] for tag, v in scalar_tags(rec).items()}
            for logger in pl_module.loggers:  # at the monitor's step: the record's own x coordinate
                logger.log_metrics(values, step=mon.current_step - 1)
        if self.stop_on_alarm and trainer.strategy.reduce_boolean_decision(mon.alarm is not None, all=False):
            if not trainer.should_stop:
                rank_zero_warn(f"VarianceMonitorCallback: {mon.alarm or 'an alarm on another rank'}; stopping")
            trainer.should_stop = True

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is not None and self.jsonl is not None and trainer.is_global_zero:
            self.monitor.to_jsonl(self.jsonl)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.monitor is not None:
            self.monitor.close()  # hooks removed; the records stay

    def state_dict(self) -> dict[str, Any]:
        return {"monitor": self.monitor.state_dict()} if self.monitor is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("monitor")
        if state is not None and self.monitor is not None:
            self.monitor.load_state_dict(state)
        else:
            self._state = state
