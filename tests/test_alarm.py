"""Countdown alarm (CountdownRule, mon.alarm): variance growth rate and level, gradient norm, non-finite."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import idle, step_without_update
from torch import nn

from normlab.monitor import VarianceMonitor
from normlab.monitor.rules import CountdownRule, FactorRule, RegimeRule, StepContext


def check(rule, step, records, exempt=(), grad_norm=None):
    """The rule's event at ``step``; ``exempt``: the layers the monitor exempts (output layer, renormalized)."""
    return rule.check(StepContext(step=step, grad_norm=grad_norm, feeds_norm=frozenset(exempt)), records)


def recs(v1, head=1.0):
    return [
        dict(layer="c1", index=0, kind="conv", output_var=v1),
        dict(layer="head", index=1, kind="conv", output_var=head),
    ]


def run(det, values, **kw):
    """First alarm of a sequence of c1 variances (one record per step), or None."""
    for t, v in enumerate(values):
        alarm = check(det, t, recs(v), exempt={"head"}, **kw)
        if alarm is not None:
            return alarm
    return None


def test_growth_rate_fires_over_the_span_and_not_on_slow_growth():
    slow = [1.0 * 1.5**t for t in range(6)]  # rate ln 1.5 = 0.41 per step, level 7.6 at the end
    assert run(CountdownRule(growth=1.0, level=15.0), slow) is None
    fast = [1.0, 1.0, 1.0, 3.0, 9.0]  # (ln 9 - ln 1) / 2 = 1.1 at step 4; (ln 3 - ln 1) / 2 = 0.55 at step 3
    a = run(CountdownRule(growth=1.0, level=None), fast)
    assert a.step == 4 and a.layer == "c1" and a.quantity == "output_var_growth" and a.details["ratio"] == 9.0


def test_growth_rate_over_records_further_apart_than_the_span():
    det = CountdownRule(growth=1.0, level=None)
    assert check(det, 0, recs(1.0), exempt={"head"}) is None
    assert check(det, 10, recs(1000.0), exempt={"head"}) is None  # ln(1000) / 10 = 0.69 per step
    assert check(det, 12, recs(1e5), exempt={"head"}).quantity == "output_var_growth"  # ln(100) / 2 = 2.3


def test_level_fires_above_its_threshold_only():
    assert run(CountdownRule(growth=None, level=15.0), [2.0, 20.0, 29.0]) is None
    a = run(CountdownRule(growth=None, level=15.0), [2.0, 20.0, 31.0])
    assert a.step == 2 and a.quantity == "output_var_level" and a.details["ratio"] == pytest.approx(15.5)
    assert a.details["baseline"] == 2.0 and "15" in a.details["reason"]


def test_output_layer_is_exempt_but_still_non_finite():
    det = CountdownRule(growth=0.5, level=2.0)
    for t, head in enumerate([1.0, 100.0, 1e4]):
        assert check(det, t, recs(1.0, head), exempt={"head"}) is None
    a = check(det, 3, recs(1.0, math.inf), exempt={"head"})
    assert a.layer == "head" and a.details["reason"] == "non-finite"


def test_non_finite_norm_layer_output_fires():
    det = CountdownRule()
    a = check(det, 0, [dict(layer="bn", index=0, kind="norm", output_var=math.nan)])
    assert a.layer == "bn" and a.details["reason"] == "non-finite"


def test_gradient_norm_over_its_running_median():
    det = CountdownRule(growth=None, level=None, grad_ratio=10.0)
    for t, g in enumerate([1.0, 2.0, 1.0, 1.5, 1.0]):
        assert check(det, t, recs(1.0), exempt={"head"}, grad_norm=g) is None
    assert check(det, 5, recs(1.0), exempt={"head"}, grad_norm=9.0) is None  # 9x the median 1.0
    a = check(det, 6, recs(1.0), exempt={"head"}, grad_norm=30.0)
    assert a.quantity == "grad_norm" and a.details["ratio"] == pytest.approx(30.0 / 1.25)
    assert check(CountdownRule(), 0, recs(1.0), grad_norm=math.inf).details["reason"] == "non-finite gradient norm"


def test_no_gradient_test_before_five_values():
    det = CountdownRule(growth=None, level=None, grad_ratio=2.0)
    assert all(check(det, t, recs(1.0), grad_norm=g) is None for t, g in enumerate([1.0, 5.0, 25.0, 125.0]))


