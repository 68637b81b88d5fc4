"""normlab.models: architectures of the PWS paper (plain net, pre-activation ResNet, official PWS ResNet, 1-D CNN)."""

import math

import pytest
import torch
from torch import nn

from normlab.nn.registry import CONV_KINDS, NORM_NAMES
from normlab.runner.models import MODEL_DIMS, MODELS, PreActBottleneck, PWSBottleneck, build_model

CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


pytestmark = pytest.mark.usefixtures("one_thread")


def convs(model):
    return [m for m in model.modules() if isinstance(m, CONV_TYPES)]


@pytest.mark.parametrize("name", MODELS)
def test_every_model_name_builds_a_net_of_its_dimension_and_unknown_names_are_refused(name):
    # every name the CLI and TrainConfig accept builds, with convs of the dimension MODEL_DIMS says, and runs
    dim = MODEL_DIMS[name]
    shape = (1, 40) if dim == 1 else (3, 16, 16)
    norm = "ln" if name == "resnet_pws" else "bn"
    m = build_model(
        name,
        norm,
        "conv",
        in_channels=shape[0],
        num_classes=7,
        input_shape=shape,
        width=0.125,
        **({"blocks": 1} if name.startswith("resnet") else {}),
    ).eval()
    assert {type(c) for c in convs(m)} == {CONV_TYPES[dim - 1]}
    assert m(torch.randn(2, *shape)).shape == (2, 7)
    with pytest.raises(ValueError, match=f"unknown model '{name}x'; valid names: {', '.join(MODELS)}$"):
        build_model(name + "x", norm, "conv", in_channels=shape[0], input_shape=shape)


def test_plain_net_layout_matches_the_paper():
    m = build_model("plain", "bn", "conv", in_channels=3, num_classes=10, input_shape=(3, 32, 32))
    cs = convs(m)
    assert [c.kernel_size for c in cs] == [(3, 3)] * 7 + [(1, 1)] * 3
    assert [c.out_channels for c in cs] == [96] * 3 + [192] * 6 + [10]
    assert [c.padding for c in cs][:7] == [(1, 1)] * 6 + [(0, 0)]  # the 7th conv is "valid"
    assert sum(isinstance(x, nn.MaxPool2d) for x in m.modules()) == 2
    assert sum(isinstance(x, nn.BatchNorm2d) for x in m.modules()) == 9  # one per hidden conv, none on the head
    assert not any(isinstance(x, nn.Dropout) for x in m.modules())
    # norm sits between conv and ReLU
    block = m.features[0]
    assert [type(x) for x in block] == [nn.Conv2d, nn.BatchNorm2d, nn.ReLU]
    # spatial sizes: 32 -> 16 -> 8 -> 6 (valid 3x3), then global average pooling
    feats = m.features(torch.randn(2, 3, 32, 32))
    assert feats.shape == (2, 192, 6, 6)
    out = m(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)
    # parameter count from the layout: convs without bias (norm follows), BN affine, head with bias
    chans = [
        (3, 96, 3),
        (96, 96, 3),
        (96, 96, 3),
        (96, 192, 3),
        (192, 192, 3),
        (192, 192, 3),
        (192, 192, 3),
        (192, 192, 1),
        (192, 192, 1),
    ]
    expected = sum(ci * co * k * k + 2 * co for ci, co, k in chans) + 192 * 10 + 10
    assert sum(p.numel() for p in m.parameters()) == expected


def test_plain_width_multiplier_and_no_norm_bias():
    m = build_model("plain", "none", "conv", 1, 10, (1, 16, 16), width=0.5)
    cs = convs(m)
    assert [c.out_channels for c in cs] == [48] * 3 + [96] * 6 + [10]
    assert all(c.bias is not None for c in cs)  # without a norm every conv keeps its bias
    assert not any(isinstance(x, nn.BatchNorm2d) for x in m.modules())
    assert m(torch.randn(2, 1, 16, 16)).shape == (2, 10)


