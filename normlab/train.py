"""One training loop: seeds, checkpoint/resume, DDP, monitor hooks, metrics.

``train(config, out_dir, progress=True) -> summary`` trains ``config.model`` on ``config.dataset`` with SGD
(momentum, weight decay not on norm parameters / biases / PWS alpha), a MultiStepLR schedule and
cross-entropy. Accuracies are fractions in [0, 1] (``target_acc`` too).

Files in ``out_dir`` (only rank 0 writes):

- ``checkpoint.pt``: model, optimizer, scheduler, RNG states (torch global + the data-order generator),
  history and counters, and the monitor's state (step count, collapse baselines, alarm) when it is on;
  written atomically (temp file + ``os.replace``) before training and after every epoch. Calling ``train``
  again with the same ``out_dir`` resumes from it and ends with exactly the same metrics (and monitor alarm) as
  an uninterrupted run (CPU); a finished run just returns its summary.
- ``metrics.jsonl``: one JSON line per epoch (``epoch, train_loss, train_acc, test_loss, test_acc, lr,
  time_s``), rewritten atomically from the checkpointed history.
- ``monitor.jsonl``: the :class:`normlab.monitor.VarianceMonitor` records when ``monitor_every > 0``.
- ``summary.json``: the returned summary.

A non-finite loss (train or test) marks the run collapsed at that epoch and stops it; with
``stop_on_collapse`` a monitor alarm does the same (``collapse_reason`` says which). The checkpoint then
keeps the last good weights.

DDP: launched by ``torchrun`` (``WORLD_SIZE > 1``) the loop initialises a gloo (CPU) / nccl (CUDA) process
group, shards each epoch with ``DistributedSampler`` (``batch_size`` is per process), wraps the model in
``DistributedDataParallel`` and averages the train metrics over ranks.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from normlab.data import DATASETS, get_dataset
from normlab.models import MODEL_DIMS, MODELS, build_model
from normlab.nn import RenormSchedule
from normlab.utils import (
    atomic_torch_save,
    atomic_write_text,
    dumps_line,
    make_param_groups,
    resolve_device,
    seed_everything,
    to_jsonable,
)

CHECKPOINT_FORMAT = 1
# Config fields that may differ between a run and its resumption (they do not change the results).
_RESUME_FREE = ("num_workers", "data_dir")


@dataclass
class TrainConfig:
    """Everything that defines a training run (see module docstring).

    ``batch_size`` is per process under DDP; ``milestones`` are epochs after which the LR is multiplied by
    ``lr_gamma``; ``target_acc`` is a test-accuracy fraction for ``epochs_to_target``; ``max_steps_per_epoch``
    caps the optimizer steps per epoch (quick runs); ``monitor_every > 0`` attaches a VarianceMonitor.
    ``num_workers`` is accepted for API compatibility: all data sets are in-memory tensors and batches are
    gathered by index in the main process, so no loader workers are used. ``model_kwargs`` (an addition to
    the common contract) go to :func:`normlab.models.build_model`, e.g. ``{"blocks": 2}`` for the ResNets.
    ``brn_schedule`` sets the rmax/dmax schedule of every BatchRenorm layer: ``"paper"`` (identity for 5k steps,
    rmax 3 at 40k, dmax 5 at 25k: a short run never leaves the warm-up and BRN is BN) or ``"run"`` (default: the
    same schedule compressed so the final limits are reached halfway through this run,
    :meth:`normlab.nn.RenormSchedule.scaled`).
    """

    dataset: str = "digits"
    model: str = "plain"
    norm: str = "bn"
    conv: str = "conv"
    width: float = 1.0
    lr: float = 0.05
    batch_size: int = 64
    epochs: int = 10
    momentum: float = 0.9
    weight_decay: float = 5e-4
    nowd_norm_alpha: bool = True
    milestones: tuple = ()
    lr_gamma: float = 0.1
    seed: int = 0
    data_dir: str | None = None
    device: str = "cpu"
    monitor_every: int = 0
    stop_on_collapse: bool = False
    target_acc: float | None = None
    max_steps_per_epoch: int | None = None
    num_workers: int = 0
    model_kwargs: dict = field(default_factory=dict)
    brn_schedule: str = "run"

    def validate(self) -> None:
        """Raise ValueError naming the field for values that cannot work."""

        def bad(name, expected):
            raise ValueError(f"TrainConfig: {name} must be {expected}, got {getattr(self, name)!r}")

        if self.dataset not in DATASETS:
            raise ValueError(f"TrainConfig: unknown dataset {self.dataset!r}; valid names: {', '.join(DATASETS)}")
        if self.model not in MODELS:
            raise ValueError(f"TrainConfig: unknown model {self.model!r}; valid names: {', '.join(MODELS)}")
        if self.brn_schedule not in ("paper", "run"):
            bad("brn_schedule", "'paper' or 'run'")
        for name in ("batch_size", "epochs"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(name, "an int >= 1")
        for name in ("lr", "width", "lr_gamma"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                bad(name, "a finite number > 0")
        for name in ("momentum", "weight_decay"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                bad(name, "a finite number >= 0")
        if any((not isinstance(m, int)) or m < 1 for m in self.milestones) or list(self.milestones) != sorted(
            self.milestones
        ):
            bad("milestones", "increasing epoch numbers >= 1")
        if not isinstance(self.monitor_every, int) or self.monitor_every < 0:
            bad("monitor_every", "an int >= 0")
        if self.max_steps_per_epoch is not None and (
            not isinstance(self.max_steps_per_epoch, int) or self.max_steps_per_epoch < 1
        ):
            bad("max_steps_per_epoch", "None or an int >= 1")
        if self.target_acc is not None and not (0.0 <= self.target_acc <= 1.0):
            bad("target_acc", "None or a fraction in [0, 1]")
        if not isinstance(self.num_workers, int) or self.num_workers < 0:
            bad("num_workers", "an int >= 0")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            bad("seed", "an int >= 0")
        if not isinstance(self.model_kwargs, dict):
            bad("model_kwargs", "a dict")
        if self.device != "auto":
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError):
                bad("device", "a torch device string such as 'cpu', 'cuda', 'cuda:1' or 'auto'")

    def to_dict(self) -> dict:
        return to_jsonable(dataclasses.asdict(self))


def _dist_setup(device: torch.device):
    """(world_size, rank, device): joins the torchrun process group when WORLD_SIZE > 1 (gloo on CPU, nccl on
    CUDA, one GPU per process chosen by LOCAL_RANK)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 1, 0, device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return dist.get_world_size(), dist.get_rank(), device


