"""Tests of normlab.monitor against hand-computed values and the variance decomposition (docs/design.md section 2)."""

from __future__ import annotations

import copy
import csv
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import idle, step_without_update
from torch import nn

from normlab.monitor import RecordOptions, VarianceMonitor, signal_propagation, stats
from normlab.monitor.rules import CountdownRule, FactorRule, RegimeRule, StepContext
from normlab.monitor.rules import Rule as StepRule
from normlab.monitor.spp import channel_signal_stats


def small_cnn(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 8, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 5),
    )


def sgd(model, lr=0.1, momentum=0.9, wd=5e-4):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=wd)


def train_steps(model, mon, n_steps, seed=1):
    """Train ``n_steps`` on random input with the monitor's optimizer (attached: its step records), or a new
    :func:`sgd` without a monitor."""
    opt = sgd(model) if mon is None else mon.optimizer
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n_steps):
        x = torch.randn(8, 2, 4, 4, generator=gen)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return opt


# ------------------------------------------------------------------------------------------ pure statistics
W = torch.tensor([[1.0, 2.0], [3.0, 5.0]])  # 2 filters, fan_in 2


def test_shift_of_average_hand_computed():
    # n * mean(W_o) = [3, 8]; biased variance = 2.5^2 = 6.25
    assert stats.fan_in(W) == 2
    assert stats.shift_of_average(W).item() == pytest.approx(6.25)
    # Var[W] over all entries [1, 2, 3, 5] = 2.1875; n Var[W] = 4.375
    assert stats.shift_scale_free(W).item() == pytest.approx(6.25 / 4.375)
    torch.testing.assert_close(stats.weight_variance(W), torch.tensor([0.25, 1.0]))
    # conv weight (2, 1, 1, 2) has the same filters
    assert stats.shift_of_average(W.view(2, 1, 1, 2)).item() == pytest.approx(6.25)
    # zero-mean filters -> no shift
    assert stats.shift_of_average(W - W.mean(dim=1, keepdim=True)).item() == pytest.approx(0.0, abs=1e-12)


def test_update_ratio_and_mean_update_hand_computed():
    after = torch.tensor([[1.0, 3.0], [3.0, 4.0]])
    torch.testing.assert_close(stats.update_ratio(W, after), torch.tensor([4.0, 0.25]))
    # dW = before - after = [[0, -1], [0, 1]]
    torch.testing.assert_close(stats.filter_mean_update(W, after), torch.tensor([-0.5, 0.5]))
    with pytest.raises(ValueError, match="update_ratio"):
        stats.update_ratio(W, after[:1])


def test_input_ratio_hand_computed():
    assert stats.input_ratio(torch.tensor([1.0, 3.0])).item() == pytest.approx(4.0 / 5.0)
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # (N=2, C=2)
    torch.testing.assert_close(stats.channel_input_ratio(x), torch.tensor([4.0 / 5.0, 9.0 / 10.0]))
    # ReLU of a Gaussian: 1/pi
    g = torch.Generator().manual_seed(0)
    r = stats.input_ratio(torch.relu(torch.randn(400_000, generator=g))).item()
    assert r == pytest.approx(1 / math.pi, rel=0.01)
    assert stats.output_variance(torch.tensor([1.0, 3.0])).item() == pytest.approx(1.0)


def test_random_init_scale_free_shift_is_about_one():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 64, generator=g)
    assert stats.shift_scale_free(w).item() == pytest.approx(1.0, rel=0.05)


# ---------------------------------------------------------------------------------------- decomposition
@pytest.mark.parametrize("layer", ["linear", "conv1x1"])
def test_variance_decomposition_on_iid_input(layer):
    """Var[Y] = n E[W^2] Var[X] + E^2[X] Var_o[n E[W_o]] on i.i.d. input; tolerance 5% (seeded)."""
    torch.manual_seed(0)
    n, out, samples = 32, 64, 20_000
    w = torch.randn(out, n) * math.sqrt(1.0 / n)
    w += torch.randn(out, 1) * 0.1  # per-filter shifts ...
    w -= w.mean()  # ... with zero overall mean, so E[W^2] = Var[W]
    if layer == "linear":
        mod = nn.Linear(n, out, bias=False)
        mod.weight.data.copy_(w)
        x = 1.0 + torch.randn(samples, n)  # E[X] = 1, Var[X] = 1
    else:
        mod = nn.Conv2d(n, out, 1, bias=False)
        mod.weight.data.copy_(w.view(out, n, 1, 1))
        x = 1.0 + torch.randn(samples // 16, n, 4, 4)
    with VarianceMonitor(mod, every=1, optimizer=idle(mod)) as mon:
        mod(x)
        step_without_update(mon)
    (rec,) = mon.records
    e2x = rec["input_mean_sq"] / rec["input_ratio"]
    var_x = e2x - rec["input_mean_sq"]
    # E[W^2] = mean_o Var[W_o] + mean_o mean(W_o)^2 = weight_var + shift / n^2 (filter means average to 0)
    second_moment = rec["weight_var"] + rec["shift"] / n**2
    variance_term = n * second_moment * var_x
    shift_term = rec["input_mean_sq"] * rec["shift"]
    assert shift_term > 0.5 * variance_term  # the shift term matters here: omitting it fails the test
    assert rec["output_var"] == pytest.approx(variance_term + shift_term, rel=0.05)
    assert rec["shift"] == pytest.approx(stats.shift_of_average(w).item(), rel=1e-5)


# -------------------------------------------------------------------------------------- monitor behaviour
def test_update_ratio_matches_hand_made_sgd_step():
    torch.manual_seed(0)
    lin = nn.Linear(6, 4)
    x = torch.randn(10, 6)
    opt = torch.optim.SGD(lin.parameters(), lr=0.3)
    w0 = lin.weight.detach().clone()
    with VarianceMonitor(lin, every=1, optimizer=opt) as mon:
        lin(x).pow(2).sum().backward()
        g = lin.weight.grad.clone()
        opt.step()
    (rec,) = mon.records
    w1 = w0 - 0.3 * g
    ratio = w1.var(dim=1, unbiased=False) / w0.var(dim=1, unbiased=False)
    mean_update = (0.3 * g).mean(dim=1)
    assert rec["update_ratio_mean"] == pytest.approx(ratio.mean().item(), rel=1e-5)
    assert rec["update_ratio_min"] == pytest.approx(ratio.min().item(), rel=1e-5)
    assert rec["update_ratio_max"] == pytest.approx(ratio.max().item(), rel=1e-5)
    assert rec["mean_update_mean"] == pytest.approx(mean_update.mean().item(), rel=1e-4, abs=1e-7)
    assert rec["mean_update_std"] == pytest.approx(mean_update.std(unbiased=False).item(), rel=1e-4)
    assert rec["mean_update_absmax"] == pytest.approx(mean_update.abs().max().item(), rel=1e-5)
    assert rec["weight_var"] == pytest.approx(w0.var(dim=1, unbiased=False).mean().item(), rel=1e-5)


def test_update_includes_momentum_and_weight_decay():
    torch.manual_seed(0)
    lin = nn.Linear(5, 3, bias=False)
    xs = [torch.randn(7, 5) for _ in range(2)]
    lr, m, wd = 0.1, 0.9, 0.01
    opt = torch.optim.SGD(lin.parameters(), lr=lr, momentum=m, weight_decay=wd)
    mon = VarianceMonitor(lin, every=2, optimizer=opt)
    w = lin.weight.detach().clone()
    buf = None
    for x in xs:
        opt.zero_grad()
        lin(x).sum().backward()
        d = lin.weight.grad + wd * lin.weight.detach()
        buf = d if buf is None else m * buf + d
        w_before = w
        w = w - lr * buf
        opt.step()
    assert [r["step"] for r in mon.records] == [0]  # step 1 is not a recording step with every=2
    # record the third step (step 2) and compare with the hand-made momentum update
    opt.zero_grad()
    lin(xs[0]).sum().backward()
    d = lin.weight.grad + wd * lin.weight.detach()
    buf = m * buf + d
    w_before, w = w, w - lr * buf
    opt.step()
    rec = mon.records[-1]
    assert rec["step"] == 2
    expected = (w_before - w).mean(dim=1)
    assert rec["mean_update_std"] == pytest.approx(expected.std(unbiased=False).item(), rel=1e-4)
    assert rec["mean_update_absmax"] == pytest.approx(expected.abs().max().item(), rel=1e-4)
    torch.testing.assert_close(lin.weight.detach(), w)


def test_records_only_on_recording_steps_and_hooks_detached_between():
    model = small_cnn()
    mon = VarianceMonitor(
        model, every=3, rules=[FactorRule(), RegimeRule(), CountdownRule(every_step=False)], optimizer=sgd(model)
    )  # full records only
    conv = model[0]
    counts = []
    for _ in range(7):
        counts.append(len(conv._forward_hooks))
        train_steps(model, mon, 1)
    assert counts == [1, 0, 0, 1, 0, 0, 1]
    assert sorted({r["step"] for r in mon.records}) == [0, 3, 6]
    assert mon.current_step == 7
    # 4 layers: conv, bn, conv, linear; in forward order
    assert [r["layer"] for r in mon.records if r["step"] == 0] == ["0", "1", "3", "6"]
    assert [r["kind"] for r in mon.records if r["step"] == 0] == ["conv", "norm", "conv", "linear"]
    mon.close()
    assert all(len(m._forward_hooks) == 0 for m in model.modules())


def test_hooks_removed_leave_outputs_bit_identical():
    model = small_cnn()
    x = torch.randn(4, 2, 4, 4)
    model.eval()
    ref = model(x)
    with VarianceMonitor(model, every=1, recording=RecordOptions(record_eval=True), optimizer=idle(model)) as mon:
        during = model(x)
        step_without_update(mon)
    after = model(x)
    assert len(mon.records) == 4
    assert torch.equal(ref, during) and torch.equal(ref, after)
    assert all(len(m._forward_hooks) == 0 for m in model.modules())


def test_gradients_and_parameters_identical_with_and_without_monitor():
    a, b = small_cnn(), small_cnn()
    x = torch.randn(8, 2, 4, 4)
    for mod in (a, b):
        mod(x).square().mean().backward()
    mon = VarianceMonitor(b, every=1, optimizer=sgd(b))
    a.zero_grad()
    b.zero_grad()
    a(x).square().mean().backward()
    b(x).square().mean().backward()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa.grad, pb.grad)
    # a few full steps (BN running stats included) stay bit-identical
    train_steps(a, None, 3)
    train_steps(b, mon, 3)
    for ta, tb in zip(a.state_dict().values(), b.state_dict().values()):
        assert torch.equal(ta, tb)
    mon.close()