def test_state_dict_round_trip_gives_the_same_alarm():
    a, b = CountdownRule(grad_ratio=5.0), CountdownRule(grad_ratio=5.0)
    for t, v in enumerate([1.0, 1.2, 1.1, 1.3, 1.2, 1.1]):
        assert check(a, t, recs(v), exempt={"head"}, grad_norm=1.0) is None
    b.load_state_dict(a.state_dict())
    alarm_a = check(a, 6, recs(9.0), exempt={"head"}, grad_norm=1.0)
    assert alarm_a is not None and check(b, 6, recs(9.0), exempt={"head"}, grad_norm=1.0) == alarm_a
    with pytest.raises(ValueError, match="span=2"):
        CountdownRule(span=3).load_state_dict(a.state_dict())


@pytest.mark.parametrize(
    "kw",
    [dict(growth=0.0), dict(level=1.0), dict(grad_ratio=math.inf), dict(span=0), dict(history=4), dict(level=True)],
)
def test_arguments_are_validated(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        CountdownRule(**kw)


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))


def test_monitor_countdown_alarm_in_a_real_loop_and_resume():
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = VarianceMonitor(model, every=1, optimizer=opt, rules=[CountdownRule(level=15.0)])
    x = torch.randn(32, 8)
    for t in range(6):
        if t == 4:
            with torch.no_grad():
                model.b.weight.mul_(5.0)  # Var of b's output x25 > level 15
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if t == 3:
            assert mon.alarm is None
            state = mon.state_dict()
    assert mon.alarm.step == 4 and mon.alarm.layer == "b" and mon.alarm.quantity == "output_var_level"
    torch.manual_seed(0)
    twin = Chain()  # the same run from the state saved after step 3: step 4 raises the same alarm
    with torch.no_grad():
        twin.b.weight.mul_(5.0)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.0)
    resumed = VarianceMonitor(twin, every=1, rules=[CountdownRule(level=15.0)], optimizer=twin_opt)
    resumed.load_state_dict(state)
    twin(x).square().mean().backward()
    twin_opt.step()
    assert resumed.alarm == mon.alarm


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv1d(2, 8, 3), nn.BatchNorm1d(8), nn.Conv1d(8, 2, 1)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))))


def test_shift_of_a_conv_followed_by_a_norm_raises_no_alarm():
    """The SwitchableNorm U-Net false alarm: the shift of a conv before a normalization grew 116x."""
    torch.manual_seed(0)
    model = ConvBN()
    mon = VarianceMonitor(model, every=1, rules=[FactorRule(), RegimeRule()], optimizer=idle(model))
    x = torch.randn(16, 2, 12)
    model(x)
    step_without_update(mon)
    with torch.no_grad():  # spread the filter means of `conv` apart: shift x >100, BN renormalizes it
        model.conv.weight += torch.linspace(-3, 3, 8).view(8, 1, 1)
    for _ in range(3):
        model(x)
        step_without_update(mon)
    assert mon.records[-3]["shift"] > 100 * mon.records[0]["shift"]
    assert mon.alarm is None


def test_no_level_test_on_a_standardized_kernel_but_growth_still_fires():
    det = CountdownRule(growth=1.0, level=15.0)
    pws = lambda t, v: [dict(layer="c1", index=0, kind="conv", output_var=v, shift_scale_free=0.0)]  # noqa: E731
    for t in range(40):  # x1.2 per step: level 1,400x after 40 steps, rate 0.18
        assert check(det, t, pws(t, 1.2**t)) is None
    assert check(det, 40, pws(40, 1e6)).quantity == "output_var_growth"


def test_monitor_countdown_skips_a_layer_renormalized_downstream():
    torch.manual_seed(0)
    model = ConvBN()
    mon = VarianceMonitor(model, every=1, rules=[CountdownRule()], optimizer=idle(model))
    x = torch.randn(16, 2, 12)
    for t in range(4):
        if t == 2:
            with torch.no_grad():
                model.conv.weight.mul_(100.0)  # conv output x1e4, BN output unchanged
        model(x)
        step_without_update(mon)
    conv = [r["output_var"] for r in mon.records if r["layer"] == "conv"]
    assert conv[-1] > 1e3 * conv[0]
    assert mon.alarm is None


@pytest.mark.parametrize("watch", [False, True])
def test_output_variance_growth_of_a_conv_its_norm_reads_alone_alarms_only_when_watched(watch):
    # round 3: BatchNorm removes the conv's scale, so FactorRule no longer growth-tests it unless asked to
    torch.manual_seed(0)
    model = ConvBN()
    mon = VarianceMonitor(model, every=1, rules=[FactorRule(watch_renormalized=watch)], optimizer=idle(model))
    x = torch.randn(16, 2, 12)
    for t in range(3):
        if t == 1:
            with torch.no_grad():
                model.conv.weight.mul_(1e3)
        model(x)
        step_without_update(mon)
    if not watch:
        assert mon.alarm is None
    else:
        assert mon.alarm.layer == "conv" and mon.alarm.quantity == "output_var" and mon.alarm.step == 1