def _evaluate(model, ds, device, batch_size=512):
    """Mean cross-entropy and accuracy of ``model`` (eval mode) on all of ``ds``."""
    model.eval()
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ds), batch_size):
            idx = torch.arange(start, min(start + batch_size, len(ds)))
            x, y = ds.batch(idx)
            x, y = x.to(device), y.to(device)
            out = model(x)
            loss_sum += F.cross_entropy(out, y, reduction="sum").item()
            correct += (out.argmax(1) == y).sum().item()
    return loss_sum / len(ds), correct / len(ds)


def _load_checkpoint(path: Path) -> dict:
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise RuntimeError(
            f"train: checkpoint {path} is corrupt or unreadable ({type(e).__name__}: {e}); "
            f"refusing to restart over existing results - move it away or use another out_dir"
        ) from e
    if not isinstance(ck, dict) or ck.get("format") != CHECKPOINT_FORMAT:
        raise RuntimeError(f"train: checkpoint {path} is not a normlab checkpoint (format {CHECKPOINT_FORMAT})")
    return ck


def _check_same_config(saved: dict, current: dict, path: Path) -> None:
    diff = sorted(
        k for k in set(saved) | set(current) if k not in _RESUME_FREE and saved.get(k) != current.get(k)
    )
    if diff:
        detail = ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in diff)
        raise ValueError(f"train: {path} was written by a different config ({detail}); use another out_dir")


def _summary(config_dict, history, state) -> dict:
    accs = [h["test_acc"] for h in history if h.get("test_acc") is not None]
    return {
        "config": config_dict,
        "final_test_acc": history[-1]["test_acc"] if history else None,
        "best_test_acc": max(accs) if accs else None,
        "collapsed": state["collapse_epoch"] is not None,
        "collapse_epoch": state["collapse_epoch"],
        "collapse_reason": state["collapse_reason"],
        "monitor_alarm": state["monitor_alarm"],
        "epochs_to_target": state["epochs_to_target"],
        "step_time_s": state["step_time_total"] / state["steps_total"] if state["steps_total"] else None,
        "epochs_run": len(history),
        "world_size": state["world_size"],
        "history": history,
    }