def test_eval_forward_not_recorded_by_default():
    model = small_cnn()
    mon = VarianceMonitor(model, every=1, optimizer=idle(model))
    model.eval()
    model(torch.randn(2, 2, 4, 4))
    step_without_update(mon)
    assert all("output_var" not in r for r in mon.records)
    assert all("shift" in r for r in mon.records if r["kind"] != "norm")


# ------------------------------------------------------------------------------------ effective weights
class ZeroMeanLinear(nn.Linear):
    """Applies zero-mean filters, like WS/PWS: effective_weight() is the kernel really used."""

    def effective_weight(self):
        return self.weight - self.weight.mean(dim=1, keepdim=True)

    def forward(self, x):
        return F.linear(x, self.effective_weight(), self.bias)


def test_effective_weight_is_used_for_shift():
    torch.manual_seed(0)
    lin = ZeroMeanLinear(8, 6)
    with torch.no_grad():
        lin.weight += torch.arange(6.0).view(6, 1)  # raw filters far apart
    assert stats.shift_of_average(lin.weight).item() > 100
    with VarianceMonitor(lin, every=1, optimizer=idle(lin)) as mon:
        lin(torch.randn(4, 8))
        step_without_update(mon)
    assert mon.records[0]["shift"] == pytest.approx(0.0, abs=1e-9)
    assert mon.records[0]["shift_scale_free"] == pytest.approx(0.0, abs=1e-9)


def test_pws_conv_shift_is_zero():
    nlnn = pytest.importorskip("normlab.nn.weight_std", reason="normlab WS/PWS layers not available")
    conv = nlnn.PWSConv2d(3, 8, 3, padding=1)
    with torch.no_grad():
        conv.weight += torch.linspace(-1, 1, 8).view(8, 1, 1, 1)
    with VarianceMonitor(conv, every=1, optimizer=idle(conv)) as mon:
        conv(torch.randn(2, 3, 5, 5))
        step_without_update(mon)
    assert mon.records[0]["shift"] == pytest.approx(0.0, abs=1e-6)


def test_weight_norm_parametrization_uses_effective_weight():
    torch.manual_seed(0)
    lin = nn.utils.parametrizations.weight_norm(nn.Linear(5, 4))
    with torch.no_grad():
        lin.parametrizations.weight.original0.mul_(3.0)
    with VarianceMonitor(lin, every=1, optimizer=idle(lin)) as mon:
        lin(torch.randn(3, 5))
        step_without_update(mon)
    assert mon.records[0]["shift"] == pytest.approx(stats.shift_of_average(lin.weight).item(), rel=1e-5)


# ------------------------------------------------------------------------------------------------ alarm
class TwoLayers(nn.Module):
    """`late` is registered first but runs second: the alarm must follow forward order."""

    def __init__(self):
        super().__init__()
        self.late = nn.Linear(8, 8)
        self.early = nn.Linear(8, 8)

    def forward(self, x):
        return self.late(torch.relu(self.early(x)))


