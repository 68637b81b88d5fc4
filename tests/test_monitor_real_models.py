"""VarianceMonitor on real model definitions (timm, torchvision, Hugging Face transformers), built without weights.

Each model takes 2 monitored SGD steps on a tiny input (2 images of 32x32, or 2 sequences of 8 tokens). The checks
are computed here independently of the monitor: which modules apply a weight as a linear map (and of which kind),
the per-channel input statistics over the right axis (conv and norm layers: dim 1; nn.Linear, transformers'
Conv1D and LayerNorm: the trailing dims), the per-filter weight statistics of transposed weights (Conv1D), the
kernels timm's standardized convs apply (F.conv2d of the layer's input with it gives the layer's output), and that
no record of these healthy models holds a non-finite value.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import idle, step_without_update
from torch import nn

from normlab.monitor import RecordOptions, VarianceMonitor, stats
from normlab.monitor.layers import effective_weight
from normlab.nn import is_norm_layer

timm = pytest.importorskip("timm")
torchvision = pytest.importorskip("torchvision")
transformers = pytest.importorskip("transformers")
from timm.layers import ScaledStdConv2d, ScaledStdConv2dSame, StdConv2d, StdConv2dSame  # noqa: E402
from timm.layers.padding import pad_same  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

TIMM_STD_CONVS = (StdConv2d, StdConv2dSame, ScaledStdConv2d, ScaledStdConv2dSame)


def _images():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def _tokens():
    return torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))


def _timm(name, **kwargs):
    return lambda: timm.create_model(name, pretrained=False, num_classes=10, **kwargs)


def _gpt2():
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(cfg)


def _bert():
    cfg = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=50,
        max_position_embeddings=16,
    )
    return transformers.BertModel(cfg)


def _hf_resnet():
    return transformers.ResNetModel(transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1]))


def _hf_convnext():
    return transformers.ConvNextModel(transformers.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2))


# name -> (builder, input)
MODELS = {
    "timm_resnet10t": (_timm("resnet10t"), _images),
    "timm_regnetx_002": (_timm("regnetx_002"), _images),  # BatchNormAct2d
    "timm_resnetv2_50x1_bit": (_timm("resnetv2_50x1_bit"), _images),  # StdConv2d, GroupNormAct
    "timm_nf_resnet26": (_timm("nf_resnet26"), _images),  # ScaledStdConv2d
    "timm_convnext_atto": (_timm("convnext_atto"), _images),  # LayerNorm2d (channels first) + 1x1 conv MLP
    "timm_convnext_atto_channels_last": (_timm("convnext_atto", conv_mlp=False), _images),  # LayerNorm + Linear
    "timm_mobilenetv3_small_050": (_timm("mobilenetv3_small_050"), _images),  # SE: dead bottleneck channels
    "torchvision_resnet18": (lambda: torchvision.models.resnet18(num_classes=10), _images),
    "hf_gpt2": (_gpt2, _tokens),  # Conv1D (transposed weights), LayerNorm on (B, T, C)
    "hf_bert": (_bert, _tokens),
    "hf_resnet": (_hf_resnet, _images),
    "hf_convnext": (_hf_convnext, _images),  # ConvNextLayerNorm channels_first and channels_last
}


def _output_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def expected_kind(module: nn.Module) -> str | None:
    """The kind each module should be recorded as, decided here from the classes themselves."""
    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    if isinstance(module, nn.Linear | Conv1D):
        return "linear"
    return "norm" if is_norm_layer(module) else None


def channel_dims(module: nn.Module, x: torch.Tensor) -> tuple[int, ...]:
    """Per-channel axes of a layer's input: features of linear maps and layer norms are trailing."""
    if isinstance(module, nn.Linear | Conv1D):
        return (x.dim() - 1,)
    if isinstance(module, nn.LayerNorm | nn.RMSNorm):
        channels_first = getattr(module, "data_format", None) == "channels_first" or re.search(
            r"[23]d(Fp32)?$", type(module).__name__
        )
        k = len(module.normalized_shape)
        return tuple(range(1, 1 + k)) if channels_first else tuple(range(x.dim() - k, x.dim()))
    return (1,)


