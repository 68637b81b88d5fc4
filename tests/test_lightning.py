"""The Lightning callback, for real on CPU: records Lightning's own optimizer steps through the optimizer's step hooks
(gradient accumulation, two optimizers, a GradScaler that skips), logs through the module's logger, stops the trainer
on an alarm, refuses sharded strategies; its guard rescues."""

from __future__ import annotations

import csv
import json
import math
import re
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import needs
from torch import nn

pl = needs("lightning.pytorch")
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.strategies import FSDPStrategy  # noqa: E402

from normlab.integrations.lightning import VarianceMonitorCallback  # noqa: E402
from normlab.monitor import CollapseCriteria, RescueOptions, SnapshotOptions  # noqa: E402


def guard(every, check_every=1, **rescue):
    """The callback's ``guard`` argument: snapshots every ``every`` steps, a check every step unless told; enough of
    them kept to reach the default window (10) and the margin back, so that the guard takes them ``every`` steps
    apart (``snapshot_interval``)."""
    margin = rescue.get("margin")
    keep = max(3, 1 + math.ceil((CollapseCriteria().window + (every if margin is None else margin)) / every))
    return {
        "snapshots": SnapshotOptions(every=every, keep=keep),
        "rescue": RescueOptions(check_every=check_every, **rescue),
    }


class Tiny(pl.LightningModule):
    """A conv net on 8x8 inputs; ``blow_up_at``: multiply the BatchNorm's gain by 1e3 at that step (the conv before it
    is renormalized by it, so a blown-up conv kernel would change nothing downstream)."""

    def __init__(self, blow_up_at: int | None = None, two_optimizers: bool = False):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3))
        self.blow_up_at = blow_up_at
        self.automatic_optimization = not two_optimizers

    def training_step(self, batch, batch_idx):
        if self.blow_up_at is not None and self.global_step == self.blow_up_at:
            with torch.no_grad():
                self.net[1].weight.mul_(1e3)
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if not self.automatic_optimization:  # manual optimization: the conv and the classifier step separately
            for opt in self.optimizers():
                opt.zero_grad()
            self.manual_backward(loss)
            for opt in self.optimizers():
                opt.step()
        return loss

    def configure_optimizers(self):
        if self.automatic_optimization:
            return torch.optim.SGD(self.parameters(), lr=0.05)
        return [torch.optim.SGD(self.net[:2].parameters(), lr=0.05), torch.optim.SGD(self.net[4].parameters(), lr=0.05)]


def _data(n: int = 64, batch: int = 8):
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=batch)


def _fit(module, callback, tmp_path=None, ckpt_path=None, **kw) -> pl.Trainer:
    torch.manual_seed(0)
    logger = CSVLogger(str(tmp_path), name="csv") if tmp_path is not None else False
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        log_every_n_steps=1,
        **kw,
    )
    trainer.fit(module, _data(), ckpt_path=ckpt_path)
    return trainer


def test_records_every_n_steps_and_logs_through_the_module_logger(tmp_path, one_thread):
    cb = VarianceMonitorCallback(every=2, jsonl=tmp_path / "mon.jsonl")
    trainer = _fit(Tiny(), cb, tmp_path, max_steps=6)
    assert trainer.global_step == 6 and cb.monitor.current_step == 6
    records = cb.monitor.records
    assert sorted({r["step"] for r in records}) == [0, 2, 4]
    assert all("update_ratio_mean" in r for r in records if r["kind"] != "norm")
    assert len((tmp_path / "mon.jsonl").read_text().splitlines()) == len(records)
    with open(trainer.logger.experiment.metrics_file_path) as f:
        rows = list(csv.DictReader(f))
    logged = {int(r["step"]): float(r["output_var/net.0"]) for r in rows if r.get("output_var/net.0")}
    assert logged == pytest.approx({r["step"]: r["output_var"] for r in records if r["layer"] == "net.0"}, rel=1e-6)