def test_alarm_names_first_exploding_layer_in_forward_order():
    torch.manual_seed(0)
    model = TwoLayers()
    fired = []
    # the countdown on recorded steps only: on every step it would fire at step 3; this test is the factor rules'
    rules = [FactorRule(explode_factor=50.0, watch_output_layer=True), RegimeRule(), CountdownRule(every_step=False)]
    mon = VarianceMonitor(model, every=2, rules=rules, optimizer=idle(model))
    mon.add_sink(fired.append)
    x = torch.randn(32, 8)
    for step in range(6):
        if step == 3:  # explode the first layer: both outputs grow by 1e4 (early) and more (late)
            with torch.no_grad():
                model.early.weight.mul_(100.0)
        model(x)
        step_without_update(mon)
        if step == 2:
            assert mon.alarm is None and not mon.should_stop
    assert mon.alarm is not None and mon.should_stop
    assert mon.alarm.layer == "early" and mon.alarm.step == 4
    assert mon.alarm.quantity in ("output_var", "shift")
    assert mon.alarm.value > 50 * mon.alarm.details["baseline"]
    assert {f["layer"] for f in mon.alarm.details["flagged"]} == {"early", "late"}
    assert fired == mon.events and fired[0] is mon.alarm and mon.alarm.rule == "factor"  # once per event
    assert len({e.rule for e in fired}) == len(fired)  # each rule's first event only


def test_alarm_on_shift_growth_and_non_finite():
    torch.manual_seed(0)
    model = TwoLayers()
    mon = VarianceMonitor(
        model,
        every=1,
        rules=[FactorRule(explode_factor=10.0, watch=("shift",), watch_output_layer=True)],
        optimizer=idle(model),
    )
    x = torch.randn(16, 8)
    model(x)
    step_without_update(mon)
    with torch.no_grad():  # spread the filter means of `late` apart: shift grows, no other change
        model.late.weight += torch.linspace(-3, 3, 8).view(8, 1)
    model(x)
    step_without_update(mon)
    assert mon.alarm.layer == "late" and mon.alarm.quantity == "shift" and mon.alarm.step == 1

    model2 = TwoLayers()
    mon2 = VarianceMonitor(model2, every=1, optimizer=idle(model2))
    model2(x)
    step_without_update(mon2)
    with torch.no_grad():
        model2.early.weight[0, 0] = float("inf")
    model2(x)
    step_without_update(mon2)
    assert mon2.alarm.layer == "early" and mon2.alarm.details["reason"] == "non-finite"


def test_output_layer_growth_not_flagged_by_default_but_non_finite_is():
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    for watch_output, expected in ((False, None), (True, "late")):
        model = TwoLayers()  # `late` is the output layer (last in forward order)
        mon = VarianceMonitor(
            model,
            every=1,
            rules=[FactorRule(explode_factor=10.0, watch_output_layer=watch_output), CountdownRule()],
            optimizer=idle(model),
        )
        model(x)
        step_without_update(mon)
        with torch.no_grad():  # the classifier's logits and class offsets grow: confident, not collapsing
            model.late.weight.mul_(10.0).add_(torch.linspace(-3, 3, 8).view(8, 1))
        model(x)
        step_without_update(mon)
        assert (mon.alarm.layer if mon.alarm else None) == expected
        with torch.no_grad():
            model.late.weight[0, 0] = float("nan")
        model(x)
        step_without_update(mon)
        assert mon.alarm.layer == "late" and (watch_output or mon.alarm.details["reason"] == "non-finite")


def test_detector_ignores_round_off_on_zero_initial_shift():
    det = FactorRule(explode_factor=10.0, watch=("shift",), min_initial=1e-6)
    assert det.check(StepContext(step=0), [{"layer": "a", "index": 0, "shift": 1e-15}]) is None
    assert det.check(StepContext(step=1), [{"layer": "a", "index": 0, "shift": 1e-12}]) is None
    assert det.check(StepContext(step=2), [{"layer": "a", "index": 0, "shift": 1e-4}]).layer == "a"


def test_detector_floor_is_a_minimum_absolute_level():
    det = FactorRule(explode_factor=1000.0, watch=("output_var",), min_initial={"output_var": 1.0})
    rec = lambda v: [{"layer": "a", "index": 0, "output_var": v}]  # noqa: E731
    assert det.check(StepContext(step=0), rec(0.01)) is None  # a layer whose signal starts tiny
    assert det.check(StepContext(step=1), rec(50.0)) is None  # 5000x its start, but only 50x unit variance
    alarm = det.check(StepContext(step=2), rec(1500.0))
    assert (
        alarm.details["baseline"] == 0.01 and alarm.details["ratio"] == 1500.0
    )  # the ratio is measured against the floor
    with pytest.raises(ValueError, match="min_initial for 'shift'"):
        FactorRule(min_initial={"shift": -1.0})
    rule = VarianceMonitor(nn.Linear(2, 2)).rules[0]  # the default rule: unit-variance floor for output_var
    # round 4 (lab/docs/monitor_calibration.md): the scale-free shift, no implosion test
    assert rule.min_initial == {"output_var": 1.0, "shift_scale_free": 1e-6}
    assert rule.explode_factor == {"output_var": 1e3, "shift_scale_free": 100.0}
    assert rule.implode_factor == {}


def test_detector_per_quantity_factors_and_forward_order():
    det = FactorRule(explode_factor={"output_var": 1000.0, "shift": 10.0}, watch=("output_var", "shift"))
    init = [
        {"layer": "b", "index": 1, "output_var": 1.0, "shift": 1.0},
        {"layer": "a", "index": 0, "output_var": 1.0, "shift": 1.0},
    ]
    assert det.check(StepContext(step=0), init) is None
    grown = [
        {"layer": "b", "index": 1, "output_var": 1.0, "shift": 20.0},
        {"layer": "a", "index": 0, "output_var": 500.0, "shift": 1.0},
    ]
    alarm = det.check(StepContext(step=5), grown)  # a's 500x stays under its 1000x factor; b's shift 20x exceeds 10x
    assert (alarm.layer, alarm.quantity, alarm.step, alarm.details["ratio"]) == ("b", "shift", 5, 20.0)
    with pytest.raises(ValueError, match="factor for 'shift'"):
        FactorRule(explode_factor={"shift": 1.0})


def test_detector_baseline_window_takes_max_of_first_records():
    rec = lambda v: [{"layer": "a", "index": 0, "shift": v}]  # noqa: E731
    one = FactorRule(explode_factor=10.0, watch=("shift",))
    three = FactorRule(explode_factor=10.0, watch=("shift",), baseline_records=3)
    # an early transient (1 -> 5 -> 8) then a 60x value: with a 1-record baseline (1.0) the transient already fires
    assert one.check(StepContext(step=0), rec(1.0)) is None
    assert one.check(StepContext(step=1), rec(15.0)).details["ratio"] == 15.0
    for step, v in enumerate([1.0, 5.0, 8.0]):
        assert three.check(StepContext(step=step), rec(v)) is None  # no growth test while the baseline is collected
    assert three.baselines[("a", "shift")] == 8.0
    assert three.check(StepContext(step=3), rec(79.0)) is None  # 9.9x the max of the window
    alarm = three.check(StepContext(step=4), rec(81.0))
    assert alarm.details["baseline"] == 8.0 and alarm.details["ratio"] == pytest.approx(81.0 / 8.0)
    assert three.check(StepContext(step=5), rec(float("nan"))).details["reason"] == "non-finite"
    with pytest.raises(ValueError, match="baseline_records"):
        FactorRule(baseline_records=0)