def live_channel_ratios(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """E_c^2[X] / E_c[X^2] of the channels with E_c[X^2] > 0 (dead channels have no ratio)."""
    x = x.double()
    rest = [d for d in range(x.dim()) if d not in dims]
    xc = x.permute(*dims, *rest).reshape(math.prod(x.shape[d] for d in dims), -1)
    mean, sq = xc.mean(dim=1), xc.square().mean(dim=1)
    live = sq > 0
    return mean[live].square() / sq[live]


def run_monitored(name: str, steps: int = 2):
    """Build model ``name``, take ``steps`` monitored SGD steps; returns (model, monitor, first inputs and outputs)."""
    build, make_input = MODELS[name]
    torch.manual_seed(0)
    model = build().train()
    seen: dict[str, tuple] = {}

    def capture(mod_name):
        def hook(_m, args, out):
            if mod_name not in seen and args and isinstance(args[0], torch.Tensor):
                kernel = None
                if isinstance(_m, TIMM_STD_CONVS):  # the kernel and bias of this forward (SGD changes both)
                    kernel = (effective_weight(_m).clone(), None if _m.bias is None else _m.bias.detach().clone())
                seen[mod_name] = (args[0].detach().clone(), out.detach().clone(), kernel)

        return hook

    handles = [m.register_forward_hook(capture(n)) for n, m in model.named_modules() if expected_kind(m)]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = VarianceMonitor(model, every=1, optimizer=opt)
    x = make_input()
    for _ in range(steps):
        _output_tensor(model(x)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    for h in handles:
        h.remove()
    return model, mon, seen


@pytest.fixture(scope="module")
def runs():
    cache: dict[str, tuple] = {}

    def get(name):
        if name not in cache:
            n = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                cache[name] = run_monitored(name)
            finally:
                torch.set_num_threads(n)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(MODELS))
def test_every_weight_applying_module_is_recorded_with_its_kind(runs, name):
    model, mon, _ = runs(name)
    want = {n: expected_kind(m) for n, m in model.named_modules() if expected_kind(m)}
    got = {n: kind for n, _, kind in mon.layers}
    assert got == want
    # no module with a matrix weight escapes the rule (an embedding is a lookup, not a linear map)
    for n, m in model.named_modules():
        w = m._parameters.get("weight")
        if w is not None and w.dim() >= 2 and not isinstance(m, nn.Embedding):
            assert got.get(n) in ("conv", "linear"), n
    step0 = {r["layer"]: r for r in mon.records if r["step"] == 0}
    for n, k in want.items():
        if k != "norm":  # a layer whose every filter is constant (zero gain, skip-init) has no update ratio
            assert "shift" in step0[n] and "mean_update_std" in step0[n], n
            constant = step0[n].get("constant_filters", 0) == step0[n]["out_channels"]
            assert ("update_ratio_mean" in step0[n]) != constant, n


@pytest.mark.parametrize("name", list(MODELS))
def test_every_record_of_a_healthy_model_is_finite(runs, name):
    _, mon, _ = runs(name)
    assert len(mon.records) == 2 * len(mon.layers)
    bad = [
        (r["layer"], k, v) for r in mon.records for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)
    ]
    assert bad == []


@pytest.mark.parametrize("name", list(MODELS))
def test_channel_input_ratios_are_taken_over_the_channel_axis(runs, name):
    model, mon, seen = runs(name)
    modules = dict(model.named_modules())
    step0 = {r["layer"]: r for r in mon.records if r["step"] == 0}
    checked = 0
    for layer, (x, _, _) in seen.items():
        if x.dim() < 2 or not x.is_floating_point():
            continue
        r = live_channel_ratios(x, channel_dims(modules[layer], x))
        rec = step0[layer]
        assert rec["input_ratio_ch_mean"] == pytest.approx(r.mean().item(), rel=1e-4, abs=1e-9), layer
        assert rec["input_ratio_ch_min"] == pytest.approx(r.min().item(), rel=1e-4, abs=1e-9), layer
        assert rec["input_ratio_ch_max"] == pytest.approx(r.max().item(), rel=1e-4, abs=1e-9), layer
        checked += 1
    assert checked == len(seen)


@pytest.mark.parametrize(
    "name",
    ["timm_resnetv2_50x1_bit", "timm_nf_resnet26", "timm_mobilenetv3_small_050", "torchvision_resnet18", "hf_gpt2"],
)
def test_dead_input_channels_are_counted_and_left_out(runs, name):
    model, mon, seen = runs(name)
    modules = dict(model.named_modules())
    step0 = {r["layer"]: r for r in mon.records if r["step"] == 0}
    dead = {}
    for layer, (x, _, _) in seen.items():
        sq = x.double().square().mean(dim=[d for d in range(x.dim()) if d not in channel_dims(modules[layer], x)])
        dead[layer] = int((sq == 0).sum())
        assert step0[layer]["input_dead_channels"] == dead[layer], layer
    # dead ReLUs at 1x1 resolution and SE bottlenecks (step 0 or 1): the layers whose ratios were nan on main
    with_dead = [r for r in mon.records if r.get("input_dead_channels", 0) > 0]
    assert bool(with_dead) == (name != "hf_gpt2")
    assert all(k in r for r in with_dead for k in ("input_ratio_ch_mean", "input_ratio_ch_min", "input_ratio_ch_max"))