class _RemoteAlarm:
    """Stand-in when another DDP rank's monitor raised the alarm."""

    layer, step, quantity, value, initial = "another rank", None, None, None, None


def _alarm_dict(alarm) -> dict:
    """layer, step, quantity, value, initial of a monitor alarm (object or dict)."""
    get = alarm.get if isinstance(alarm, dict) else (lambda k: getattr(alarm, k, None))
    return to_jsonable({k: get(k) for k in ("layer", "step", "quantity", "value", "initial")})


def _set_renorm_schedule(model: torch.nn.Module, schedule: RenormSchedule) -> None:
    """Give every BatchRenorm layer that runs on a RenormSchedule (not on constant limits) ``schedule``."""
    for m in model.modules():
        if isinstance(getattr(m, "schedule", None), RenormSchedule):
            m.schedule = schedule


def train(config: TrainConfig, out_dir: str | os.PathLike, progress: bool = True) -> dict:
    """Train (or resume / return the finished run in ``out_dir``) and return the summary dict:

    ``config, final_test_acc, best_test_acc, collapsed, collapse_epoch, collapse_reason, monitor_alarm,
    epochs_to_target, step_time_s, epochs_run, world_size, history``.
    Bad configurations (unknown names, model too big for the input, batch larger than the data set)
    raise ValueError before any training step; a corrupt checkpoint raises RuntimeError.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"train: config must be a TrainConfig, got {type(config).__name__}")
    config.validate()
    out_dir = Path(out_dir)
    cfg = config.to_dict()
    world, rank, device = _dist_setup(resolve_device(config.device))
    is_main = rank == 0

    ckpt_path = out_dir / "checkpoint.pt"
    metrics_path, summary_path, monitor_path = (
        out_dir / "metrics.jsonl",
        out_dir / "summary.json",
        out_dir / "monitor.jsonl",
    )
    ck = None
    if ckpt_path.exists():
        ck = _load_checkpoint(ckpt_path)
        _check_same_config(ck["config"], cfg, ckpt_path)
        saved_world = ck["state"].get("world_size", 1)
        if saved_world != world and not ck["state"]["finished"]:
            raise ValueError(
                f"train: {ckpt_path} was written by {saved_world} process(es), now {world}: the data order would "
                f"differ; resume with the same number of processes"
            )
        if ck["state"]["finished"]:
            summary = _summary(cfg, ck["history"], ck["state"])
            if is_main:
                atomic_write_text(summary_path, json.dumps(to_jsonable(summary), indent=2))
            return summary
    elif metrics_path.exists() or summary_path.exists():
        raise RuntimeError(
            f"train: {out_dir} holds results ({metrics_path.name} / {summary_path.name}) but no checkpoint.pt; "
            f"refusing to overwrite them - use another out_dir"
        )

    # ---- data and model (all checks before the first step) ----
    train_ds, test_ds, info = get_dataset(config.dataset, config.data_dir)
    if config.batch_size > len(train_ds):
        raise ValueError(
            f"train: batch_size {config.batch_size} is larger than the {config.dataset} training set "
            f"({len(train_ds)} samples)"
        )
    per_rank = len(train_ds) // world
    if config.batch_size > per_rank:
        raise ValueError(
            f"train: batch_size {config.batch_size} per process is larger than the {per_rank} samples each of "
            f"{world} processes gets"
        )
    if len(info["input_shape"]) - 1 != MODEL_DIMS[config.model]:
        raise ValueError(
            f"train: model {config.model!r} takes {MODEL_DIMS[config.model]}-D inputs but dataset "
            f"{config.dataset!r} has samples of shape {tuple(info['input_shape'])}"
        )
    seed_everything(config.seed)
    raw_model = build_model(
        config.model, config.norm, config.conv, info["in_channels"], info["num_classes"], info["input_shape"],
        config.width, **config.model_kwargs,
    ).to(device)
    if config.brn_schedule == "run":
        steps_per_epoch = per_rank // config.batch_size
        if config.max_steps_per_epoch is not None:
            steps_per_epoch = min(steps_per_epoch, config.max_steps_per_epoch)
        _set_renorm_schedule(raw_model, RenormSchedule.scaled(config.epochs * steps_per_epoch // 2))
    model = raw_model
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            raw_model, device_ids=[device.index] if device.type == "cuda" else None
        )
    optimizer = torch.optim.SGD(
        make_param_groups(raw_model, config.weight_decay, config.nowd_norm_alpha),
        lr=config.lr,
        momentum=config.momentum,
    )
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, list(config.milestones), gamma=config.lr_gamma)
    gen = torch.Generator().manual_seed(config.seed)
    history: list[dict] = []
    state = {
        "epoch": 0,
        "finished": False,
        "collapse_epoch": None,
        "collapse_reason": None,
        "monitor_alarm": None,
        "epochs_to_target": None,
        "step_time_total": 0.0,
        "steps_total": 0,
        "monitor_lines": 0,
        "world_size": world,
    }

    mon = None
    if config.monitor_every > 0:
        try:
            from normlab.monitor import VarianceMonitor
        except ImportError as e:
            warnings.warn(f"train: monitor_every={config.monitor_every} but normlab.monitor is unavailable ({e})",
                          stacklevel=2)
        else:
            mon = VarianceMonitor(raw_model, every=config.monitor_every)

    def snapshot():
        return {
            "format": CHECKPOINT_FORMAT,
            "config": cfg,
            "model": raw_model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "generator": gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "history": copy.deepcopy(history),
            "state": dict(state),
            # optional key: checkpoints without it (older runs, no monitor) still load
            "monitor": mon.state_dict() if mon is not None and hasattr(mon, "state_dict") else None,
        }

    def write_metrics():
        atomic_write_text(metrics_path, "".join(dumps_line(h) + "\n" for h in history))

    if ck is not None:
        raw_model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        gen.set_state(ck["generator"])
        torch.set_rng_state(ck["torch_rng"])
        if ck["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(ck["cuda_rng"])
        history = list(ck["history"])
        state.update(ck["state"])
        state["world_size"] = world
        if mon is not None:
            if ck.get("monitor") is not None and hasattr(mon, "load_state_dict"):
                # step count, collapse baselines and a fired alarm: the same alarms as without the interruption
                mon.load_state_dict(ck["monitor"])
            else:
                # checkpoint without monitor state (older run): records land on the same steps, but the collapse
                # baseline restarts from the first step recorded after the resume
                mon.current_step = state["steps_total"]
        if is_main:
            write_metrics()
            if monitor_path.exists():  # drop monitor records written after the checkpoint
                lines = monitor_path.read_text().splitlines(keepends=True)[: state["monitor_lines"]]
                atomic_write_text(monitor_path, "".join(lines))
    elif is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        if monitor_path.exists():
            monitor_path.unlink()
        atomic_torch_save(snapshot(), ckpt_path)

    mon_written = 0

    sampler = None
    if world > 1:
        sampler = torch.utils.data.distributed.DistributedSampler(
            range(len(train_ds)), num_replicas=world, rank=rank, shuffle=True, seed=config.seed, drop_last=True
        )
        aug_gen = torch.Generator()

    def all_sum(values):
        t = torch.tensor(values, dtype=torch.float64)
        if world > 1:
            dist.all_reduce(t)
        return t.tolist()

    try:
        for epoch in range(state["epoch"], config.epochs):
            t0 = time.perf_counter()
            model.train()
            if sampler is not None:
                sampler.set_epoch(epoch)
                order = torch.tensor(list(sampler), dtype=torch.long)
                aug_gen.manual_seed(config.seed * 100_003 + epoch * 1009 + rank)
                g = aug_gen
            else:
                order = torch.randperm(len(train_ds), generator=gen)
                g = gen
            n_steps = len(order) // config.batch_size
            if config.max_steps_per_epoch is not None:
                n_steps = min(n_steps, config.max_steps_per_epoch)
            loss_sum, correct, seen, bad_loss, stop_alarm = 0.0, 0, 0, False, None
            lr = optimizer.param_groups[0]["lr"]
            bar = _progress_bar(n_steps, f"epoch {epoch + 1}/{config.epochs}", progress and is_main)
            for step in range(n_steps):
                ts = time.perf_counter()
                idx = order[step * config.batch_size : (step + 1) * config.batch_size]
                x, y = train_ds.batch(idx, g)
                x, y = x.to(device), y.to(device)
                out = model(x)
                loss = F.cross_entropy(out, y)
                finite = bool(torch.isfinite(loss))
                if world > 1:
                    (n_bad,) = all_sum([0.0 if finite else 1.0])
                    finite = n_bad == 0
                if not finite:
                    bad_loss = True
                    break
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if mon is not None:
                    mon.step(optimizer)
                else:
                    optimizer.step()
                state["step_time_total"] += time.perf_counter() - ts
                state["steps_total"] += 1
                loss_sum += loss.item() * len(y)
                correct += (out.argmax(1) == y).sum().item()
                seen += len(y)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss_sum / seen:.4f}", acc=f"{correct / seen:.3f}")
                if mon is not None and config.stop_on_collapse:
                    alarmed = mon.alarm is not None
                    if world > 1:  # every rank must stop at the same step
                        alarmed = all_sum([float(alarmed)])[0] > 0
                    if alarmed:
                        stop_alarm = mon.alarm if mon.alarm is not None else _RemoteAlarm()
                        break
            scheduler.step()
            loss_sum, correct, seen = all_sum([loss_sum, correct, seen])
            if world > 1:  # BN running statistics are per process: evaluate and save rank 0's everywhere
                for buf in raw_model.buffers():
                    dist.broadcast(buf, 0)
            test_loss, test_acc = _evaluate(raw_model, test_ds, device)
            entry = {
                "epoch": epoch + 1,
                "train_loss": loss_sum / seen if seen and not bad_loss else None,
                "train_acc": correct / seen if seen else None,
                "test_loss": test_loss if math.isfinite(test_loss) else None,
                "test_acc": test_acc,
                "lr": lr,
                "time_s": time.perf_counter() - t0,
            }
            if bar is not None:
                bar.set_postfix(loss=_fmt(entry["train_loss"]), acc=_fmt(entry["train_acc"]),
                                test_acc=_fmt(entry["test_acc"]))
                bar.close()
            history.append(entry)
            state["epoch"] = epoch + 1
            if (
                state["epochs_to_target"] is None
                and config.target_acc is not None
                and test_acc >= config.target_acc
                and not bad_loss
            ):
                state["epochs_to_target"] = epoch + 1
            if mon is not None and is_main:
                lines = [dumps_line(r) for r in mon.records[mon_written:]]
                if mon.alarm is not None and state["monitor_alarm"] is None:
                    lines.append(dumps_line({"event": "alarm", **mon.alarm.to_dict()}))
                    state["monitor_alarm"] = _alarm_dict(mon.alarm)
                if lines:
                    with open(monitor_path, "a") as f:
                        f.writelines(line + "\n" for line in lines)
                state["monitor_lines"] += len(lines)
                mon_written = len(mon.records)
            if bad_loss or not math.isfinite(test_loss):
                state.update(collapse_epoch=epoch + 1, collapse_reason="non_finite_loss")
            elif stop_alarm is not None:
                state.update(collapse_epoch=epoch + 1, collapse_reason="monitor_alarm")
                if state["monitor_alarm"] is None:  # another rank's monitor fired
                    state["monitor_alarm"] = _alarm_dict(stop_alarm)
            stop = state["collapse_epoch"] is not None
            state["finished"] = stop or epoch + 1 == config.epochs
            if is_main:
                if stop:  # keep the last good weights on disk; record the collapse in its history
                    good = torch.load(ckpt_path, map_location="cpu", weights_only=True)
                    good["history"], good["state"] = copy.deepcopy(history), dict(state)
                    atomic_torch_save(good, ckpt_path)
                else:
                    atomic_torch_save(snapshot(), ckpt_path)
                write_metrics()
            if world > 1:
                dist.barrier()
            if stop:
                break
    finally:
        if mon is not None:
            mon.close()

    summary = _summary(cfg, history, state)
    if is_main:
        atomic_write_text(summary_path, json.dumps(to_jsonable(summary), indent=2))
    return summary


def _fmt(v):
    return "nan" if v is None else f"{v:.4f}"


def _progress_bar(total, desc, enabled):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=True)
