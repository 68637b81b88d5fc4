"""Tests for normlab.convert (convert_norm, fold_for_inference) and normlab.nn.param_groups."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from normlab.convert import CONVERT_TARGETS, convert_norm, fold_for_inference
from normlab.nn import is_norm_layer, param_groups
from normlab.nn.weight_std import PWSConv1d, PWSConv2d, WSConv2d


# ----------------------------------------------------------------------------------------------------------
# a small torchvision-style ResNet (BasicBlock: conv1, bn1, relu, conv2, bn2, downsample)
# ----------------------------------------------------------------------------------------------------------
class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + idt)


class TinyResNet(nn.Module):
    def __init__(self, width=8, classes=5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, stride=2))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def trained_resnet(seed=0):
    """A TinyResNet whose BatchNorms have non-trivial running statistics and affine parameters."""
    torch.manual_seed(seed)
    model = TinyResNet()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.3, 0.3)
        model.train()
        for _ in range(3):
            model(torch.randn(8, 3, 12, 12) * 2 + 0.5)
    return model.eval()


def count(model, cls):
    return sum(type(m) is cls for m in model.modules())


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# ----------------------------------------------------------------------------------------------------------
# convert_norm
# ----------------------------------------------------------------------------------------------------------
def test_convert_to_pws_replaces_convs_and_removes_following_bn():
    model = trained_resnet()
    convs = {n: m for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    out = convert_norm(model, "pws", gamma=1e-4)
    assert out is model
    assert count(model, nn.Conv2d) == 0 and count(model, nn.BatchNorm2d) == 0
    new = dict(model.named_modules())
    for name, old in convs.items():
        c = new[name]
        assert type(c) is PWSConv2d and c.gamma == 1e-4
        assert (c.stride, c.padding, c.kernel_size, c.in_channels, c.out_channels) == (
            old.stride,
            old.padding,
            old.kernel_size,
            old.in_channels,
            old.out_channels,
        )
        assert torch.equal(c.weight, old.weight)  # same raw weights
        assert c.bias is not None and torch.equal(c.bias, torch.zeros_like(c.bias))  # bias takes BN's shift role
    assert isinstance(model.bn1, nn.Identity) and isinstance(model.layer2[0].downsample[1], nn.Identity)
    model.train()
    y = model(torch.randn(2, 3, 12, 12))
    assert y.shape == (2, 5) and torch.isfinite(y).all()


def test_convert_to_ws_keeps_norm_when_asked_and_handles_1d():
    torch.manual_seed(1)
    seq = nn.Sequential(nn.Conv1d(3, 4, 3, bias=False), nn.BatchNorm1d(4), nn.ReLU(), nn.Conv1d(4, 2, 1))
    ws = convert_norm(seq, "ws", remove_norm=False, eps=1e-4)
    assert type(ws[0]).__name__ == "WSConv1d" and ws[0].eps == 1e-4 and ws[0].bias is None
    assert type(ws[1]) is nn.BatchNorm1d
    seq2 = nn.Sequential(nn.Conv1d(3, 4, 3), nn.BatchNorm1d(4), nn.ReLU(), nn.Conv1d(4, 2, 1))
    pws = convert_norm(seq2, "pws")
    assert type(pws[0]) is PWSConv1d and type(pws[3]) is PWSConv1d and isinstance(pws[1], nn.Identity)
    assert pws(torch.randn(2, 3, 9)).shape == (2, 2, 7)
    # a conv given directly is returned converted
    assert type(convert_norm(nn.Conv2d(3, 4, 3), "pws")) is PWSConv2d


def test_convert_to_ws_keeps_output_norms_by_default():
    # WS kernels have unit variance per entry (n Var[W_hat] = fan_in): without the norms a deep net's activations
    # grow by ~fan_in per layer (a ResNet-like stack overflowed float32 when they were removed by default)
    torch.manual_seed(2)
    layers = []
    for _ in range(12):
        layers += [nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
    model = convert_norm(nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), *layers), "ws")
    assert count(model, nn.BatchNorm2d) == 12 and count(model, WSConv2d) == 13
    y = model(torch.randn(2, 3, 8, 8))
    assert torch.isfinite(y).all() and y.abs().max() < 100
    with pytest.warns(UserWarning, match="fan-in"):
        stripped = convert_norm(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), "ws", remove_norm=True)
    assert isinstance(stripped[1], nn.Identity)
    assert count(convert_norm(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), "pws"), nn.BatchNorm2d) == 0


@pytest.mark.parametrize("to", ["gn", "ln", "in", "sn", "brn", "bn", "none"])
def test_convert_bn_to_other_norms(to):
    model = trained_resnet()
    bns = {n: m for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)}
    convert_norm(model, to)
    assert count(model, nn.BatchNorm2d) == (len(bns) if to == "bn" else 0)
    new = dict(model.named_modules())
    for name, bn in bns.items():
        m = new[name]
        if to == "none":
            assert isinstance(m, nn.Identity)
            continue
        assert is_norm_layer(m)
        if getattr(m, "weight", None) is not None:  # affine copied where the layer has per-channel parameters
            assert torch.equal(m.weight.reshape(-1), bn.weight.reshape(-1))
            assert torch.equal(m.bias.reshape(-1), bn.bias.reshape(-1))
        if to in ("brn", "bn"):
            assert torch.equal(m.running_mean, bn.running_mean) and torch.equal(m.running_var, bn.running_var)
            assert int(m.num_batches_tracked) == int(bn.num_batches_tracked)
            assert m.eps == bn.eps and m.momentum == bn.momentum
        if to == "gn":
            assert isinstance(m, nn.GroupNorm) and m.num_groups == bn.num_features  # <= 32 and divides C
        if to == "ln":
            assert isinstance(m, nn.GroupNorm) and m.num_groups == 1
    assert not model.training  # training mode preserved (eval)
    y = model(torch.randn(2, 3, 12, 12))
    assert y.shape == (2, 5) and torch.isfinite(y).all()


def test_bn_to_brn_keeps_eval_outputs_exactly():
    model = trained_resnet()
    x = torch.randn(3, 3, 12, 12)
    with torch.no_grad():
        y = model(x)
        brn = convert_norm(model, "brn")
        assert count(brn, nn.BatchNorm2d) == 0
        torch.testing.assert_close(brn(x), y, rtol=1e-6, atol=1e-6)


def test_convert_norm_bad_target():
    with pytest.raises(ValueError, match=r"convert_norm: unknown to='batch'; expected one of none, bn"):
        convert_norm(TinyResNet(), "batch")
    assert set(CONVERT_TARGETS) >= {"pws", "ws", "gn", "brn", "sn", "in", "ln", "none"}


# ----------------------------------------------------------------------------------------------------------
# fold_for_inference
# ----------------------------------------------------------------------------------------------------------
def test_fold_bn_resnet_equals_eval_model():
    model = trained_resnet()
    model.train()  # fold_for_inference puts it (a copy) in eval mode and restores the original's mode
    x = torch.randn(4, 3, 12, 12)
    folded = fold_for_inference(model, example_input=x)
    assert model.training and count(model, nn.BatchNorm2d) == 8  # original untouched
    assert count(folded, nn.BatchNorm2d) == 0 and not folded.training
    assert all(m.bias is not None for m in folded.modules() if isinstance(m, nn.Conv2d))
    model.eval()
    with torch.no_grad():
        assert rel_err(folded(x), model(x)) < 1e-5


def test_fold_pws_and_ws_models():
    torch.manual_seed(3)
    model = trained_resnet()
    pws = convert_norm(model, "pws", init_alpha=True)
    pws.train()
    pws(torch.randn(8, 3, 12, 12))  # data-dependent alpha init
    with torch.no_grad():
        for m in pws.modules():
            if isinstance(m, PWSConv2d):
                m.alpha.mul_(torch.rand_like(m.alpha) + 0.5)
                m.bias.uniform_(-0.1, 0.1)
    x = torch.randn(4, 3, 12, 12)
    folded = fold_for_inference(pws)
    assert count(folded, PWSConv2d) == 0 and count(folded, nn.Conv2d) == 8
    pws.eval()
    with torch.no_grad():
        assert rel_err(folded(x), pws(x)) < 1e-5
    # WS conv followed by BatchNorm: both the standardization and the BN go into one plain conv
    ws = convert_norm(trained_resnet(), "ws", remove_norm=False)
    assert count(ws, WSConv2d) == 8 and count(ws, nn.BatchNorm2d) == 8
    folded = fold_for_inference(ws.eval(), example_input=x)
    assert count(folded, WSConv2d) == 0 and count(folded, nn.BatchNorm2d) == 0
    with torch.no_grad():
        assert rel_err(folded(x), ws(x)) < 1e-5


def test_fold_batch_renorm_and_weight_norm():
    torch.manual_seed(4)
    brn_model = convert_norm(trained_resnet(), "brn")
    x = torch.randn(4, 3, 12, 12)
    folded = fold_for_inference(brn_model)
    assert not any(is_norm_layer(m) for m in folded.modules())
    with torch.no_grad():
        assert rel_err(folded(x), brn_model.eval()(x)) < 1e-5
    wn = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Conv2d(3, 4, 3)), nn.BatchNorm2d(4)).eval()
    with torch.no_grad():
        wn[1].running_mean.uniform_(-1, 1)
        wn[1].running_var.uniform_(0.5, 2)
    folded = fold_for_inference(wn, example_input=x)
    assert type(folded[0]) is nn.Conv2d and isinstance(folded[1], nn.Identity)


def test_fold_pws_with_every_conv_argument_is_a_plain_conv():
    torch.manual_seed(5)
    conv = PWSConv2d(
        4,
        6,
        (3, 2),
        stride=(2, 1),
        padding=(1, 1),
        dilation=(1, 2),
        groups=2,
        padding_mode="circular",
        dtype=torch.float64,
    )
    bn = nn.BatchNorm2d(6, dtype=torch.float64)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 2)
        bn.bias.uniform_(-1, 1)
    seq = nn.Sequential(conv, bn).eval()
    x = torch.randn(2, 4, 7, 8, dtype=torch.float64)
    folded = fold_for_inference(seq)
    f = folded[0]
    assert type(f) is nn.Conv2d and f.padding_mode == "circular" and f.groups == 2 and f.dilation == (1, 2)
    with torch.no_grad():
        torch.testing.assert_close(folded(x), seq(x), rtol=1e-12, atol=1e-12)
    # a single PWS conv folds into a plain conv too
    single = fold_for_inference(conv)
    assert type(single) is nn.Conv2d
    with torch.no_grad():
        torch.testing.assert_close(single(x), conv.eval()(x), rtol=1e-12, atol=1e-12)


def test_fold_follows_dataflow_not_registration_order():
    class BnBeforeConv(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 1)
            self.bn = nn.BatchNorm2d(4)

        def forward(self, x):
            return self.conv(self.bn(x))  # BN is registered after the conv but applied before it

    torch.manual_seed(6)
    m = BnBeforeConv().eval()
    randomize_bns(m)
    x = torch.randn(2, 4, 5, 5)
    with pytest.warns(UserWarning, match=r"left unfolded: conv -> bn: its input is the model's input, not the conv's"):
        folded = fold_for_inference(m, example_input=x)
    assert type(folded.bn) is nn.BatchNorm2d
    with torch.no_grad():
        assert rel_err(folded(x), m(x)) < 1e-6


def test_fold_check_catches_a_wrong_fold(monkeypatch):
    import normlab.convert.fold as conv_mod

    real = conv_mod._plain_conv

    def off_by_one(conv, dim, norm):
        out = real(conv, dim, norm)
        with torch.no_grad():
            out.bias.add_(1.0)
        return out

    monkeypatch.setattr(conv_mod, "_plain_conv", off_by_one)
    seq = randomize_bns(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval())
    with pytest.raises(RuntimeError, match="fold_for_inference: folded output differs"):
        fold_for_inference(seq, example_input=torch.randn(2, 3, 6, 6))


# ---------------------------------------------------------------- models whose forward is not the registration
def randomize_bns(model):
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return model


class ActBetween(nn.Module):  # registered conv, bn; applied bn(relu(conv(x)))
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(torch.relu(self.conv(x)))


class Residual(nn.Module):  # conv's output feeds its BN and the skip; a second, clean pair after it
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        return self.bn2(self.conv2(self.bn(y) + y))


class ConvTwice(nn.Module):  # one conv applied twice
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(self.conv(x)))


class SharedBN(nn.Module):  # one BN on two paths
    def __init__(self):
        super().__init__()
        self.conv1, self.bn, self.conv2 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Conv2d(3, 4, 1)

    def forward(self, x):
        return self.bn(self.conv1(x)) + self.bn(self.conv2(x))


class BranchOnData(nn.Module):  # torch.fx cannot trace it: folded through the hook trace on a default input
    def __init__(self, act=False):
        super().__init__()
        self.act = act
        self.conv, self.bn = WSConv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.head = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))

    def forward(self, x):
        y = self.conv(x)
        y = self.bn(torch.relu(y) if self.act else y)
        if y.mean() > 100:  # data-dependent control flow
            y = -y
        return self.head(y)


class Unrunnable(nn.Module):  # fx fails and no default input fits (the first registered conv is not the stem)
    def __init__(self):
        super().__init__()
        self.head = nn.Conv2d(4, 2, 1)
        self.stem, self.bn = WSConv2d(5, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.bn(self.stem(x))
        return self.head(y if y.sum() > -1e9 else -y)


@pytest.mark.parametrize(
    "model_cls, cin, unfolded, why",
    [
        (ActBetween, 3, {"bn"}, "its input is the output of relu, not the conv's output"),
        (Residual, 4, {"bn"}, "also used elsewhere"),
        (ConvTwice, 4, {"bn"}, "runs 2 times"),
        (SharedBN, 3, {"bn"}, "runs 2 times"),
        (lambda: BranchOnData(act=True), 3, {"bn"}, "its input is not the conv's output"),
    ],
)
def test_fold_leaves_pairs_the_forward_does_not_chain(model_cls, cin, unfolded, why):
    torch.manual_seed(8)
    model = randomize_bns(model_cls()).eval()
    x = torch.randn(3, cin, 8, 8)
    with pytest.warns(UserWarning) as record:  # BranchOnData: also that its folds rest on the traced path
        folded = fold_for_inference(model)
    assert any(re.match(f"fold_for_inference: left unfolded: .*{why}", str(w.message)) for w in record)
    left = {n for n, m in folded.named_modules() if isinstance(m, nn.BatchNorm2d)}
    assert left == unfolded
    with torch.no_grad():
        assert rel_err(folded(x), model(x)) < 1e-5  # the old registration-order rule missed by up to 0.18


def test_fold_through_hooks_when_fx_cannot_trace():
    torch.manual_seed(9)
    model = randomize_bns(BranchOnData()).eval()
    with pytest.warns(UserWarning, match=r"rest on the path a default input took: .* conv -> bn, head.0 -> head.1$"):
        folded = fold_for_inference(model)  # both pairs fold, on the path of the traced input
    assert not any(isinstance(m, nn.BatchNorm2d) for m in folded.modules())
    assert type(folded.conv) is nn.Conv2d
    x = torch.randn(2, 3, 11, 11)
    with torch.no_grad():
        assert rel_err(folded(x), model(x)) < 1e-5


def test_fold_without_dataflow_folds_no_bn_but_still_plain_convs():
    torch.manual_seed(10)
    model = randomize_bns(Unrunnable()).eval()
    with pytest.warns(UserWarning, match="stem -> bn: dataflow unknown"):
        folded = fold_for_inference(model)
    assert type(folded.bn) is nn.BatchNorm2d and type(folded.stem) is nn.Conv2d  # WS kernel folded: exact
    x = torch.randn(2, 5, 7, 7)
    with torch.no_grad():
        assert rel_err(folded(x), model(x)) < 1e-5
    # with an input that fits, the hook trace establishes the dataflow and the pair folds (on the path x takes)
    with pytest.warns(UserWarning, match="the folds rest on the path example_input took: .* stem -> bn$"):
        folded = fold_for_inference(model, example_input=x)
    assert type(folded.bn) is nn.Identity


def test_fold_leaves_training_mode_bn_without_running_stats():
    seq = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False))
    with pytest.warns(UserWarning, match=r"left unfolded: 0 -> 1: no running statistics"):  # it was silent
        folded = fold_for_inference(seq)
    assert type(folded[1]) is nn.BatchNorm2d  # uses batch statistics even in eval: cannot be folded


# ----------------------------------------------------------------------------------------------------------
# param_groups
# ----------------------------------------------------------------------------------------------------------
class MyNorm(nn.Module):
    _normlab_norm = True

    def __init__(self, c):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(c))

    def forward(self, x):
        return x * self.scale.reshape(1, -1, 1, 1)


def group_model():
    torch.manual_seed(7)
    m = nn.Sequential(
        PWSConv2d(3, 4, 3),
        nn.GroupNorm(2, 4),
        nn.Conv2d(4, 4, 1),
        nn.BatchNorm2d(4),
        MyNorm(4),
        nn.LayerNorm(4),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 3),
    )
    m.append(nn.Linear(3, 3, bias=False))
    m.append(nn.Linear(3, 3))
    m[-1].weight = m[-2].weight  # shared parameter
    return m


def ids(ps):
    return [id(p) for p in ps]


def test_param_groups_each_param_once_and_no_decay_on_alpha_and_norms():
    m = group_model()
    groups = param_groups(m, 5e-4)
    assert [g["weight_decay"] for g in groups] == [5e-4, 0.0]
    decay, keep = ids(groups[0]["params"]), ids(groups[1]["params"])
    all_ids = decay + keep
    assert len(all_ids) == len(set(all_ids)) == len({id(p) for p in m.parameters()})  # each param exactly once
    expected_keep = [
        m[0].alpha,
        m[0].bias,
        m[1].weight,
        m[1].bias,
        m[2].bias,
        m[3].weight,
        m[3].bias,
        m[4].scale,
        m[5].weight,
        m[5].bias,
        m[7].bias,
        m[9].bias,
    ]
    assert set(keep) == set(ids(expected_keep))
    assert set(decay) == set(ids([m[0].weight, m[2].weight, m[7].weight, m[8].weight]))


def test_param_groups_bias_configurable_and_frozen_params():
    m = group_model()
    groups = param_groups(m, 0.1, no_decay=("alpha", "norm"))
    decay, keep = ids(groups[0]["params"]), ids(groups[1]["params"])
    assert id(m[0].bias) in decay and id(m[2].bias) in decay and id(m[7].bias) in decay
    assert id(m[3].bias) in keep and id(m[0].alpha) in keep  # norm biases stay with the norm
    m[0].alpha.requires_grad_(False)
    assert id(m[0].alpha) not in ids(p for g in param_groups(m, 0.1) for p in g["params"])
    with pytest.raises(ValueError, match="param_groups: unknown no_decay kind"):
        param_groups(m, 0.1, no_decay=("alphas",))
    with pytest.raises(ValueError, match="param_groups: weight_decay must be a number >= 0"):
        param_groups(m, -1.0)


def test_param_groups_with_sgd_decays_only_the_decay_group():
    m = group_model()
    before = {id(p): p.detach().clone() for p in m.parameters()}
    opt = torch.optim.SGD(param_groups(m, 0.5), lr=1.0)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    decay = set(ids(opt.param_groups[0]["params"]))
    for p in m.parameters():
        if id(p) in decay:
            torch.testing.assert_close(p.detach(), before[id(p)] * 0.5)
        else:
            assert torch.equal(p.detach(), before[id(p)])


def test_is_norm_layer_covers_torch_and_normlab_norms():
    from normlab.nn.batch_renorm import BatchRenorm2d
    from normlab.nn.instance_norm import InstanceNorm2d

    for mod in (
        nn.BatchNorm1d(3),
        nn.SyncBatchNorm(3),
        nn.InstanceNorm2d(3),
        nn.GroupNorm(1, 3),
        nn.LayerNorm(3),
        BatchRenorm2d(3),
        InstanceNorm2d(3),
        MyNorm(3),
    ):
        assert is_norm_layer(mod), type(mod).__name__
    for mod in (nn.Conv2d(3, 3, 1), PWSConv2d(3, 3, 1), nn.Linear(3, 3)):
        assert not is_norm_layer(mod)


# ----------------------------------------------------------------------------------------------------------
# convert_norm: shared modules, dataflow, (N, C) inputs, unknown subclasses, inplace
# ----------------------------------------------------------------------------------------------------------
class Aliased(nn.Module):  # one BN under two names, one conv + BN pair shared by two parents
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.bn_alias = self.bn
        self.conv_alias = self.conv
        shared = nn.Sequential(nn.Conv2d(8, 8, 1, bias=False), nn.BatchNorm2d(8))
        self.a, self.b = nn.Sequential(shared), nn.Sequential(shared)

    def forward(self, x):
        return self.b(self.a(self.bn_alias(self.conv(x))))


@pytest.mark.parametrize("to", ["brn", "gn", "sn", "none", "pws", "ws"])
def test_shared_modules_stay_shared(to):
    model = Aliased()
    convert_norm(model, to)
    assert model.bn is model.bn_alias and model.conv is model.conv_alias and model.a[0] is model.b[0]
    assert model.a[0][0] is model.b[0][0] and model.a[0][1] is model.b[0][1]
    assert not any(type(m) is nn.BatchNorm2d for m in model.modules()) or to == "ws"
    if to in ("pws", "ws"):
        assert type(model.conv) is (PWSConv2d if to == "pws" else WSConv2d)
        assert type(model.a[0][0]) is type(model.conv)
    model(torch.randn(2, 3, 6, 6)).sum().backward()


class InputNorm(nn.Module):  # registered conv, bn_in, bn; applied conv(bn_in(x)) then bn: order != dataflow
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn_in = nn.BatchNorm2d(4)
        self.head = nn.Conv2d(4, 4, 1)
        self.relu = nn.ReLU()
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.head(self.relu(self.conv(self.bn_in(x)))))


def test_pws_removes_the_norm_the_dataflow_feeds_not_the_next_registered():
    model = convert_norm(InputNorm(), "pws")
    assert type(model.bn_in) is nn.BatchNorm2d  # normalizes the input, not a conv's output: kept
    assert isinstance(model.bn, nn.Identity)  # head's output norm (not head's registration neighbour): removed
    assert model.head.bias is not None and type(model.head) is PWSConv2d
    assert model(torch.randn(2, 4, 5, 5)).shape == (2, 4, 5, 5)


class UnrunnablePlain(Unrunnable):  # as Unrunnable, with a plain stem conv (fx fails, no default input fits)
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(5, 4, 3)


def test_pws_removes_nothing_when_the_dataflow_is_unknown():
    model = UnrunnablePlain()
    with pytest.warns(UserWarning, match="remove_norm: the dataflow could not be established"):
        convert_norm(model, "pws")
    assert type(model.bn) is nn.BatchNorm2d and type(model.stem) is PWSConv2d and type(model.head) is PWSConv2d
    x = torch.randn(2, 5, 7, 7)
    with pytest.warns(UserWarning, match="BatchNorms removed rest on the path example_input took: .* removed: bn$"):
        model2 = convert_norm(UnrunnablePlain(), "pws", example_input=x)  # the input establishes it (its path)
    assert isinstance(model2.bn, nn.Identity) and model2.stem.bias is not None


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)  # N == C on purpose: (6, 6) input would run with the wrong semantics
        self.bn = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 2)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.fc(x))))


class Seq1d(nn.Module):  # a Conv1d feeds the BatchNorm1d: (N, C, L)
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 6, 3)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x):
        return self.bn(self.conv(x))


class Reshaped1d(nn.Module):  # the BatchNorm1d's input comes from a reshape: its rank is unknown without input
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x):
        return self.bn(x.flatten(2))


@pytest.mark.parametrize("to", ["gn", "ln", "in", "sn"])
def test_norms_needing_a_length_axis_are_refused_for_bn1d_over_n_c(to):
    model = MLP()
    with pytest.raises(ValueError) as err:
        convert_norm(model, to)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"convert_norm(to={to!r}): cannot replace bn (BatchNorm1d)")
    assert "nn.Linear" in msg and "(N, C, L)" in msg
    assert type(model.bn) is nn.BatchNorm1d  # nothing changed
    with pytest.raises(ValueError, match=r"bn \(BatchNorm1d\): sees \(N, C\) input on example_input"):
        convert_norm(model, to, example_input=torch.randn(6, 6))
    conv = convert_norm(Seq1d(), to)  # fx shows a Conv1d feeds it: converted
    assert conv(torch.randn(2, 3, 8)).shape == (2, 6, 6) and type(conv.bn) is not nn.BatchNorm1d
    with pytest.raises(ValueError, match="give example_input"):
        convert_norm(Reshaped1d(), to)
    shown = convert_norm(Reshaped1d(), to, example_input=torch.randn(2, 6, 2, 3))
    assert type(shown.bn) is not nn.BatchNorm1d


@pytest.mark.parametrize("to", ["brn", "bn", "none"])
def test_bn1d_over_n_c_converts_to_batch_norms(to):
    model = MLP()
    convert_norm(model, to)
    assert model(torch.randn(6, 6)).shape == (6, 2)


def test_instance_statistics_refused_where_example_input_shows_one_position():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, stride=4), nn.BatchNorm2d(4))
    one_position = r"1 \(BatchNorm2d, input \(2, 4, 1, 1\)\): sees a single position per channel on example_input"
    with pytest.raises(ValueError, match=one_position):
        convert_norm(model, "in", example_input=torch.randn(2, 3, 4, 4))
    one_value = r"1 \(BatchNorm2d, input \(2, 4, 1, 1\), GroupNorm\(4, 4\)\): sees one value per group"
    with pytest.raises(ValueError, match=one_value):
        convert_norm(model, "gn", example_input=torch.randn(2, 3, 4, 4))
    assert convert_norm(model, "gn", num_groups=2, example_input=torch.randn(2, 3, 4, 4))[1].num_groups == 2


class OwnForwardBN(nn.BatchNorm2d):  # a BatchNorm subclass that computes something else
    def forward(self, x):
        return super().forward(x) * 2


class PlainSubclassBN(nn.BatchNorm2d):  # same forward as BatchNorm2d: converted
    pass


@pytest.mark.parametrize("to", ["brn", "none", "pws"])
def test_unknown_batchnorm_subclasses_are_left_and_named_in_one_warning(to):
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), OwnForwardBN(4), nn.Conv2d(4, 4, 1), OwnForwardBN(4), nn.Conv2d(4, 4, 1), PlainSubclassBN(4)
    )
    with pytest.warns(UserWarning) as record:
        convert_norm(model, to)
    msgs = [str(w.message) for w in record if "own forward" in str(w.message)]
    assert len(msgs) == 1 and "1 (OwnForwardBN), 3 (OwnForwardBN)" in msgs[0]
    assert type(model[1]) is OwnForwardBN and type(model[3]) is OwnForwardBN
    assert type(model[5]) is not PlainSubclassBN
    folded = None
    with pytest.warns(UserWarning, match=r"0 -> 1, 2 -> 3: a BatchNorm subclass with its own forward"):
        folded = fold_for_inference(randomize_bns(model).eval(), example_input=torch.randn(2, 3, 6, 6))
    assert type(folded[1]) is OwnForwardBN


def test_sync_batchnorm_to_brn_is_sync_batch_renorm():
    from normlab.nn import BatchRenorm2d, SyncBatchRenorm

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.SyncBatchNorm(4), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))
    convert_norm(model, "brn")
    assert type(model[1]) is SyncBatchRenorm and type(model[3]) is BatchRenorm2d
    fold_input = torch.randn(2, 3, 6, 6)
    ref = randomize_bns(nn.Sequential(nn.Conv2d(3, 4, 3), nn.SyncBatchNorm(4))).eval()
    folded = fold_for_inference(ref, example_input=fold_input)  # eval SyncBatchNorm folds
    assert isinstance(folded[1], nn.Identity)


def test_inplace_false_converts_a_copy():
    model = trained_resnet()
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        y = model(x)
    for to in ("brn", "pws"):
        out = convert_norm(model, to, inplace=False)
        assert out is not model and count(model, nn.BatchNorm2d) == 8 and count(model, nn.Conv2d) == 8
        assert not any(type(m) is nn.BatchNorm2d for m in out.modules())
    with torch.no_grad():
        assert torch.equal(model(x), y)
    assert convert_norm(model, "brn") is model  # default: in place


# ----------------------------------------------------------------------------------------------------------
# transposed convs (a U-Net's up-convolutions)
# ----------------------------------------------------------------------------------------------------------
class TinyUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.up = nn.ConvTranspose2d(8, 6, 3, stride=2, padding=1, output_padding=1, groups=2)
        self.up_bn = nn.BatchNorm2d(6)
        self.up3 = nn.ConvTranspose3d(2, 4, 2, stride=2, bias=False)
        self.up3_bn = nn.BatchNorm3d(4)
        self.head = nn.Conv2d(6 + 3, 2, 1)

    def forward(self, x):
        u = torch.relu(self.up_bn(self.up(self.down(x))))
        v = self.up3_bn(self.up3(x[:, :2, None]))  # (N, 2, 1, H, W) -> (N, 4, 2, 2H, 2W)
        return self.head(torch.cat([u, x], 1)) + v.mean((1, 2))[:, None, ::2, ::2]


def test_fold_transposed_convs_and_pws_names_them():
    torch.manual_seed(11)
    model = TinyUNet().eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, 3, 8, 8)
    folded = fold_for_inference(model, example_input=x)
    assert isinstance(folded.up_bn, nn.Identity) and isinstance(folded.up3_bn, nn.Identity)
    assert type(folded.up) is nn.ConvTranspose2d and folded.up.output_padding == (1, 1) and folded.up.groups == 2
    with torch.no_grad():
        assert rel_err(folded(x), model(x)) < 1e-5
    transposed = r"left as they are: up \(ConvTranspose2d\), up3 \(ConvTranspose3d\): a transposed conv"
    with pytest.warns(UserWarning, match=transposed):
        pws = convert_norm(model, "pws")
    assert type(pws.up) is nn.ConvTranspose2d and type(pws.up_bn) is nn.BatchNorm2d  # kept: its conv is not PWS
    assert isinstance(pws.down[1], nn.Identity)


def test_sync_batchnorm_takes_the_rank_example_input_shows():
    from normlab.nn import InstanceNorm1d

    seq = nn.Sequential(nn.Conv1d(3, 4, 3), nn.SyncBatchNorm(4))
    assert type(convert_norm(seq, "in", inplace=False, example_input=torch.randn(2, 3, 9))[1]) is InstanceNorm1d
    mlp = nn.Sequential(nn.Linear(3, 4), nn.SyncBatchNorm(4))
    with pytest.raises(ValueError, match=r"cannot replace 1 \(SyncBatchNorm\): sees \(N, C\) input"):
        convert_norm(mlp, "gn", example_input=torch.randn(2, 3))


class SamePadConv(nn.Conv2d):  # a conv subclass with its own forward (like timm's Conv2dSame)
    def forward(self, x):
        return super().forward(nn.functional.pad(x, (1, 1, 1, 1)))


def test_fold_names_the_pairs_of_conv_subclasses_it_cannot_fold():
    model = randomize_bns(
        nn.Sequential(SamePadConv(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))
    ).eval()
    x = torch.randn(2, 3, 6, 6)
    with pytest.warns(UserWarning, match=r"left unfolded: 0 -> 1: SamePadConv is a conv subclass with its own"):
        folded = fold_for_inference(model, example_input=x)
    assert type(folded[1]) is nn.BatchNorm2d and isinstance(folded[3], nn.Identity)
    with torch.no_grad():
        assert rel_err(folded(x), model(x)) < 1e-5


class _SharedInput(nn.Module):
    """y = norm_act(x) + x: the norm's input is read again after it (DPN's dual paths, residual blocks)."""

    def __init__(self, norm_act: nn.Module):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm_act = norm_act

    def forward(self, x):
        h = self.conv(x)
        return self.norm_act(h) + h


def test_removing_a_norm_before_an_in_place_activation_does_not_overwrite_its_input():
    from conftest import needs

    layers = needs("timm.layers")
    torch.manual_seed(100)
    model = _SharedInput(layers.BatchNormAct2d(4, act_layer=nn.ReLU, inplace=True))
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    convert_norm(model, "none")
    h = model.conv(x)
    expected = torch.relu(h) + h  # the norm is gone, the activation stays, the shortcut keeps the raw h
    y = model(x)
    torch.testing.assert_close(y, expected)
    y.sum().backward()  # an in-place ReLU on h would also break autograd ("modified by an inplace operation")
    assert torch.isfinite(x.grad).all()
