"""lab/scripts/long_regime.py, which produces the long-regime table of lab/docs/reproduction.md, on a tiny run."""

from __future__ import annotations

import json
import math
import sys

import pytest

from normlab.runner.training.config import TrainConfig
from normlab.runner.training.train import train

from .labtest import load_script


@pytest.fixture(scope="module")
def lr_script():
    return load_script("lab/scripts/long_regime.py")


@pytest.mark.parametrize("norm, conv", [("none", "conv"), ("none", "pws")])
def test_rebuilt_initial_weights_are_the_runs_and_the_table_prints(
    lr_script, norm, conv, tmp_path, capsys, monkeypatch, one_thread
):
    cfg = TrainConfig(
        width=0.05,
        batch_size=32,
        epochs=2,
        max_steps_per_epoch=3,
        lr=0.05,
        norm=norm,
        conv=conv,
        seed=3,
        monitor_every=1,
    )
    name = norm if conv == "conv" else conv  # the grid's cell ids start with the comparison name
    run = tmp_path / "runs" / f"{name}_lr0.05_bs32_s3"
    train(cfg, run, progress=False)
    row = lr_script.describe(run)
    assert row["norm"] == name and row["seed"] == 3 and row["steps"] == 6 and row["collapsed"] is False
    eff0 = row["marks"][0][0]
    if conv == "conv":  # the kernels applied are the stored ones: the rebuilt init is the run's step-0 record
        assert math.isclose(row["raw0"], eff0, rel_tol=1e-5)
    assert row["raw_end"] != row["raw0"] and math.isfinite(row["raw_end"])
    monkeypatch.setattr(sys, "argv", ["long_regime.py", str(tmp_path)])  # the script as a command
    lr_script.main()
    assert f"| {name} s3 | 6 | no |" in capsys.readouterr().out


def test_worst_window_finds_a_late_spike(lr_script, tmp_path):
    losses = [0.05] * 3000
    losses[2510:2520] = [2.3] * 10  # one window at chance level, after step 2,000
    losses[100:110] = [9.0] * 10  # earlier than step 2,000: ignored
    (tmp_path / "loss_trace.json").write_text(json.dumps({"window": 10, "losses": losses}))
    loss, step = lr_script.worst_window(tmp_path)
    assert step == 2510 and math.isclose(loss, 2.3)
