"""lab/scripts/collapse_study.py, which produces the calibration record lab/docs/monitor_calibration.md, on tiny
and synthetic runs."""

from __future__ import annotations

import json
import math

import pytest

from .labtest import load_script


@pytest.fixture(scope="module")
def study():
    return load_script("lab/scripts/collapse_study.py")


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


def test_a_collection_without_bn_runs_is_complete_per_seed(study):
    runs = [r for r in full_seed(study, 100) + full_seed(study, 101) if r["cfg"]["norm"] != "bn"]
    runs = [r for r in runs if not (r["cfg"]["seed"] == 101 and r["cfg"]["norm"] == "pws" and r["cfg"]["lr"] == 0.2)]
    assert sorted({r["cfg"]["seed"] for r in study.complete_seeds(runs)}) == [100]  # 101 lacks a pws run
    assert len(study.complete_seeds(runs)) == 6


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

    def fake_train_run(cfg, steps=None, guard_kwargs=None):
        calls.append(cfg["lr"])
        risk = {"step": 20, "layer": "c2", "ratio": 3.0, "suggested_lr": 0.04} if cfg["lr"] == 0.1 else None
        return {}, [], {"kind": None if cfg["lr"] < 0.1 else "never_left_chance", "collapse_step": None,
                        "test_acc": 0.5, "risk": risk}  # fmt: skip

    monkeypatch.setattr(study, "train_run", fake_train_run)
    out = study._suggest_one((dict(norm="none", width=0.5, lr=0.1, seed=100), str(tmp_path), 5))
    assert calls == [0.1, 0.04]  # the run, then the same run at the suggested rate
    assert out["risk"]["suggested_lr"] == 0.04 and out["restart"]["kind"] is None
    assert study._suggest_one((dict(norm="none", width=0.5, lr=0.1, seed=100), str(tmp_path), 5)) == out
    assert len(calls) == 2  # written once, read back the second time


def test_widths_option_adds_the_width_and_keeps_the_default(study):
    assert study.parse_widths("1.0") == (1.0,) and study.parse_widths("0.5,1.0") == (0.5, 1.0)
    assert {c["width"] for c in study.configs([100])} == {0.5}  # default unchanged
    cfgs = study.configs([100], (1.0,))
    assert len(cfgs) == 10 and {c["width"] for c in cfgs} == {1.0}
    with pytest.raises(SystemExit, match="--widths"):
        study.parse_widths("wide")
    runs = full_seed(study, 100)  # width 0.5 only: no complete seed at width 1.0
    assert study.complete_seeds(runs, (1.0,)) == [] and len(study.complete_seeds(runs)) == 10


@pytest.fixture
def tiny(study, monkeypatch):
    monkeypatch.setattr(study, "NUM_SAMPLES", 400)
    monkeypatch.setattr(study, "BATCH", 16)
    return study


def test_replayed_detectors_match_the_live_monitor(tiny, monkeypatch, one_thread):
    """evaluate replays the shipped detectors on the collected records: on a real run it must raise what the live
    VarianceMonitor raised, step for step. Shorter windows and a 3x factor rule make every detector fire in 30 steps
    (the replay reads the same rules as the monitor, so the patched rules reach both)."""
    from normlab.monitor.rules import CountdownRule, FactorRule, RegimeRule

    def rules():
        factor = FactorRule(explode_factor={"output_var": 3.0, "shift": 100.0})
        return [factor, RegimeRule(window=3, min_ratio=1.0, pws_factor=3.0), CountdownRule()]

    monkeypatch.setattr(tiny, "rules", rules)
    for norm in ("none", "pws"):
        head, lines, summary = tiny.train_run(dict(norm=norm, width=0.25, lr=0.2, seed=100), steps=30)
        again = tiny.replay({**head, "steps": lines, "summary": summary})
        assert summary["alarm"] is not None and summary["risk"] is not None
        assert again["alarm"] == summary["alarm"]["step"] and again["risk"] == summary["risk"]["step"]
        assert again["countdown"] is None or again["countdown"] >= again["alarm"]


