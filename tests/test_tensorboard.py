"""TensorBoard, read back with TensorBoard's own EventAccumulator: the monitor's scalars equal its JSONL records,
histograms summarise the per-filter mean updates, the alarm is a text event, ``normlab train --tensorboard`` adds
the run's loss, accuracy and learning rate."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import idle, needs, step_without_update
from torch import nn

from normlab.cli import main
from normlab.integrations.tensorboard import LAYOUT_TITLE, SCALARS, MonitorBoard
from normlab.monitor import VarianceMonitor

needs("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def _events(path) -> EventAccumulator:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def _scalars(acc: EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def _records(path) -> tuple[list[dict], list[dict]]:
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    return [r for r in lines if "event" not in r], [r for r in lines if r.get("severity") == "alarm"]


def _check_scalars_equal_records(acc: EventAccumulator, records: list[dict]) -> int:
    """Every SCALARS value of every record is in the event file at its step (float32); returns how many."""
    n = 0
    for rec in records:
        for key, (section, _) in SCALARS.items():
            if rec.get(key) is not None:
                assert _scalars(acc, f"{section}/{rec['layer']}")[rec["step"]] == pytest.approx(rec[key], rel=1e-6)
                n += 1
    return n


def _net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.ReLU(),
        nn.BatchNorm2d(8),
        nn.Conv2d(8, 6, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 4 * 4, 5),
    )


def test_monitor_events_equal_its_jsonl_records_histograms_and_alarm(tmp_path, one_thread):
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 5, (16,))
    mon = VarianceMonitor(model, every=2, optimizer=opt)
    mon.add_sink(MonitorBoard(tmp_path / "tb"))  # closed by mon.close()
    for step in range(8):
        if step == 5:  # blow up the first conv: the alarm fires at the next recorded step
            with torch.no_grad():
                model[0].weight.mul_(1e3)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    mon.close()
    mon.to_jsonl(tmp_path / "mon.jsonl")
    records, alarms = _records(tmp_path / "mon.jsonl")
    acc = _events(tmp_path / "tb")
    assert _check_scalars_equal_records(acc, records) > 5 * 4 * 3  # 4 steps x 3 weighted layers x 5 quantities
    assert {r["step"] for r in records} == {0, 2, 4, 6}
    for rec in (r for r in records if r["kind"] != "norm"):
        h = {e.step: e.histogram_value for e in acc.Histograms(f"mean_update/{rec['layer']}")}[rec["step"]]
        assert h.num == rec["out_channels"]
        assert h.sum / h.num == pytest.approx(rec["mean_update_mean"], rel=1e-4, abs=1e-9)
        assert max(abs(h.min), abs(h.max)) == pytest.approx(rec["mean_update_absmax"], rel=1e-5)
    (alarm,) = alarms
    (text,) = acc.Tensors("alarm/text_summary")
    assert text.step == alarm["step"] == 6 and f"layer '{alarm['layer']}'" in text.tensor_proto.string_val[0].decode()
    assert "custom_scalars__config__" in acc.Tags()["tensors"]
    assert LAYOUT_TITLE.encode() in acc.Tensors("custom_scalars__config__")[0].tensor_proto.SerializeToString()


def test_monitor_writes_to_a_given_writer_and_leaves_it_open(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    model = _net()
    with VarianceMonitor(model, every=1, optimizer=idle(model)) as mon:
        mon.add_sink(MonitorBoard(writer))
        model(torch.randn(4, 3, 8, 8)).sum().backward()
        step_without_update(mon)
    writer.add_scalar("mine", 1.0, 0)  # still open
    writer.close()
    acc = _events(tmp_path)
    assert "mine" in acc.Tags()["scalars"] and "output_var/0" in acc.Tags()["scalars"]
    with pytest.raises(TypeError, match="log directory or a SummaryWriter"):
        MonitorBoard(42)


def test_train_tensorboard_has_the_run_and_the_monitor(tmp_path):
    out, tb = tmp_path / "run", tmp_path / "tb"
    assert (
        main(
            [
                "train",
                "--norm",
                "bn",
                "--epochs",
                "2",
                "--width",
                "0.125",
                "--max-steps-per-epoch",
                "4",
                "--batch-size",
                "16",
                "--monitor-every",
                "2",
                "--evals-per-epoch",
                "2",
                "--threads",
                "1",
                "--quiet",
                "--out",
                str(out),
                "--tensorboard",
                str(tb),
            ]
        )
        == 0
    )
    acc = _events(tb)
    records, _ = _records(out / "monitor.jsonl")
    assert _check_scalars_equal_records(acc, records) > 0
    history = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(history) == 4
    for key in ("train_loss", "train_acc", "test_loss", "test_acc", "lr"):
        assert _scalars(acc, f"run/{key}") == pytest.approx({h["step"]: h[key] for h in history}, rel=1e-6)
    losses = json.loads((out / "loss_trace.json").read_text())["losses"]
    assert _scalars(acc, "run/step_loss") == pytest.approx(dict(enumerate(losses)), rel=1e-6)


def test_a_resumed_run_purges_the_events_after_its_checkpoint(tmp_path, monkeypatch):
    from normlab.runner.training.config import TrainConfig
    from normlab.runner.training.train import Trainer, train

    cfg = TrainConfig(norm="bn", width=0.125, batch_size=16, epochs=2, max_steps_per_epoch=4, monitor_every=1)
    real, calls = Trainer._train_step, []

    def killed_mid_epoch_two(self, batch, win):  # steps 4 and 5 are written, then the run dies before a checkpoint
        calls.append(1)
        if len(calls) == 7:
            raise KeyboardInterrupt
        return real(self, batch, win)

    monkeypatch.setattr(Trainer, "_train_step", killed_mid_epoch_two)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "run", progress=False, tensorboard=tmp_path / "tb")
    monkeypatch.undo()
    train(cfg, tmp_path / "run", progress=False, tensorboard=tmp_path / "tb")
    acc = _events(tmp_path / "tb")
    steps = [e.step for e in acc.Scalars("run/step_loss")]
    assert steps == list(range(8))  # each step once: the first try's steps 4 and 5 were purged
    losses = json.loads((tmp_path / "run" / "loss_trace.json").read_text())["losses"]
    assert [e.value for e in acc.Scalars("run/step_loss")] == pytest.approx(losses, rel=1e-6)
    records, _ = _records(tmp_path / "run" / "monitor.jsonl")
    assert [e.step for e in acc.Scalars("output_var/features.0.conv")] == list(range(8))
    assert _check_scalars_equal_records(acc, records) > 0


def test_without_tensorboard_the_error_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # not installed
    with pytest.raises(ImportError, match=r"pip install 'normlab\[tensorboard\]'"):
        MonitorBoard(tmp_path / "tb")
    assert main(["train", "--tensorboard", str(tmp_path / "tb"), "--out", str(tmp_path / "run")]) == 2
    assert "--tensorboard needs TensorBoard: pip install 'normlab[tensorboard]'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and not (tmp_path / "tb").exists()
