"""No silent converter result: every converter that rebuilds a norm layer keeps what the old one computed, or
refuses / names it in one line (small models; the timm models: tests/test_convert_real_models.py).

* ``SyncBatchRenorm.convert_sync_batchrenorm``: NormAct layers keep their activation, subclasses with their own
  forward are named, shared layers stay shared; ``convert_norm`` keeps a synchronized BatchNorm synchronized.
* ``convert_norm(to="gn"/"ln"/"in"/"sn")``: a layer whose statistics would be of a single value is refused (1x1
  maps after global pooling), with or without ``example_input``; ``num_groups`` that does not divide C is named.
* ``fold_for_inference``: folds that rest on one traced path of a data-dependent forward are named; a conv ->
  BatchNorm pair whose BatchNorm has no running statistics is named, for every dim.
* ``convert_norm`` requires ``to``.
"""

from __future__ import annotations

import copy
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from normlab.convert import convert_norm, fold_for_inference
from normlab.nn import BatchRenorm1d, BatchRenorm2d, BatchRenorm3d, SyncBatchRenorm

BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
BRN = {1: BatchRenorm1d, 2: BatchRenorm2d, 3: BatchRenorm3d}
CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
POOL = {1: nn.AdaptiveAvgPool1d, 2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}


def randomize(model: nn.Module, seed: int = 100) -> nn.Module:
    """Random running statistics and affine parameters on every BatchNorm / BatchRenorm."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if not isinstance(m, nn.modules.batchnorm._NormBase):  # BatchNorm, BatchRenorm
                continue
            for name, lo, hi in (
                ("running_mean", -1, 1),
                ("running_var", 0.5, 2),
                ("weight", 0.5, 1.5),
                ("bias", -1, 1),
            ):
                t = getattr(m, name, None)
                if t is not None:
                    t.copy_(torch.rand(t.shape, generator=g) * (hi - lo) + lo)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture
def gloo_world_of_one():
    """A gloo process group of world size 1 (what DDP on one process has)."""
    assert not dist.is_initialized()
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# convert_sync_batchrenorm
# ---------------------------------------------------------------------------------------------------------
class OwnForwardBRN(BatchRenorm2d):  # computes something else than a BatchRenorm
    def forward(self, x):
        return super().forward(x) * 2


def _brn_model(dim: int) -> nn.Module:
    shared = BRN[dim](4, rmax=1.0, dmax=0.0)
    model = nn.Sequential(CONV[dim](3, 4, 3), BRN[dim](4, rmax=2.0, dmax=0.5), nn.ReLU(), CONV[dim](4, 4, 1), shared)
    model.add_module("alias", shared)  # one layer under two names
    return randomize(model)


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_sync_conversion_keeps_the_function_and_shares_state(dim, gloo_world_of_one):
    model = _brn_model(dim)
    ref = copy.deepcopy(model)
    x = torch.randn(3, 3, *([6] * dim), generator=torch.Generator().manual_seed(101))
    old = model[1]
    out = SyncBatchRenorm.convert_sync_batchrenorm(model)
    assert type(out[1]) is SyncBatchRenorm and type(out[4]) is SyncBatchRenorm
    assert out[4] is out.alias  # the shared layer is one new layer (the old recursion made two)
    assert out[1].weight is old.weight and out[1].running_var is old.running_var  # shared, like torch
    assert (out[1].rmax, out[1].dmax) == (2.0, 0.5)
    for mode in ("train", "eval"):
        getattr(out, mode)(), getattr(ref, mode)()
        torch.testing.assert_close(out(x), ref(x), rtol=1e-6, atol=1e-6)
    assert list(out.state_dict()) == list(ref.state_dict())


def test_sync_conversion_keeps_the_norm_act_activation(gloo_world_of_one):
    timm_na = pytest.importorskip("normlab.integrations.timm")
    model = randomize(
        nn.Sequential(nn.Conv2d(3, 4, 3), timm_na.BatchRenormAct2d(4, act_layer="silu", rmax=1.0, dmax=0.0))
    )
    ref = copy.deepcopy(model)
    act = model[1].act
    out = SyncBatchRenorm.convert_sync_batchrenorm(model)
    assert type(out[1]) is timm_na.SyncBatchRenormAct and out[1].act is act  # was a plain SyncBatchRenorm
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(102))
    for mode in ("train", "eval"):
        getattr(out, mode)(), getattr(ref, mode)()
        torch.testing.assert_close(out(x), ref(x), rtol=1e-6, atol=1e-6)  # the SiLU was dropped: 17 % off
    root = SyncBatchRenorm.convert_sync_batchrenorm(timm_na.BatchRenormAct2d(4))  # the root itself
    assert type(root) is timm_na.SyncBatchRenormAct and isinstance(root.act, nn.ReLU)


def test_sync_conversion_leaves_and_names_subclasses_with_their_own_forward():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), OwnForwardBRN(4), BatchRenorm2d(4), OwnForwardBRN(4))
    with pytest.warns(UserWarning) as record:
        SyncBatchRenorm.convert_sync_batchrenorm(model)
    msgs = [str(w.message) for w in record if "own forward" in str(w.message)]
    assert len(msgs) == 1 and "\n" not in msgs[0] and "1 (OwnForwardBRN), 3 (OwnForwardBRN)" in msgs[0]
    assert type(model[1]) is OwnForwardBRN and type(model[2]) is SyncBatchRenorm


@pytest.mark.parametrize("to, cls", [("bn", nn.SyncBatchNorm), ("brn", SyncBatchRenorm)])
def test_convert_norm_keeps_a_synchronized_batchnorm_synchronized(to, cls):
    model = randomize(nn.Sequential(nn.Conv2d(3, 4, 3), nn.SyncBatchNorm(4))).eval()
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        y = model(x)
        convert_norm(model, to)
        assert type(model[1]) is cls  # bn gave a plain BatchNorm2d: no longer synchronized under DDP
        torch.testing.assert_close(model(x), y)


# ---------------------------------------------------------------------------------------------------------
# convert_norm: statistics of a single value
# ---------------------------------------------------------------------------------------------------------
class SqueezeExcite(nn.Module):
    """x * sigmoid(conv(bn(conv(pool(x))))): its BatchNorm sees 1 position per channel at every input size."""

    def __init__(self, dim: int, c: int = 8, rd: int = 4):
        super().__init__()
        self.conv = CONV[dim](3, c, 3, padding=1)
        self.pool = POOL[dim](1)
        self.reduce, self.bn, self.expand = CONV[dim](c, rd, 1), BN[dim](rd), CONV[dim](rd, c, 1)
        self.body = BN[dim](c)

    def forward(self, x):
        x = self.body(self.conv(x))
        return x * torch.sigmoid(self.expand(torch.relu(self.bn(self.reduce(self.pool(x))))))


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("to", ["gn", "in", "sn"])
@pytest.mark.parametrize("given", [True, False])
def test_a_single_value_per_statistic_is_refused(to, dim, given):
    model = SqueezeExcite(dim).eval()
    x = torch.randn(2, 3, *([8] * dim)) if given else None
    with pytest.raises(ValueError) as err:
        convert_norm(model, to, example_input=x)
    msg = str(err.value)
    assert "\n" not in msg and f"bn ({BN[dim].__name__}, input (2, 4{', 1' * dim})" in msg
    assert ("on example_input" if given else "at every input size tried") in msg
    assert "body" not in msg and type(model.bn) is BN[dim]  # nothing changed
    if to == "gn":
        assert "GroupNorm(4, 4)): sees one value per group" in msg and "GroupNorm would output its bias" in msg
        out = convert_norm(model, "gn", num_groups=2, inplace=False, example_input=x)  # 2 values per group
        assert out.bn.num_groups == 2
    out = convert_norm(model, "ln", inplace=False, example_input=x)  # 4 values in its one group
    assert type(out.bn) is nn.GroupNorm and out.bn.num_groups == 1


def test_a_1x1_map_only_on_a_small_default_input_is_not_refused():
    # a stride-32 stage is 1x1 on the 32 x 32 default input but 2x2 on 64 x 64: not fixed by the architecture
    model = nn.Sequential(nn.Conv2d(3, 4, 32, stride=32), nn.BatchNorm2d(4), nn.Flatten())
    assert type(convert_norm(copy.deepcopy(model), "in")[1]) is not nn.BatchNorm2d
    assert convert_norm(copy.deepcopy(model), "gn")[1].num_groups == 4
    one_value = r"1 \(BatchNorm2d, input \(2, 4, 1, 1\), GroupNorm\(4, 4\)\): sees one value per group on example_input"
    with pytest.raises(ValueError, match=one_value):
        convert_norm(model, "gn", example_input=torch.randn(2, 3, 32, 32))  # the user's own input: refused


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_num_groups_that_does_not_divide_the_channels_is_named(dim):
    model = nn.Sequential(CONV[dim](3, 24, 3), BN[dim](24), CONV[dim](24, 32, 1), BN[dim](32), CONV[dim](32, 40, 1))
    model.append(BN[dim](40))
    with pytest.raises(ValueError) as err:
        convert_norm(model, "gn", num_groups=32, example_input=torch.randn(2, 3, *([6] * dim)))
    msg = str(err.value)  # torch's own error named neither the layer nor the channels
    assert "\n" not in msg and msg.startswith("convert_norm(to='gn'): cannot replace 1 (")
    assert "1 (" + BN[dim].__name__ + ", 24 channels, divisors up to 32: 1, 2, 3, 4, 6, 8, 12, 24)" in msg
    tail = ": channels not divisible by num_groups=32 (without num_groups each layer takes its largest <= 32)"
    assert msg.endswith(tail)
    assert "5 (" in msg and "40 channels" in msg and "3 (" not in msg
    assert type(model[1]) is BN[dim]  # nothing changed
    assert convert_norm(model, "gn", num_groups=8, example_input=torch.randn(2, 3, *([6] * dim)))[5].num_groups == 8


def test_num_groups_is_named_for_norm_act_layers():
    layers = pytest.importorskip("timm.layers")
    model = nn.Sequential(nn.Conv2d(3, 24, 3), layers.BatchNormAct2d(24))
    with pytest.raises(
        ValueError, match=r"1 \(BatchNormAct2d, 24 channels, .*\): channels not divisible by num_groups"
    ):
        convert_norm(model, "gn", num_groups=32)


def test_convert_norm_requires_to():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    with pytest.raises(TypeError, match="'to'"):
        convert_norm(model)  # the old default, "pws", replaced every conv and removed every BatchNorm
    assert [type(m) for m in model] == [nn.Conv2d, nn.BatchNorm2d]


# ---------------------------------------------------------------------------------------------------------
# fold_for_inference
# ---------------------------------------------------------------------------------------------------------
class SignBranch(nn.Module):
    """Data-dependent control flow (torch.fx cannot trace it): the BatchNorm runs only for a positive input."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        self.head = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))

    def forward(self, x):
        y = self.conv(x)
        if x.sum() > 0:
            y = self.bn(y)
        return self.head(y)


