"""One training loop: seeds, checkpoint/resume, DDP, the variance monitor, metrics.

``train(config, out_dir, progress=True, inputs=None) -> summary`` trains ``config.model`` on ``config.dataset``
with SGD (momentum; weight decay not on norm parameters, biases and PWS alpha), a MultiStepLR schedule and the
config's loss (cross-entropy by default), and reports its metric (accuracy by default: the ``*_acc`` values are the
metric's, fractions in [0, 1] for accuracy). ``inputs``: what :func:`~normlab.runner.training.setup.prepare` built
for this config (its data and model), so that a command loads and builds once; without it the trainer prepares them.

Files in ``out_dir`` (only rank 0 writes, every file atomically):

- ``checkpoint.pt``: model, optimizer, scheduler, RNG states, history, :class:`TrainState` and the monitor's state;
  written before training and after every epoch. ``train`` again with the same ``out_dir`` resumes from it and
  ends with exactly the metrics (and monitor alarm) of an uninterrupted run; a finished run returns its summary.
- ``metrics.jsonl``: one line per evaluation (``evals_per_epoch`` per epoch): ``epoch`` (fractional within an
  epoch), ``step``, ``train_loss``/``train_acc`` since the previous evaluation, ``test_loss``, ``test_acc``
  (eval mode), ``test_acc_train_mode`` (with ``eval_train_mode``), ``lr``, ``time_s``.
- ``loss_trace.json``: the training loss of every step and the window of the smoothed loss.
- ``monitor.jsonl``: the :class:`~normlab.monitor.VarianceMonitor` records when ``monitor_every > 0``.
- ``summary.json``: the returned summary.

``train(..., tensorboard=DIR)`` also writes the run's loss (every step), evaluations and learning rate and the
monitor's records to TensorBoard event files in ``DIR`` (:mod:`normlab.integrations.tensorboard`; a resumed run
purges the events after its checkpoint).

Mixed precision (``amp``): the forward pass and the loss run under ``torch.autocast``, bfloat16 on CPU and float16
on CUDA with a ``GradScaler`` (its state is checkpointed); normlab's layers keep float32 statistics and running
buffers under autocast; evaluation runs in float32.

Collapse (:mod:`normlab.monitor.collapse`, over about 1,024 examples against the task's chance loss): a non-finite
loss stops the run and the checkpoint keeps the last good weights; an exploded loss or a return to chance is recorded
and training goes on, unless ``stop_on="confirmed"`` and the monitor has raised its alarm: then the alarm is
confirmed and the run stops there (``stopped_early``); with ``stop_on="alarm"`` the alarm alone stops it. A net that
never left chance is judged at the end. With ``guard`` a :class:`~normlab.monitor.CollapseGuard` at the library's
defaults watches the optimizer's steps (checking every step: the loop reads its loss anyway) and rolls failures back.

DDP: under ``torchrun`` (``WORLD_SIZE > 1``) the loop joins a gloo (CPU) / nccl (CUDA) process group, shards each
epoch with ``DistributedSampler`` (``batch_size`` is per process), wraps the model in
``DistributedDataParallel`` and averages the train metrics over ranks; the guard's rollbacks happen on every rank
at the same step.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from normlab.monitor import (
    CollapseCriteria,
    CollapseGuard,
    Event,
    Failure,
    RecordSchedule,
    RescueOptions,
    RunCollapsed,
    VarianceMonitor,
    load_log,
    scaler_step,
    write_monitor_log,
)
from normlab.monitor.collapse import CollapseTracker
from normlab.nn import param_groups
from normlab.runner.errors import RunError, UsageError
from normlab.runner.io import (
    atomic_torch_save,
    atomic_write_json,
    atomic_write_text,
    from_fields,
    json_line,
    remove_stale_temps,
)
from normlab.runner.training.config import TrainConfig, resolve_device
from normlab.runner.training.evaluation import evaluate, evaluate_train_mode
from normlab.runner.training.setup import RunInputs, prepare, seed_everything, steps_per_epoch

__all__ = [
    "train",
    "Trainer",
    "TrainState",
    "CHECKPOINT_FORMAT",
    "read_checkpoint",
    "seed_everything",
    "eval_marks",
]

CHECKPOINT_FORMAT = 1


@dataclass
class TrainState:
    """The counters a checkpoint carries besides the weights (plain Python values)."""

    epoch: int = 0
    finished: bool = False
    collapse_epoch: int | None = None
    collapse_step: int | None = None
    collapse_reason: str | None = None
    monitor_alarm: dict | None = None
    monitor_risk: dict | None = None  # the monitor's regime warning (the regime rule's event) as a dict, once raised
    monitor_events: list = dataclasses.field(default_factory=list)  # [rule, step] of the events in monitor.jsonl
    epochs_to_target: int | None = None
    step_time_total: float = 0.0
    steps_total: int = 0
    monitor_lines: int = 0
    world_size: int = 1
    rescues: list = dataclasses.field(default_factory=list)  # --guard: CollapseGuard.rescues as dicts
    guard: dict | None = None  # --guard: CollapseGuard.state_dict()
    guard_gave_up: str | None = None
    stopped_early: str | None = None  # why the run stopped before its last epoch (non_finite, confirmed, ...)
    num_classes: int | None = None  # of the data (None: not a classification, or not known)
    learned: bool = False  # the smoothed loss has been below LEARNED x its reference (normlab.monitor.collapse)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainState:
        return from_fields(cls, d, "checkpoint state")


@dataclass
class _Window:
    """Training loss and accuracy since the last evaluation; why the epoch stopped early, if it did."""

    loss_sum: float = 0.0
    correct: float | None = 0.0  # the metric summed over the samples (None: no metric)
    seen: float = 0.0
    collapse: str | None = None
    alarm: dict | None = None
    started: float = dataclasses.field(default_factory=time.perf_counter)

    @property
    def stopped(self) -> bool:
        return self.collapse is not None or self.alarm is not None


def eval_marks(n_steps: int, evals_per_epoch: int) -> list[int]:
    """Steps of an epoch (counted from 1) after which the test set is evaluated; the last is ``n_steps``."""
    k = max(1, min(evals_per_epoch, n_steps))
    return sorted({max(1, round(n_steps * j / k)) for j in range(1, k + 1)})


def _dist_setup(device: torch.device) -> tuple[int, int, torch.device]:
    """(world size, rank, device); joins the torchrun process group when WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 1, 0, device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return dist.get_world_size(), dist.get_rank(), device


