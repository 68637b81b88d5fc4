"""The round-4 defaults of the variance rules (lab/docs/monitor_calibration.md, "Collapse benchmark, round 4") and
the thresholds the run scales: the countdown's new high and its per-layer spread, the confirmation under any
optimizer, the factor rule's scale-free shift, no implosion test and no regime warning by default. Each behaviour is
checked under SGD and under an adaptive optimizer, on every step and on recorded steps only."""

from __future__ import annotations

import math

import pytest
import torch

from normlab.monitor.rules import DEFAULT_RULES, CountdownRule, FactorRule, RegimeRule, StepContext, replay

CONTEXTS = [  # (adaptive, every_step): the whole class of contexts the variance rules see
    (False, True),
    (False, False),
    (True, True),
    (True, False),
]


def _steps(values, adaptive=False, **rec):
    """(ctx, records) per step: one hidden conv whose output variance is ``values[t]``, then the output layer; every
    other step is a recorded one (a rule with ``every_step=False`` sees only those)."""
    return [
        (
            StepContext(step=t, adaptive=adaptive, output_layer="head", recorded=t % 2 == 0),
            [
                dict(layer="c1", index=0, kind="conv", output_var=v, **rec),
                dict(layer="head", index=1, kind="linear", output_var=1.0, shift=0.01, input_sq=1.0),
            ],
        )
        for t, v in enumerate(values)
    ]


def _alarm_steps(rule, steps):
    return [e.step for e in replay([rule], steps, once=False)]


def _countdown(adaptive: bool, every_step: bool, **kw) -> CountdownRule:
    # adaptive_confirm=1 so that each case reads its own mechanism; adaptive_steps=5 as the default
    return CountdownRule(every_step=every_step, adaptive_confirm=1, **kw)


SETTLE = [1.0] * 8  # the steps an adaptive optimizer's transient skips, and a flat start


# ------------------------------------------------------------------------------------------ new_high
@pytest.mark.parametrize("adaptive,every_step", CONTEXTS)
def test_new_high_ignores_a_recovery_from_a_dip_and_keeps_a_runaway(adaptive, every_step):
    # an over-scaled start deflating 1,000x, then growing back at e^1.5 per step to its old level and beyond
    dip = [1.0 * math.exp(-1.0 * s) for s in range(7)]  # 1 -> 0.0025
    back = [dip[-1] * math.exp(1.5 * s) for s in range(1, 9)]  # 0.0025 -> 0.4 (below the start), then past it
    values = SETTLE + dip + back
    old = _alarm_steps(_countdown(adaptive, every_step, new_high=False), _steps(values, adaptive))
    new = _alarm_steps(_countdown(adaptive, every_step, new_high=True), _steps(values, adaptive))
    first_above = next(t for t, v in enumerate(values) if t >= len(SETTLE) + len(dip) and v > 1.0)
    assert old and old[0] < first_above, "the rate alone flags the recovery"
    assert new == [t for t in old if t >= first_above] and new, "only growth past the old high is flagged"
    # a runaway from a flat start makes a new high every step: the same alarm with or without new_high
    runaway = SETTLE + [math.exp(1.5 * s) for s in range(1, 8)]
    assert _alarm_steps(_countdown(adaptive, every_step, new_high=True), _steps(runaway, adaptive)) == _alarm_steps(
        _countdown(adaptive, every_step, new_high=False), _steps(runaway, adaptive)
    )
    assert CountdownRule().new_high, "the default (round 4)"


