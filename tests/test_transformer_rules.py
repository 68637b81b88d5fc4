"""Transformer rules (normlab.monitor.rules.transformer): fire on crafted growth, silent on a first-step transient."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from normlab.monitor.probes import ProbeSet
from normlab.monitor.rules import StepContext, replay
from normlab.monitor.rules.transformer import (
    TRANSFORMER_RULES,
    AttentionLogitRule,
    NormGainRule,
    OutputLogitRule,
    ResidualStreamRule,
)

PROBE_KEYS = {
    AttentionLogitRule: "attn_logit/blocks.0.attn",
    OutputLogitRule: "logit_max/output",
    ResidualStreamRule: "residual_rms/blocks.1.ln1",
    NormGainRule: "norm_gain/ln_f",
}


def _ctx(step, probes, recorded=True):
    return StepContext(step=step, probes=probes, recorded=recorded)


@pytest.mark.parametrize("cls", TRANSFORMER_RULES)
def test_fires_on_crafted_growth(cls):
    key = PROBE_KEYS[cls]
    values = [0.5, 0.6, 0.7, 0.7] + [0.7 * 3**k for k in range(1, 12)]  # x3 per recorded step from step 40
    events = replay([cls()], [(_ctx(10 * i, {key: v}), []) for i, v in enumerate(values)])
    assert len(events) == 1 and events[0].severity == cls().severity and events[0].rule == cls.name
    rule = cls()
    limit = max(rule.floor, rule.factor * max(v for i, v in enumerate(values) if 10 * i < rule.warmup))
    first_above = next(10 * i for i, v in enumerate(values) if 10 * i >= rule.warmup and v > limit)
    assert events[0].step == first_above + 10 * (rule.patience - 1)
    assert events[0].layer == key.split("/", 1)[1]


@pytest.mark.parametrize("cls", TRANSFORMER_RULES)
def test_silent_on_steady_values_other_probes_and_unrecorded_steps(cls):
    key = PROBE_KEYS[cls]
    steady = [(_ctx(10 * i, {key: 2.0 + 0.1 * (i % 3), "other/x": 1e9 * i}), []) for i in range(30)]
    assert replay([cls()], steady) == []
    rule = cls()
    assert rule.every_step is False  # probes exist on recorded steps only


@pytest.mark.parametrize("cls", TRANSFORMER_RULES)
def test_non_finite_fires_at_once_and_state_round_trips(cls):
    key = PROBE_KEYS[cls]
    rule = cls()
    for i, v in enumerate([0.5, 0.6, 0.7, 0.7, 0.7, 0.7]):
        rule.check(_ctx(10 * i, {key: v}), [])
    clone = cls()
    clone.load_state_dict(rule.state_dict())
    assert clone.state_dict() == rule.state_dict()
    growth = [0.7 * 10**k for k in range(1, 6)]
    a = [rule.check(_ctx(60 + 10 * i, {key: v}), []) for i, v in enumerate(growth)]
    b = [clone.check(_ctx(60 + 10 * i, {key: v}), []) for i, v in enumerate(growth)]
    assert any(e is not None for e in a)
    assert [e and e.step for e in a] == [e and e.step for e in b]
    fresh = cls()
    ev = fresh.check(_ctx(0, {key: math.inf}), [])
    assert ev is not None and ev.severity == fresh.severity
    rule.reset()
    assert rule.state_dict() == {"baseline": {}, "streak": {}}


def test_refuses_bad_arguments():
    with pytest.raises(ValueError, match="AttentionLogitRule"):
        AttentionLogitRule(factor=0.5)
    with pytest.raises(ValueError, match="warmup"):
        ResidualStreamRule(warmup=0)


class _Block(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads, self.ln1, self.ln2 = heads, nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj, self.fc = nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))
        return x + self.fc(F.gelu(self.ln2(x)))


@pytest.mark.parametrize("opt_name, lr", [("adamw", 1e-2), ("adamw", 3e-3), ("sgd", 0.1)])
def test_silent_on_the_first_steps_transient(opt_name, lr):
    """A tiny pre-LN GPT (0.02-std init, as GPT-2) learning a periodic sequence, recorded every 10 steps: the first
    updates move the probes by large factors (AdamW moves every weight by ~lr at once). With their defaults the rules
    stay silent; the same rules with a baseline from step 0 alone and no floor would fire."""
    torch.manual_seed(104)
    vocab = 16
    model = nn.Sequential(nn.Embedding(vocab, 32), _Block(), _Block(), nn.LayerNorm(32), nn.Linear(32, vocab))
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
    if opt_name == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95))
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    pattern = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]).repeat(4)
    probes, steps = ProbeSet(model), []
    for step in range(150):
        start = torch.randint(0, 14, (8,))
        ids = torch.stack([pattern[s : s + 13] for s in start.tolist()])
        if step % 10 == 0:
            probes.start()
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps.append((_ctx(step, probes.stop(), recorded=step % 10 == 0), []))
    assert loss.item() < 1.0  # healthy: it learned the sequence
    assert replay([cls() for cls in TRANSFORMER_RULES], steps) == []
    naive = [cls(factor=2.0, floor=0.0, warmup=1) for cls in TRANSFORMER_RULES]
    assert replay(naive, steps) != []  # there is growth to be silent on


def test_severity_is_an_argument():
    assert AttentionLogitRule().severity == "warning" and OutputLogitRule().severity == "alarm"
    assert AttentionLogitRule(severity="alarm").severity == "alarm"
    with pytest.raises(ValueError, match="severity"):
        NormGainRule(severity="loud")