def test_a_schedule_recording_options_and_tensorboard_reach_the_monitor(tmp_path, one_thread):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from normlab.monitor import RecordOptions, RecordSchedule

    schedule = RecordSchedule(every=4, dense_steps=3)
    cb = VarianceMonitorCallback(
        every=schedule, log=False, recording=RecordOptions(include_norm=False), tensorboard=tmp_path / "tb"
    )
    _fit(Tiny(), cb, max_steps=6)
    assert cb.monitor.schedule == schedule and sorted({r["step"] for r in cb.monitor.records}) == [0, 1, 2, 4]
    assert {r["kind"] for r in cb.monitor.records} <= {"conv", "linear"}
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()  # written by the monitor's board, closed at teardown
    assert {e.step for e in acc.Scalars("output_var/net.0")} == {0, 1, 2, 4}


def test_gradient_accumulation_records_once_per_optimizer_step(one_thread):
    cb = VarianceMonitorCallback(every=1, log=False)
    trainer = _fit(Tiny(), cb, max_steps=3, accumulate_grad_batches=2)
    assert trainer.global_step == 3 and cb.monitor.current_step == 3  # 6 batches, 3 steps
    assert sorted({r["step"] for r in cb.monitor.records}) == [0, 1, 2]


def test_two_optimizers_the_monitor_follows_the_first(one_thread):
    cb = VarianceMonitorCallback(every=1, log=False)
    trainer = _fit(Tiny(two_optimizers=True), cb, max_epochs=1, limit_train_batches=3)
    assert cb.monitor.current_step == 3 and cb.monitor.optimizer is trainer.optimizers[0]
    first = {r["layer"]: r for r in cb.monitor.records if r["step"] == 0}
    assert first["net.0"]["mean_update_absmax"] > 0  # stepped by the first optimizer: its update is the record's
    assert first["net.4"]["mean_update_absmax"] == 0  # the second steps after the monitor's step ended


def test_alarm_stops_the_trainer(one_thread):
    cb = VarianceMonitorCallback(every=1, stop_on_alarm=True, log=False)
    with pytest.warns(UserWarning, match="collapse warning at step 3: layer 'net.1'"):
        trainer = _fit(Tiny(blow_up_at=3), cb, max_steps=20)
    assert cb.monitor.alarm.layer == "net.1" and cb.monitor.alarm.step == 3
    assert trainer.global_step == 4  # stopped after the batch that raised the alarm
    free = VarianceMonitorCallback(every=1, log=False)
    assert _fit(Tiny(blow_up_at=3), free, max_steps=8).global_step == 8 and free.monitor.alarm is not None


def test_sharded_strategies_are_refused():
    cb = VarianceMonitorCallback()
    trainer = types.SimpleNamespace(strategy=FSDPStrategy(), global_rank=0)
    with pytest.raises(ValueError, match="strategy FSDPStrategy is not supported.*single device or DDP"):
        cb.setup(trainer, Tiny(), "fit")


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")  # on purpose
def test_monitor_state_travels_with_lightning_checkpoints(tmp_path, one_thread):
    cb = VarianceMonitorCallback(every=1, log=False)
    trainer = _fit(Tiny(), cb, max_steps=3)
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    resumed = VarianceMonitorCallback(every=1, log=False)
    _fit(Tiny(), resumed, ckpt_path=tmp_path / "a.ckpt", max_steps=5)
    assert resumed.monitor.current_step == 5  # counted on from the checkpoint's 3
    assert sorted({r["step"] for r in resumed.monitor.records}) == [3, 4]


class BlowUpOnRankOne(Tiny):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == 3:
            with torch.no_grad():
                self.net[1].weight.mul_(1e3)
        return super().training_step(batch, batch_idx)

    def teardown(self, stage):
        # Lightning destroys only NCCL groups at exit; a gloo group left to interpreter exit can abort a worker
        # (SIGABRT, "terminate called without an active exception"), which failed CI once
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def test_ddp_an_alarm_on_one_rank_stops_every_rank(tmp_path):
    cb = VarianceMonitorCallback(every=1, stop_on_alarm=True, log=False, jsonl=tmp_path / "rank0.jsonl")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=20,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
    )
    trainer.fit(BlowUpOnRankOne(), _data())  # each rank trains on its half of the batches
    lines = [json.loads(x) for x in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in lines) == 3  # rank 0 saw no alarm itself but stopped with rank 1
    assert not [r for r in lines if r.get("event") in ("alarm", "rule") and r.get("severity", "alarm") == "alarm"]


