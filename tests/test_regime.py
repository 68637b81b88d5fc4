"""Regime warning (RegimeRule, mon.warning): shift term over variance term, sustained, in a layer not normalized
downstream."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from normlab.monitor import VarianceMonitor
from normlab.monitor.rules import CountdownRule, Event, FactorRule, RegimeRule, StepContext
from normlab.monitor.rules.regime import exempt_layers


def check(rule, step, records, lr=None):
    """The rule's event at ``step`` (``lr``: one rate for every layer, or one per layer name)."""
    lrs = {} if lr is None else lr if isinstance(lr, dict) else {r["layer"]: lr for r in records}
    return rule.check(StepContext(step=step, layer_lrs=lrs), records)


def conv(name, index, shift, variance=1.0, ssf=1.0):
    return dict(layer=name, index=index, kind="conv", shift_term=shift, variance_term=variance, shift_scale_free=ssf)


def norm(name, index):
    return dict(layer=name, index=index, kind="norm", output_var=1.0)


def plain(shift):  # c1 -> c2 -> head, no normalization
    return [conv("c1", 0, 0.1), conv("c2", 1, shift), conv("head", 2, 50.0)]


def test_warning_needs_the_window_and_names_the_layer():
    det = RegimeRule(window=3, min_ratio=1.0)
    assert [check(det, t, plain(2.0)) for t in range(2)] == [None, None]
    w = check(det, 2, plain(2.0))
    assert (
        isinstance(w, Event)
        and w.severity == "warning"
        and w.layer == "c2"
        and w.step == 2
        and w.details["case"] == "shift"
    )
    assert w.details["shift_term"] == 2.0 and w.details["variance_term"] == 1.0 and w.details["ratio"] == 2.0
    assert "c2" in w.details["suggestion"] and "PWS" in w.details["suggestion"] and "c2" in str(w)


def test_a_step_below_the_variance_term_resets_the_streak():
    det = RegimeRule(window=3, min_ratio=1.0)
    for t, s in enumerate([2.0, 2.0, 0.5, 2.0, 2.0]):
        assert check(det, t, plain(s)) is None
    assert check(det, 5, plain(2.0)).step == 5


def test_no_warning_when_the_shift_stays_below_the_variance_term():
    det = RegimeRule(window=1, min_ratio=1.0)
    assert all(check(det, t, plain(0.99)) is None for t in range(10))


@pytest.mark.parametrize("norm_kind", ["bn", "gn", "sn"])
def test_a_layer_followed_by_a_normalization_and_the_output_layer_are_exempt(norm_kind):
    recs = [
        conv("c1", 0, 5.0),
        norm(f"{norm_kind}1", 1),
        conv("c2", 2, 0.1),
        conv("c3", 3, 0.1),
        norm(f"{norm_kind}2", 4),
        conv("head", 5, 50.0),
    ]
    assert exempt_layers(recs) == {"c1", "c3", "head"}
    det = RegimeRule(window=1, min_ratio=1.0)
    assert all(check(det, t, recs) is None for t in range(5))
    recs[3]["shift_term"] = 5.0  # c3 is followed by a norm: still exempt
    assert check(det, 5, recs) is None
    recs[2]["shift_term"] = 5.0  # c2 feeds c3 directly: in the regime
    assert check(det, 6, recs).layer == "c2"


def test_exemption_follows_forward_order_not_list_order():
    recs = [conv("head", 2, 50.0), norm("bn", 1), conv("c1", 0, 5.0)]
    assert exempt_layers(recs) == {"c1", "head"}


def test_pws_case_growing_variance_term_of_a_standardized_conv():
    det = RegimeRule(window=2, pws_factor=10.0, min_ratio=1.0)
    recs = lambda v: [conv("c1", 0, 0.0, v, ssf=0.0), conv("head", 1, 0.0, 1.0, ssf=0.0)]  # noqa: E731
    assert check(det, 0, recs(0.5)) is None  # first value 0.5
    assert check(det, 1, recs(4.0)) is None  # 8x: below the factor
    assert check(det, 2, recs(6.0)) is None  # 12x: first step of the streak
    w = check(det, 3, recs(6.0))
    assert w.details["case"] == "pws" and w.layer == "c1" and w.details["ratio"] == pytest.approx(12.0)