class ShapeBranch(nn.Module):
    """Control flow on the input's shape only (torch.fx cannot trace it either)."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        if x.shape[-1] > 4:
            x = x[..., :4, :4]
        return self.bn(self.conv(x))


def test_fold_names_the_folds_that_rest_on_one_path_of_a_data_dependent_forward():
    model = randomize(SignBranch()).eval()
    x = torch.rand(2, 3, 8, 8) + 0.1
    with pytest.warns(UserWarning) as record:
        folded = fold_for_inference(model, example_input=x)
    msgs = [str(w.message) for w in record if "rest on the path" in str(w.message)]
    assert len(msgs) == 1 and "\n" not in msgs[0]
    assert "Tensor.__bool__" in msgs[0] and "conv -> bn, head.0 -> head.1" in msgs[0]
    with torch.no_grad():
        assert rel_err(folded(x), model(x)) < 1e-5
        assert rel_err(folded(-x), model(-x)) > 1e-2  # what the warning is about: another path, another function


def test_fold_of_a_hook_trace_without_value_reads_does_not_warn():
    model = randomize(ShapeBranch()).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        folded = fold_for_inference(model, example_input=torch.randn(2, 3, 8, 8))
    assert type(folded.bn) is nn.Identity


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("norm", ["bn", "brn"])
def test_fold_names_a_pair_whose_batchnorm_has_no_running_statistics(dim, norm):
    cls = BN[dim] if norm == "bn" else BRN[dim]
    model = randomize(nn.Sequential(CONV[dim](3, 4, 3), cls(4, track_running_stats=False), CONV[dim](4, 4, 1)))
    model.append(cls(4))  # this one folds
    with pytest.warns(UserWarning, match=r"left unfolded: 0 -> 1: no running statistics: track_running_stats=False"):
        folded = fold_for_inference(model.eval(), example_input=torch.randn(2, 3, *([6] * dim)))
    assert type(folded[1]) is cls and type(folded[3]) is nn.Identity


def test_the_default_input_trace_draws_no_global_randomness():
    model = SqueezeExcite(2)
    torch.manual_seed(102)
    expected = torch.rand(3)
    torch.manual_seed(102)
    with pytest.raises(ValueError):
        convert_norm(model, "gn")  # two forwards on default inputs
    assert torch.equal(torch.rand(3), expected)


def test_convert_norm_keeps_timm_sync_batchnorm_act_synchronized():
    layers = pytest.importorskip("timm.layers")
    model = nn.Sequential(nn.Conv2d(3, 4, 3), layers.BatchNormAct2d(4, act_layer=nn.SiLU))
    model = randomize(layers.convert_sync_batchnorm(model)).eval()
    assert type(model[1]) is layers.SyncBatchNormAct
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        y = model(x)
        convert_norm(model, "bn")
        assert type(model[1]) is layers.SyncBatchNormAct and isinstance(model[1].act, nn.SiLU)  # was BatchNormAct2d
        torch.testing.assert_close(model(x), y)


def test_pws_names_the_norms_it_removes_on_one_path_of_a_data_dependent_forward():
    model = SignBranch()
    with pytest.warns(
        UserWarning, match=r"the BatchNorms removed rest on the path example_input took: .*removed: bn, head.1$"
    ):
        convert_norm(model, "pws", example_input=torch.rand(2, 3, 8, 8))
    assert type(model.bn) is nn.Identity and type(model.head[1]) is nn.Identity
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a hook trace without value reads: no warning
        convert_norm(ShapeBranch(), "pws", example_input=torch.randn(2, 3, 8, 8))


# ---------------------------------------------------------------------------------------------------------
# errors of the new layer's constructor, and hooks, name the layer
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "to, kw, error, what",
    [
        ("brn", {"rmax": 2.0}, ValueError, r"1 \(BatchNorm2d\): BatchRenorm2d: rmax/dmax/schedule need running stat"),
        ("gn", {"momentum": 0.1}, TypeError, r"1 \(BatchNorm2d\): GroupNorm.__init__\(\) got an unexpected keyword"),
        ("pws", {"gamma": -1.0}, ValueError, r"0 \(Conv2d\): PWSConv2d: gamma must be"),
    ],
)
def test_an_error_of_the_new_layers_constructor_names_the_layer(to, kw, error, what):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False))
    with pytest.raises(error, match=rf"^convert_norm\(to='{to}'\): cannot build the new layer for {what}"):
        convert_norm(model, to, **kw)
    assert [type(m) for m in model] == [nn.Conv2d, nn.BatchNorm2d]  # nothing changed


@pytest.mark.parametrize("to", ["brn", "gn", "none", "pws", "sync"])
def test_hooks_of_replaced_layers_are_named(to):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), BatchRenorm2d(4) if to == "sync" else nn.BatchNorm2d(4))
    model[1].register_forward_hook(lambda m, args, out: out * 2)  # changes what the layer computes
    with pytest.warns(UserWarning, match=r"hooks on these layers are not carried over .*: 1 \(Batch(Norm|Renorm)2d\)$"):
        if to == "sync":
            SyncBatchRenorm.convert_sync_batchrenorm(model)
        else:
            convert_norm(model, to)