def test_without_lightning_the_error_names_the_extra(monkeypatch):
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)  # not installed
    monkeypatch.delitem(sys.modules, "normlab.integrations.lightning")
    with pytest.raises(ImportError, match=r"pip install 'normlab\[lightning\]'"):
        importlib.import_module("normlab.integrations.lightning")


@pytest.mark.parametrize("overflow", [False, True])
def test_a_step_the_grad_scaler_skips_is_recorded_as_no_update(overflow, one_thread):
    # 16-mixed with a GradScaler (torch's CPU GradScaler here; CUDA in practice): inf gradients make the scaler
    # skip the step and lower its scale, and the monitor must not record that step as an update
    from lightning.pytorch.plugins.precision import MixedPrecision

    module = Tiny()
    if overflow:
        module.net[0].weight.register_hook(lambda g: g * float("inf"))
    callback = VarianceMonitorCallback(every=1)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))
    _fit(module, callback, max_steps=2, plugins=[plugin])
    updates = [r for r in callback.monitor.records if r["kind"] != "norm" and "update_ratio_mean" in r]
    assert callback.monitor.current_step == 2
    assert (updates == []) if overflow else len(updates) == 4  # 2 steps x (conv, linear)


# ------------------------------------------------------------------------------------------------ guard=
class NanLoss(Tiny):
    """Tiny whose loss is NaN at the global steps in ``nan_at`` (Lightning then steps NaN gradients)."""

    def __init__(self, nan_at=(), scheduler: bool = False, **kw):
        super().__init__(**kw)
        self.nan_at, self.scheduler = set(nan_at), scheduler

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step in self.nan_at else loss

    def configure_optimizers(self):
        opt = super().configure_optimizers()
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _params(module):
    return [p.detach().clone() for p in module.parameters()]


def test_guard_leaves_a_healthy_run_untouched(one_thread):
    torch.manual_seed(100)
    plain = Tiny()
    torch.manual_seed(100)
    guarded = Tiny()
    _fit(plain, VarianceMonitorCallback(every=1, log=False), max_steps=12)
    cb = VarianceMonitorCallback(every=1, log=False, guard=guard(3, check_every=5))
    _fit(guarded, cb, max_steps=12)
    assert cb.guard.rescues == [] and cb.guard.steps == 12 and cb.gave_up is None
    for p, q in zip(_params(plain), _params(guarded)):
        assert torch.equal(p, q)


def test_guard_rescues_a_blow_up_lowers_the_lr_and_trains_on(one_thread):
    module = Tiny(blow_up_at=5)
    cb = VarianceMonitorCallback(every=1, log=False, guard=guard(2, confirm=None))  # act on the alarm
    with pytest.warns(UserWarning, match=r"rescue 1: monitor alarm: collapse warning at step 5.*0.05 -> 0.025"):
        trainer = _fit(module, cb, max_steps=16)
    (r,) = cb.guard.rescues
    assert r.step == 5 and r.onset == 5 and r.restored_step == 2 and r.steps_lost == 4  # 2 <= 5 - margin 2
    assert trainer.global_step == 16 and cb.guard.steps == 16 - 4  # the trainer counts the lost steps too
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.025)
    assert cb.monitor.alarm is None and all(torch.isfinite(p).all() for p in module.parameters())
    assert float(module.net[1].weight.detach().abs().max()) < 10  # the x1e3 gain was thrown away


def test_guard_by_default_waits_for_the_alarm_to_be_confirmed_and_restores_from_before_it(one_thread):
    module = NanLoss(blow_up_at=5, nan_at={8})  # the alarm at step 5, the NaN it foretold at step 8
    cb = VarianceMonitorCallback(every=1, log=False, guard=guard(2))
    with pytest.warns(UserWarning, match=r"rescue 1: non-finite loss.*after the monitor alarm: collapse warning"):
        _fit(module, cb, max_steps=16)
    (r,) = cb.guard.rescues
    assert r.step == 8 and r.onset == 5 and r.restored_step == 2 and cb.guard.dismissed == []
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert float(module.net[1].weight.detach().abs().max()) < 10  # back to before the x1e3 gain


