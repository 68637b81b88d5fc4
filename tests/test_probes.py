"""Probes (normlab.monitor.probes): attention logits through every mechanism, residual stream, gains, logits."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from normlab.monitor.probes import (
    AttentionLogitProbe,
    NormGainProbe,
    OutputLogitProbe,
    ProbeSet,
    ResidualStreamProbe,
    attention_logit_max,
)


def _explicit(q, k, scale, keep=None):
    """max |q k^T| * scale over the kept pairs, the slow way."""
    best = 0.0
    logits = (q @ k.transpose(-2, -1)) * scale
    for idx in torch.nonzero(torch.ones_like(logits, dtype=torch.bool)):
        idx = tuple(idx.tolist())
        if keep is None or keep[idx[-2], idx[-1]]:
            best = max(best, abs(float(logits[idx].detach())))
    return best


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_multihead_attention_logit_max(batch_first, causal):
    torch.manual_seed(100)
    mha = nn.MultiheadAttention(8, 2, batch_first=batch_first)
    x = torch.randn(3, 5, 8) * 3
    xin = x if batch_first else x.transpose(0, 1)
    mask = nn.Transformer.generate_square_subsequent_mask(5) if causal else None
    ps = ProbeSet(mha, [AttentionLogitProbe()])
    ps.start()
    mha(xin, xin, xin, attn_mask=mask)
    got = ps.stop()["attn_logit/model"]
    q = F.linear(x, mha.in_proj_weight[:8], mha.in_proj_bias[:8]).view(3, 5, 2, 4).transpose(1, 2)
    k = F.linear(x, mha.in_proj_weight[8:16], mha.in_proj_bias[8:16]).view(3, 5, 2, 4).transpose(1, 2)
    keep = torch.ones(5, 5, dtype=torch.bool).tril() if causal else None
    assert got == pytest.approx(_explicit(q, k, 0.5, keep), rel=1e-5)
    assert not mha._forward_pre_hooks and not mha._forward_hooks  # hooks gone after stop()


class SDPAAttention(nn.Module):
    """Any module that calls F.scaled_dot_product_attention (here with a custom scale)."""

    def __init__(self, d=8, heads=2, scale=None):
        super().__init__()
        self.qkv, self.heads, self.scale = nn.Linear(d, 3 * d), heads, scale

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        self.q, self.k = q.detach(), k.detach()
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale).transpose(1, 2).flatten(2)


@pytest.mark.parametrize("scale", [None, 0.7])
def test_sdpa_caller_attributed_to_its_module(scale):
    torch.manual_seed(101)
    model = nn.Sequential(nn.Linear(8, 8), SDPAAttention(scale=scale), nn.Linear(8, 4))
    ps = ProbeSet(model, [AttentionLogitProbe()])
    ps.start()
    model(torch.randn(2, 6, 8) * 4)
    got = ps.stop()
    att = model[1]
    s = 0.5 if scale is None else scale
    assert list(got) == ["attn_logit/1"]
    assert got["attn_logit/1"] == pytest.approx(_explicit(att.q, att.k, s, torch.ones(6, 6).tril().bool()), rel=1e-5)


def test_attention_logit_max_grouped_query_and_bool_mask():
    torch.manual_seed(102)
    q, k = torch.randn(1, 4, 3, 2), torch.randn(1, 2, 3, 2)
    keep = torch.tensor([[True, False, True]] * 3)
    want = _explicit(q, k.repeat_interleave(2, dim=1), 1 / math.sqrt(2), keep)
    assert float(attention_logit_max(q, k, attn_mask=keep)) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_gpt2_from_config(impl):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_embd=16, n_layer=2, n_head=2, n_positions=8, vocab_size=20, bos_token_id=0, eos_token_id=0
    )
    cfg._attn_implementation = impl
    torch.manual_seed(103)
    model = transformers.GPT2LMHeadModel(cfg).eval()  # no dropout: the explicit forward below sees the same
    with torch.no_grad():  # larger logits than at init, so that a wrong scale or mask shows
        for block in model.transformer.h:
            block.attn.c_attn.weight.mul_(30)
    ids = torch.randint(0, 20, (2, 7))
    ps = ProbeSet(model)
    ps.start()
    out = model(ids)
    got = ps.stop()
    # explicit: each block's q, k from its c_attn on its ln_1 input
    hidden = model(ids, output_hidden_states=True).hidden_states
    for i, block in enumerate(model.transformer.h):
        q, k, _ = block.attn.c_attn(block.ln_1(hidden[i])).split(16, dim=2)
        q, k = (t.view(2, 7, 2, 8).transpose(1, 2) for t in (q, k))
        want = _explicit(q.detach(), k.detach(), 1 / math.sqrt(8), torch.ones(7, 7).tril().bool())
        assert got[f"attn_logit/transformer.h.{i}.attn"] == pytest.approx(want, rel=1e-4)
        assert got[f"residual_rms/transformer.h.{i}.ln_1"] == pytest.approx(
            float(hidden[i].detach().square().mean().sqrt())
        )
    assert got["logit_max/output"] == pytest.approx(float(out.logits.abs().max()))
    assert got["norm_gain/transformer.ln_f"] == pytest.approx(1.0)


def test_residual_gain_and_output_probes():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 3))
    with torch.no_grad():
        model[1].weight.fill_(2.0)
    ps = ProbeSet(model, [ResidualStreamProbe(), NormGainProbe(), OutputLogitProbe()])
    x = torch.randn(5, 4)
    ps.start()
    y = model(x)
    got = ps.stop()
    h = model[0](x)
    assert got["residual_rms/1"] == pytest.approx(float(h.square().mean().sqrt()), rel=1e-6)
    assert got["norm_gain/1"] == pytest.approx(2.0)
    assert got["logit_rms/output"] == pytest.approx(float(y.square().mean().sqrt()), rel=1e-6)
    assert got["logit_max/output"] == pytest.approx(float(y.abs().max()), rel=1e-6)


def test_probes_cost_nothing_between_recorded_steps_and_keep_the_max():
    model = nn.Sequential(nn.LayerNorm(4), SDPAAttention(d=4, heads=1))
    ps = ProbeSet(model)
    model(torch.randn(1, 3, 4))
    assert ps.stop() == {}  # never started: nothing, and no hook was attached
    ps.start()
    model(torch.ones(1, 3, 4))
    model(torch.ones(1, 3, 4) * 10)  # a second forward (gradient accumulation): the larger value stays
    got = ps.stop()
    assert got["residual_rms/0"] == pytest.approx(10.0)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert torch.overrides._get_current_function_mode_stack() == []


def test_mode_left_after_a_failed_forward():
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    model = nn.Sequential(SDPAAttention(d=4, heads=1), Boom())
    ps = ProbeSet(model, [AttentionLogitProbe()])
    ps.start()
    with pytest.raises(RuntimeError):
        model(torch.randn(1, 3, 4))
    ps.stop()
    assert torch.overrides._get_current_function_mode_stack() == []


def test_probe_set_refuses_other_objects():
    with pytest.raises(TypeError, match="Probe"):
        ProbeSet(nn.Linear(2, 2), [object()])


@pytest.mark.parametrize("name", ["normlab.monitor.probes", "normlab.monitor.rules.transformer"])
def test_docstring_examples(name):
    import doctest
    import importlib

    mod = importlib.import_module(name)
    result = doctest.testmod(mod, extraglobs={"torch": torch, "nn": nn}, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_hf_llama_eager_and_sdpa_agree():
    """Two independent mechanisms (softmax input inside the attention module; the SDPA call with grouped-query keys
    after rotary embeddings) give the same logit max on the same Llama (built from a tiny config)."""
    transformers = pytest.importorskip("transformers")
    got = {}
    for impl in ("eager", "sdpa"):
        cfg = transformers.LlamaConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=20, max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        cfg._attn_implementation = impl
        torch.manual_seed(105)
        model = transformers.LlamaForCausalLM(cfg).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(200)
        ps = ProbeSet(model, [AttentionLogitProbe()])
        ps.start()
        model(torch.randint(0, 20, (2, 9)))
        got[impl] = ps.stop()
    assert sorted(got["eager"]) == ["attn_logit/model.layers.0.self_attn", "attn_logit/model.layers.1.self_attn"]
    for key, value in got["eager"].items():
        assert value > 0.5 and got["sdpa"][key] == pytest.approx(value, rel=1e-4)