def test_evaluate_scores_the_shipped_rules_on_a_complete_seed(tiny, tmp_path, monkeypatch, one_thread):
    monkeypatch.setattr(tiny, "STEPS", 12)
    for cfg in tiny.configs([100], (0.25,)):
        tiny._collect_one((cfg, str(tmp_path)))
    text = tiny.evaluate(tiny.load_runs(tmp_path), (0.25,))
    assert text.startswith("10 runs, seeds [100]")
    assert "differs from the live monitor on 0 runs" in text
    assert "shipped alarm (mon.alarm): warned=" in text and "regime warning (regime rule): recall=" in text
    assert len([x for x in text.splitlines() if x.startswith("  pws_w0.25")]) == 3
    assert tiny.evaluate(tiny.load_runs(tmp_path)).startswith("0 runs")  # width 0.5: none collected


def test_evaluate_refuses_runs_without_the_kernel_shift(study):
    with pytest.raises(ValueError, match="collected without"):
        study.replay(fake_run(100))


def test_replay_exempts_convs_followed_by_batchnorm_like_the_monitor(tiny, monkeypatch, one_thread):
    """At lr 3 the convs before BN grow their output variance > e^2 per 2 steps; the monitor's countdown skips them
    (renormalized downstream) and so must the replay. Factor rules off (factor 1e30) so the alarm is the countdown."""
    from normlab.monitor.rules import CountdownRule, FactorRule, RegimeRule, StepContext

    def rules():
        return [FactorRule(explode_factor={"output_var": 1e30, "shift": 1e30}), RegimeRule(), CountdownRule()]

    monkeypatch.setattr(tiny, "rules", rules)
    head, lines, summary = tiny.train_run(dict(norm="bn", width=0.25, lr=3.0, seed=100), steps=30)
    run = {**head, "steps": lines, "summary": summary}
    assert summary["alarm"] is None and tiny.replay(run)["countdown"] is None
    plain = CountdownRule(growth=1.0)  # the same rule without the exemption fires
    last = head["order"][-1]
    fired = [plain.check(StepContext(step=x["t"], output_layer=last), tiny.replay_records(run, x)) for x in lines]
    assert any(a is not None for a in fired)


LOSS_SCENARIOS = {
    "alarm, no trouble": ([2.3] * 10 + [0.4] * 90, 37),
    "alarm, then non-finite": ([2.3] * 10 + [0.4] * 35 + [None], 37),
    "alarm, non-finite much later": ([2.3] * 10 + [0.4] * 75 + [None], 37),
    "alarm, then back to chance": ([2.3] * 10 + [0.4] * 32 + [2.3] * 30, 37),
    "no alarm, back to chance": ([2.3] * 10 + [0.4] * 52 + [2.25] * 30, 10**6),
    "alarm at step 3": ([2.3] * 3 + [None], 3),
    "alarm at step 3, dead net": ([2.35] * 80, 3),
    "alarm at step 3, learns late": ([2.35] * 30 + [0.5] * 50, 3),
    "high first loss, back to chance": ([3.1] * 10 + [1.0] * 40 + [2.3] * 30, 10**6),
}

# The snapshot step the first rollback of the guard of rounds 3-5 restored on each scenario, measured with that guard
# itself (normlab at commit d5e347c, the last with it: CollapseGuard(model, opt, monitor, every=10, keep=3, margin=5,
# confirm, loss_climb, chance_loss) stepped with guard.step(loss) under a monitor raising its alarm at the scenario's
# step), "-" where it made none. One group per confirm of CONFIRM_GRID; in a group, loss_climb of CLIMB_GRID in
# order, each with chance_loss None then ln 10.
ROUND3_GUARD_ROLLBACKS = {
    "alarm, no trouble": "30 30 30 30 30 30 30 30|- - - - - - - -|- - - - - - - -|- - - - - - - -|- - - - - - - -",
    "alarm, then non-finite": "30 30 30 30 30 30 30 30|30 30 30 30 30 30 30 30|30 30 30 30 30 30 30 30|"
    "30 30 30 30 30 30 30 30|30 30 30 30 30 30 30 30",
    "alarm, non-finite much later": "30 30 30 30 30 30 30 30|80 80 80 80 80 80 80 80|80 80 80 80 80 80 80 80|"
    "30 30 30 30 30 30 30 30|30 30 30 30 30 30 30 30",
    "alarm, then back to chance": "30 30 30 30 30 30 30 30|- - 30 30 30 30 30 30|- - 30 30 30 30 30 30|"
    "- - 30 30 30 30 30 30|- - 30 30 30 30 30 30",
    "no alarm, back to chance": "- - 50 50 50 50 50 50|- - 50 50 50 50 50 50|- - 50 50 50 50 50 50|"
    "- - 50 50 50 50 50 50|- - 50 50 50 50 50 50",
    "alarm at step 3": "0 0 0 0 0 0 0 0|0 0 0 0 0 0 0 0|0 0 0 0 0 0 0 0|0 0 0 0 0 0 0 0|0 0 0 0 0 0 0 0",
    "alarm at step 3, dead net": "0 0 0 0 0 0 0 0|- 0 - 0 - 0 - 0|- 0 - 0 - 0 - 0|- 0 - 0 - 0 - 0|- 0 - 0 - 0 - 0",
    "alarm at step 3, learns late": "0 0 0 0 0 0 0 0|- - - - - - - -|- - - - - - - -|- - - - - - - -|- - - - - - - -",
    "high first loss, back to chance": "- - - 40 - 40 40 40|- - - 40 - 40 40 40|- - - 40 - 40 40 40|"
    "- - - 40 - 40 40 40|- - - 40 - 40 40 40",
}