def test_state_dict_round_trip_gives_the_same_warning():
    a, b = RegimeRule(window=3, min_ratio=1.0), RegimeRule(window=3, min_ratio=1.0)
    check(a, 0, plain(2.0)), check(a, 1, plain(2.0))
    b.load_state_dict(a.state_dict())
    assert check(b, 2, plain(2.0)) == check(a, 2, plain(2.0))
    for other in (
        RegimeRule(window=2, min_ratio=1.0),
        RegimeRule(window=3, min_ratio=10.0),
    ):  # an older checkpoint's rule
        with pytest.warns(UserWarning, match="state was made with window=3, min_ratio=1; .* its streaks start again"):
            other.load_state_dict(a.state_dict())
        assert other.streak == {} and other.first_variance == a.first_variance
    old = {k: v for k, v in a.state_dict().items() if k != "min_ratio"}  # saved before min_ratio existed
    with pytest.warns(UserWarning, match="min_ratio=1; this rule uses window=2, min_ratio=10"):
        RegimeRule(window=2, min_ratio=10.0).load_state_dict(old)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_window_is_validated(bad):
    with pytest.raises(ValueError, match="window"):
        RegimeRule(window=bad, min_ratio=1.0)


@pytest.mark.parametrize("shift, warned", [(9.99, False), (10.0, False), (10.01, True), (40.0, True)])
def test_min_ratio_is_the_factor_the_shift_term_must_exceed(shift, warned):
    det = RegimeRule(window=2, min_ratio=10.0)
    got = [check(det, t, plain(shift)) for t in range(2)]
    assert got[0] is None and (got[1] is not None) == warned
    if warned:
        assert got[1].details["ratio"] == pytest.approx(shift) and got[1].layer == "c2"


def test_the_default_rule_is_the_round_3_choice():
    # lab/docs/monitor_calibration.md, round 3: ratio 10 for 2 consecutive steps (a ratio of 3 is the ordinary
    # healthy plain net)
    det = RegimeRule()
    assert (det.window, det.min_ratio, det.pws_factor) == (2, 10.0, None)
    assert all(check(det, t, plain(3.0)) is None for t in range(50))


@pytest.mark.parametrize("bad", [0.5, 0, -1, float("inf"), True, "10"])
def test_min_ratio_is_validated(bad):
    with pytest.raises(ValueError, match="RegimeRule: min_ratio must be a finite number >= 1"):
        RegimeRule(window=20, min_ratio=bad)


def _net(with_norm: bool) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Conv1d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv1d(8, 8, 3, padding=1)]
    layers += [nn.BatchNorm1d(8)] if with_norm else []
    layers += [nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16, 4)]
    net = nn.Sequential(*layers)
    with torch.no_grad():  # spread the filter means of the second conv: its shift term dominates
        net[2].weight += torch.linspace(-2, 2, 8).view(8, 1, 1)
    return net


@pytest.mark.parametrize("with_norm", [False, True])
def test_monitor_raises_risk_only_where_the_shift_reaches_the_next_layer(with_norm):
    net = _net(with_norm)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    mon = VarianceMonitor(
        net, every=1, optimizer=opt, rules=[RegimeRule(window=3, min_ratio=1.0), CountdownRule(), FactorRule()]
    )
    x = torch.randn(32, 1, 16)
    for t in range(4):
        net(x).square().mean().backward()
        opt.step()
        if t == 1:
            assert mon.warning is None
    if with_norm:
        assert mon.warning is None
    else:
        assert mon.warning is not None and mon.warning.layer == "2" and mon.warning.step == 2
        assert mon.warning.details["shift_term"] > mon.warning.details["variance_term"]
        state = mon.state_dict()
        mon2 = VarianceMonitor(
            _net(False), every=1, rules=[RegimeRule(window=3, min_ratio=1.0), CountdownRule(), FactorRule()]
        )
        mon2.load_state_dict(state)
        assert mon2.warning == mon.warning and mon2.rules[0].state_dict() == mon.rules[0].state_dict()