def test_guard_rescues_a_nan_loss_and_the_lr_scheduler_keeps_working(one_thread):
    module = NanLoss(nan_at={7}, scheduler=True)
    cb = VarianceMonitorCallback(every=1, log=False, guard=guard(2, margin=0))
    with pytest.warns(UserWarning, match="rescue 1: non-finite loss"):
        trainer = _fit(module, cb, max_steps=14)
    (r,) = cb.guard.rescues
    # the guard acts inside the optimizer's step, before Lightning steps a step-interval scheduler: the rate of step 7
    assert r.step == 7 and r.restored_step == 6 and r.lr_before == pytest.approx(0.05 * 0.5)  # epoch 7
    assert r.lr_after == pytest.approx(0.05 * 0.5 * 0.5)  # the snapshot's (StepLR: x0.5 at 4), x0.5 from the guard
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert sched.base_lrs == [pytest.approx(0.025)]  # the schedule goes on from the lowered rate
    # 14 scheduler steps, rolled back from epoch 8 to 6: epoch 12; lr = 0.025 * 0.5 ** (12 // 4)
    assert sched.last_epoch == 12 and trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.025 / 8)
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_guard_gives_up_rolls_back_and_stops_the_trainer(one_thread):
    module = NanLoss(nan_at=range(4, 100))
    cb = VarianceMonitorCallback(every=1, log=False, guard=guard(2, max_rescues=2))
    with pytest.warns(UserWarning) as caught:  # each rescue, then the surrender: all said, none left over
        trainer = _fit(module, cb, max_steps=30)
    said = [str(w.message) for w in caught]
    assert [n for n in (1, 2, 3) if any(f"rescue {n}: non-finite loss" in m for m in said)] == [1, 2], said
    assert any(re.search(r"gave up after 2 rescue\(s\).*back on the state of step", m) for m in said), said
    assert len(cb.guard.rescues) == 2 and cb.gave_up.startswith("CollapseGuard: gave up after 2 rescue(s)")
    assert trainer.should_stop and trainer.global_step < 30
    assert all(torch.isfinite(p).all() for p in module.parameters())  # ends on a snapshot, not on NaN


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")  # on purpose
def test_guard_state_travels_with_lightning_checkpoints(tmp_path, one_thread):
    cb = VarianceMonitorCallback(every=1, log=False, guard=guard(2, margin=0))
    with pytest.warns(UserWarning, match="rescue 1"):
        trainer = _fit(NanLoss(nan_at={3}), cb, max_steps=6)
    trainer.save_checkpoint(tmp_path / "g.ckpt")
    resumed = VarianceMonitorCallback(every=1, log=False, guard=guard(2, margin=0))
    _fit(NanLoss(), resumed, ckpt_path=tmp_path / "g.ckpt", max_steps=8)
    assert resumed.guard.rescues == cb.guard.rescues and resumed.guard.lr_scale == 0.5
    assert resumed.guard.steps == cb.guard.steps + 2


def test_guard_is_refused_under_ddp_and_with_two_optimizers(one_thread):
    from lightning.pytorch.strategies import DDPStrategy

    cb = VarianceMonitorCallback(guard=True)
    trainer = types.SimpleNamespace(strategy=DDPStrategy(), global_rank=0, world_size=2)
    with pytest.raises(ValueError, match="guard runs in one process only.*drop guard= or train on one device"):
        cb.setup(trainer, Tiny(), "fit")
    with pytest.raises(ValueError, match="guard needs exactly one optimizer, the trainer has 2"):
        _fit(Tiny(two_optimizers=True), VarianceMonitorCallback(every=1, log=False, guard=True), max_steps=2)
    with pytest.raises(ValueError, match=r"guard: \['optimizer'\] are taken from the trainer"):
        VarianceMonitorCallback(guard={"optimizer": None})


def test_guard_leaves_steps_the_grad_scaler_skips_to_the_scaler(one_thread):
    # 16-mixed: inf gradients make the scaler skip the step (and lower its scale); the guard sees a finite loss and
    # leaves it to the scaler, and snapshots the scaler with the rest
    from lightning.pytorch.plugins.precision import MixedPrecision

    module = Tiny()
    module.net[0].weight.register_hook(lambda g: g * float("inf"))
    cb = VarianceMonitorCallback(every=1, log=False, guard=guard(1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    _fit(module, cb, max_steps=3, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert cb.guard.scaler is scaler and cb.guard.rescues == [] and cb.guard.steps == 3
    assert scaler.get_scale() == 2.0**5 and all(torch.isfinite(p).all() for p in module.parameters())
