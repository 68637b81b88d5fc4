"""convert_norm / fold_for_inference on real model definitions (timm, torchvision; built without weights).

Small variants, ``num_classes=4``, 2 x 3 x 64 x 64 inputs (the last stage of a stride-32 net is 2 x 2, so that
instance statistics apply everywhere). Every BatchNorm gets random running statistics and affine parameters, so that
a wrong fold or a lost activation shows in the outputs.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from normlab.convert import CONVERT_TARGETS, convert_norm, fold_for_inference

timm = pytest.importorskip("timm")
tv_models = pytest.importorskip("torchvision.models")
from timm.layers import BatchNormAct2d, ScaledStdConv2d, StdConv2d  # noqa: E402
from torchvision.ops.misc import FrozenBatchNorm2d  # noqa: E402

# name -> what it covers
TIMM = {
    "resnet10t": "plain BatchNorm2d",
    "regnetx_002": "BatchNormAct2d (ReLU)",
    "mobilenetv3_small_050": "BatchNormAct2d (hard-swish), SE",
    "efficientnet_b0": "BatchNormAct2d (SiLU), drop path",
    "cspresnet50": "BatchNormAct2d in ConvNormAct, CSP stages",
    "densenet121": "pre-activation BatchNormAct2d (norm before conv)",
    "resnetv2_50x1_bit": "StdConv2d + GroupNormAct",
    "nf_regnet_b0": "ScaledStdConv2d, no norm",
    "convnext_atto": "LayerNorm2d, no BatchNorm",
}
TORCHVISION = ("tv_resnet18", "tv_resnet18_frozen")
MODELS = tuple(TIMM) + TORCHVISION
# models whose every BatchNorm follows a conv (post-activation): nothing may stay unfolded
ALL_FOLD = {"resnet10t", "regnetx_002", "mobilenetv3_small_050", "efficientnet_b0", "cspresnet50", *TORCHVISION}
NORMS = (nn.modules.batchnorm._BatchNorm, FrozenBatchNorm2d)


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if name == "tv_resnet18":
        model = tv_models.resnet18(num_classes=4)
    elif name == "tv_resnet18_frozen":
        model = tv_models.resnet18(num_classes=4, norm_layer=FrozenBatchNorm2d)
    else:
        model = timm.create_model(name, pretrained=False, num_classes=4)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, NORMS):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return model.eval()


def inputs(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(seed))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def norm_act_acts(model: nn.Module) -> list[str]:
    """The activations of norm + act modules (BatchNormAct2d, its conversions, nn.Sequential(drop, act))."""
    return sorted(
        type(m.act).__name__
        for m in model.modules()
        if hasattr(m, "drop") and hasattr(m, "act") and isinstance(m.act, nn.Module)
    )


def norm_types(model: nn.Module) -> set[type]:
    return {type(m) for m in model.modules() if isinstance(m, NORMS)}


@pytest.fixture(autouse=True)
def _few_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", MODELS)
def test_to_bn_keeps_the_function(name):
    # float64: the conversion is exact, so the comparison holds without float32 rounding (a frozen torchvision
    # ResNet-18 differed by 2.6e-6 relative in float32 on one CPU, by less on another)
    model, x = build(name).double(), inputs().double()
    with torch.no_grad():
        y = model(x)
        converted = convert_norm(copy.deepcopy(model), "bn")
        assert rel_err(converted(x), y) < 1e-12  # timm BatchNormAct2d lost its activation here (up to 0.4)
    acts = [type(m.act) for m in model.modules() if isinstance(m, BatchNormAct2d)]
    assert [type(m.act) for m in converted.modules() if isinstance(m, BatchNormAct2d)] == acts
    assert FrozenBatchNorm2d not in norm_types(converted)


@pytest.mark.parametrize("to", ["none", "pws", "brn", "gn"])
@pytest.mark.parametrize("name", ["regnetx_002", "mobilenetv3_small_050", "densenet121"])
def test_norm_act_layers_keep_their_activation(name, to):
    model = build(name)
    before = norm_act_acts(model)
    convert_norm(model, to)  # none/pws: the old converter replaced each BatchNormAct2d by Identity
    assert norm_act_acts(model) == before and len(before) > 10


@pytest.mark.parametrize("to", CONVERT_TARGETS)
@pytest.mark.parametrize("name", MODELS)
def test_every_target_converts_and_trains_one_step(name, to):
    model, x = build(name), inputs()
    before = norm_act_acts(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pws on StdConv models: "left as they are", tested below
        model = convert_norm(model, to, example_input=x)
    assert norm_act_acts(model) == before  # every BatchNormAct2d's activation is kept (none/pws dropped them)
    if to not in ("bn", "ws") and (to != "pws" or name in ALL_FOLD):
        assert not any(type(m) in (nn.BatchNorm2d, BatchNormAct2d, FrozenBatchNorm2d) for m in model.modules())
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss = nn.functional.cross_entropy(model(x), torch.tensor([0, 3]))
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name", MODELS)
def test_fold_equals_the_unfolded_model(name):
    model, x = build(name), inputs()
    fold_for_inference(model, example_input=x)  # float32: its own check passes (no RuntimeError)
    model, x = model.double(), x.double()  # float64: the fold itself is exact, without float32 rounding
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        folded = fold_for_inference(model, example_input=x)
    with torch.no_grad():
        assert rel_err(folded(x), model(x)) < 1e-9
    left = [n for n, m in folded.named_modules() if isinstance(m, NORMS)]
    messages = [str(w.message) for w in record if "left unfolded" in str(w.message)]
    assert len(messages) <= 1
    if name in ALL_FOLD:
        assert not left and not messages
    assert not any(isinstance(m, (StdConv2d, ScaledStdConv2d)) for m in folded.modules())
    assert norm_act_acts(folded) == norm_act_acts(model)  # the activations of the BatchNormAct2d layers are kept


@pytest.mark.parametrize("name, std", [("resnetv2_50x1_bit", StdConv2d), ("nf_regnet_b0", ScaledStdConv2d)])
def test_pws_leaves_timm_std_convs_with_a_warning(name, std):
    model = build(name)
    n = sum(type(m) is std for m in model.modules())
    with pytest.warns(UserWarning, match=rf"left as they are: .*\({std.__name__}\).*: already weight-standardized"):
        convert_norm(model, "pws")
    assert sum(type(m) is std for m in model.modules()) == n > 0


def test_frozen_batchnorm_resnet18_folds_and_converts():
    model, x = build("tv_resnet18_frozen"), inputs()
    folded = fold_for_inference(model, example_input=x)
    assert not norm_types(folded)
    brn = convert_norm(model, "brn", inplace=False)
    assert FrozenBatchNorm2d not in norm_types(brn) and not brn.training
    with torch.no_grad():  # float64: the same eval function, without float32 rounding (2.6e-6 on one CPU)
        assert rel_err(brn.double()(x.double()), model.double()(x.double())) < 1e-12  # the buffers are copied


def test_fold_check_allows_the_float32_rounding_of_a_deep_model():
    # at this seed resnetv2_50x1_bit's own float32 output is ~3e-5 (relative) off its float64 value, more than
    # rtol: the check compares the folded model with the float64 function instead of failing
    torch.manual_seed(1)
    model = timm.create_model("resnetv2_50x1_bit", pretrained=False, num_classes=4).eval()
    x = torch.randn(2, 3, 64, 64)
    folded = fold_for_inference(model, example_input=x)
    exact = fold_for_inference(model.double(), example_input=x.double())
    with torch.no_grad():
        assert rel_err(folded(x).double(), exact(x.double())) < 1e-4


@pytest.fixture
def gloo_world_of_one(tmp_path):
    """A gloo process group of world size 1 (DDP on one process)."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _outputs(model: nn.Module, x: torch.Tensor, mode: str) -> torch.Tensor:
    """The output of a copy of ``model`` in ``mode`` (the same dropout masks for every model)."""
    model = getattr(copy.deepcopy(model), mode)()
    torch.manual_seed(101)
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("name", MODELS)
def test_brn_then_sync_keeps_the_function(name, gloo_world_of_one):
    from normlab.nn import SyncBatchRenorm

    model, x = build(name), inputs()
    brn = convert_norm(copy.deepcopy(model), "brn", rmax=1.0, dmax=0.0)  # rmax=1, dmax=0: exactly BatchNorm
    acts = norm_act_acts(brn)
    sync = SyncBatchRenorm.convert_sync_batchrenorm(copy.deepcopy(brn))
    assert norm_act_acts(sync) == acts  # BatchRenormAct2d became a plain SyncBatchRenorm, its act never called
    assert not any(type(m).__name__ in ("BatchRenorm2d", "BatchRenormAct2d") for m in sync.modules())
    modes = ("eval",) if name == "tv_resnet18_frozen" else ("eval", "train")  # a frozen BN ignores the batch
    for mode in modes:
        y = _outputs(model, x, mode)
        assert rel_err(_outputs(brn, x, mode), y) < 1e-5
        assert rel_err(_outputs(sync, x, mode), y) < 1e-5  # efficientnet_b0 was off by far more than 17 %


