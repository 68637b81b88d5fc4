"""Mixed precision: every normlab layer under autocast (bfloat16, what ``--amp`` uses on CPU, and float16, what it
uses on CUDA, both run here on CPU) with inputs of magnitude 1e4 gives finite outputs and gradients equal to its
float32 result up to rounding, and keeps float32 running statistics; the monitor records under autocast;
``normlab train --amp`` trains in bfloat16 and resumes exactly."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from normlab.cli import main
from normlab.monitor import VarianceMonitor
from normlab.nn import PrimaryCapsules, RoutingCapsules, SyncBatchRenorm
from normlab.nn.registry import CONV_KINDS, DIMS, NORM_NAMES, create_conv, create_norm
from normlab.runner.training.config import TrainConfig
from normlab.runner.training.train import Trainer, train

AMP_DTYPES = (torch.bfloat16, torch.float16)
NORMS = [(name, dim) for name in NORM_NAMES if name != "none" for dim in DIMS]
CONVS = [(kind, dim) for kind in CONV_KINDS for dim in DIMS]


def _close(y: torch.Tensor, ref: torch.Tensor, rtol: float = 2e-2) -> None:
    """Finite, and within ``rtol`` of the float32 result relative to its largest entry."""
    assert y.float().isfinite().all()
    assert (y.float() - ref).abs().max() <= rtol * ref.abs().max()


def _loss(y: torch.Tensor) -> torch.Tensor:
    """A fixed random projection of the output (the gradient of a normalized output's square is zero)."""
    proj = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    return (y.float() * proj).sum()


def _run(module: nn.Module, x: torch.Tensor, dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and input gradient of ``module`` under CPU autocast to ``dtype`` (None: float32, no autocast)."""
    x = x.detach().requires_grad_()
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        y = module(x)
    _loss(y).backward()
    return y, x.grad


@pytest.mark.parametrize("dtype", AMP_DTYPES, ids=str)
@pytest.mark.parametrize("name,dim", NORMS + [("sync_brn", 2)])
def test_norm_layer_under_autocast_keeps_float32_statistics(name, dim, dtype, one_thread):
    torch.manual_seed(0)
    layer = SyncBatchRenorm(8) if name == "sync_brn" else create_norm(name, 8, dim=dim)
    ref = copy.deepcopy(layer)
    x = (1e4 * torch.randn((6, 8) + (5,) * dim)).to(dtype)  # Var 1e8: beyond float16 (max 65504)
    y, grad = _run(layer.train(), x, dtype)
    expected, expected_grad = _run(ref.train(), x.float(), None)
    _close(y, expected.detach())
    _close(grad, expected_grad, rtol=5e-2)
    for (key, buf), (_, want) in zip(layer.named_buffers(), ref.named_buffers()):
        if buf.is_floating_point():
            assert buf.dtype == torch.float32 and buf.isfinite().all(), key
            torch.testing.assert_close(buf, want, rtol=1e-2, atol=1e-3)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):  # inference with the running statistics
        y = layer.eval()(x)
    _close(y, ref.eval()(x.float()))


@pytest.mark.parametrize("dtype", AMP_DTYPES, ids=str)
@pytest.mark.parametrize("kind,dim", CONVS)
def test_conv_under_autocast_standardizes_in_float32(kind, dim, dtype, one_thread):
    torch.manual_seed(0)
    conv = create_conv(kind, 3, 8, 3, dim=dim)
    ref = copy.deepcopy(conv)
    # WS kernels have unit variance per filter: the output is ~sqrt(27) x the input, so 1e4 inputs would give a true
    # output beyond float16's range (as for any conv with such kernels); 1e3 keeps it representable
    scale = 1e3 if (kind, dtype) == ("ws", torch.float16) else 1e4
    x = (scale * torch.randn((4, 3) + (6,) * dim)).to(dtype)
    y, grad = _run(conv, x, dtype)
    expected, expected_grad = _run(ref, x.float(), None)
    _close(y, expected.detach())
    _close(grad, expected_grad, rtol=5e-2)
    if hasattr(conv, "effective_weight"):  # a half conv (``.to(dtype)``) standardizes its kernel in float32
        half = copy.deepcopy(ref).to(dtype)
        expected_kernel = copy.deepcopy(half).float().effective_weight().to(dtype)
        assert torch.equal(half.effective_weight(), expected_kernel)


@pytest.mark.parametrize("dtype", AMP_DTYPES, ids=str)
def test_capsules_under_autocast(dtype, one_thread):
    torch.manual_seed(0)
    caps = nn.Sequential(
        PrimaryCapsules(4, num_capsules=2, capsule_dim=4, kernel_size=3, stride=1), RoutingCapsules(2 * 4 * 4, 4, 3, 5)
    )
    ref = copy.deepcopy(caps)
    x = (1e4 * torch.randn(2, 4, 6, 6)).to(dtype)  # |s|^2 ~ 1e8: squashed in float32
    y, grad = _run(caps, x, dtype)
    expected, expected_grad = _run(ref, x.float(), None)
    _close(y, expected.detach(), rtol=5e-2)
    assert grad.float().isfinite().all() and expected_grad.isfinite().all()


def _net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        create_conv("pws", 8, 8, 3),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def _one_step(model: nn.Module, x, y, amp: bool) -> list[dict]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with VarianceMonitor(model, every=1, optimizer=opt) as mon:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return mon.records


def test_monitor_records_under_autocast(one_thread):
    torch.manual_seed(0)
    model = _net()
    x, y = torch.randn(16, 3, 10, 10), torch.randint(0, 4, (16,))
    full, mixed = _one_step(copy.deepcopy(model), x, y, False), _one_step(model, x, y, True)
    assert [r["layer"] for r in mixed] == [r["layer"] for r in full]
    for a, b in zip(mixed, full):
        for key in ("output_var", "input_ratio", "input_sq", "update_ratio_mean", "shift", "weight_var"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=5e-2, abs=1e-6), (a["layer"], key)


def _amp_cfg(**kw) -> TrainConfig:
    base = dict(norm="bn", width=0.125, batch_size=16, epochs=2, max_steps_per_epoch=3, amp=True, monitor_every=1)
    return TrainConfig(**{**base, **kw})


def test_train_amp_runs_in_bfloat16_and_resumes_exactly(tmp_path, monkeypatch, one_thread):
    t = Trainer(_amp_cfg(), tmp_path / "probe", progress=False)
    t._build()
    out, loss = t._step(*t.train_ds.batch(torch.arange(16), t.generator))
    assert out.dtype == torch.bfloat16 and loss == loss
    assert all(b.dtype == torch.float32 for b in t.raw_model.buffers() if b.is_floating_point())
    whole = train(_amp_cfg(), tmp_path / "whole", progress=False)
    real, calls = Trainer._end_epoch, []

    def stop_after_first(self, epoch, win):
        stop = real(self, epoch, win)
        calls.append(epoch)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return stop

    monkeypatch.setattr(Trainer, "_end_epoch", stop_after_first)
    with pytest.raises(KeyboardInterrupt):
        train(_amp_cfg(), tmp_path / "cut", progress=False)
    monkeypatch.undo()
    resumed = train(_amp_cfg(), tmp_path / "cut", progress=False)
    strip = [{k: v for k, v in h.items() if k != "time_s"} for h in whole["history"]]
    assert [{k: v for k, v in h.items() if k != "time_s"} for h in resumed["history"]] == strip
    assert (tmp_path / "cut" / "monitor.jsonl").read_text() == (tmp_path / "whole" / "monitor.jsonl").read_text()


def test_amp_is_a_result_changing_field_and_old_checkpoints_stay_resumable():
    saved = TrainConfig().to_dict()
    del saved["amp"]  # a checkpoint written before the field existed
    assert TrainConfig().differences(saved) == []
    assert TrainConfig(amp=True).differences(saved) == ["amp: None -> True"]
    with pytest.raises(ValueError, match="amp must be True or False"):
        TrainConfig(amp="yes").validate()


def test_cli_train_amp(tmp_path):
    assert (
        main(
            [
                "train",
                "--amp",
                "--norm",
                "pws",
                "--epochs",
                "1",
                "--width",
                "0.125",
                "--batch-size",
                "16",
                "--max-steps-per-epoch",
                "2",
                "--threads",
                "1",
                "--quiet",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["amp"] is True and summary["final_test_acc"] is not None


def test_grad_scaler_step_with_the_monitor(tmp_path, one_thread):
    # what --amp does on CUDA (float16 + GradScaler), with torch's CPU GradScaler: the monitor records around
    # scaler.step and the scaler's state goes into the checkpoint
    t = Trainer(_amp_cfg(), tmp_path, progress=False)
    t._build()
    t.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    before = [p.detach().clone() for p in t.raw_model.parameters()]
    out, loss = t._step(*t.train_ds.batch(torch.arange(16), t.generator))
    assert loss == loss and any(not torch.equal(a, p) for a, p in zip(before, t.raw_model.parameters()))
    rec = [r for r in t.monitor.records if "update_ratio_mean" in r]
    assert rec and all(r["update_ratio_mean"] == r["update_ratio_mean"] for r in rec) and t.monitor.current_step == 1
    assert t._snapshot()["scaler"]["scale"] == 2.0**10


def test_a_step_the_grad_scaler_skips_records_no_update(tmp_path, one_thread):
    # an overflowing float16 backward: one gradient is inf, the scaler skips the step and lowers its scale; the
    # monitor must not record an update ratio of 1 as if the optimizer had stepped
    t = Trainer(_amp_cfg(), tmp_path, progress=False)
    t._build()
    t.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    next(t.raw_model.parameters()).register_hook(lambda g: g * float("inf"))
    before = [p.detach().clone() for p in t.raw_model.parameters()]
    t._step(*t.train_ds.batch(torch.arange(16), t.generator))
    assert all(torch.equal(a, p) for a, p in zip(before, t.raw_model.parameters()))  # skipped
    assert t.scaler.get_scale() < 2.0**10
    recs = [r for r in t.monitor.records if r["kind"] != "norm"]
    assert recs and not any("update_ratio_mean" in r for r in recs) and t.monitor.current_step == 1
