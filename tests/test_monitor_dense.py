"""The monitor's light per-step path (``CountdownRule(every_step=True)``): the countdown alarm sees every step
between the full records, with one host read-back per step, and fires exactly as a monitor recording every step
would."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from normlab.monitor import VarianceMonitor
from normlab.monitor.rules import CountdownRule, FactorRule, RegimeRule
from normlab.runner.models import build_model

BLOW_UP = 13  # the step at which a hidden conv's weights are multiplied (not a recording step of every=10)


def plain1d(seed: int = 100):
    torch.manual_seed(seed)
    return build_model(
        "plain1d", norm="none", conv="conv", in_channels=1, num_classes=10, input_shape=(1, 40), width=0.25
    )


def batches(n: int, seed: int = 101):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 1, 40, generator=gen), torch.randint(0, 10, (32,), generator=gen)) for _ in range(n)]


def opt_for(model):
    return torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)


def run(model, mon, data, blow_up=BLOW_UP, factor=5.0, start=0):
    """Train on ``data`` with the monitor's optimizer (attached: its step records); at step ``blow_up`` multiply a
    hidden conv's weight."""
    opt = mon.optimizer
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv1d)]
    for step, (x, y) in enumerate(data, start=start):
        if step == blow_up:
            with torch.no_grad():
                convs[2].weight.mul_(factor)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return opt


def alarm_key(alarm):
    return (alarm.step, alarm.layer, alarm.quantity, alarm.value, alarm.details["baseline"], alarm.details["flagged"])


@pytest.mark.parametrize(
    "countdown",
    [{}, {"growth": None, "level": 15.0}, {"growth": 1.0, "grad_ratio": 5.0}],
    ids=["growth", "level", "grad_ratio"],
)
def test_dense_countdown_fires_exactly_as_every_step_records(countdown):
    base, data = plain1d(), batches(30)
    dense_model, full_model = copy.deepcopy(base), copy.deepcopy(base)
    dense = VarianceMonitor(dense_model, every=10, rules=[CountdownRule(**countdown)], optimizer=opt_for(dense_model))
    full = VarianceMonitor(full_model, every=1, rules=[CountdownRule(**countdown)], optimizer=opt_for(full_model))
    run(dense_model, dense, data)
    run(full_model, full, data)
    assert full.alarm is not None and full.alarm.step >= BLOW_UP and full.alarm.step % 10 != 0
    assert alarm_key(dense.alarm) == alarm_key(full.alarm)
    assert sorted({r["step"] for r in dense.records}) == [0, 10, 20]  # light steps add no records
    # without the light path the countdown only sees steps 0, 10, 20: no alarm at the step it fired
    sparse_model = copy.deepcopy(base)
    sparse = VarianceMonitor(
        sparse_model, every=10, rules=[CountdownRule(**countdown, every_step=False)], optimizer=opt_for(sparse_model)
    )
    run(sparse_model, sparse, data)
    assert sparse.alarm is None or sparse.alarm.step % 10 == 0


def test_light_step_reads_back_once(monkeypatch):
    model, data = plain1d(), batches(6)
    rules = [FactorRule(), RegimeRule(), CountdownRule(grad_ratio=5.0)]  # gradient norm on too
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = VarianceMonitor(model, every=5, rules=rules, optimizer=opt)
    reads, syncs = [], []
    tolist = torch.Tensor.tolist
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or tolist(t))
    monkeypatch.setattr(torch.Tensor, "item", lambda t: syncs.append(t.shape) or item(t))
    per_step = []
    for x, y in data:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        reads.clear(), syncs.clear()
        light = mon.is_light
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            opt.step()
        dense_reads = [e.key for e in prof.key_averages() if e.key in ("aten::_local_scalar_dense", "aten::item")]
        per_step.append((light, len(reads), len(syncs), dense_reads))
    for light, n_reads, n_items, scalar_reads in per_step[1:5]:  # steps 1-4: light steps
        assert light and n_reads == 1 and n_items == 0 and scalar_reads == []
    assert not per_step[0][0] and per_step[0][1] == 1  # step 0: every layer's full record in one read-back
    assert len(rules[2].grad_norms) == 6  # every step fed the gradient norm


def test_non_finite_value_alarms_on_a_light_step():
    model, data = plain1d(), batches(10)
    mon = VarianceMonitor(model, every=10, rules=[CountdownRule()], optimizer=opt_for(model))
    run(model, mon, data, blow_up=6, factor=math.nan)
    assert mon.alarm is not None and mon.alarm.step == 6
    assert mon.alarm.quantity == "output_var" and not math.isfinite(mon.alarm.value)


def test_state_dict_round_trip_continues_the_countdown():
    base, data = plain1d(), batches(30)
    ref_model, model = copy.deepcopy(base), copy.deepcopy(base)

    def kw():
        return dict(every=10, rules=[CountdownRule()])

    ref = VarianceMonitor(ref_model, **kw(), optimizer=opt_for(ref_model))
    run(ref_model, ref, data)
    assert ref.alarm is not None and ref.alarm.step % 10 != 0
    first = VarianceMonitor(model, **kw(), optimizer=opt_for(model))
    opt = run(model, first, data[: BLOW_UP + 1])  # the light steps before and at the blow-up fill the countdown
    state = first.state_dict()
    first.close()
    second = VarianceMonitor(model, **kw(), optimizer=opt)
    second.load_state_dict(copy.deepcopy(state))
    assert second.current_step == BLOW_UP + 1 and second.is_light
    for x, y in data[BLOW_UP + 1 :]:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert alarm_key(second.alarm) == alarm_key(ref.alarm)


@pytest.mark.parametrize("every_step", [True, False])
def test_every_step_sets_the_cadence_and_hooks_follow_it(every_step):
    model, data = plain1d(), batches(9)
    seen = []
    rule = CountdownRule(every_step=every_step)
    check = rule.check
    rule.check = lambda ctx, records: seen.append(ctx.step) or check(ctx, records)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = VarianceMonitor(model, every=6, rules=[rule], optimizer=opt)
    conv = mon.layers[0][1]
    hooks = []
    for x, y in data:
        hooks.append(len(conv._forward_hooks))
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert seen == (list(range(9)) if every_step else [0, 6])
    assert hooks == ([1] * 9 if every_step else [1, 0, 0, 0, 0, 0, 1, 0, 0])
    off = VarianceMonitor(plain1d(), every=6, rules=[FactorRule(), RegimeRule()])  # no light steps, no hooks between
    off.current_step = 1
    off._sync_hooks()
    assert not off.is_light and len(off.layers[0][1]._forward_hooks) == 0