def read_checkpoint(path: str | os.PathLike) -> dict:
    """A run's ``checkpoint.pt`` read with ``torch.load(weights_only=True)`` on the CPU.

    Raises:
        ValueError: saying what is wrong (unreadable, or not a normlab checkpoint of this format).
    """
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"corrupt or unreadable ({type(e).__name__})") from None
    if not isinstance(ck, dict) or ck.get("format") != CHECKPOINT_FORMAT or not isinstance(ck.get("config"), dict):
        raise ValueError(f"not a normlab checkpoint (format {CHECKPOINT_FORMAT})")
    return ck


def _load_checkpoint(path: Path) -> dict:
    try:
        return read_checkpoint(path)
    except ValueError as e:
        raise RunError(
            f"train: checkpoint {path} is {e}; refusing to restart over existing results - move it "
            f"away or use another output directory"
        ) from None


def _alarm_dict(alarm: Event) -> dict:
    """rule, layer, step, quantity, value, initial (the baseline of a variance rule's alarm, else None) of a monitor
    alarm."""
    d = alarm.to_dict()
    out = {k: d[k] for k in ("rule", "layer", "step", "quantity", "value")}
    return {**out, "initial": d["details"].get("baseline")}


def _regime_dict(event: Event) -> dict:
    """The regime rule's warning as the summary's ``monitor_risk``: step, layer and the rule's details (shift_term,
    variance_term, ratio, case, suggestion, suggested_lr)."""
    d = event.to_dict()
    return {"step": d["step"], "layer": d["layer"], **d["details"]}


def _progress_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=True)


def _fmt(v) -> str:
    return "nan" if v is None else f"{v:.4f}"