# ------------------------------------------------------------------------------------------ spread
@pytest.mark.parametrize("adaptive,every_step", CONTEXTS)
def test_spread_scales_each_layers_threshold_by_the_median_of_its_own_rates(adaptive, every_step):
    # a layer whose log-variance swings as 2 sin(2.1 t) in healthy training: 2-step rates up to 1.7 per step
    swing = SETTLE + [math.exp(2.0 * math.sin(2.1 * s)) for s in range(40)]
    rule = _countdown(adaptive, every_step, new_high=False, spread=3.0)
    replay([rule], _steps(swing, adaptive), once=False)
    mags = sorted(abs(r) for r in rule.rates["c1"])
    median = (mags[len(mags) // 2] + mags[(len(mags) - 1) // 2]) / 2  # the formula, written out
    assert len(mags) == min(rule.spread_window, len(mags)) >= 5
    assert rule.threshold("c1") == pytest.approx(max(1.0, 3.0 * median)) and rule.threshold("c1") > 2.0
    assert rule.threshold("other") == 1.0, "a layer with < 5 rates keeps growth"
    # growth alone flags the swings; with spread only the runaway after them (rate 5 per step)
    runaway = [swing[-1] * math.exp(5.0 * s) for s in range(1, 5)]
    noisy = swing + runaway
    assert any(t < len(swing) for t in _alarm_steps(_countdown(adaptive, every_step, new_high=False), _steps(noisy)))
    scaled = _alarm_steps(_countdown(adaptive, every_step, new_high=False, spread=3.0), _steps(noisy, adaptive))
    warm = len(SETTLE) + 15  # by then the layer has >= 5 rates in any context: its threshold is scaled
    assert any(t >= len(swing) for t in scaled) and not any(warm <= t < len(swing) for t in scaled)
    # a quiet layer keeps growth: spread changes nothing there
    quiet = SETTLE + [1.0] * 10 + [math.exp(1.5 * s) for s in range(1, 6)]
    assert _alarm_steps(_countdown(adaptive, every_step, spread=3.0), _steps(quiet, adaptive)) == _alarm_steps(
        _countdown(adaptive, every_step), _steps(quiet, adaptive)
    )
    with pytest.raises(ValueError, match="spread"):
        CountdownRule(spread=0.0)
    with pytest.raises(ValueError, match="spread_window"):
        CountdownRule(spread_window=4)


# ------------------------------------------------------------------------------------------ confirm
@pytest.mark.parametrize("every_step", [True, False])
def test_confirm_under_sgd_waits_like_adaptive_confirm_does_under_adam(every_step):
    runaway = SETTLE + [math.exp(1.5 * s) for s in range(1, 12)]
    stride = 1 if every_step else 2  # consecutive checked steps: every step, or every recorded one
    first = {k: _alarm_steps(CountdownRule(confirm=k, every_step=every_step), _steps(runaway))[0] for k in (1, 2, 3)}
    assert first[2] == first[1] + stride and first[3] == first[1] + 2 * stride, first
    adam = {
        k: _alarm_steps(CountdownRule(adaptive_confirm=k, every_step=every_step), _steps(runaway, True))[0]
        for k in (1, 2, 3)
    }
    assert adam[2] - adam[1] == stride and adam[3] - adam[1] == 2 * stride
    # confirm does not act under Adam, adaptive_confirm not under SGD
    only_sgd = CountdownRule(confirm=3, adaptive_confirm=1, every_step=every_step)
    only_adam = CountdownRule(confirm=1, adaptive_confirm=3, every_step=every_step)
    assert _alarm_steps(only_sgd, _steps(runaway, True))[0] == adam[1]
    assert _alarm_steps(only_adam, _steps(runaway))[0] == first[1]
    # a non-finite value alarms at once
    assert _alarm_steps(CountdownRule(confirm=5), _steps(SETTLE + [math.inf]))[0] == len(SETTLE)
    with pytest.raises(ValueError, match="confirm"):
        CountdownRule(confirm=0)


# ------------------------------------------------------------------------------------------ state
def test_the_countdowns_new_state_is_in_its_state_dict(tmp_path):
    values = SETTLE + [math.exp(-s) for s in range(6)] + [math.exp(-5 + 1.5 * s) for s in range(1, 8)]
    steps = _steps(values)
    make = lambda: CountdownRule(spread=2.0, confirm=2)  # noqa: E731
    whole = replay([make()], steps, once=False)
    first, cut = make(), 12
    replay([first], steps[:cut], once=False)
    torch.save(first.state_dict(), tmp_path / "rule.pt")
    second = make()
    second.load_state_dict(torch.load(tmp_path / "rule.pt", weights_only=True))
    assert second.state_dict() == first.state_dict() and set(first.state_dict()) >= {"high", "rates"}
    assert replay([second], steps[cut:], once=False) == [e for e in whole if e.step >= cut]


# ------------------------------------------------------------------------------------------ the factor rule
@pytest.mark.parametrize("adaptive", [False, True])
def test_factor_rule_watches_the_scale_free_shift_by_default(adaptive):
    grow = [1.0] * 8 + [1.0 * 10**s for s in range(5)]  # a quantity growing 10,000x
    flat = [1.0] * len(grow)
    # the weights grow as a whole: the raw shift grows with them, the scale-free shift stays at its init value;
    # the output variance grows only 500x (under its own 1,000x)
    whole = [
        (StepContext(step=t, adaptive=adaptive, output_layer="head"),
         [dict(layer="c1", index=0, kind="conv", output_var=min(g, 500.0), shift=g, shift_scale_free=1.0),
          dict(layer="head", index=1, kind="linear", output_var=1.0, shift=0.01, input_sq=1.0)])
        for t, g in enumerate(grow)
    ]  # fmt: skip
    assert replay([FactorRule()], whole) == []
    assert replay([FactorRule(watch=("output_var", "shift"))], whole), "the raw shift (round 3) alarms"
    # the filter means drift apart relative to the weights: the scale-free shift grows 200x
    drift = _steps(flat, adaptive, shift=0.01, shift_scale_free=1.0)
    for t, (_ctx, recs) in enumerate(drift):
        recs[0]["shift_scale_free"] = 200.0 if t >= 10 else 1.0
    events = replay([FactorRule()], drift)
    assert [(e.step, e.quantity) for e in events] == [(10, "shift_scale_free")]
    # a layer a normalization renormalizes gets no shift test, scale-free or raw
    for ctx, _recs in drift:
        ctx.feeds_norm = frozenset({"c1"})
    assert replay([FactorRule()], drift) == []
    # a standardized kernel (WS/PWS: scale-free shift 0) stays silent
    pws = _steps(grow[:8] + [1.0] * 5, adaptive, shift=0.0, shift_scale_free=0.0)
    assert replay([FactorRule()], pws) == []


def test_no_implosion_test_by_default_and_one_on_request():
    steps = [
        (StepContext(step=t, output_layer="head"),
         [dict(layer="c1", index=0, kind="conv", output_var=1.0, shift_scale_free=1.0),
          dict(layer="head", index=1, kind="linear", output_var=1.0, input_sq=1.0 if t < 5 else 1e-6)])
        for t in range(8)
    ]  # fmt: skip
    assert FactorRule().implode_factor == {} and replay([FactorRule()], steps) == []
    events = replay([FactorRule(implode_factor={"input_sq": 1e4})], steps)
    assert [(e.step, e.details["direction"]) for e in events] == [(5, "shrank")]


def test_default_rules_are_the_factor_rule_and_the_countdown():
    rules = DEFAULT_RULES()
    assert [type(r) for r in rules] == [FactorRule, CountdownRule]
    assert not any(isinstance(r, RegimeRule) for r in rules)
    factor, countdown = rules
    assert factor.watch == ("output_var", "shift_scale_free") and factor.implode_factor == {}
    assert factor.explode_factor == {"output_var": 1e3, "shift_scale_free": 100.0}
    assert countdown.growth == 1.0 and countdown.new_high and countdown.spread is None and countdown.confirm == 1