def test_monitor_state_dict_round_trip_gives_the_same_alarm(tmp_path):
    """A monitor restored from state_dict() mid-run raises the alarm the uninterrupted monitor raises."""

    def run(model, mon, steps, x, grow_at=6):
        for step in steps:
            if step == grow_at:
                with torch.no_grad():
                    model.late.weight += torch.linspace(-2, 2, 8).view(8, 1)  # shift of `late` grows
            model(x)
            step_without_update(mon)

    torch.manual_seed(0)
    x = torch.randn(16, 8)
    ref_model = TwoLayers()
    model = copy.deepcopy(ref_model)

    def kw():
        factor = FactorRule(explode_factor=10.0, watch=("shift",), baseline_records=2, watch_output_layer=True)
        return dict(every=2, rules=[factor, RegimeRule(), CountdownRule()], optimizer=idle(model))

    ref = VarianceMonitor(ref_model, **kw())
    run(ref_model, ref, range(10), x)
    assert ref.alarm is not None and (ref.alarm.layer, ref.alarm.step) == ("late", 6)

    first = VarianceMonitor(model, **kw())
    run(model, first, range(4), x)  # steps 0 and 2 form the baseline
    state = first.state_dict()
    first.close()
    torch.save(state, tmp_path / "mon.pt")
    state = torch.load(tmp_path / "mon.pt", weights_only=True)  # plain types only
    resumed = VarianceMonitor(model, **kw())
    resumed.load_state_dict(state)
    assert resumed.current_step == 4 and resumed.is_recording
    run(model, resumed, range(4, 10), x)
    a, b = resumed.alarm, ref.alarm
    assert (a.layer, a.step, a.quantity, a.value, a.details["baseline"]) == (
        b.layer,
        b.step,
        b.quantity,
        b.value,
        b.details["baseline"],
    )
    # without the state, the baseline would be the (already grown) value at step 6: no alarm at all
    fresh_model = copy.deepcopy(ref_model)
    run(fresh_model, VarianceMonitor(fresh_model, **kw()), range(4), x)
    lost = VarianceMonitor(fresh_model, **kw())
    lost.current_step = 4
    run(fresh_model, lost, range(4, 10), x)
    assert lost.alarm is None
    # an alarm that already fired is restored (and not sent to the sinks again)
    again = VarianceMonitor(ref_model, **kw())
    again.add_sink(lambda a: pytest.fail("event sent twice"))
    again.load_state_dict(ref.state_dict())
    assert again.alarm == ref.alarm and again.should_stop


def test_monitor_load_state_dict_refuses_mismatched_state():
    mon = VarianceMonitor(TwoLayers(), every=2)
    state = mon.state_dict()
    with pytest.raises(ValueError, match="every=2"):
        VarianceMonitor(TwoLayers(), every=3).load_state_dict(state)
    with pytest.raises(ValueError, match="current_step"):
        mon.load_state_dict({**state, "current_step": -1})
    with pytest.raises(ValueError, match="does not have"):
        mon.load_state_dict({**state, "order": {"nope": 0}})
    with pytest.raises(ValueError, match="expected a dict"):
        mon.load_state_dict([1, 2])
    with pytest.raises(ValueError, match="baseline_records"):
        VarianceMonitor(TwoLayers(), every=2, rules=[FactorRule(baseline_records=4)]).load_state_dict(state)


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("every", [0, -3, 1.5, True, "10"])
def test_bad_every_raises(every):
    with pytest.raises(ValueError, match="every"):
        VarianceMonitor(nn.Linear(2, 2), every=every)


def test_model_without_supported_layers_raises():
    with pytest.raises(ValueError, match="no supported layers"):
        VarianceMonitor(nn.Sequential(nn.ReLU(), nn.Flatten()))
    with pytest.raises(TypeError, match="nn.Module"):
        VarianceMonitor("model")
    with pytest.raises(ValueError, match="factor"):
        FactorRule(explode_factor=0.5)
    with pytest.raises(TypeError, match="rules must be"):
        VarianceMonitor(nn.Linear(2, 2), rules=[FactorRule])
    with pytest.raises(ValueError, match="rule names must be unique"):
        VarianceMonitor(nn.Linear(2, 2), rules=[FactorRule(), FactorRule()])


# --------------------------------------------------------------------------------------------- wrappers
def test_ddp_wrapped_model(tmp_path):
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = small_cnn()
        ref = small_cnn()
        ddp = nn.parallel.DistributedDataParallel(model)
        mon = VarianceMonitor(ddp, every=1, optimizer=sgd(ddp))
        assert mon.model is model
        train_steps(ddp, mon, 2)
        train_steps(ref, None, 2)
        assert len(mon.records) == 8
        for ta, tb in zip(ref.state_dict().values(), model.state_dict().values()):
            assert torch.equal(ta, tb)
        mon.close()
    finally:
        dist.destroy_process_group()


def test_compiled_model_records_same_values():
    model = small_cnn()
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(4, 2, 4, 4)
    ref = VarianceMonitor(small_cnn(), every=1, optimizer=idle(small_cnn()))
    ref.model(x)
    step_without_update(ref)
    ref.close()
    mon = VarianceMonitor(compiled, every=1, optimizer=idle(compiled))
    assert mon.model is model and mon.compiled
    compiled(x)
    step_without_update(mon)
    mon.close()
    assert len(mon.records) == len(ref.records) == 4
    for a, b in zip(mon.records, ref.records):
        assert a["output_var"] == pytest.approx(b["output_var"], rel=1e-6)
        assert a["input_ratio"] == pytest.approx(b["input_ratio"], rel=1e-6)


# -------------------------------------------------------------------------------------- export and plots
def test_export_jsonl_csv_and_plots(tmp_path):
    from normlab.cli import main as cli_main
    from normlab.monitor.plots import load_log, render_monitor_plots

    model = small_cnn()
    mon = VarianceMonitor(model, every=2, optimizer=sgd(model))
    train_steps(model, mon, 5)
    mon.records[0]["output_var"] = float("nan")  # exported as null
    mon.add_signal_propagation((4, 2, 4, 4))
    jl = mon.to_jsonl(tmp_path / "log.jsonl")
    cv = mon.to_csv(tmp_path / "log.csv")
    lines = [json.loads(s) for s in jl.read_text().splitlines()]
    assert len(lines) == len(mon.records) + 1 and lines[-1]["event"] == "spp"
    assert lines[0]["output_var"] is None and lines[1]["output_var"] == mon.records[1]["output_var"]
    rows = list(csv.DictReader(open(cv)))
    assert len(rows) == len(mon.records)
    assert float(rows[1]["output_var"]) == pytest.approx(mon.records[1]["output_var"])
    assert rows[1]["shift"] == ""  # BN layer has no weight-side quantities
    records, alarm, spp, events = load_log(jl)
    assert len(records) == len(mon.records) and alarm is None and events == [] and len(spp["entries"]) == 4
    assert cli_main(["monitor", str(jl), "--out", str(tmp_path / "cli")]) == 0
    paths = sorted((tmp_path / "cli").iterdir())
    assert [p.name for p in paths] == sorted(
        [
            "fig1a_update_ratio.png",
            "fig1b_mean_update.png",
            "fig2_weight_var.png",
            "fig6_input_ratio.png",
            "output_var.png",
            "spp.png",
        ]
    )
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    with pytest.raises(ValueError, match="no monitor records"):
        (tmp_path / "empty.jsonl").write_text("")
        render_monitor_plots(tmp_path / "empty.jsonl", tmp_path / "y")
    assert cli_main(["monitor", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "x")]) == 2


