"""FactorRule and layers a normalization layer reads alone (normlab.monitor.rules.variance.renormalized_alone): the
norm removes their output's scale, so their output variance is not growth-tested by default; a layer that feeds a
norm only through a residual sum (a pre-LN block's output projection) still is."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from normlab.monitor import VarianceMonitor
from normlab.monitor.rules import FactorRule, StepContext, replay
from normlab.monitor.rules.variance import renormalized_alone


def _steps(values, norm_input, kind="conv"):
    """A hidden layer with ``values`` of output variance, then a norm whose input variance is
    ``norm_input(value)``, then a quiet head."""
    out = []
    for t, v in enumerate(values):
        recs = [
            dict(layer="h", index=0, kind=kind, output_var=v, shift=0.01),
            dict(layer="n", index=1, kind="norm", output_var=1.0, input_var=norm_input(v)),
            dict(layer="head", index=2, kind="linear", output_var=1.0, shift=0.01, input_sq=1.0),
        ]
        out.append((StepContext(step=t, output_layer="head", feeds_norm=frozenset({"h"})), recs))
    return out


GROWTH = [1.0, 3.0, 50.0, 2e3, 5e4]  # 5e4x its baseline: past the default factor 1e3


@pytest.mark.parametrize("kind", ["conv", "linear"])
def test_a_layer_its_norm_reads_alone_is_not_growth_tested_by_default(kind):
    alone = _steps(GROWTH, lambda v: v * (1 + 1e-5), kind)
    assert replay([FactorRule()], alone) == []
    events = replay([FactorRule(watch_renormalized=True)], alone)
    assert events and events[0].layer == "h" and events[0].quantity == "output_var" and events[0].step == 3


@pytest.mark.parametrize("rest", [1.0, 1e-2, 10.0])
def test_a_layer_that_feeds_a_norm_through_a_residual_sum_still_is(rest):
    summed = _steps(GROWTH, lambda v: v + rest)  # the norm reads the layer's output plus a residual stream
    events = replay([FactorRule()], summed)
    assert events and events[0].layer == "h" and events[0].step == 3


def test_non_finite_values_are_flagged_in_layers_a_norm_reads_alone():
    events = replay([FactorRule()], _steps([1.0, 2.0, float("inf")], lambda v: v))
    assert events and events[0].details["direction"] == "non-finite"


class _Tape(FactorRule):
    def __init__(self):
        super().__init__()
        self.tape = []

    def check(self, ctx, records):
        self.tape.append(renormalized_alone(records))
        return super().check(ctx, records)


def test_renormalized_alone_on_a_live_monitor_bn_and_pre_ln_residual():
    torch.manual_seed(100)
    cnn = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))

    class PreLN(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.proj, self.ln, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3)

        def forward(self, x):
            h = self.inp(x)
            return self.head(self.ln(h + self.proj(h)))

    for model, x, expected in ((cnn, torch.randn(16, 1, 8, 8), {"0"}), (PreLN(), torch.randn(16, 8), set())):
        tape = _Tape()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        mon = VarianceMonitor(model, every=1, rules=[tape], optimizer=opt)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        mon.close()
        assert tape.tape and tape.tape[-1] == expected, (type(model).__name__, tape.tape)


def test_repr_and_default():
    assert "watch_renormalized=False" in repr(FactorRule())


def test_judged_at_the_first_record_a_branch_that_comes_to_dominate_is_still_tested():
    # the norm reads h + a residual of variance 1e-3: at 5e4x its baseline h dominates the sum (relative
    # difference 2e-8), yet it was not read alone at its first record
    events = replay([FactorRule()], _steps(GROWTH, lambda v: v + 1e-3))
    assert events and events[0].step == 3


def test_state_dict_keeps_the_judgement():
    rule = FactorRule()
    replay([rule], _steps([1.0, 2.0], lambda v: v))
    state = rule.state_dict()
    assert state["alone"] == {"h": True, "head": False}
    fresh = FactorRule()
    fresh.load_state_dict(state)
    assert fresh.alone == rule.alone
    legacy = {k: v for k, v in state.items() if k != "alone"}  # a state saved before the judgement existed
    fresh.load_state_dict(legacy)
    assert fresh.alone == {}