@pytest.mark.parametrize("hw", [(11, 16), (8, 8)])
def test_plain_refuses_too_small_inputs(hw):
    with pytest.raises(ValueError, match="too small"):
        build_model("plain", "bn", "conv", 1, 10, (1, *hw))
    build_model("plain", "bn", "conv", 1, 10, (1, 12, 12), width=0.05)  # the smallest size that fits


def test_resnet_paper_layout():
    m = build_model("resnet", "bn", "conv", 3, 10, (3, 32, 32), blocks=2)
    blocks = [b for b in m.modules() if isinstance(b, PreActBottleneck)]
    assert len(blocks) == 6
    assert m.stem.out_channels == 64 and m.stem.kernel_size == (3, 3)
    outs = [b.branch[-1].out_channels for b in blocks]
    mids = [b.branch[0].out_channels for b in blocks]
    strides = [b.branch[3].stride for b in blocks]
    assert outs == [64, 64, 128, 128, 256, 256] and mids == [16, 16, 32, 32, 64, 64]
    assert strides == [(1, 1), (2, 2), (1, 1), (2, 2), (1, 1), (1, 1)]  # stride on the last unit of stages 1-2
    # spatial path 32 -> 16 -> 8 through the stages
    sizes = []
    hooks = [b.register_forward_hook(lambda mod, i, o: sizes.append(o.shape[-1])) for b in blocks]
    assert m(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    for h in hooks:
        h.remove()
    assert sizes == [32, 16, 16, 8, 8, 8]
    assert all(isinstance(b.branch, nn.Module) for b in blocks)  # signal propagation reads .branch
    assert len(blocks) == 18 // 3 * 1  # blocks=2 per stage
    assert (
        len(
            [
                b
                for b in build_model("resnet", "bn", "conv", 3, 10, (3, 8, 8)).modules()
                if isinstance(b, PreActBottleneck)
            ]
        )
        == 18
    )  # default 6 per stage


def test_resnet_block_math_with_and_without_norm():
    torch.manual_seed(0)
    m = build_model("resnet", "none", "conv", 1, 10, (1, 8, 8), width=0.25, blocks=2)
    blk = m.blocks[0]  # identity shortcut
    assert blk.shortcut is None
    x = torch.randn(3, 16, 8, 8)
    torch.testing.assert_close(blk(x), x + blk.branch(torch.relu(x / math.sqrt(2))))
    proj = m.blocks[1]  # strided: projection of the pre-activation
    h = torch.relu(x / math.sqrt(2))
    torch.testing.assert_close(proj(x), proj.shortcut(h) + proj.branch(h))
    mb = build_model("resnet", "gn", "conv", 1, 10, (1, 8, 8), width=0.25, blocks=2)
    b = mb.blocks[0]
    torch.testing.assert_close(b(x), x + b.branch(torch.relu(b.preact_norm(x))))
    assert isinstance(b.preact_norm, nn.GroupNorm)


def test_resnet_pws_official_layout():
    m = build_model("resnet_pws", "none", "pws", 3, 10, (3, 32, 32), blocks=2)
    norms = [x for x in m.modules() if isinstance(x, (nn.GroupNorm, nn.BatchNorm2d))]
    assert len(norms) == 2 and all(isinstance(n, nn.GroupNorm) and n.num_groups == 1 for n in norms)
    assert norms[0] is m.stem_norm and norms[1] is m.head_norm
    cs = convs(m)
    assert cs and all(type(c).__name__ == "PWSConv2d" and c.bias is not None for c in cs)
    blocks = [b for b in m.modules() if isinstance(b, PWSBottleneck)]
    assert sum(b.shortcut is not None for b in blocks) == 4  # shortcut convs are PWS too
    # block: ReLU(x) first, no ReLU after the add (outputs can be negative)
    torch.manual_seed(0)
    x = torch.randn(2, 64, 8, 8)
    b = blocks[0]
    y = b(x)
    torch.testing.assert_close(y, x + b.branch(torch.relu(x)))
    assert (y < 0).any()
    assert m(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError, match="GroupNorm"):
        build_model("resnet_pws", "bn", "pws", 3, 10, (3, 32, 32))


def test_cnn1d_mnist1d_paper_cnn():
    m = build_model("cnn1d", "bn", "conv", 1, 10, (1, 40))
    cs = convs(m)
    want = [((5,), (2,), (1,)), ((3,), (2,), (1,)), ((3,), (2,), (1,))]
    assert [(c.kernel_size, c.stride, c.padding) for c in cs] == want
    assert all(c.out_channels == 25 for c in cs)
    assert m.fc.in_features == 25 * 5  # 40 -> 19 -> 10 -> 5
    assert sum(isinstance(x, nn.BatchNorm1d) for x in m.modules()) == 3
    assert m(torch.randn(4, 1, 40)).shape == (4, 10)
    p = build_model("cnn1d", "none", "pws", 1, 10, (40,))  # spatial-only shape accepted
    assert all(type(c).__name__ == "PWSConv1d" for c in convs(p))
    with pytest.raises(ValueError, match="too small"):
        build_model("cnn1d", "bn", "conv", 1, 10, (1, 2))
    with pytest.raises(ValueError, match="input_shape"):
        build_model("cnn1d", "bn", "conv", 1, 10, (1, 16, 16))


@pytest.mark.parametrize(
    "name,shape,kw",
    [
        ("plain", (1, 16, 16), {}),
        ("resnet", (1, 16, 16), {"blocks": 1}),
        ("plain1d", (1, 40), {}),
        ("cnn1d", (1, 40), {}),
    ],
)
def test_every_norm_and_conv_kind_trains_a_step(name, shape, kw):
    for norm in NORM_NAMES:
        for conv in CONV_KINDS:
            torch.manual_seed(0)
            m = build_model(name, norm, conv, 1, 10, shape, width=0.1, **kw)
            x, y = torch.randn(4, *shape), torch.randint(0, 10, (4,))
            loss = nn.functional.cross_entropy(m(x), y)
            loss.backward()
            assert torch.isfinite(loss), (norm, conv)
            grads = [p.grad for p in m.parameters() if p.requires_grad]
            assert all(g is not None and torch.isfinite(g).all() for g in grads), (norm, conv)


def test_bad_names_and_arguments():
    with pytest.raises(ValueError, match="plain, plain1d, resnet, resnet_pws, cnn1d"):
        build_model("vgg", "bn", "conv", 3, 10, (3, 32, 32))
    with pytest.raises(ValueError, match="unknown norm"):
        build_model("plain", "batchnorm", "conv", 3, 10, (3, 32, 32))
    with pytest.raises(ValueError, match="unknown conv"):
        build_model("plain", "bn", "sconv", 3, 10, (3, 32, 32))
    with pytest.raises(ValueError, match="channels"):
        build_model("plain", "bn", "conv", 3, 10, (1, 32, 32))
    with pytest.raises(ValueError, match="width"):
        build_model("plain", "bn", "conv", 3, 10, (3, 32, 32), width=0)
    with pytest.raises(ValueError, match="blocks"):
        build_model("plain", "bn", "conv", 3, 10, (3, 32, 32), blocks=2)


def test_same_seed_same_init():
    torch.manual_seed(3)
    a = build_model("resnet", "bn", "pws", 1, 10, (1, 8, 8), width=0.25, blocks=1)
    torch.manual_seed(3)
    b = build_model("resnet", "bn", "pws", 1, 10, (1, 8, 8), width=0.25, blocks=1)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


@pytest.mark.parametrize("conv", ["conv", "wn"])
def test_convs_start_from_he_init(conv):
    """n Var[W_effective] = 2 for every plain / weight-normed conv, biases zero (the paper's initialization)."""
    torch.manual_seed(0)
    model = build_model("plain", norm="none", conv=conv, in_channels=1, num_classes=10, input_shape=(16, 16), width=0.5)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 10
    for m in convs[:-1]:
        n = m.weight[0].numel()
        assert 1.6 < n * m.weight.var().item() < 2.4, (m, n * m.weight.var().item())
        assert m.bias is None or torch.count_nonzero(m.bias) == 0
