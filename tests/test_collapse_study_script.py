"""scripts/collapse_study.py, which produces the calibration record docs/monitor.md, on tiny and synthetic runs."""

from __future__ import annotations

import json
import math

import pytest
from conftest import load_script


@pytest.fixture(scope="module")
def study():
    return load_script("scripts/collapse_study.py")


LAYERS = [["c1", "conv"], ["c2", "conv"], ["head", "conv"]]


def fake_run(seed, norm="none", lr=0.1, kind=None, cstep=None, blow=None, shift_from=None, steps=60):
    """A recorded run: c2's output variance x100 from step ``blow``; its shift term above the variance term from
    step ``shift_from``; losses at chance after ``cstep`` for a returned_to_chance run."""
    lines = []
    for t in range(steps):
        v2 = 100.0 if blow is not None and t >= blow else 1.0
        shift = 2.0 if shift_from is not None and t >= shift_from else 0.1
        loss = 1.0 if kind is None or t < (cstep or 0) else math.log(10)
        lines.append(
            {
                "t": t,
                "loss": loss,
                "gnorm": 1.0,
                "L": {"c1": [1.0, 0.1, 1.0, 1.0], "c2": [v2, shift, 1.0, 1.0], "head": [1.0, 5.0, 1.0, 1.0]},
            }
        )
    return {
        "cfg": dict(norm=norm, width=0.5, lr=lr, seed=seed),
        "layers": LAYERS,
        "order": ["c1", "c2", "head"],
        "steps": lines,
        "summary": {"kind": kind, "collapse_step": cstep, "alarm": None, "old_alarm": None},
    }


def full_seed(study, seed, collapse_at=30):
    """All 10 configurations of a seed: the plain runs collapse (warned by level and regime), the others healthy."""
    runs = []
    for cfg in study.configs([seed]):
        if cfg["norm"] == "none":
            runs.append(
                fake_run(
                    seed, "none", cfg["lr"], "returned_to_chance", collapse_at, blow=collapse_at - 10, shift_from=2
                )
            )
        else:
            runs.append(fake_run(seed, cfg["norm"], cfg["lr"]))
    return runs


def test_never_left_chance_is_dated_where_the_loss_stays_at_chance(study):
    run = fake_run(100, kind="never_left_chance")
    for x in run["steps"]:
        x["loss"] = 2.0 if x["t"] < 20 else math.log(10)
    # a window ending at t >= 26 holds <= 3 losses of 2.0 and has a mean >= 0.95 ln 10: the first starts at 17
    assert study._collapse_step(run) == 17


def test_rules_are_chosen_on_one_half_and_reported_on_the_other(study):
    runs = [r for s in (100, 101, 102, 103) for r in full_seed(study, s)]
    text = study.analyze(runs)
    assert text.startswith("40 runs")
    assert "calibrate A (even seeds) -> report B (odd)" in text and "calibrate B (odd seeds) -> report A (even)" in text
    level = [line for line in text.splitlines() if line.startswith("level ")]
    assert len(level) == 2  # each collapse is 10 steps after the x100 jump; 6 plain runs per half, 14 healthy
    assert all("REPORT warned=6 warnable=6 median_lead=10" in line and "false=0 healthy=14" in line for line in level)
    regime = [line for line in text.splitlines() if "REPORT recall" in line]
    assert all("recall=6 collapsing=6" in line and "bn_healthy_flagged=0" in line for line in regime)


def test_a_partial_seed_is_left_out(study):
    runs = full_seed(study, 100) + full_seed(study, 101)[:4]
    assert {r["cfg"]["seed"] for r in study.complete_seeds(runs)} == {100}


def test_seeds_below_100_are_refused(study):
    with pytest.raises(SystemExit, match="100"):
        study.parse_seeds("99-101")
    assert study.parse_seeds("100-102") == [100, 101, 102]


def test_a_tiny_real_run_is_written_once(study, tmp_path, monkeypatch, one_thread):
    monkeypatch.setattr(study, "NUM_SAMPLES", 400)
    monkeypatch.setattr(study, "STEPS", 3)
    monkeypatch.setattr(study, "BATCH", 16)
    cfg = dict(norm="none", width=0.1, lr=0.05, seed=100)
    name, kind, _ = study._collect_one((cfg, str(tmp_path)))
    path = tmp_path / f"{name}.jsonl"
    lines = path.read_text().splitlines()
    head, steps = json.loads(lines[0]), [json.loads(x) for x in lines[1:]]
    assert head["cfg"] == cfg and head["order"][-1] == "head" and len(steps) == 3
    assert set(steps[0]["L"]) == {n for n, _ in head["layers"]} and steps[2]["gnorm"] > 0
    assert "old_alarm" in head["summary"]  # the alarm before the countdown, replayed on the records
    assert study._collect_one((cfg, str(tmp_path)))[1] == "done before"


def test_suggest_restarts_a_warned_run_at_the_suggested_lr(study, tmp_path, monkeypatch):
    calls = []

    def fake_train_run(cfg, steps=None, guard_kwargs=None, defaults=False):
        calls.append((cfg["lr"], defaults))
        risk = {"step": 20, "layer": "c2", "ratio": 3.0, "suggested_lr": 0.04} if cfg["lr"] == 0.1 else None
        return {}, [], {"kind": None if cfg["lr"] < 0.1 else "never_left_chance", "collapse_step": None,
                        "test_acc": 0.5, "risk": risk}  # fmt: skip

    monkeypatch.setattr(study, "train_run", fake_train_run)
    out = study._suggest_one((dict(norm="none", width=0.5, lr=0.1, seed=100), str(tmp_path), 5))
    assert calls == [(0.1, True), (0.04, True)]  # the run, then the same run at the suggested rate
    assert out["risk"]["suggested_lr"] == 0.04 and out["restart"]["kind"] is None
    assert study._suggest_one((dict(norm="none", width=0.5, lr=0.1, seed=100), str(tmp_path), 5)) == out
    assert len(calls) == 2  # written once, read back the second time
