"""The probes through the live monitor: values on recorded steps only, switched on by the rules that read them, and
a transformer rule firing on crafted attention-logit growth."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from normlab.monitor import VarianceMonitor
from normlab.monitor.probes import NormGainProbe
from normlab.monitor.rules import DEFAULT_RULES, AttentionLogitRule, Rule


class Spy(Rule):
    """Keeps every context it is checked with."""

    name, needs_loss = "spy", False

    def __init__(self, needs_probes: bool = False) -> None:
        self.needs_probes = needs_probes
        self.seen = []

    def check(self, ctx, records):
        self.seen.append(ctx)
        return None


def tiny_gpt2(impl: str = "eager"):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_embd=16, n_layer=2, n_head=2, n_positions=8, vocab_size=20, bos_token_id=0, eos_token_id=0
    )
    cfg._attn_implementation = impl
    torch.manual_seed(104)
    return transformers.GPT2LMHeadModel(cfg)


def train(model, mon, opt, steps: int, before_step=None):
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        ids = torch.randint(0, 20, (2, 7))
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        mon.observe_loss(loss)
        opt.step()


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_monitored_gpt2_gets_probe_values_on_recorded_steps_only(impl):
    model = tiny_gpt2(impl)
    spy = Spy(needs_probes=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = VarianceMonitor(model, every=3, rules=[spy], optimizer=opt)
    assert mon.probes is not None  # a rule that reads probes switches them on
    train(model, mon, opt, 7)
    by_step = {c.step: c for c in spy.seen}
    assert sorted(by_step) == [0, 3, 6]  # a recorded-steps rule
    for ctx in by_step.values():
        keys = set(ctx.probes)
        assert {"attn_logit/transformer.h.0.attn", "attn_logit/transformer.h.1.attn"} <= keys
        assert {"residual_rms/transformer.h.0.ln_1", "norm_gain/transformer.ln_f", "logit_max/output"} <= keys
        assert all(v > 0 for v in ctx.probes.values())
        assert ctx.adaptive  # AdamW
    assert not mon.probes.active or mon.is_recording  # hooks attached only for a recorded step
    mon.close()
    assert not mon.probes.active


def test_probes_are_off_for_the_default_rules_and_can_be_forced():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    assert VarianceMonitor(model).probes is None
    assert VarianceMonitor(model, rules=[*DEFAULT_RULES(), AttentionLogitRule()]).probes is not None
    assert VarianceMonitor(model, rules=[AttentionLogitRule()], probes=False).probes is None
    spy = Spy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    VarianceMonitor(model, every=1, rules=[spy], probes=[NormGainProbe()], optimizer=opt)  # attached: it records
    for _ in range(2):
        model(torch.randn(3, 4)).square().mean().backward()
        opt.step()
    assert [sorted(c.probes) for c in spy.seen] == [["norm_gain/1"], ["norm_gain/1"]]
    assert not spy.seen[0].adaptive  # SGD
    with pytest.raises(ValueError, match="VarianceMonitor: probes must be None, True, False or a list of Probe"):
        VarianceMonitor(model, probes=NormGainProbe())


def test_attention_logit_rule_fires_through_the_live_monitor_on_crafted_growth():
    model = tiny_gpt2("sdpa")
    rule = AttentionLogitRule(factor=10.0, floor=1.0, warmup=4, patience=1, severity="alarm")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights change only where the test changes them
    mon = VarianceMonitor(model, every=2, rules=[rule], optimizer=opt)

    def grow(step):
        if step == 6:  # q and k scaled 10x each: the logits grow 100x
            with torch.no_grad():
                for block in model.transformer.h:
                    block.attn.c_attn.weight[:, :32].mul_(10)

    train(model, mon, opt, 10, grow)
    assert mon.alarm is not None and mon.alarm.rule == "attn_logit_growth"
    assert mon.alarm.step == 6 and mon.alarm.layer.startswith("transformer.h.")
    # without the growth: silent
    model2 = tiny_gpt2("sdpa")
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.0)
    mon2 = VarianceMonitor(
        model2, every=2, rules=[AttentionLogitRule(factor=10.0, floor=1.0, warmup=4)], optimizer=opt2
    )
    train(model2, mon2, opt2, 10)
    assert mon2.events == []
