"""The variance rules under an adaptive optimizer (StepContext.adaptive): the first ``adaptive_steps`` steps (the
optimizer's first-step transient) are neither tested nor used as baselines; under SGD nothing changes."""

from __future__ import annotations

import math
import random

import pytest
import torch

from normlab.monitor import VarianceMonitor
from normlab.monitor.optim_step import is_adaptive
from normlab.monitor.rules import CountdownRule, FactorRule, StepContext, replay


def rec(v, layer="h", index=0, **extra):
    return [dict(layer=layer, index=index, kind="linear", output_var=v, shift=0.01, **extra),
            dict(layer="out", index=1, kind="linear", output_var=1.0, shift=0.01, input_sq=1.0)]  # fmt: skip


def run(rule, values, adaptive, recorded=True):
    steps = [(StepContext(step=s, adaptive=adaptive, output_layer="out", recorded=recorded), rec(v))
             for s, v in enumerate(values)]  # fmt: skip
    return replay([rule], steps, once=False)


@pytest.mark.parametrize(
    "make", [lambda k: CountdownRule(adaptive_steps=k, adaptive_confirm=1), lambda k: FactorRule(adaptive_steps=k)]
)
def test_the_transient_is_skipped_under_an_adaptive_optimizer_only(make):
    transient = [1e-3 * 100**s for s in range(4)] + [2e3] * 26  # 2e6x its first value in 4 steps
    assert run(make(5), transient, adaptive=False), "the transient trips the rule under SGD (as before)"
    assert run(make(5), transient, adaptive=True) == []
    assert run(make(0), transient, adaptive=True), "adaptive_steps=0: no skip"
    # growth after the skipped steps is still seen, against the value after the transient
    later = transient[:20] + [2e3 * 3e3] * 10
    events = run(make(5), later, adaptive=True)
    assert events and events[0].step == 20


def test_countdown_first_value_and_growth_rate_start_after_the_skipped_steps():
    rule = CountdownRule(growth=1.0, level=15.0, adaptive_steps=3)
    run(rule, [1e-4, 1e-2, 1.0, 2.0, 2.0], adaptive=True)
    assert rule.first["h"] == 2.0 and all(s >= 3 for s, _ in rule.recent["h"])
    factor = FactorRule(adaptive_steps=3)
    run(factor, [1e-4, 1e-2, 1.0, 2.0, 2.0], adaptive=True)
    assert factor.baselines[("h", "output_var")] == 2.0


@pytest.mark.parametrize("make", [lambda k: CountdownRule(adaptive_steps=k), lambda k: FactorRule(adaptive_steps=k)])
def test_non_finite_values_are_flagged_during_the_skipped_steps(make):
    events = run(make(10), [1.0, math.inf, 1.0], adaptive=True)
    assert events and events[0].step == 1 and events[0].details["direction"] == "non-finite"


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("cls", [CountdownRule, FactorRule])
def test_without_an_adaptive_optimizer_adaptive_steps_changes_nothing(cls, seed):
    rnd = random.Random(seed)
    values = [math.exp(rnd.gauss(0, 2) + 0.2 * s) for s in range(60)]  # noisy, drifting up: events to compare
    got = {k: [e.to_dict() for e in run(cls(adaptive_steps=k), values, adaptive=False)] for k in (0, 5, 20, 1000)}
    assert got[0] and all(v == got[0] for v in got.values())


def test_adaptive_steps_is_checked():
    for cls in (CountdownRule, FactorRule):
        with pytest.raises(ValueError, match=f"{cls.__name__}: adaptive_steps must be an int >= 0"):
            cls(adaptive_steps=-1)
        with pytest.raises(ValueError, match="adaptive_steps must be an int"):
            cls(adaptive_steps=2.5)


def test_is_adaptive_by_class_and_by_state():
    net = torch.nn.Linear(2, 1)
    for opt in (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax,
                torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adadelta):  # fmt: skip
        assert is_adaptive(opt(net.parameters(), lr=0.1)), opt.__name__
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.ones(1, 2)).sum().backward()
    sgd.step()
    assert not is_adaptive(sgd) and not is_adaptive(None)

    class MyAdam(torch.optim.Optimizer):  # an Adam outside torch.optim: known by its second-moment state
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p].setdefault("exp_avg_sq", torch.zeros_like(p))

    mine = MyAdam(net.parameters())
    assert not is_adaptive(mine)
    mine.step()
    assert is_adaptive(mine)


def test_the_monitor_tells_the_rules_whether_the_optimizer_is_adaptive():
    seen = []

    class Spy(CountdownRule):
        def check(self, ctx, records):
            seen.append(ctx.adaptive)
            return super().check(ctx, records)

    for opt_cls, want in ((torch.optim.AdamW, True), (torch.optim.SGD, False)):
        seen.clear()
        net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
        opt = opt_cls(net.parameters(), lr=0.01)
        VarianceMonitor(net, every=2, rules=[Spy()], optimizer=opt)  # attached: the optimizer steps record
        for _ in range(3):
            net(torch.randn(4, 3)).square().mean().backward()
            opt.step()
        assert seen == [want] * 3
    assert StepContext.from_dict(StepContext(step=1, adaptive=True).to_dict()).adaptive
    assert not StepContext.from_dict({"step": 1}).adaptive  # older contexts: not adaptive


def test_adaptive_confirm_waits_for_a_persisting_rate_under_an_adaptive_optimizer_only():
    # after the skipped steps: one 20x jump that then levels off (flagged on the two steps whose span holds it), and
    # a runaway at 1.5 per step
    surge = [1.0] * 11 + [20.0] * 10
    runaway = [1.0] * 10 + [math.exp(1.5 * s) for s in range(15)]
    for k in (2, 3):
        assert run(CountdownRule(adaptive_confirm=k), surge, adaptive=False), "under SGD the surge still alarms"
    assert run(CountdownRule(adaptive_confirm=1), surge, adaptive=True), "k=1: no confirmation"
    assert run(CountdownRule(adaptive_confirm=2), surge, adaptive=True)
    assert run(CountdownRule(adaptive_confirm=3), surge, adaptive=True) == []
    first = {k: run(CountdownRule(adaptive_confirm=k), runaway, adaptive=True)[0].step for k in (1, 2, 3)}
    assert first[2] == first[1] + 1 and first[3] == first[1] + 2, first
    # a non-finite value alarms at once
    events = run(CountdownRule(adaptive_confirm=5), [1.0] * 8 + [math.inf], adaptive=True)
    assert events and events[0].step == 8


def test_adaptive_confirm_streak_is_in_the_state_dict():
    rule = CountdownRule(adaptive_confirm=3)
    run(rule, [1.0] * 11 + [20.0], adaptive=True)
    state = rule.state_dict()
    assert state["streak"] == {"h": 1}
    fresh = CountdownRule(adaptive_confirm=3)
    fresh.load_state_dict(state)
    assert fresh.streak == {"h": 1}
    with pytest.raises(ValueError):
        CountdownRule(adaptive_confirm=0)