@pytest.mark.parametrize("to", ["bn", "brn"])
def test_timm_frozen_norm_act_converts_keeping_the_eval_function(to):
    from timm.layers import FrozenBatchNormAct2d, freeze_batch_norm_2d

    model, x = freeze_batch_norm_2d(build("efficientnet_b0")), inputs()
    assert any(type(m) is FrozenBatchNormAct2d for m in model.modules())
    converted = convert_norm(model, to, inplace=False)
    assert not any(type(m) is FrozenBatchNormAct2d for m in converted.modules())
    assert norm_act_acts(converted) == norm_act_acts(model)
    with torch.no_grad():
        assert rel_err(converted.eval()(x), model(x)) < 1e-5


@pytest.mark.parametrize("name, where", [("rexnet_100", "features.3.se.bn"), ("skresnet18", "layer1.0.conv1.attn.bn")])
@pytest.mark.parametrize("to", ["gn", "in", "sn"])
def test_attention_batchnorms_on_1x1_maps_are_refused(name, where, to):
    # gn put them on GroupNorm(C, C) over one value per group: the output was the bias whatever the input
    model = build(name)
    for x in (inputs(), None):
        with pytest.raises(ValueError, match=rf"cannot replace {where} \(BatchNorm2d, input \(2, \d+, 1, 1\)[,)]"):
            convert_norm(model, to, example_input=x)
    ln = convert_norm(model, "ln", inplace=False)  # C values in one group
    assert not any(isinstance(m, nn.BatchNorm2d) for m in ln.modules())
    ln.train()
    assert torch.isfinite(ln(inputs())).all()