@pytest.mark.parametrize("spike, scale", [(1e3, "log"), (1.05, "linear")])
def test_fig1a_update_ratio_is_on_a_log_axis_where_it_spans_decades(spike, scale, tmp_path, monkeypatch):
    """Fig. 1(a): ratios near 1 and a collapse's spike to 1e3 on a linear axis left every curve flat until the
    spike; a log axis shows both. Ratios that stay near 1 keep a linear axis."""
    from normlab.monitor import plots, write_monitor_log

    records = [
        {"step": s, "layer": layer, "index": i, "type": "Conv2d", "kind": "conv",
         "update_ratio_mean": spike if s == 9 else 1.0 + 0.01 * s}
        for s in range(10) for i, layer in enumerate(("conv1", "conv2"))
    ]  # fmt: skip
    write_monitor_log(tmp_path / "log.jsonl", records)
    scales = {}
    real = plots.save_figure

    def keep(fig, path, *a, **kw):
        scales[Path(path).name] = [ax.get_yscale() for ax in fig.axes]
        return real(fig, path, *a, **kw)

    monkeypatch.setattr(plots, "save_figure", keep)
    plots.render_monitor_plots(tmp_path / "log.jsonl", tmp_path / "plots")
    assert scales["fig1a_update_ratio.png"] == [scale]


# ------------------------------------------------------------------------------------- signal propagation
class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.branch = nn.Sequential(nn.ReLU(), nn.Conv2d(c, c, 1))

    def forward(self, x):
        return x + self.branch(x)


def test_signal_propagation_matches_hand_computed_and_keeps_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), Block(4), Block(4))
    state = copy.deepcopy(model.state_dict())
    data = signal_propagation(model, (8, 3, 5, 5), seed=3)
    assert data["mode"] == "blocks" and [e["name"] for e in data["entries"]] == ["2", "3"]
    # the same computation by hand (train mode: BN uses batch statistics)
    x = torch.randn((8, 3, 5, 5), generator=torch.Generator().manual_seed(3))
    net = copy.deepcopy(model).train()
    with torch.no_grad():
        h = net[1](net[0](x))
        r1 = net[2].branch(h)
        h1 = h + r1
        h2 = net[3](h1)
    xc = h1.transpose(0, 1).reshape(4, -1)
    assert data["entries"][0]["avg_sq_mean"] == pytest.approx(xc.mean(1).square().mean().item(), rel=1e-5)
    assert data["entries"][0]["avg_var"] == pytest.approx(xc.var(1, unbiased=False).mean().item(), rel=1e-5)
    assert data["entries"][0]["residual_var"] == pytest.approx(channel_signal_stats(r1)[1], rel=1e-5)
    assert data["entries"][1]["avg_var"] == pytest.approx(channel_signal_stats(h2)[1], rel=1e-5)
    for k, v in model.state_dict().items():  # running stats untouched
        assert torch.equal(v, state[k])
    plain = signal_propagation(small_cnn(), (4, 2, 4, 4))
    assert plain["mode"] == "layers" and len(plain["entries"]) == 4
    with pytest.raises(ValueError, match="input_shape"):
        signal_propagation(model, (0, 3))


def test_compiled_model_attached_late_warns_and_keeps_weight_stats():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(5, 3)
    compiled(x)  # compiled before the hooks exist: compiled code will not run them
    mon = VarianceMonitor(compiled, every=1, optimizer=idle(compiled))
    compiled(x)
    with pytest.warns(UserWarning, match="before calling the compiled model"):
        step_without_update(mon)
    assert all("output_var" not in r and "shift" in r for r in mon.records)
    mon.close()


def test_copies_of_monitored_model_do_not_record():
    model = small_cnn()
    mon = VarianceMonitor(model, every=1, optimizer=idle(model))
    twin = copy.deepcopy(model)  # carries the hooks (EMA copies, signal_propagation's copy)
    twin(torch.randn(4, 2, 4, 4) * 100)
    mon.add_signal_propagation((4, 2, 4, 4))
    x = torch.randn(4, 2, 4, 4)
    model(x)
    step_without_update(mon)
    with torch.no_grad():
        expected = stats.output_variance(model[0](x)).item()
    assert mon.records[0]["output_var"] == pytest.approx(expected, rel=1e-6)
    mon.close()


def test_normlab_norm_layers_are_monitored():
    from normlab.monitor.layers import supported_layers
    from normlab.nn import BatchRenorm2d, InstanceNorm2d, SwitchableNorm2d

    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), BatchRenorm2d(4), nn.Conv2d(4, 4, 1), SwitchableNorm2d(4), InstanceNorm2d(4, affine=True)
    )
    kinds = {name: kind for name, _, kind in supported_layers(model)}
    assert kinds == {"0": "conv", "1": "norm", "2": "conv", "3": "norm", "4": "norm"}