@pytest.mark.parametrize("scenario", list(LOSS_SCENARIOS))
def test_the_guard_replay_reproduces_the_guard_of_rounds_3_to_5(study, scenario):
    """round3/round4 replay the guard of their time (its loss climb; today's guard reads the failure taxonomy
    instead), so that they reproduce the record: the replay must restore what that guard restored."""
    losses, alarm = LOSS_SCENARIOS[scenario]
    run = {"losses": losses, "gnorms": [1.0 if v is not None else None for v in losses], "alarm": alarm}
    recorded = [
        None if v == "-" else int(v) for group in ROUND3_GUARD_ROLLBACKS[scenario].split("|") for v in group.split()
    ]
    grid = [(c, m, k) for c in study.CONFIRM_GRID for m in study.CLIMB_GRID for k in (None, math.log(10))]
    assert len(recorded) == len(grid)
    for (confirm, climb, chance), restored in zip(grid, recorded):
        hit = study.guard_replay(run, confirm, climb, chance)
        assert (hit and hit[1]) == restored, (confirm, climb, chance)


@pytest.mark.parametrize("variant", ["defaults", "immediate", "chance"])
def test_the_guard_command_trains_under_todays_guard(tiny, variant, one_thread):
    """``guard`` trains under CollapseGuard with the study's snapshot and rescue options: the run at lr 0.5 fails
    (its loss explodes) and is rolled back; the kept trajectory is the steps taken less the steps each rescue threw
    away, and the summary is written as JSON."""
    kwargs = tiny.guard_kwargs(variant)
    assert kwargs["snapshots"].every == 10 and kwargs["rescue"].margin == 5
    _, lines, summary = tiny.train_run(dict(norm="none", width=0.25, lr=0.5, seed=100), 40, guard_kwargs=kwargs)
    rescues = summary["rescues"]
    assert rescues and all(r["restored_step"] % 10 == 0 for r in rescues)
    assert all(r["kind"] == "alarm" for r in rescues) == (variant == "immediate")
    lost = sum(r["steps_lost"] for r in rescues)
    assert len(lines) == 40 and len(summary["kept_losses"]) == 40 - lost
    assert json.loads(json.dumps(summary)) == summary


def test_the_round3_regime_rule_matches_the_regime_rule(tiny, one_thread):
    """round3 scores (ratio, window) candidates offline; each must give the step RegimeRule(window, min_ratio)
    gives on the same records (a real plain run that blows up, so non-finite steps are in it too)."""
    from normlab.monitor.rules import RegimeRule, StepContext

    head, lines, summary = tiny.train_run(dict(norm="none", width=0.25, lr=0.5, seed=100), steps=40)
    run = {**head, "steps": lines, "summary": summary}
    prepared = tiny.prepare(run)
    fired = 0
    for ratio in tiny.RATIO_GRID:
        for w in (1, 2, 3):
            det, live = RegimeRule(window=w, min_ratio=ratio), None
            for line in lines:
                hit = det.check(StepContext(step=line["t"]), tiny.replay_records(run, line))
                live = hit.step if hit is not None and live is None else live
            offline = tiny.regime3_step(prepared, ratio, w)
            assert (None if offline == math.inf else offline) == live, (ratio, w)
            fired += live is not None
    assert fired > 0