def test_pws_case_is_off_by_default():
    det = RegimeRule(window=1, min_ratio=1.0)
    recs = lambda v: [conv("c1", 0, 0.0, v, ssf=0.0), conv("head", 1, 0.0, 1.0, ssf=0.0)]  # noqa: E731
    assert all(check(det, t, recs(10.0**t)) is None for t in range(6))


def _shift_rec(name, index, shift, mean_sq, variance):
    """A conv record with the raw quantities the suggested learning rate reads: shift term = E^2[X] * shift."""
    return dict(
        layer=name,
        index=index,
        kind="conv",
        shift=shift,
        input_mean_sq=mean_sq,
        shift_term=mean_sq * shift,
        variance_term=variance,
        shift_scale_free=1.0,
    )


def test_suggested_lr_follows_the_formula_on_constructed_records():
    # c1: shift 0.3 at the first check, then its filter means drift apart; E^2[X] = 0.7, V = 1.1 (float64 values)
    det = RegimeRule(window=2, min_ratio=1.0)
    head = dict(layer="head", index=1, kind="linear")
    assert check(det, 0, [_shift_rec("c1", 0, 0.3, 0.7, 1.1), head], lr=0.2) is None
    assert check(det, 1, [_shift_rec("c1", 0, 2.5, 0.7, 1.1), head], lr=0.2) is None  # 1.75 > 1.1: streak 1
    w = check(det, 2, [_shift_rec("c1", 0, 3.0, 0.7, 1.1), head], lr={"c1": 0.2})
    expected = 0.2 * ((1.1 - 0.7 * 0.3) / (0.7 * 3.0 - 0.7 * 0.3)) ** 0.5  # lr sqrt((V - E2 s0) / (S - E2 s0))
    assert w.details["suggested_lr"] == pytest.approx(expected, rel=1e-12) and w.details["suggested_lr"] < 0.2
    # a run at that rate: shift(t) = s0 + f^2 (shift - s0) puts the shift term exactly on the variance term
    f2 = (w.details["suggested_lr"] / 0.2) ** 2
    assert 0.7 * (0.3 + f2 * (3.0 - 0.3)) == pytest.approx(1.1, rel=1e-12)
    assert f"{w.details['suggested_lr']:.3g}" in w.details["suggestion"] and f"{w.details['suggested_lr']:.3g}" in str(
        w
    )


def test_no_suggested_lr_without_a_learning_rate_or_when_the_initial_shift_dominates():
    head = dict(layer="head", index=1, kind="linear")
    det = RegimeRule(window=1, min_ratio=1.0)
    assert check(det, 0, [_shift_rec("c1", 0, 3.0, 1.0, 1.0), head]).details["suggested_lr"] is None  # lr unknown
    det = RegimeRule(window=1, min_ratio=1.0)
    w = check(det, 0, [_shift_rec("c1", 0, 3.0, 1.0, 1.0), head], lr=0.1)  # in the regime from the first check
    assert w.details["suggested_lr"] is None and "does not remove it" in w.details["suggestion"]
    det = RegimeRule(window=1, pws_factor=2.0, min_ratio=1.0)
    pws = [
        dict(
            layer="c1",
            index=0,
            kind="conv",
            shift=0.0,
            input_mean_sq=1.0,
            shift_term=0.0,
            variance_term=v,
            shift_scale_free=0.0,
        )
        for v in (1.0, 5.0)
    ]
    check(det, 0, [pws[0], head], lr=0.1)
    assert check(det, 1, [pws[1], head], lr=0.1).details["suggested_lr"] is None  # the PWS case: no rate from the shift


def test_first_shift_travels_with_the_state_dict():
    head = dict(layer="head", index=1, kind="linear")
    a, b = RegimeRule(window=2, min_ratio=1.0), RegimeRule(window=2, min_ratio=1.0)
    check(a, 0, [_shift_rec("c1", 0, 0.3, 0.7, 1.1), head], lr=0.2)
    check(a, 1, [_shift_rec("c1", 0, 2.5, 0.7, 1.1), head], lr=0.2)
    b.load_state_dict(a.state_dict())
    rec = [_shift_rec("c1", 0, 3.0, 0.7, 1.1), head]
    assert check(b, 2, rec, lr=0.2) == check(a, 2, rec, lr=0.2) and a.first_shift == {"c1": 0.3}


