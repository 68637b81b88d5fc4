"""The demo's collapse diagnosis reads a run's monitor log through normlab's reader (normlab.monitor.log)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from normlab.monitor import VarianceMonitor
from normlab.monitor.rules import FactorRule


def _monitored_run(steps=6, blow_up_at=3):
    """A monitored run whose first conv's kernel is multiplied by 1e3 at ``blow_up_at``: the monitor's alarm."""
    torch.manual_seed(100)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = VarianceMonitor(model, every=1, rules=[FactorRule(watch_renormalized=True)], optimizer=opt)
    x, y = torch.randn(8, 3, 4, 4), torch.randint(0, 5, (8,))
    for step in range(steps):
        if step == blow_up_at:
            with torch.no_grad():
                model[0].weight.mul_(1e3)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()  # the monitor records the step
        opt.zero_grad()
    return mon


def test_the_demo_diagnosis_plots_from_the_reader(tmp_path):
    from normlab_lab.demo.diagnosis import load_records, plot_diagnosis

    run = tmp_path / "run"
    run.mkdir()
    mon = _monitored_run()
    mon.to_jsonl(run / "monitor.jsonl")
    (run / "summary.json").write_text(json.dumps({"collapsed": False, "monitor_alarm": None}))
    (run / "loss_trace.json").write_text(json.dumps({"losses": [2.3, 2.2, None, 2.0], "window": 2}))
    records, alarm = load_records(run)
    assert len(records) == len(mon.records) and alarm["layer"] == mon.alarm.layer
    assert plot_diagnosis([("run", run)], tmp_path / "d.png").is_file()
    (run / "monitor.jsonl").write_text('{"step": 0, "layer": 1}\n')
    with pytest.raises(ValueError, match=r"monitor.jsonl:1: expected a string 'layer'"):
        load_records(run)