def test_every_layer_is_norm_layer_counts_is_recorded_as_a_norm():
    # is_norm_layer (weight decay) and the monitor share one definition: RMSNorm was counted but not recorded
    from normlab.nn import is_norm_layer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.RMSNorm(6), nn.ReLU(), nn.Linear(6, 3), nn.LayerNorm(3))
    norms = [n for n, m in model.named_modules() if is_norm_layer(m)]
    assert norms == ["1", "4"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = VarianceMonitor(model, every=1, optimizer=opt)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    recorded = {r["layer"]: r for r in mon.records}
    assert set(recorded) == {"0", "1", "3", "4"}
    assert recorded["1"]["kind"] == "norm" and recorded["1"]["output_var"] > 0


def test_records_carry_the_two_terms_of_the_output_variance():
    # 1x1 conv (no padding) on i.i.d. ReLU(N(0, 1)) input with filter means spread apart: the shift term matters
    torch.manual_seed(3)
    conv = nn.Conv2d(64, 32, 1, bias=False)
    with torch.no_grad():
        conv.weight.normal_(0, (2 / 64) ** 0.5).add_(torch.randn(32, 1, 1, 1) * 0.05)
    mon = VarianceMonitor(
        nn.Sequential(conv), every=1, recording=RecordOptions(include_norm=False), optimizer=idle(nn.Sequential(conv))
    )
    conv(torch.relu(torch.randn(64, 64, 8, 8)))
    step_without_update(mon)
    (rec,) = mon.records
    assert rec["shift_term"] > 0.3 * rec["variance_term"]
    assert (rec["variance_term"] + rec["shift_term"]) == pytest.approx(rec["output_var"], rel=0.05)
    w = conv.weight.detach()
    assert rec["weight_sq_mean"] == pytest.approx(w.square().mean().item(), rel=1e-5)
    assert rec["weight_norm"] == pytest.approx(w.norm().item(), rel=1e-5)


def test_dead_relus_before_the_classifier_raise_the_implosion_alarm():
    # a collapse with a finite loss: every ReLU before the classifier dies; the head's input second moment falls
    # (the implosion test is asked for: it is off by default since round 4, lab/docs/monitor_calibration.md)
    def run(rules):
        torch.manual_seed(4)
        model = nn.Sequential(
            nn.Conv1d(1, 8, 3, padding=1),
            nn.ReLU(),
            nn.Conv1d(8, 8, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool1d(1),
            nn.Flatten(),
            nn.Linear(8, 4),
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        mon = VarianceMonitor(model, every=1, rules=rules, optimizer=opt)
        x = torch.randn(16, 1, 20)
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
        assert mon.alarm is None  # healthy: no growth, no implosion
        with torch.no_grad():
            model[2].bias.fill_(-100.0)  # the last ReLUs die: the classifier's input is 0
        model(x).sum().backward()
        opt.step()
        return mon

    assert run(None).alarm is None, "no implosion test by default"
    mon = run([FactorRule(implode_factor={"input_sq": 1e4})])
    assert mon.alarm is not None and mon.alarm.layer == "6" and mon.alarm.quantity == "input_sq"
    assert (
        "fell to" in mon.alarm.details["reason"]
        and mon.alarm.details["ratio"] < 1e-4
        and mon.alarm.details["direction"] == "shrank"
    )
    with pytest.raises(ValueError, match="implode_factor for 'input_sq' must be a finite number > 1"):
        FactorRule(implode_factor={"input_sq": 0.5})


# ----------------------------------------------------------------- linear-map rules, channel axes, dead channels
def _record(module, x, steps=1, **kw):
    """The step-0 record of ``module`` (wrapped alone) after one forward on ``x`` and an SGD step."""
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    mon = VarianceMonitor(module, every=1, **kw, optimizer=opt)
    for _ in range(steps):
        module(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    return mon.records[0]


def _hand_ratio(x, dims):
    x = x.double()
    rest = [d for d in range(x.dim()) if d not in dims]
    xc = x.permute(*dims, *rest).reshape(math.prod(x.shape[d] for d in dims), -1)
    mean, sq = xc.mean(1), xc.square().mean(1)
    live = sq > 0
    return mean[live].square() / sq[live], int((~live).sum())


def _conv_transpose(d, groups):
    return {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}[d](4, 6, 3, groups=groups)


@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("groups", [1, 2])
def test_conv_transpose_is_recorded_per_output_filter(d, groups):
    from normlab.monitor.layers import effective_weight, filter_kernel

    torch.manual_seed(0)
    conv = _conv_transpose(d, groups)
    with torch.no_grad():  # output filters with distinct means: a wrong filter axis changes every statistic
        conv.weight += torch.linspace(-0.5, 0.5, 6 // groups).view(1, -1, *[1] * d)
    x = torch.randn(2, 4, *[5] * d)
    # the filter view is the equivalent convolution's kernel (flipped): it reproduces the transposed conv
    fk = filter_kernel(conv).clone()  # a view of the weight: the SGD step below changes it in place
    assert effective_weight(conv).shape == (4, 6 // groups, *[3] * d) and fk.shape == (6, 4 // groups, *[3] * d)
    conv_nd = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[d]
    same = conv_nd(x, fk.flip(list(range(2, 2 + d))), conv.bias, padding=2, groups=groups)
    torch.testing.assert_close(same, conv(x))
    rec = _record(conv, x)
    assert rec["kind"] == "conv" and (rec["fan_in"], rec["out_channels"]) == (4 // groups * 3**d, 6)
    rows = fk.reshape(6, -1)
    assert rec["weight_var"] == pytest.approx(rows.var(1, unbiased=False).mean().item(), rel=1e-5)
    assert rec["shift"] == pytest.approx(stats.shift_of_average(rows).item(), rel=1e-5)
    assert "update_ratio_mean" in rec and math.isfinite(rec["update_ratio_mean"])


class TinyUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, stride=2, padding=1))
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.out = nn.Conv2d(16, 2, 1)

    def forward(self, x):
        skip = self.down[1](self.down[0](x))
        return self.out(torch.cat([skip, self.up(torch.relu(self.down[2](skip)))], dim=1))


def test_unet_up_convolutions_are_monitored():
    torch.manual_seed(0)
    model = TinyUNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = VarianceMonitor(model, every=1, optimizer=opt)
    assert {n: k for n, _, k in mon.layers} == {"down.0": "conv", "down.2": "conv", "up": "conv", "out": "conv"}
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    opt.step()
    up = next(r for r in mon.records if r["layer"] == "up")
    assert up["index"] == 2 and (up["fan_in"], up["out_channels"]) == (16 * 4, 8) and "update_ratio_mean" in up


@pytest.mark.parametrize(
    "make, shape, dims",
    [
        (lambda: nn.LayerNorm(4), (3, 5, 4), (2,)),  # (B, T, C): the features, not the sequence
        (lambda: nn.LayerNorm((5, 4)), (3, 5, 4), (1, 2)),  # two normalized dims: T*C channels
        (lambda: nn.RMSNorm(4), (3, 5, 4), (2,)),
        (lambda: nn.LayerNorm(6), (2, 3, 5, 6), (3,)),  # channels-last image (B, H, W, C)
        (lambda: nn.BatchNorm1d(4), (6, 4), (1,)),
        (lambda: nn.BatchNorm1d(4), (3, 4, 5), (1,)),
        (lambda: nn.BatchNorm2d(4), (3, 4, 5, 5), (1,)),
        (lambda: nn.BatchNorm3d(4), (3, 4, 3, 3, 3), (1,)),
        (lambda: nn.GroupNorm(2, 4), (3, 4, 5), (1,)),
        (lambda: nn.InstanceNorm2d(4, affine=True), (3, 4, 5, 5), (1,)),
        (lambda: __import__("normlab.nn", fromlist=["x"]).BatchRenorm2d(4), (3, 4, 5, 5), (1,)),
        (lambda: __import__("normlab.nn", fromlist=["x"]).SwitchableNorm1d(4), (3, 4, 5), (1,)),
        (lambda: nn.Linear(4, 3), (3, 5, 4), (2,)),  # a token sequence (B, T, F)
        (lambda: nn.Linear(4, 3), (2, 3, 5, 4), (3,)),  # channels-last image (B, H, W, F)
        (lambda: nn.Conv1d(4, 3, 3), (4, 7), (0,)),  # unbatched (C, L)
        (lambda: nn.Conv2d(4, 3, 3), (2, 4, 5, 5), (1,)),
    ],
)
def test_channel_statistics_are_taken_over_the_channel_axes(make, shape, dims):
    torch.manual_seed(0)
    layer = make()
    # every entry has its own mean: statistics over a wrong axis differ from the hand values
    x = torch.randn(shape) + torch.arange(math.prod(shape[1:]), dtype=torch.float32).view(shape[1:]) % 7 * 0.3
    rec = _record(layer, x)
    r, dead = _hand_ratio(x, dims)
    assert rec["input_ratio_ch_mean"] == pytest.approx(r.mean().item(), rel=1e-5)
    assert rec["input_ratio_ch_min"] == pytest.approx(r.min().item(), rel=1e-5)
    assert rec["input_ratio_ch_max"] == pytest.approx(r.max().item(), rel=1e-5)
    assert dead == 0


@pytest.mark.parametrize(
    "layer, shape, dims",
    [
        (nn.Conv1d(4, 3, 3), (2, 4, 6), (1,)),
        (nn.Conv2d(4, 3, 3), (2, 4, 5, 5), (1,)),
        (nn.Conv3d(4, 3, 3), (2, 4, 3, 3, 3), (1,)),
        (nn.Linear(4, 3), (6, 4), (1,)),
        (nn.Linear(4, 3), (2, 5, 4), (2,)),
        (nn.BatchNorm2d(4), (2, 4, 3, 3), (1,)),
        (nn.LayerNorm(4), (2, 5, 4), (2,)),
    ],
)
def test_dead_input_channels_leave_the_per_channel_ratios_finite(layer, shape, dims):
    torch.manual_seed(0)
    x = torch.relu(torch.randn(shape))
    x.select(dims[0], 1).zero_()  # channel 1 is dead (a dead ReLU, a dropped channel)
    x.select(dims[0], 3).zero_()
    rec = _record(layer, x)
    r, dead = _hand_ratio(x, dims)
    assert rec["input_dead_channels"] == dead == 2
    assert rec["input_ratio_ch_mean"] == pytest.approx(r.mean().item(), rel=1e-5)
    assert rec["input_ratio_ch_min"] == pytest.approx(r.min().item(), rel=1e-5)
    assert rec["input_ratio_ch_max"] == pytest.approx(r.max().item(), rel=1e-5)
    assert all(math.isfinite(v) for v in rec.values() if isinstance(v, float))
    # an all-zero input has no ratio at all: the keys are absent, nothing is nan
    rec0 = _record(copy.deepcopy(layer), torch.zeros(shape))
    assert rec0["input_dead_channels"] == 4 and rec0["input_sq"] == 0.0
    assert not {"input_ratio", "input_ratio_ch_mean", "input_ratio_ch_min", "input_ratio_ch_max"} & set(rec0)
    assert all(math.isfinite(v) for v in rec0.values() if isinstance(v, float))
    # a non-finite channel is no dead one: it still shows in the record (the collapse warning reads it)
    x[(slice(None),) * dims[0] + (0,)] = float("nan")
    recn = _record(copy.deepcopy(layer), x)
    assert recn["input_dead_channels"] == 2 and math.isnan(recn["input_ratio_ch_mean"])


def test_constant_filters_are_left_out_of_the_update_ratio():
    torch.manual_seed(0)
    lin = nn.Linear(5, 4)
    with torch.no_grad():
        lin.weight[2] = 0.0  # a zero-initialized filter (skip-init, a zero gain): Var[W_o] = 0, no ratio
    x = torch.randn(8, 5)
    w0 = lin.weight.detach().clone()
    rec = _record(lin, x)
    ratio = lin.weight.detach().var(1, unbiased=False) / w0.var(1, unbiased=False)
    keep = torch.tensor([True, True, False, True])
    assert rec["constant_filters"] == 1
    assert rec["update_ratio_mean"] == pytest.approx(ratio[keep].mean().item(), rel=1e-5)
    assert rec["update_ratio_max"] == pytest.approx(ratio[keep].max().item(), rel=1e-5)
    zero = nn.Linear(5, 4)
    nn.init.zeros_(zero.weight)
    rec = _record(zero, x)
    assert rec["constant_filters"] == 4 and "update_ratio_mean" not in rec and rec["shift_scale_free"] == 0.0
    assert all(math.isfinite(v) for v in rec.values() if isinstance(v, float))
    with torch.no_grad():
        lin.weight[1, 0] = float("nan")  # a non-finite filter is not left out
    assert math.isnan(_record(lin, x)["update_ratio_mean"])


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("kind", ["ws", "pws"])
@pytest.mark.parametrize("d", [1, 2, 3])
def test_normlab_standardized_convs_are_recorded_on_the_kernel_they_apply(kind, d, training):
    from normlab.monitor.layers import effective_weight
    from normlab.nn import PWSConv1d, PWSConv2d, PWSConv3d, WSConv1d, WSConv2d, WSConv3d

    cls = {"ws": (WSConv1d, WSConv2d, WSConv3d), "pws": (PWSConv1d, PWSConv2d, PWSConv3d)}[kind][d - 1]
    torch.manual_seed(0)
    conv = cls(3, 4, 3)
    with torch.no_grad():
        conv.weight += torch.linspace(-1, 1, 4).view(4, *[1] * (d + 1))
    x = torch.randn(2, 3, *[5] * d)
    conv.train(training)  # eval: the inference kernel cache serves the kernel
    conv_nd = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[d]
    torch.testing.assert_close(conv_nd(x, effective_weight(conv), conv.bias), conv(x))
    rec = _record(conv, x, recording=RecordOptions(record_eval=not training))
    assert rec["output_var"] > 0 and stats.shift_scale_free(conv.weight).item() > 0.5 and rec["shift_scale_free"] < 1e-6


class Conv1D(nn.Module):
    """Stands in for transformers.pytorch_utils.Conv1D: y = x @ W + b, W (nx, nf)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1 + torch.linspace(-1, 1, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, self.nx), self.weight).reshape(*x.shape[:-1], self.nf)


def test_conv1d_rule_recognizes_the_transformers_class_by_module_and_shape():
    from normlab.monitor.layers import filter_kernel, linear_map_rule

    hf = type("Conv1D", (Conv1D,), {"__module__": "transformers.pytorch_utils"})
    layer = hf(6, 4)
    assert linear_map_rule(layer).name == "hf_conv1d" and linear_map_rule(Conv1D(6, 4)) is None
    assert torch.equal(filter_kernel(layer), layer.weight.detach().t())  # filter o is the column W[:, o]
    odd = hf(6, 4)
    odd.nx = 5  # weight shape does not match (nx, nf): not the transformers layer
    assert linear_map_rule(odd) is None
    x = torch.randn(2, 3, 4)
    w = filter_kernel(layer).clone()
    rec = _record(layer, x)
    after = layer.weight.detach().t()  # the SGD step's result, per output column
    ratio = after.var(1, unbiased=False) / w.var(1, unbiased=False)
    assert rec["update_ratio_mean"] == pytest.approx(ratio.mean().item(), rel=1e-5)
    assert rec["mean_update_absmax"] == pytest.approx((w - after).mean(1).abs().max().item(), rel=1e-5)
    assert (rec["kind"], rec["fan_in"], rec["out_channels"]) == ("linear", 4, 6)
    assert rec["shift"] == pytest.approx(stats.shift_of_average(w).item(), rel=1e-5)
    r, _ = _hand_ratio(x, (2,))
    assert rec["input_ratio_ch_max"] == pytest.approx(r.max().item(), rel=1e-5)


def test_monitor_imports_neither_transformers_nor_timm_and_docstring_examples_run():
    import doctest
    import subprocess
    import sys

    import normlab.monitor.layers
    import normlab.monitor.stats

    for mod in (normlab.monitor.layers, normlab.monitor.stats):
        assert doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE).failed == 0
    code = (
        "import sys, torch, normlab.monitor as m; m.VarianceMonitor(torch.nn.Linear(2, 2)); "
        "print(sorted({'transformers', 'timm', 'torchvision'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_effective_weight_of_a_module_without_a_linear_map_names_it():
    from normlab.monitor.layers import effective_weight

    with pytest.raises(TypeError, match="Embedding applies no weight as a linear map"):
        effective_weight(nn.Embedding(3, 2))


def test_signal_propagation_takes_each_layers_channel_axes():
    # a token model: the Linear and LayerNorm outputs (B, T, F) have their features on the last dim, not dim 1
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3))
    with torch.no_grad():
        model[0].bias.copy_(torch.linspace(-2, 2, 6))  # per-feature means
    data = signal_propagation(model, (8, 5, 4), seed=1)
    x = torch.randn((8, 5, 4), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = model[0](x)
    feat = h.reshape(-1, 6).double()
    e = data["entries"][0]
    assert data["mode"] == "layers" and e["name"] == "0"
    assert e["avg_sq_mean"] == pytest.approx(feat.mean(0).square().mean().item(), rel=1e-6)
    assert e["avg_var"] == pytest.approx(feat.var(0, unbiased=False).mean().item(), rel=1e-6)
    assert channel_signal_stats(h, -1) == pytest.approx((e["avg_sq_mean"], e["avg_var"]), rel=1e-6)


def _attached(seed=100):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_the_optimizers_own_step_records_and_changes_nothing():
    x = torch.randn(16, 4)
    ref, ref_opt = _attached()
    a, opt_a = _attached()
    mon_a = VarianceMonitor(a, every=1, optimizer=opt_a)
    for _ in range(3):
        for model, opt in ((ref, ref_opt), (a, opt_a)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()  # the usual loop: nothing else
    for p, q in zip(ref.parameters(), a.parameters()):
        assert torch.equal(p, q)
    assert mon_a.current_step == 3
    assert {r["step"] for r in mon_a.records} == {0, 1, 2} and "update_ratio_mean" in mon_a.records[0]


def test_an_attached_monitor_detaches_on_close_and_refuses_a_non_optimizer():
    model, opt = _attached()
    mon = VarianceMonitor(model, every=1, optimizer=opt)
    mon.close()
    model(torch.randn(16, 4)).sum().backward()
    opt.step()
    assert mon.current_step == 0 and mon.records == []
    with pytest.raises(TypeError, match="VarianceMonitor: optimizer must be a torch.optim.Optimizer, got list"):
        VarianceMonitor(model, optimizer=[])
    with pytest.raises(RuntimeError, match="VarianceMonitor.observe_loss: the monitor follows no optimizer"):
        VarianceMonitor(model).observe_loss(1.0)


@pytest.mark.parametrize("helper", [False, True])
def test_a_step_the_grad_scaler_skips(helper):
    """Through scaler_step the skipped step counts as a step without an update (the records of steps 0-2, the
    second without update ratios); a bare ``scaler.step(opt)`` never calls the optimizer, so the monitor does not
    see that step at all."""
    from normlab.monitor import scaler_step

    model, opt = _attached()
    mon = VarianceMonitor(model, every=1, optimizer=opt)
    scaler = torch.amp.GradScaler("cpu")
    for poison in (False, True, False):
        opt.zero_grad()
        loss = model(torch.randn(16, 4)).square().mean() * (float("inf") if poison else 1.0)
        scaler.scale(loss).backward()
        if helper:
            assert scaler_step(scaler, opt) is not poison
        else:
            scaler.step(opt)
            scaler.update()
    if helper:
        assert mon.current_step == 3 and {r["step"] for r in mon.records} == {0, 1, 2}
        assert not any("update_ratio_mean" in r for r in mon.records if r["step"] == 1)
    else:
        assert mon.current_step == 2 and {r["step"] for r in mon.records} == {0, 1}


class _LossSeen(StepRule):
    """Keeps the loss the monitor hands the rules on every step."""

    name, every_step = "seen", True

    def __init__(self):
        self.losses = []

    def check(self, ctx, records):
        self.losses.append(ctx.loss)

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


@pytest.mark.parametrize("set_to_none", [True, False])
def test_the_usual_loops_count_one_step_per_optimizer_step(set_to_none):
    # zero_grad either way, gradient accumulation over micro-batches (their losses observed add up), an eval forward
    # in between, no zero_grad at all, a closure (LBFGS-style: seen after its backward, its loss the step's)
    model, opt = _attached()
    seen = _LossSeen()
    mon = VarianceMonitor(model, every=2, optimizer=opt, rules=[seen])
    x = torch.randn(16, 4)
    for _ in range(6):
        opt.zero_grad(set_to_none=set_to_none)
        expected = 0.0
        for half in x.chunk(2):
            loss = model(half).square().mean() / 2
            loss.backward()
            mon.observe_loss(loss)
            expected += loss.item()
        with torch.no_grad():
            model.eval()
            model(x)
            model.train()
        opt.step()
        assert seen.losses[-1] == pytest.approx(expected)  # the micro-batches' losses add up
    no_reset, no_reset_opt = _attached()
    mon2 = VarianceMonitor(no_reset, every=1, optimizer=no_reset_opt)
    for _ in range(3):  # no zero_grad at all: gradients accumulate in place
        no_reset(x).square().mean().backward()
        no_reset_opt.step()

    def closure():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        model_loss_before = model(x).square().mean().item()
    opt.step(closure)
    assert mon.current_step == 7 and mon2.current_step == 3 and len(seen.losses) == 7
    assert seen.losses[-1] == pytest.approx(model_loss_before)
    assert not all(torch.equal(p, q) for p, q in zip(before, model.parameters()))  # the closure's gradients stepped


class _RecurrentLM(nn.Module):
    def __init__(self, cell: type[nn.RNNBase]) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.rnn = cell(4, 8, num_layers=2, batch_first=True)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.rnn(self.emb(x))[0])


@pytest.mark.parametrize("cell", [nn.RNN, nn.LSTM, nn.GRU])
def test_recurrent_layers_are_listed_unwatched_and_warned_once(cell):
    model = _RecurrentLM(cell)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=rf"recurrent layers are not watched: 'rnn' \({cell.__name__}\)"):
        mon = VarianceMonitor(model, every=1, optimizer=opt)
    assert [(name, type(mod)) for name, mod in mon.unwatched] == [("emb", nn.Embedding), ("rnn", cell)]
    assert [name for name, _, _ in mon.layers] == ["head"]
    F.cross_entropy(model(torch.randint(0, 10, (3, 5))).flatten(0, 1), torch.randint(0, 10, (15,))).backward()
    opt.step()  # the run goes on: the head is recorded
    assert {r["layer"] for r in mon.records} == {"head"}
    mon.close()


def test_unwatched_lists_what_no_record_reads_and_nothing_else(recwarn):
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 8), nn.LayerNorm(8), nn.Bilinear(8, 8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = VarianceMonitor(model, every=1, optimizer=opt)
    assert [name for name, _ in mon.unwatched] == ["0", "3"]  # a lookup and a bilinear form: no warning
    without_norms = VarianceMonitor(model, every=1, recording=RecordOptions(include_norm=False))
    assert [name for name, _ in without_norms.unwatched] == ["0", "2", "3"]
    watched = VarianceMonitor(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)), every=1)
    assert watched.unwatched == []
    assert not [w for w in recwarn if "not watched" in str(w.message)]
    for m in (mon, without_norms, watched):
        m.close()