class Trainer:
    """One run of :func:`train`: set-up or resume, epochs, evaluation, checkpoints, summary."""

    def __init__(
        self,
        config: TrainConfig,
        out_dir: str | os.PathLike,
        progress: bool = True,
        tensorboard: str | os.PathLike | None = None,
        inputs: RunInputs | None = None,
    ) -> None:
        if not isinstance(config, TrainConfig):
            raise TypeError(f"train: config must be a TrainConfig, got {type(config).__name__}")
        self.config = config.validate()
        self.cfg = config.to_dict()
        self.out = Path(out_dir)
        self.progress = progress
        self.world, self.rank, self.device = _dist_setup(resolve_device(config.device))
        self.is_main = self.rank == 0
        self.inputs = inputs
        self.state = TrainState(world_size=self.world)
        self.history: list[dict] = []
        self.losses: list[float | None] = []  # training loss of every step (None: not finite)
        self.monitor: VarianceMonitor | None = None
        self._monitor_written = 0
        self.tensorboard = tensorboard
        self.board = None
        self.scaler = None
        self.guard: CollapseGuard | None = None

    # -- paths ---------------------------------------------------------------------------------------------
    @property
    def checkpoint_path(self) -> Path:
        return self.out / "checkpoint.pt"

    @property
    def metrics_path(self) -> Path:
        return self.out / "metrics.jsonl"

    @property
    def summary_path(self) -> Path:
        return self.out / "summary.json"

    @property
    def monitor_path(self) -> Path:
        return self.out / "monitor.jsonl"

    # -- the run -------------------------------------------------------------------------------------------
    def run(self) -> dict:
        """Train (or resume, or return the finished run) and return the summary."""
        ck = self._existing_checkpoint()
        if ck is not None and ck["state"]["finished"]:
            self.history, self.state = list(ck["history"]), TrainState.from_dict(ck["state"])
            return self._write_summary()
        try:
            self._build(ck)
            if ck is not None:
                self._restore(ck)
            else:
                self._start()
            self._make_guard()
            for epoch in range(self.state.epoch, self.config.epochs):
                if self._end_epoch(epoch, self._train_epoch(epoch)):
                    break
        finally:
            if self.monitor is not None:
                self.monitor.close()
            if self.board is not None:
                self.board.close()
        return self._write_summary()

    def _existing_checkpoint(self) -> dict | None:
        """The checkpoint to resume from (checked against this config), or None for a fresh directory."""
        if not self.checkpoint_path.exists():
            if self.metrics_path.exists() or self.summary_path.exists():
                raise RunError(
                    f"train: {self.out} holds results ({self.metrics_path.name} / {self.summary_path.name}) but no "
                    f"checkpoint.pt; refusing to overwrite them - use another output directory"
                )
            return None
        ck = _load_checkpoint(self.checkpoint_path)
        diff = self.config.differences(ck["config"])
        if diff:
            raise UsageError(
                f"train: {self.checkpoint_path} was written by a different config ({', '.join(diff)}); "
                f"use another output directory"
            )
        saved_world = ck["state"].get("world_size", 1)
        if saved_world != self.world and not ck["state"]["finished"]:
            raise UsageError(
                f"train: {self.checkpoint_path} was written by {saved_world} process(es), now {self.world}: the data "
                f"order would differ; resume with the same number of processes"
            )
        return ck

    # -- set-up --------------------------------------------------------------------------------------------
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.config, len(self.train_ds), self.world)

    def _build(self, ck: dict | None = None) -> None:
        cfg = self.config
        inputs = self.inputs if self.inputs is not None else prepare(cfg, world=self.world)
        self.inputs = None  # the model is this run's from here on; a second run() prepares again
        self.train_ds, self.test_ds, self.task = inputs.train, inputs.test, inputs.task
        self.per_rank = len(self.train_ds) // self.world
        torch.set_rng_state(inputs.rng)  # as right after the model was built (a resumed run restores its own)
        self.raw_model = inputs.model.to(self.device)
        self.model = self.raw_model
        if self.world > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = torch.nn.parallel.DistributedDataParallel(self.raw_model, device_ids=ids)
        groups = param_groups(
            self.raw_model, cfg.weight_decay, no_decay=() if not cfg.nowd_norm_alpha else ("alpha", "norm", "bias")
        )
        self.optimizer = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, foreach=True)
        self.scheduler = torch.optim.lr_scheduler.MultiStepLR(self.optimizer, list(cfg.milestones), cfg.lr_gamma)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.state.num_classes = inputs.info["num_classes"]
        # the failure taxonomy over about 1,024 examples, against the task's chance loss (ln C for cross-entropy over
        # C classes; estimated from the first loss otherwise): the run's label; the guard reads it too
        chance = self.task.chance_loss(self.state.num_classes)
        self.criteria = CollapseCriteria.over_examples(cfg.batch_size, chance_loss=chance)
        self.tracker = CollapseTracker(self.criteria)
        if cfg.amp and self.device.type == "cuda":
            self.scaler = torch.amp.GradScaler("cuda")
        if self.tensorboard is not None and self.is_main:
            from normlab.integrations.tensorboard import MonitorBoard

            # a resumed run drops the events written after its checkpoint
            self.board = MonitorBoard(self.tensorboard, purge_step=ck["state"]["steps_total"] if ck else None)
        if cfg.monitor_every > 0:
            schedule = RecordSchedule(cfg.monitor_every, cfg.monitor_dense_steps, cfg.monitor_dense_every)
            self.monitor = VarianceMonitor(self.raw_model, every=schedule, optimizer=self.optimizer)
            if self.board is not None:  # the run's board: the monitor's records and events beside the run's scalars
                self.monitor.add_sink(MonitorBoard(self.board.writer))

    def _snapshot(self) -> dict:
        if self.guard is not None:
            self.state.guard = self.guard.state_dict()
        return {
            "format": CHECKPOINT_FORMAT,
            "config": self.cfg,
            "model": self.raw_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "generator": self.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "history": copy.deepcopy(self.history),
            "losses": list(self.losses),
            "state": self.state.to_dict(),
            "monitor": self.monitor.state_dict() if self.monitor is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def _start(self) -> None:
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            self.monitor_path.unlink(missing_ok=True)
            atomic_torch_save(self._snapshot(), self.checkpoint_path)

    def _restore(self, ck: dict) -> None:
        self.raw_model.load_state_dict(ck["model"])
        self.optimizer.load_state_dict(ck["optimizer"])
        self.scheduler.load_state_dict(ck["scheduler"])
        self.generator.set_state(ck["generator"])
        torch.set_rng_state(ck["torch_rng"])
        if ck["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(ck["cuda_rng"])
        self.history = list(ck["history"])
        self.losses = list(ck.get("losses", []))
        for value in self.losses:  # the collapse tracker is a function of the loss trace
            self.tracker.update(value)
        self.state = TrainState.from_dict({**ck["state"], "world_size": self.world})
        if self.scaler is not None and ck.get("scaler"):
            self.scaler.load_state_dict(ck["scaler"])
        if self.monitor is not None:
            if ck.get("monitor") is not None:
                self.monitor.load_state_dict(ck["monitor"])  # the same alarms as without the interruption
            else:  # an older checkpoint: records land on the same steps, baselines restart
                self.monitor.current_step = self.state.steps_total
        if self.is_main:
            remove_stale_temps(self.out)
            self._write_metrics()
            if self.monitor_path.exists():  # drop monitor records written after the checkpoint
                lines = self.monitor_path.read_text().splitlines(keepends=True)[: self.state.monitor_lines]
                atomic_write_text(self.monitor_path, "".join(lines))

    # -- one epoch -----------------------------------------------------------------------------------------
    def _epoch_order(self, epoch: int) -> tuple[torch.Tensor, torch.Generator]:
        """Sample order of this epoch and the generator for augmentation (per rank under DDP)."""
        if self.world == 1:
            return torch.randperm(len(self.train_ds), generator=self.generator), self.generator
        sampler = torch.utils.data.distributed.DistributedSampler(
            range(len(self.train_ds)),
            num_replicas=self.world,
            rank=self.rank,
            shuffle=True,
            seed=self.config.seed,
            drop_last=True,
        )
        sampler.set_epoch(epoch)
        aug = torch.Generator().manual_seed(self.config.seed * 100_003 + epoch * 1009 + self.rank)
        return torch.tensor(list(sampler), dtype=torch.long), aug

    def _all_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(t)
        return t.tolist()

    def _step(self, x: torch.Tensor, y: torch.Tensor):
        """One SGD step; returns (outputs, loss value), or (None, None) when the loss is not finite on any rank.

        Under DDP the loss value is the mean over ranks, so every rank judges collapse alike. With ``amp`` the
        forward pass and the loss run under autocast."""
        amp_dtype = torch.float16 if self.device.type == "cuda" else torch.bfloat16
        with torch.autocast(self.device.type, dtype=amp_dtype, enabled=self.config.amp):
            out = self.model(x)
            loss = self.task.loss_fn(out, y)
        value = loss.item()
        if self.world > 1:
            finite = math.isfinite(value)
            total, bad = self._all_sum([value if finite else 0.0, 0.0 if finite else 1.0])
            value = total / self.world if bad == 0 else math.nan
        if self.guard is not None:
            return self._guarded_step(out, loss, value)
        if not math.isfinite(value):
            return None, None
        self.optimizer.zero_grad(set_to_none=True)
        if self.monitor is not None:
            self.monitor.observe_loss(value)  # the value read above: no second host read
        self._backward_and_step(loss)
        return out, value

    def _backward_and_step(self, loss: torch.Tensor) -> None:
        """Backward and the optimizer step, through the GradScaler (float16 on CUDA) when there is one; the monitor
        and the guard attached to the optimizer see the step."""
        if self.scaler is None:
            loss.backward()
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            scaler_step(self.scaler, self.optimizer)

    # -- the guard (--guard) -------------------------------------------------------------------------------
    def _make_guard(self) -> None:
        """A CollapseGuard over the model, optimizer, monitor and scaler at the library's defaults, counting the
        run's optimizer steps and checking every step (the loop reads its loss every step anyway); the failure
        taxonomy's window is the run's; with ``guard_dead`` it knows chance (ln of the number of classes), else it
        estimates it by the first loss. Under DDP every rank has one and they roll back together."""
        if not self.config.guard:
            return
        chance = self.criteria.chance_loss if self.config.guard_dead else None
        self.guard = CollapseGuard(
            self.raw_model,
            self.optimizer,
            self.monitor,
            rescue=RescueOptions(check_every=1),
            criteria=dataclasses.replace(self.criteria, chance_loss=chance),
            scaler=self.scaler,
        )
        saved = self.state.guard or {"rescues": self.state.rescues}
        self.guard.load_state_dict({**saved, "steps": self.state.steps_total})

    def _guarded_step(self, out, loss: torch.Tensor, value: float):
        """The step through the guard: (outputs, loss) when it was kept, (None, "rescued") after a rollback. A
        non-finite loss takes no backward: the step changes nothing, and the guard, seeing the loss, rolls back."""
        self.optimizer.zero_grad(set_to_none=True)
        self.guard.observe_loss(value)  # the value read above: no second host read
        if math.isfinite(value):
            self._backward_and_step(loss)
        else:
            self.optimizer.step()
        if not self.guard.rolled_back:
            return out, value
        self._after_rescue()
        return None, "rescued"

    def _after_rescue(self) -> None:
        """Bring the run's own state to the guard's rollback: step count, rescues, the loss trace and the collapse
        tracker. The learning rate is the guard's: the epoch schedule is not given to the guard, so the guard keeps
        this epoch's rate times its factor (the snapshot may be from before a milestone)."""
        st = self.state
        st.steps_total = self.guard.steps
        st.rescues = [r.to_dict() for r in self.guard.rescues]
        self.losses = _first_steps(self.losses, st.steps_total)
        self.tracker = CollapseTracker(self.criteria)
        for v in self.losses:  # the collapse tracker is a function of the (rolled back) loss trace
            self.tracker.update(v)

    def _alarm_stops(self) -> dict | None:
        """The alarm that stops training now (``stop_on="alarm"``), the same decision on every rank."""
        if self.monitor is None or self.config.stop_on != "alarm":
            return None
        alarmed = self.monitor.alarm is not None
        if self.world > 1:
            alarmed = self._all_sum([float(alarmed)])[0] > 0
        if not alarmed:
            return None
        return _alarm_dict(self.monitor.alarm) if self.monitor.alarm is not None else {"layer": "another rank"}

    def _confirmed(self) -> bool:
        """``stop_on="confirmed"``: the monitor has raised its alarm and the loss has collapsed (the tracker found a
        return to chance, or to the starting loss); the same decision on every rank (the loss is the ranks' mean)."""
        if self.monitor is None or self.config.stop_on != "confirmed" or self.tracker.kind is None:
            return False
        alarmed = self.monitor.alarm is not None
        if self.world > 1:
            alarmed = self._all_sum([float(alarmed)])[0] > 0
        return alarmed

    def _bar_metric(self, win: _Window) -> dict:
        """The progress bar's metric since the last evaluation (accuracy in percent, as the summary line gives it)."""
        if win.correct is None:
            return {}
        if self.config.metric == "accuracy":
            return {"train_acc": f"{100 * win.correct / win.seen:.1f} %"}
        return {self.config.metric.rsplit(":", 1)[-1]: f"{win.correct / win.seen:.4g}"}

    def _train_step(self, batch, win: _Window) -> None:
        """One step of training on ``batch``: losses, collapse tracking, the window's sums."""
        t0 = time.perf_counter()
        x, y = (t.to(self.device) for t in batch)
        try:
            out, value = self._step(x, y)
        except RunCollapsed as e:  # --guard gave up: a collapse the rescues did not save; the run stops here
            self.state.guard_gave_up = str(e)
            if e.kind == "non_finite":
                win.collapse = "non_finite"
                self.tracker.failure = Failure("non_finite", self.state.steps_total)
            elif self.monitor is not None and self.monitor.alarm is not None:
                win.alarm = _alarm_dict(self.monitor.alarm)
            else:  # another failure: recorded as the guard's, the run stops
                win.collapse = "guard_gave_up"
            return
        if value == "rescued":
            return
        elapsed = time.perf_counter() - t0  # the step's cost, without the logging below
        self.losses.append(value)
        if self.board is not None:
            self.board.write_scalars({"step_loss": value}, self.state.steps_total)
        if self.tracker.update(value) is not None and self.tracker.kind == "non_finite":
            win.collapse = "non_finite"
        if out is None:
            return
        self.state.step_time_total += elapsed
        self.state.steps_total += 1
        win.loss_sum += value * len(y)
        if win.correct is not None:
            right = self.task.metric_sum(out.detach(), y)
            win.correct = None if right is None else win.correct + right.item()
        win.seen += len(y)
        win.alarm = self._alarm_stops()
        if win.alarm is None and self._confirmed():
            win.collapse = "confirmed"

    def _train_epoch(self, epoch: int) -> _Window:
        """Train one epoch, evaluating at :func:`eval_marks`; returns the window since the last evaluation."""
        cfg, win = self.config, _Window()
        self.model.train()
        order, gen = self._epoch_order(epoch)
        n_steps = self.steps_per_epoch()
        marks = set(eval_marks(n_steps, cfg.evals_per_epoch)) - {n_steps}
        bar = _progress_bar(n_steps, f"epoch {epoch + 1}/{cfg.epochs}", self.progress and self.is_main)
        for step in range(n_steps):
            self._train_step(self.train_ds.batch(order[step * cfg.batch_size : (step + 1) * cfg.batch_size], gen), win)
            if bar is not None:
                bar.update(1)
                if win.seen:
                    bar.set_postfix(loss=f"{win.loss_sum / win.seen:.4f}", **self._bar_metric(win))
            if win.stopped:
                break
            if step + 1 in marks:
                self.history.append(self._eval_entry(epoch + (step + 1) / n_steps, win))
                self._board_entry(self.history[-1])
                self.model.train()
                win = _Window()
        if bar is not None:
            bar.close()
        return win

    # -- evaluation and the end of an epoch ----------------------------------------------------------------
    def _eval_entry(self, epoch: float, win: _Window) -> dict:
        """Evaluate on the test set (eval mode, and train mode when asked) and describe the window."""
        has_metric = win.correct is not None
        win.loss_sum, correct, win.seen = self._all_sum([win.loss_sum, win.correct or 0.0, win.seen])
        win.correct = correct if has_metric else None
        if self.world > 1:  # running statistics are per process: evaluate and save rank 0's everywhere
            for buf in self.raw_model.buffers():
                dist.broadcast(buf, 0)
        test_loss, test_acc = evaluate(self.raw_model, self.test_ds, self.device, self.task)
        entry = {
            "epoch": round(epoch, 4) if epoch != int(epoch) else int(epoch),
            "step": self.state.steps_total,
            "train_loss": win.loss_sum / win.seen if win.seen and win.collapse != "non_finite" else None,
            "train_acc": win.correct / win.seen if win.seen and win.correct is not None else None,
            "test_loss": test_loss if math.isfinite(test_loss) else None,
            "test_acc": test_acc,
            "lr": self.optimizer.param_groups[0]["lr"],
            "time_s": time.perf_counter() - win.started,
        }
        if self.config.eval_train_mode:
            entry["test_acc_train_mode"] = evaluate_train_mode(
                self.raw_model, self.test_ds, self.device, self.config.batch_size, task=self.task
            )
        return entry

    def _board_entry(self, entry: dict) -> None:
        """An evaluation's numbers (train/test loss and accuracy, lr) as TensorBoard scalars at its step."""
        if self.board is not None:
            self.board.write_scalars(
                {k: v for k, v in entry.items() if k not in ("epoch", "step", "time_s")}, entry["step"]
            )
            self.board.flush()

    def _flush_monitor(self) -> None:
        """Append the monitor records of this epoch and the events not logged yet to monitor.jsonl."""
        mon, st = self.monitor, self.state
        if mon is None or not self.is_main:
            return
        if mon.alarm is not None and st.monitor_alarm is None:
            st.monitor_alarm = _alarm_dict(mon.alarm)
        regime = next((e for e in mon.events if e.rule == "regime"), None)
        if regime is not None and st.monitor_risk is None:
            st.monitor_risk = _regime_dict(regime)
        logged = {(rule, step) for rule, step in st.monitor_events}
        events = [e for e in mon.events if (e.rule, e.step) not in logged]
        st.monitor_events += [[e.rule, e.step] for e in events]
        if len(mon.records) < self._monitor_written:  # the guard rolled back past records already in the file
            kept = load_log(self.monitor_path).events if self.monitor_path.exists() else []
            st.monitor_lines = write_monitor_log(self.monitor_path, mon.records, kept)
            self._monitor_written = len(mon.records)
        new = mon.records[self._monitor_written :]
        st.monitor_lines += write_monitor_log(self.monitor_path, new, events, append=True)
        self._monitor_written = len(mon.records)

    def _rescue_non_finite_test_loss(self, epoch: int) -> bool:
        """--guard: a non-finite test loss is trouble the guard did not see in the training losses (a model that
        overflows on other inputs); True when it rolled the run back, False when it gave up."""
        try:
            self.guard.report(f"non-finite test loss after epoch {epoch + 1}")
        except RunCollapsed as e:
            self.state.guard_gave_up = str(e)
            return False
        self._after_rescue()
        return True

    def _mark_collapse(self, epoch: int, entry: dict, win: _Window, last_epoch: bool) -> bool:
        """Record the first collapse (see :mod:`normlab.monitor.collapse`); True when training must stop.

        A non-finite loss stops the run (and an alarm with ``stop_on="alarm"``, an alarm and a collapse with
        ``stop_on="confirmed"``); a return to chance alone is recorded and the run goes on (nets at a high learning
        rate sometimes recover); a dead net is judged at the end. ``stopped_early`` says why a run stopped.
        """
        st, tracker = self.state, self.tracker
        if tracker.kind is None and entry["test_loss"] is None and not entry.get("rescued"):
            tracker.failure = Failure("non_finite", st.steps_total)
        if tracker.kind is None and last_epoch:
            tracker.finish()
        if tracker.kind is not None and st.collapse_reason is None:
            reason = "non_finite_loss" if tracker.kind == "non_finite" else tracker.kind
            st.collapse_epoch, st.collapse_step, st.collapse_reason = epoch + 1, tracker.step, reason
        if win.alarm is not None and st.collapse_reason is None:
            st.collapse_epoch, st.collapse_step, st.collapse_reason = epoch + 1, win.alarm.get("step"), "monitor_alarm"
            st.monitor_alarm = st.monitor_alarm or win.alarm
        if win.collapse == "guard_gave_up" and st.collapse_reason is None:
            st.collapse_epoch, st.collapse_step, st.collapse_reason = epoch + 1, st.steps_total, "guard_gave_up"
        stop = {
            "non_finite": tracker.kind == "non_finite",
            "alarm": win.alarm is not None,
            "guard_gave_up": win.collapse == "guard_gave_up",
            "confirmed": win.collapse == "confirmed",
        }
        st.stopped_early = st.stopped_early or next((why for why, now in stop.items() if now), None)
        return any(stop.values())

    def _end_epoch(self, epoch: int, win: _Window) -> bool:
        """Evaluate, record, checkpoint; True when training stops here (collapse or alarm)."""
        entry = self._eval_entry(epoch + 1, win)
        self.scheduler.step()
        self.history.append(entry)
        self._board_entry(entry)
        st = self.state
        st.epoch = epoch + 1
        st.learned = self.tracker.learned
        last = epoch + 1 == self.config.epochs  # after the last epoch a rollback would leave an untrained model
        if entry["test_loss"] is None and self.guard is not None and st.guard_gave_up is None and not last:
            entry["rescued"] = self._rescue_non_finite_test_loss(epoch)
        target = self.config.target_acc
        if st.epochs_to_target is None and target is not None and entry["test_acc"] >= target and not win.stopped:
            st.epochs_to_target = epoch + 1
        self._flush_monitor()
        stop = self._mark_collapse(epoch, entry, win, epoch + 1 == self.config.epochs)
        st.finished = stop or epoch + 1 == self.config.epochs
        if self.is_main:
            self._save_epoch(keep_last_good=stop)
        if self.world > 1:
            dist.barrier()
        return stop

    def _save_epoch(self, keep_last_good: bool) -> None:
        if keep_last_good:  # keep the last good weights on disk; record the collapse in their history
            good = torch.load(self.checkpoint_path, map_location="cpu", weights_only=True)
            good["history"], good["state"] = copy.deepcopy(self.history), self.state.to_dict()
            good["losses"] = list(self.losses)
            atomic_torch_save(good, self.checkpoint_path)
        else:
            atomic_torch_save(self._snapshot(), self.checkpoint_path)
        self._write_metrics()

    def _write_metrics(self) -> None:
        atomic_write_text(self.metrics_path, "".join(json_line(h) + "\n" for h in self.history))
        atomic_write_json(
            self.out / "loss_trace.json", {"window": self.criteria.window, "losses": self.losses}, indent=None
        )

    def _write_summary(self) -> dict:
        st, hist = self.state, self.history
        if self.guard is not None:
            st.guard = self.guard.state_dict()
        accs = [h["test_acc"] for h in hist if h.get("test_acc") is not None]
        summary = {
            "config": self.cfg,
            "final_test_acc": hist[-1]["test_acc"] if hist else None,
            "final_test_loss": hist[-1]["test_loss"] if hist else None,
            "final_train_loss": next(
                (h["train_loss"] for h in reversed(hist) if h.get("train_loss") is not None), None
            ),
            "best_test_acc": max(accs) if accs else None,
            "collapsed": st.collapse_epoch is not None,
            "learned": st.learned,
            "collapse_epoch": st.collapse_epoch,
            "collapse_step": st.collapse_step,
            "collapse_reason": st.collapse_reason,
            "stopped_early": st.stopped_early,
            "monitor_alarm": st.monitor_alarm,
            "monitor_risk": st.monitor_risk,
            "epochs_to_target": st.epochs_to_target,
            "step_time_s": st.step_time_total / st.steps_total if st.steps_total else None,
            "final_test_acc_train_mode": hist[-1].get("test_acc_train_mode") if hist else None,
            "steps_run": st.steps_total,
            "epochs_run": st.epoch,
            "rescues": list(st.rescues),
            "steps_lost": sum(r["steps_lost"] for r in st.rescues),
            "guard_gave_up": st.guard_gave_up,
            "alarms_dismissed": list((st.guard or {}).get("dismissed", [])),
            "world_size": st.world_size,
            "num_classes": st.num_classes,
            "history": hist,
        }
        if self.is_main:
            atomic_write_json(self.summary_path, summary, indent=2)
        return summary


def _first_steps(losses: list, steps: int) -> list:
    """The loss trace up to (and including) its ``steps``-th finite entry (None entries are steps not taken)."""
    seen = 0
    for i, v in enumerate(losses):
        if seen == steps:
            return losses[:i]
        seen += v is not None
    return list(losses)


def train(
    config: TrainConfig,
    out_dir: str | os.PathLike,
    progress: bool = True,
    tensorboard: str | os.PathLike | None = None,
    inputs: RunInputs | None = None,
) -> dict:
    """Train (or resume, or return the finished run in ``out_dir``) and return the summary dict.

    ``tensorboard``: a directory for TensorBoard event files of the run and its monitor (rank 0 writes them).
    ``inputs``: the run's data and model as :func:`~normlab.runner.training.setup.prepare` built them for ``config``
    (else the trainer prepares them).

    Summary keys: ``config, final_test_acc, best_test_acc`` (the metric's), ``final_test_loss, final_train_loss,
    collapsed, learned`` (the smoothed training loss went below ``LEARNED`` x its reference,
    :mod:`normlab.monitor.collapse`), ``collapse_epoch, collapse_reason, stopped_early`` (why the run stopped
    before its last epoch, or None), ``monitor_alarm, monitor_risk`` (the regime rule's warning as a dict, or None),
    ``epochs_to_target, step_time_s, epochs_run, world_size, num_classes, history``, and for ``guard``: ``rescues``
    (what :class:`~normlab.monitor.CollapseGuard` did, one dict per rescue), ``steps_lost``, ``guard_gave_up``
    (the message when it gave up, else None; a give-up on a loss climb is ``collapse_reason`` "guard_gave_up") and
    ``alarms_dismissed`` (the alarms the guard waited on and no trouble followed).

    Under ``torchrun`` (``WORLD_SIZE`` > 1) it joins the process group when none is initialised and destroys it
    before returning; a group the caller initialised stays the caller's.

    Raises:
        UsageError: a configuration that cannot work (before any training step), or an ``out_dir`` holding a run
            of another configuration.
        RunError: an unreadable checkpoint, or results without a checkpoint in ``out_dir``.
    """
    joined = not dist.is_initialized()  # train() joins the torchrun group itself: then it also leaves it
    finished = False
    try:
        summary = Trainer(config, out_dir, progress, tensorboard, inputs).run()
        finished = True
        return summary
    finally:
        if joined and dist.is_initialized():
            _leave_group(finished)


def _leave_group(finished: bool) -> None:
    """Destroy the process group :func:`train` created (all ranks first meet at a barrier when the run finished).

    A gloo group left alive to interpreter exit can abort the process (SIGABRT, "terminate called without an active
    exception") while its worker threads still hold work; a failed rank does not wait for the others.
    """
    if finished:
        dist.barrier()
    dist.destroy_process_group()