def test_layer_norms_of_transformers_take_channel_stats_over_the_last_dim(runs):
    model, mon, seen = runs("hf_gpt2")
    norms = [n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    assert len(norms) == 5
    step0 = {r["layer"]: r for r in mon.records if r["step"] == 0}
    for n in norms:
        x = seen[n][0]
        assert x.shape == (2, 8, 32)
        over_features = live_channel_ratios(x, (2,))
        over_positions = live_channel_ratios(x, (1,))
        assert step0[n]["input_ratio_ch_max"] == pytest.approx(over_features.max().item(), rel=1e-4)
        assert not over_positions.max().item() == pytest.approx(over_features.max().item(), rel=1e-2)


def test_gpt2_conv1d_projections_have_per_column_filter_statistics(runs):
    model, mon, _ = runs("hf_gpt2")
    proj = {n: m for n, m in model.named_modules() if isinstance(m, Conv1D)}
    assert sorted({n.rsplit(".", 1)[-1] for n in proj}) == ["c_attn", "c_fc", "c_proj"] and len(proj) == 8
    kinds = {n: k for n, _, k in mon.layers}
    step0 = {r["layer"]: r for r in mon.records if r["step"] == 0}
    torch.manual_seed(0)
    fresh = _gpt2()  # the weights before the first step: same seed, same init
    for n, m in proj.items():
        w0 = dict(fresh.named_modules())[n].weight.detach()  # (in, out): filter o is the column w0[:, o]
        rec = step0[n]
        assert kinds[n] == "linear" and rec["type"] == "Conv1D"
        assert (rec["fan_in"], rec["out_channels"]) == (m.nx, m.nf) == tuple(w0.shape)
        var_o = w0.T.var(dim=1, unbiased=False)
        assert rec["weight_var"] == pytest.approx(var_o.mean().item(), rel=1e-5)
        assert rec["weight_var_min"] == pytest.approx(var_o.min().item(), rel=1e-5)
        assert rec["shift"] == pytest.approx((m.nx * w0.mean(dim=0)).var(unbiased=False).item(), rel=1e-5)
        assert rec["shift"] != pytest.approx((m.nf * w0.mean(dim=1)).var(unbiased=False).item(), rel=1e-2)


@pytest.mark.parametrize("name", ["timm_resnetv2_50x1_bit", "timm_nf_resnet26"])
def test_timm_standardized_convs_are_recorded_on_the_kernel_they_apply(runs, name):
    model, mon, seen = runs(name)
    step0 = {r["layer"]: r for r in mon.records if r["step"] == 0}
    std = [(n, m) for n, m in model.named_modules() if isinstance(m, TIMM_STD_CONVS)]
    assert len(std) > 20
    for n, m in std:
        assert step0[n]["shift_scale_free"] < 1e-6, n
        assert step0[n]["shift"] <= 1e-6 * step0[n]["fan_in"] * step0[n]["weight_var"], n
        raw = stats.shift_scale_free(m.weight).item()
        assert raw > 0.1, n  # the raw weight's filter means do spread: recorded on it, the test would fail
    zero_gain = [n for n, m in std if not seen[n][2][0].any()]  # the kernel of the first forward
    for n in zero_gain:  # nf_resnet's last conv of each block starts at gain 0: constant filters, no update ratio
        assert step0[n]["constant_filters"] == step0[n]["out_channels"] and "update_ratio_mean" not in step0[n]
    assert len(zero_gain) == (8 if name == "timm_nf_resnet26" else 0)
    for n, m in std[:4] + std[-2:]:  # the kernel applied in the first forward reproduces the layer's output
        x, y, (w, b) = seen[n]
        # float32 convs of 1-2k channels: the conv algorithm (it can change with the threads free) moves the last
        # bits; the raw weight instead of the applied kernel would miss by O(|y|)
        scale = y.abs().max().item()
        torch.testing.assert_close(
            F.conv2d(x, w, b, m.stride, m.padding, m.dilation, m.groups), y, rtol=1e-4, atol=1e-5 * scale
        )


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("cls", TIMM_STD_CONVS)
def test_every_timm_standardized_conv_class_has_its_applied_kernel(cls, training):
    torch.manual_seed(0)
    conv = cls(3, 4, 3, stride=2, bias=True).train(training)  # stride 2: the *Same classes pad dynamically
    with torch.no_grad():
        conv.weight.add_(torch.linspace(-1, 1, 4).view(4, 1, 1, 1))  # raw filter means far apart
        if hasattr(conv, "gain"):
            conv.gain.uniform_(0.5, 2.0)
    x = torch.randn(2, 3, 9, 9)
    mon = VarianceMonitor(conv, every=1, recording=RecordOptions(record_eval=not training), optimizer=idle(conv))
    y = conv(x)
    step_without_update(mon)
    xin = pad_same(x, conv.kernel_size, conv.stride, conv.dilation) if getattr(conv, "same_pad", False) else x
    w = effective_weight(conv)
    torch.testing.assert_close(F.conv2d(xin, w, conv.bias, conv.stride, conv.padding, conv.dilation), y)
    assert stats.shift_scale_free(conv.weight).item() > 0.5
    assert mon.records[0]["shift_scale_free"] < 1e-6 and mon.records[0]["output_var"] > 0
    assert mon.records[0]["weight_sq_mean"] == pytest.approx(w.square().mean().item(), rel=1e-6)
