"""The monitor's rules (normlab.monitor.rules): each fires on a crafted sequence and stays silent on a healthy one,
its state_dict restores it exactly, a user's own rule works with the monitor and the guard untouched, replay gives
the live monitor's events, and a log written before the rules existed loads as the same alarm."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from normlab.monitor import CollapseGuard, RescueOptions, SnapshotOptions, VarianceMonitor, load_log
from normlab.monitor.rules import (
    DEFAULT_RULES,
    CountdownRule,
    Event,
    FactorRule,
    GradNormZScoreRule,
    LossSpikeRule,
    NonFiniteRule,
    RegimeRule,
    Rule,
    StepContext,
    replay,
)

DATA = Path(__file__).parent / "data"


# ------------------------------------------------------------------------------------------ crafted sequences
def _conv(v, shift=0.01, st=0.1, vt=1.0, layer="c1", index=0):
    return dict(
        layer=layer,
        index=index,
        kind="conv",
        output_var=v,
        shift=shift,
        shift_term=st,
        variance_term=vt,
        shift_scale_free=1.0,
    )


def _head(index=1):
    return dict(layer="head", index=index, kind="linear", output_var=1.0, shift=0.01, input_sq=1.0)


def _record_steps(values, **conv):
    """(ctx, records) per step: a hidden conv with ``values`` of output variance and a quiet head."""
    return [(StepContext(step=t, output_layer="head"), [_conv(v, **conv), _head()]) for t, v in enumerate(values)]


def _scalar_steps(losses=None, norms=None, skipped=()):
    n = len(losses if losses is not None else norms)
    return [
        (
            StepContext(
                step=t,
                loss=None if losses is None else losses[t],
                grad_norm=None if norms is None else norms[t],
                skipped=t in skipped,
                recorded=False,
            ),
            [],
        )
        for t in range(n)
    ]


HEALTHY_VAR = [1.0 * 1.1**t for t in range(30)]  # slow growth: rate 0.1 per step, 16x over the run
NOISY_LOSS = [2.3 - 0.02 * t + 0.1 * math.sin(t) for t in range(60)]
NOISY_NORM = [1.0 + 0.1 * math.sin(1.7 * t) for t in range(60)]

CASES = {  # rule factory, healthy steps, crafted steps, (expected step, quantity) of the event
    "factor": (
        lambda: FactorRule(),
        _record_steps(HEALTHY_VAR),
        _record_steps([1.0] * 5 + [2e3]),
        (5, "output_var"),
    ),
    "countdown": (
        lambda: CountdownRule(),
        _record_steps(HEALTHY_VAR),
        _record_steps([1.0] * 5 + [3.0, 30.0]),
        (6, "output_var_growth"),
    ),
    "regime": (
        lambda: RegimeRule(),
        _record_steps(HEALTHY_VAR, st=3.0),  # shift term 3x the variance term: the healthy plain net
        _record_steps([1.0] * 6, st=20.0),  # 20x for 2 steps
        (1, "shift_term"),
    ),
    "loss_spike": (
        lambda: LossSpikeRule(),
        _scalar_steps(losses=NOISY_LOSS),
        _scalar_steps(losses=NOISY_LOSS[:20] + [40.0]),
        (20, "loss"),
    ),
    "grad_norm_zscore": (
        lambda: GradNormZScoreRule(),
        _scalar_steps(norms=NOISY_NORM),
        _scalar_steps(norms=NOISY_NORM[:30] + [3.0]),
        (30, "grad_norm"),
    ),
    "non_finite": (
        lambda: NonFiniteRule(),
        _scalar_steps(losses=NOISY_LOSS, norms=NOISY_NORM, skipped={3, 7, 8}),  # a few skips: the scaler's calibration
        _scalar_steps(losses=NOISY_LOSS[:10] + [math.inf], norms=NOISY_NORM[:11]),
        (10, "loss"),
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_each_rule_fires_on_its_crafted_sequence_and_stays_silent_on_a_healthy_one(name):
    make, healthy, crafted, (step, quantity) = CASES[name]
    assert replay([make()], healthy) == []
    (event,) = replay([make()], crafted)
    assert (event.rule, event.step, event.quantity) == (name, step, quantity) and event.rule == make().name
    assert event.severity == ("warning" if name == "regime" else "alarm") and event.message
    assert Event.from_dict(event.to_dict()) == event


def test_non_finite_rule_counts_consecutive_skipped_steps():
    steps = _scalar_steps(losses=[1.0] * 20, skipped=set(range(5, 20)))
    (event,) = replay([NonFiniteRule(max_skips=10)], steps)
    assert (event.step, event.quantity, event.value) == (14, "skipped_steps", 10.0)
    assert replay([NonFiniteRule(max_skips=None)], steps) == []
    nan_norm = _scalar_steps(losses=[1.0] * 3, norms=[1.0, math.nan, 1.0])
    assert [e.quantity for e in replay([NonFiniteRule()], nan_norm)] == ["grad_norm"]
    assert replay([NonFiniteRule(grad_norm=False)], nan_norm) == []


def test_loss_spike_statistics_and_patience():
    base = [1.0, 2.0] * 10  # mean and median 1.5, max 2
    for statistic, spike, fires in (("mean", 3.5, True), ("median", 3.5, True), ("max", 3.5, False)):
        rule = LossSpikeRule(factor=2.0, statistic=statistic)
        assert bool(replay([rule], _scalar_steps(losses=base + [spike]))) == fires, statistic
    patient = LossSpikeRule(factor=2.0, statistic="mean", patience=4)  # LLM Foundry's KillLossSpike
    assert replay([patient], _scalar_steps(losses=base + [3.5] * 3 + [1.0])) == []
    assert [
        e.step
        for e in replay(
            [LossSpikeRule(factor=2.0, statistic="mean", patience=4)], _scalar_steps(losses=base + [3.5] * 4)
        )
    ] == [23]
    with pytest.raises(ValueError, match="statistic must be"):
        LossSpikeRule(statistic="mode")
    with pytest.raises(ValueError, match="min_history .* at most window"):
        LossSpikeRule(window=5, min_history=10)


def test_grad_norm_zscore_warm_up_and_clipped_update():
    rule = GradNormZScoreRule(warmup=25)
    assert replay([rule], _scalar_steps(norms=[1.0] * 10 + [50.0])) == []  # within the warm-up: no test
    spikes = _scalar_steps(norms=NOISY_NORM[:30] + [3.0, 3.0, 3.0])
    events = replay([GradNormZScoreRule()], spikes, once=False)
    assert [e.step for e in events] == [30, 31, 32]  # a clipped spike does not lift the EMA enough to hide the next
    with pytest.raises(ValueError, match="alpha must be a number in"):
        GradNormZScoreRule(alpha=1.0)


# ------------------------------------------------------------------------------------------ state dicts
@pytest.mark.parametrize("name", CASES)
def test_state_dict_round_trip_restores_the_rule_exactly(name, tmp_path):
    make, _, crafted, _ = CASES[name]
    steps = crafted[:-1] + crafted[-1:] * 3  # the firing step repeated: streaks and patience count on
    cut = len(crafted) - 2
    whole = replay([make()], steps, once=False)
    first = make()
    assert replay([first], steps[:cut], once=False) == [e for e in whole if e.step < steps[cut][0].step]
    torch.save(first.state_dict(), tmp_path / "rule.pt")
    second = make()
    second.load_state_dict(torch.load(tmp_path / "rule.pt", weights_only=True))  # plain types only
    assert second.state_dict() == first.state_dict()
    assert replay([second], steps[cut:], once=False) == [e for e in whole if e.step >= steps[cut][0].step]
    second.reset()
    assert second.state_dict() == make().state_dict()


# ------------------------------------------------------------------------------------------ a user's rule
class HeadVarianceAbove(Rule):
    """The guide's example rule (docs/monitor.md): an alarm when the output layer's output variance exceeds a limit."""

    name = "head_variance"
    needs_loss = False

    def __init__(self, limit: float = 100.0) -> None:
        self.limit, self.checked = limit, 0

    def check(self, ctx, records):
        self.checked += 1
        head = next((r for r in records if r["layer"] == ctx.output_layer), None)
        if head is not None and head.get("output_var", 0.0) > self.limit:
            return Event(
                rule=self.name,
                severity="alarm",
                step=ctx.step,
                message=f"head variance {head['output_var']:.3g}",
                layer=head["layer"],
                quantity="output_var",
                value=head["output_var"],
            )
        return None

    def state_dict(self):
        return {"checked": self.checked}

    def load_state_dict(self, state):
        self.checked = int(state["checked"])


def _net():
    torch.manual_seed(100)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_a_user_rule_works_with_the_monitor_and_the_guard_untouched():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = VarianceMonitor(model, every=1, rules=[HeadVarianceAbove(limit=50.0)], optimizer=opt)
    rescue = RescueOptions(check_every=1, confirm=None, max_rescues=1)
    guard = CollapseGuard(model, opt, mon, snapshots=SnapshotOptions(every=1), rescue=rescue)
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    taken = []
    for t in range(4):
        if t == 2:
            with torch.no_grad():
                model[2].weight.mul_(100.0)  # the head's output variance x1e4
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        guard.observe_loss(loss)
        opt.step()
        taken.append(not guard.rolled_back)
    assert taken[2] is False  # the user's alarm at step 2 made the guard roll back
    (rescue,) = guard.rescues
    assert "head variance" in rescue.reason and "[head_variance]" in rescue.reason and rescue.onset == 2
    assert mon.state_dict()["rules"]["head_variance"]["checked"] == mon.current_step  # its state rolled back too


def test_a_warning_is_not_acted_on_by_the_guard():
    class AlwaysWarn(Rule):
        name, every_step, needs_loss = "always", True, False

        def check(self, ctx, records):
            return Event(self.name, "warning", ctx.step, "just saying")

    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = VarianceMonitor(model, every=5, rules=[AlwaysWarn()], optimizer=opt)
    rescue = RescueOptions(check_every=1, confirm=None)
    guard = CollapseGuard(model, opt, mon, snapshots=SnapshotOptions(every=1), rescue=rescue)
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    for _ in range(3):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        guard.observe_loss(loss)
        opt.step()
        assert not guard.rolled_back
    assert mon.warning.rule == "always" and mon.alarm is None and not mon.should_stop and guard.rescues == []


# ------------------------------------------------------------------------------------------ replay = live
class _Tape(Rule):
    """Keeps a copy of every (ctx, records) the monitor checks; never fires."""

    name, every_step = "tape", True

    def __init__(self):
        self.steps = []

    def check(self, ctx, records):
        self.steps.append((copy.deepcopy(ctx), copy.deepcopy(list(records))))
        return None


def _all_rules():
    return DEFAULT_RULES() + [
        LossSpikeRule(factor=3.0, statistic="mean", min_history=3),
        GradNormZScoreRule(warmup=5),
        NonFiniteRule(),
    ]


def test_replay_gives_the_live_monitors_events_on_the_same_run():
    torch.manual_seed(100)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    tape = _Tape()
    mon = VarianceMonitor(model, every=4, rules=[tape, *_all_rules()], optimizer=opt)
    for _ in range(40):
        x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        mon.observe_loss(loss)
        opt.step()
        for group in opt.param_groups:
            group["lr"] *= 1.2  # the run becomes unstable and collapses
    assert {e.rule for e in mon.events} >= {"countdown", "loss_spike", "grad_norm_zscore", "non_finite"}
    assert len(tape.steps) == 40 and sum(ctx.recorded for ctx, _ in tape.steps) == 10
    assert replay(_all_rules(), tape.steps) == mon.events


# ------------------------------------------------------------------------------------------ old logs
def _approx_floats(value):
    """``value`` (a record, its nested dicts and lists) with every float compared within float32 rounding; ints,
    strings and None compare exactly."""
    if isinstance(value, dict):
        return {k: _approx_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_approx_floats(v) for v in value]
    return pytest.approx(value, rel=1e-5, abs=1e-9) if isinstance(value, float) else value


def test_a_log_written_before_the_rules_loads_as_the_alarm_the_rules_raise_today():
    """tests/data/monitor_log_before_rules.jsonl: written by VarianceMonitor.to_jsonl before the rules existed (its
    one "alarm" event), on the run below; the default rules raise the same alarm on the same run today."""
    log = load_log(DATA / "monitor_log_before_rules.jsonl")
    (old,) = log.events
    assert (old.rule, old.severity, old.step, old.layer, old.quantity) == (
        "countdown",
        "alarm",
        5,
        "2",
        "output_var_growth",
    )
    assert log.alarm == old.to_dict() and len(log.spp["entries"]) == 3
    torch.manual_seed(100)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = VarianceMonitor(model, every=2, optimizer=opt)
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    for t in range(8):
        if t == 5:
            with torch.no_grad():
                model[2].weight.mul_(30.0)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    # float32 statistics: the same run on another CPU rounds differently (vector widths), so numbers are compared
    # to float32 precision and everything else exactly
    assert [_approx_floats(r) for r in log.records] == [dict(r) for r in mon.records]
    new = mon.alarm
    assert (new.rule, new.step, new.layer, new.quantity) == (old.rule, old.step, old.layer, old.quantity)
    assert new.value == pytest.approx(old.value, rel=1e-5)
    assert new.details == _approx_floats(old.details) and new.message == old.message


def test_the_cli_reads_an_old_log_and_prints_its_alarm(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from normlab.cli import main as cli_main

    assert cli_main(["monitor", str(DATA / "monitor_log_before_rules.jsonl"), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "collapse warning at step 5: layer '2' output_var_growth" in out and "[countdown]" in out