def _plain_run(lr, steps):
    """The unnormalized plain1d net (width 0.25) on a synthetic 10-class task, SGD momentum 0.9, window-5 regime."""
    from normlab.runner.models import build_model

    torch.manual_seed(100)
    model = build_model("plain1d", "none", "conv", 1, 10, (1, 40), 0.25)
    g = torch.Generator().manual_seed(101)
    x = torch.randn(512, 1, 40, generator=g)
    y = (x[:, 0, :20].mean(1) * 10).long().clamp(-5, 4) + 5
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    mon = VarianceMonitor(model, optimizer=opt, every=1, rules=[RegimeRule(window=5, min_ratio=1.0)])
    for _ in range(steps):
        idx = torch.randint(0, 512, (64,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return mon


def test_a_real_run_suggests_the_formula_and_the_restart_enters_the_regime_later(one_thread):
    from normlab.monitor.rules.regime import suggested_lr

    mon = _plain_run(0.1, 12)
    risk = mon.warning
    assert risk is not None and risk.details["case"] == "shift"
    first = next(r for r in mon.records if r["layer"] == risk.layer)
    at = next(r for r in mon.records if r["layer"] == risk.layer and r["step"] == risk.step)
    expected = suggested_lr(0.1, at["shift_term"], at["variance_term"], at["input_mean_sq"], first["shift"])
    assert risk.details["suggested_lr"] == pytest.approx(expected, rel=1e-12) and 0 < risk.details["suggested_lr"] < 0.1
    again = _plain_run(risk.details["suggested_lr"], risk.step + 1)  # same init and batches, at the suggested rate
    assert again.warning is None  # not (yet) in the regime at the original warning step


class _Drift(torch.optim.SGD):
    """An optimizer whose step moves the filter means of one conv apart (the drift the regime rule reads)."""

    def __init__(self, params, conv, lr):
        super().__init__(params, lr=lr)
        self.conv = conv

    @torch.no_grad()
    def step(self, closure=None):
        self.conv.weight += 0.5 * torch.linspace(-1, 1, 8).view(8, 1, 1)


def test_the_monitor_suggests_an_lr_from_the_optimizer_it_follows():
    net = _net(False)
    with torch.no_grad():  # no initial spread of the filter means: the shift comes from the drift
        net[2].weight -= net[2].weight.mean((1, 2), keepdim=True)
    opt = _Drift(net.parameters(), net[2], lr=0.1)
    mon = VarianceMonitor(net, every=1, rules=[RegimeRule(window=1, min_ratio=1.0)], optimizer=opt)
    for _ in range(2):
        opt.zero_grad()
        net(torch.randn(32, 1, 16)).square().mean().backward()
        opt.step()  # the optimizer's own step (hooks included): filter means drift
    assert mon.warning is not None and mon.warning.step == 1
    assert mon.warning.details["suggested_lr"] == pytest.approx(  # no initial shift: lr sqrt(V / S)
        0.1 * (mon.warning.details["variance_term"] / mon.warning.details["shift_term"]) ** 0.5
    )


def test_layer_learning_rates_finds_a_parametrized_kernel_and_skips_frozen_layers():
    from torch.nn.utils import parametrize

    from normlab.monitor.rules.regime import layer_learning_rates

    class Same(nn.Module):
        def forward(self, w):
            return w

    conv, frozen = nn.Conv1d(2, 3, 3), nn.Linear(3, 1)
    parametrize.register_parametrization(conv, "weight", Same())  # the kernel lives in conv.parametrizations
    conv.bias = None
    opt = torch.optim.SGD(conv.parameters(), lr=0.3)
    assert layer_learning_rates([("c", conv, "conv"), ("f", frozen, "linear")], opt) == {"c": 0.3}
