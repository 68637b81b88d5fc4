"""Where torch's, timm's and Lightning's tools look for BatchNorm (docs/batchnorm_tools.md, one test per row): each
with BatchRenorm (every flavour), SwitchableNorm and a tracking InstanceNorm.

On the old code (BatchRenorm derived from ``_NormBase``) torch's ``update_bn`` left BatchRenorm's statistics where
they were, ``normlab.nn.update_bn`` did not exist, mmdet-style ``norm_eval`` and FSDP's and Lightning's BatchNorm
rules missed BatchRenorm: the tests marked "old code" below failed there.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import needs
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from normlab.nn import (
    BatchRenorm1d,
    BatchRenorm2d,
    BatchRenorm3d,
    InstanceNorm2d,
    RenormSchedule,
    SwitchableNorm2d,
    SyncBatchRenorm,
    has_running_stats,
    param_groups,
    update_bn,
)

BRN = {1: BatchRenorm1d, 2: BatchRenorm2d, 3: BatchRenorm3d}
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
SIZE = {1: (12,), 2: (6, 6), 3: (3, 4, 4)}
# the limits that made torch's update_bn wrong: constant ones, a schedule past its warm-up; and the paper's default
LIMITS = {
    "constant": dict(rmax=3.0, dmax=5.0),
    "scheduled": dict(schedule=RenormSchedule(warmup_steps=0, rmax=3.0, rmax_steps=2, dmax=5.0, dmax_steps=2)),
    "default": {},
}


def brn_model(dim: int, cls=None, **kw) -> nn.Sequential:
    """conv -> BatchRenorm -> ReLU -> conv -> BatchNorm: the BatchNorm shows what the BatchRenorm handed on."""
    cls = cls or BRN[dim]
    return nn.Sequential(CONV[dim](3, 4, 3, padding=1), cls(4, **kw), nn.ReLU(), CONV[dim](4, 4, 1), BN[dim](4))


def loader(dim: int, n: int = 5, seed: int = 100) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 3, *SIZE[dim], generator=gen) * 2 + 0.5 for _ in range(n)]


def train_a_little(model: nn.Module, dim: int, steps: int = 3) -> None:
    model.train()
    with torch.no_grad():
        for x in loader(dim, steps, seed=101):
            model(x)


def as_batchnorm(model: nn.Sequential, dim: int) -> nn.Sequential:
    """The model with its BatchRenorm replaced by the BatchNorm it must compute during a re-estimation."""
    ref = copy.deepcopy(model)
    bn = BN[dim](4)
    bn.load_state_dict(ref[1].state_dict(), strict=False)
    ref[1] = bn
    return ref


def batch_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dims = (0,) + tuple(range(2, x.dim()))
    return x.double().mean(dims), x.double().var(dims, unbiased=True)


def loader_average(model: nn.Module, layer: nn.Module, data) -> tuple[torch.Tensor, torch.Tensor]:
    """The average over the loader of the batch statistics of ``layer``'s input in ``model`` (training mode)."""
    seen = []
    handle = layer.register_forward_pre_hook(lambda m, args: seen.append(batch_stats(args[0])))
    with torch.no_grad():
        model.train()
        for x in data:
            model(x)
    handle.remove()
    return tuple(torch.stack(s).mean(0) for s in zip(*seen))


# ---------------------------------------------------------------- torch.optim.swa_utils.update_bn


@pytest.mark.parametrize("limits", list(LIMITS))
@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_torch_update_bn_re_estimates_batch_renorm_exactly(dim, limits, momentum):
    """Old code: BatchRenorm's statistics stayed where training left them (45 % off the loader's average)."""
    from torch.optim.swa_utils import update_bn as torch_update_bn

    torch.manual_seed(102)
    model = brn_model(dim, momentum=momentum, **LIMITS[limits])
    train_a_little(model, dim)
    step, data = model[1].num_batches_tracked.clone(), loader(dim)
    ref = as_batchnorm(model, dim)
    torch_update_bn(data, model)
    torch_update_bn(data, ref)
    for i in (1, 4):  # the BatchRenorm and the BatchNorm after it: what a BatchNorm model gets
        torch.testing.assert_close(model[i].running_mean, ref[i].running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model[i].running_var, ref[i].running_var, rtol=1e-5, atol=1e-6)
    mean, var = loader_average(ref, ref[1], data)  # the loader's average of the BatchRenorm's input
    torch.testing.assert_close(model[1].running_mean.double(), mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model[1].running_var.double(), var, rtol=1e-5, atol=1e-6)
    assert torch.equal(model[1].num_batches_tracked, step)  # the schedule's step, put back
    assert int(model[4].num_batches_tracked) == len(data)  # a BatchNorm's counts the batches, as torch's
    assert model[1].momentum == momentum and model[1].renorm_limits() == model[1].renorm_limits(step)
    x = data[0]
    model.train()
    out = model[1](model[0](x))  # training renormalizes again after update_bn
    if limits != "default":
        bn_out = nn.functional.batch_norm(model[0](x), None, None, model[1].weight, model[1].bias, True)
        assert not torch.allclose(out, bn_out, atol=1e-4)


@pytest.mark.parametrize("kind", ["sync", "norm_act"])
def test_torch_update_bn_re_estimates_sync_and_norm_act_batch_renorm(kind):
    """Old code: not found."""
    from torch.optim.swa_utils import update_bn as torch_update_bn

    if kind == "norm_act":
        needs("timm")
        from normlab.integrations.timm import BatchRenormAct2d as cls
    else:
        cls = SyncBatchRenorm  # no process group: the single-process layer
    torch.manual_seed(103)
    model = brn_model(2, cls, rmax=3.0, dmax=5.0)
    train_a_little(model, 2)
    data, ref = loader(2), as_batchnorm(model, 2)
    if kind == "norm_act":
        ref.insert(2, nn.ReLU())  # the NormAct's own ReLU (the model's ReLU follows it)
    torch_update_bn(data, model)
    torch_update_bn(data, ref)
    torch.testing.assert_close(model[1].running_mean, ref[1].running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model[-1].running_var, ref[-1].running_var, rtol=1e-5, atol=1e-6)


def test_torch_update_bn_skips_switchable_and_instance_norm_which_normlab_update_bn_finds():
    from torch.optim.swa_utils import update_bn as torch_update_bn

    torch.manual_seed(104)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), InstanceNorm2d(4, track_running_stats=True), SwitchableNorm2d(4))
    train_a_little(model, 2)
    before = copy.deepcopy(model.state_dict())
    torch_update_bn(loader(2), model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # not _BatchNorm: not found
    assert has_running_stats(model[1]) and has_running_stats(model[2]) and not has_running_stats(model[0])


# ---------------------------------------------------------------- normlab.nn.update_bn


def _expected(layer: nn.Module, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The loader's average for any layer: the mean over its calls of what one training step with momentum 1
    (torch's convention: the new value only) writes into its running statistics."""
    means, variances = [], []
    for x in inputs:
        one = copy.deepcopy(layer).train()
        one.momentum = 1.0
        with torch.no_grad():
            one(x)
        means.append(one.running_mean.double())
        variances.append(one.running_var.double())
    return torch.stack(means).mean(0), torch.stack(variances).mean(0)


LAYERS = {
    "bn": lambda: nn.BatchNorm2d(4),
    "brn": lambda: BatchRenorm2d(4, rmax=3.0, dmax=5.0),
    "in": lambda: InstanceNorm2d(4, affine=True, track_running_stats=True),
    "torch_in": lambda: nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
    "sn": lambda: SwitchableNorm2d(4),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_normlab_update_bn_re_estimates_every_layer_with_running_statistics(name):
    """Old code: no normlab.nn.update_bn (torch's skips SwitchableNorm and InstanceNorm)."""
    torch.manual_seed(105)
    layer = LAYERS[name]()
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), BatchRenorm2d(4, rmax=3.0, dmax=5.0), nn.ReLU(), layer, nn.Conv2d(4, 4, 1)
    )
    train_a_little(model, 2)
    data, step = loader(2), model[1].num_batches_tracked.clone()
    ref = as_batchnorm(model, 2)  # what each layer must see: the BatchRenorm computing BatchNorm
    inputs = []
    handle = ref[3].register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach().clone()))
    with torch.no_grad():
        ref.train()
        for x in data:
            ref(x)
    handle.remove()
    mean, var = _expected(layer, inputs)
    model[0].eval()  # the modes come back as they were, per module
    update_bn(data, model)
    torch.testing.assert_close(model[3].running_mean.double(), mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model[3].running_var.double(), var, rtol=1e-5, atol=1e-6)
    assert torch.equal(model[1].num_batches_tracked, step)
    assert [m.training for m in model] == [False, True, True, True, True]
    assert model[3].momentum == LAYERS[name]().momentum


def test_normlab_update_bn_has_torchs_signature_and_batches():
    import inspect

    from torch.optim.swa_utils import update_bn as torch_update_bn

    assert list(inspect.signature(update_bn).parameters) == list(inspect.signature(torch_update_bn).parameters)
    torch.manual_seed(106)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    pairs = [(x, torch.zeros(6)) for x in loader(2)]  # (input, target) batches: the first element is the input
    ref = copy.deepcopy(model)
    update_bn(pairs, model, device="cpu")
    torch_update_bn(pairs, ref, device="cpu")
    assert torch.equal(model[1].running_mean, ref[1].running_mean)
    update_bn(pairs, nn.Sequential(nn.Conv2d(3, 4, 3)))  # nothing to re-estimate: nothing happens, as torch's


def test_normlab_update_bn_restores_momentum_and_modes_when_the_loader_raises():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), BatchRenorm2d(4, rmax=2.0), nn.InstanceNorm2d(4, track_running_stats=True)
    )
    model.eval()
    step = model[1].num_batches_tracked.clone()

    def broken():
        yield torch.randn(6, 3, 6, 6)
        raise OSError("disk")

    with pytest.raises(OSError):
        update_bn(broken(), model)
    assert model[1].momentum == 0.1 and model[2].momentum == 0.1 and not model.training and not model[1].training
    assert torch.equal(model[1].num_batches_tracked, step) and not model[2]._forward_pre_hooks
    assert model[1].renorm_limits() == (2.0, 0.0)  # renormalizes again


# ---------------------------------------------------------------- averaging: AveragedModel, EMA


def _models_with_every_running_stat() -> list[nn.Module]:
    out = []
    for seed in (107, 108):
        torch.manual_seed(seed)
        model = nn.Sequential(
            nn.Conv2d(3, 4, 3),
            BatchRenorm2d(4, rmax=2.0),
            InstanceNorm2d(4, track_running_stats=True),
            SwitchableNorm2d(4),
        )
        train_a_little(model, 2, steps=1 + seed % 2)
        out.append(model)
    return out


@pytest.mark.parametrize("how", ["swa", "ema"])
def test_averaged_model_averages_the_running_statistics_of_every_layer(how):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    a, b = _models_with_every_running_stat()
    kwargs = {"multi_avg_fn": get_ema_multi_avg_fn(0.75)} if how == "ema" else {}
    avg = AveragedModel(a, use_buffers=True, **kwargs)
    avg.update_parameters(a)
    avg.update_parameters(b)
    weight = 0.25 if how == "ema" else 0.5  # of the second model
    for i in (1, 2, 3):
        expected = a[i].running_mean * (1 - weight) + b[i].running_mean * weight
        torch.testing.assert_close(avg.module[i].running_mean, expected)
    assert torch.isfinite(avg(torch.randn(2, 3, 6, 6))).all()


@pytest.mark.parametrize("version", ["ModelEmaV2", "ModelEmaV3"])
def test_timm_model_ema_averages_the_running_statistics_of_every_layer(version):
    utils = needs("timm.utils")
    a, b = _models_with_every_running_stat()
    ema = getattr(utils, version)(a, decay=0.75)
    ema.update(b)
    for i in (1, 2, 3):
        expected = a[i].running_mean * 0.75 + b[i].running_mean * 0.25
        torch.testing.assert_close(ema.module[i].running_mean, expected)


# ---------------------------------------------------------------- weight decay


def _norm_params(model: nn.Module) -> set[int]:
    return {id(p) for i in (1, 2, 3) for p in model[i].parameters()}


def test_no_weight_decay_rules_exempt_every_norm():
    timm_optim = needs("timm.optim")
    tv_utils = needs("torchvision.ops._utils")
    model = _models_with_every_running_stat()[0]
    norms = _norm_params(model)
    groups = timm_optim.param_groups_weight_decay(model, 1e-4)
    assert {id(p) for g in groups if g["weight_decay"] == 0.0 for p in g["params"]} >= norms
    opt = timm_optim.create_optimizer_v2(model, "sgd", lr=0.1, weight_decay=1e-4)
    assert {id(p) for g in opt.param_groups if g["weight_decay"] == 0.0 for p in g["params"]} >= norms
    assert {id(p) for p in param_groups(model, 1e-4)[1]["params"]} >= norms
    found, _ = tv_utils.split_normalization_params(model)  # torchvision's classes: BatchRenorm (a _BatchNorm) only
    assert {id(p) for p in model[1].parameters()} <= {id(p) for p in found}
    assert not {id(p) for p in found} & {id(p) for i in (2, 3) for p in model[i].parameters()}


# ---------------------------------------------------------------- conversions to a plain BatchNorm: refused


def _every_batch_renorm() -> list[nn.Module]:
    out = [BatchRenorm1d(4), BatchRenorm2d(4, rmax=2.0), BatchRenorm3d(4), SyncBatchRenorm(4)]
    na = pytest.importorskip("normlab.integrations.timm")
    return out + [na.BatchRenormAct2d(4), na.SyncBatchRenormAct(4)]


def _converters():
    layers = needs("timm.layers")
    return {
        "torch": nn.SyncBatchNorm.convert_sync_batchnorm,
        "timm": layers.convert_sync_batchnorm,
        "timm_split": layers.convert_splitbn_model,
    }


@pytest.mark.parametrize("tool", ["torch", "timm", "timm_split"])
def test_conversions_to_a_plain_batchnorm_refuse_batch_renorm(tool):
    """Old code: not found (a _NormBase); as a _BatchNorm without the refusal it became a plain SyncBatchNorm."""
    convert = _converters()[tool]
    for layer in _every_batch_renorm():
        model = nn.Sequential(nn.Conv2d(3, 4, 1), layer)
        with pytest.raises(TypeError) as err:
            convert(model)
        msg = str(err.value)
        assert "\n" not in msg and f"would turn {type(layer).__name__}(4) into" in msg and "renormalization" in msg
        assert model[1] is layer  # not swapped in
        if tool != "timm_split":
            assert "SyncBatchRenorm.convert_sync_batchrenorm(model, batchnorm=True)" in msg


@pytest.mark.parametrize("tool", ["torch", "timm", "timm_split"])
def test_conversions_to_a_plain_batchnorm_leave_switchable_and_instance_norm(tool):
    model = nn.Sequential(nn.Conv2d(3, 4, 1), SwitchableNorm2d(4), InstanceNorm2d(4, track_running_stats=True))
    out = _converters()[tool](model)
    assert type(out[1]) is SwitchableNorm2d and type(out[2]) is InstanceNorm2d


def test_convert_sync_batchrenorm_with_batchnorm_converts_a_mixed_model():
    layers = needs("timm.layers")
    na = pytest.importorskip("normlab.integrations.timm")
    torch.manual_seed(109)
    act = nn.SiLU()
    model = nn.Sequential(
        nn.Conv2d(3, 4, 1),
        nn.BatchNorm2d(4),
        BatchRenorm2d(4, rmax=2.0),
        layers.BatchNormAct2d(4),
        na.BatchRenormAct2d(4),
    )
    model[3].act = act
    bn_weight = model[1].weight
    out = SyncBatchRenorm.convert_sync_batchrenorm(model, batchnorm=True)
    assert [type(m) for m in out] == [
        nn.Conv2d,
        nn.SyncBatchNorm,
        SyncBatchRenorm,
        layers.SyncBatchNormAct,
        na.SyncBatchRenormAct,
    ]
    assert out[1].weight is bn_weight and out[3].act is act and out[2].rmax == 2.0
    plain = SyncBatchRenorm.convert_sync_batchrenorm(copy.deepcopy(model))  # default: BatchRenorm only
    assert type(plain[1]) is nn.SyncBatchNorm  # (already converted above: in place)


def test_torch_convert_sync_batchnorm_keeps_no_hooks():
    bn = nn.BatchNorm2d(4)
    bn.register_forward_hook(lambda *a: None)
    assert not nn.SyncBatchNorm.convert_sync_batchnorm(bn)._forward_hooks  # normlab's converters warn instead


# ---------------------------------------------------------------- freezing


def test_timm_freeze_refuses_batch_renorm_and_convert_to_bn_first_works():
    """Old code: timm's freeze_batch_norm_2d left BatchRenorm trainable, without a word."""
    layers = needs("timm.layers")
    from normlab.convert import convert_norm

    torch.manual_seed(110)
    for layer in _every_batch_renorm()[1:]:
        model = nn.Sequential(nn.Conv2d(3, 4, 1), layer)
        with pytest.raises(TypeError, match=r"freeze_batch_norm_2d: would leave .*\(4\) trainable"):
            layers.freeze_batch_norm_2d(model)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), BatchRenorm2d(4, rmax=2.0))
    train_a_little(model, 2)
    x = torch.randn(2, 3, 5, 5)
    expected = model.eval()(x)
    frozen = layers.freeze_batch_norm_2d(convert_norm(model, to="bn"))
    assert type(frozen[1]).__name__ == "FrozenBatchNorm2d"
    torch.testing.assert_close(frozen.train()(x), expected)


def test_mmdet_norm_eval_finds_batch_renorm_and_has_running_stats_finds_the_rest():
    """Old code: ``isinstance(m, _BatchNorm)`` missed BatchRenorm, whose statistics then kept moving."""
    model = _models_with_every_running_stat()[0].train()
    for m in model.modules():
        if isinstance(m, _BatchNorm):  # mmdet's norm_eval
            m.eval()
    assert not model[1].training and model[2].training and model[3].training
    for m in model.modules():
        if has_running_stats(m):  # normlab's rule for every layer with running statistics
            m.eval()
    before = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        model(torch.randn(4, 3, 6, 6) + 3)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_lightning_finetuning_freeze_treats_batch_renorm_as_a_batchnorm():
    """Old code: BatchRenorm kept updating its statistics under freeze(train_bn=False)."""
    callbacks = needs("lightning.pytorch.callbacks")
    model = _models_with_every_running_stat()[0].train()
    callbacks.BaseFinetuning.freeze(model, train_bn=False)
    assert not any(p.requires_grad for p in model.parameters())
    assert model[1].track_running_stats is False  # as Lightning does to a BatchNorm
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(4, 3, 6, 6) + 3
    with torch.no_grad():
        out = model[1](model[0](x))
        model(x)
    bn = nn.functional.batch_norm(model[0](x), None, None, model[1].weight, model[1].bias, True)
    torch.testing.assert_close(out, bn)  # batch statistics, no renormalization: a BatchNorm's behaviour
    assert torch.equal(before["1.running_mean"], model[1].running_mean)
    assert not torch.equal(before["2.running_mean"], model[2].running_mean)  # documented: eval mode freezes them


def test_lightning_swa_batchnorm_epoch_re_estimates_batch_renorm_exactly():
    """Old code: the BatchNorm epoch skipped BatchRenorm; as a _BatchNorm without the switch it renormalized
    against reset statistics."""
    pl = needs("lightning.pytorch")
    torch.manual_seed(111)
    data = torch.utils.data.TensorDataset(torch.randn(48, 3, 6, 6) * 2 + 0.5, torch.randn(48, 4))

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(brn_model(2, rmax=3.0, dmax=5.0), nn.AdaptiveAvgPool2d(1), nn.Flatten())

        def training_step(self, batch, i):
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    module = Net()
    brn = module.net[0][1]
    seen = []  # (epoch, input, output, (weight, bias)) of the BatchRenorm's calls

    def record(m, args, out):
        affine = (m.weight.detach().clone(), m.bias.detach().clone())
        seen.append((module.trainer.current_epoch, args[0].detach(), out.detach(), affine))

    brn.register_forward_hook(record)
    swa = pl.callbacks.StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)
    trainer = pl.Trainer(
        max_epochs=2,
        callbacks=[swa],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=12))
    assert int(brn.num_batches_tracked) == 8 and brn.momentum == 0.1  # the 8 training steps, put back afterwards
    last = [(x, out, affine) for epoch, x, out, affine in seen if epoch == 2]  # the BatchNorm epoch SWA adds
    assert len(last) == 4
    for x, out, affine in last:  # BatchNorm's output: what the layers after it must see
        torch.testing.assert_close(out, nn.functional.batch_norm(x, None, None, *affine, True))
    mean = torch.stack([batch_stats(x)[0] for x, _, _ in last]).mean(0)
    torch.testing.assert_close(brn.running_mean.double(), mean, rtol=1e-5, atol=1e-6)  # the loader's average


# ---------------------------------------------------------------- the rest of the list


def test_functorch_replace_all_batch_norm_modules_treats_batch_renorm_as_a_batchnorm():
    torch.manual_seed(112)
    model = nn.Sequential(BatchRenorm2d(4, rmax=3.0, dmax=5.0))
    torch.func.replace_all_batch_norm_modules_(model)
    assert model[0].running_mean is None and not model[0].track_running_stats
    x = torch.randn(3, 2, 4, 5, 5)
    out = torch.func.vmap(model)(x)
    expected = torch.stack([nn.functional.batch_norm(xi, None, None, model[0].weight, model[0].bias, True) for xi in x])
    torch.testing.assert_close(out, expected)


def test_fsdp_mixed_precision_keeps_batch_renorm_in_full_precision():
    from torch.distributed.fsdp import MixedPrecision

    ignored = MixedPrecision(param_dtype=torch.float16)._module_classes_to_ignore
    assert all(isinstance(m, ignored) for m in _every_batch_renorm())
    assert not isinstance(SwitchableNorm2d(4), ignored) and not isinstance(InstanceNorm2d(4), ignored)


@pytest.mark.parametrize("fuse", ["utils", "inductor"])
def test_eval_fusion_of_conv_and_batch_renorm_is_exact(fuse):
    torch.manual_seed(113)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), BatchRenorm2d(4, rmax=3.0, dmax=5.0))
    train_a_little(model, 2)
    model.eval()
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        if fuse == "utils":
            out = torch.nn.utils.fusion.fuse_conv_bn_eval(model[0], model[1])(x)
        else:
            from torch._inductor.fx_passes.efficient_conv_bn_eval import efficient_conv_bn_eval

            out = efficient_conv_bn_eval(model[1], model[0], x)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)


def test_exact_class_fusers_refuse_batch_renorm():
    import torch.ao.quantization as quant

    model = nn.Sequential(nn.Conv2d(3, 4, 1), BatchRenorm2d(4)).eval()
    with pytest.raises(AssertionError, match="did not find fuser method"):
        quant.fuse_modules(model, [["0", "1"]])
    with pytest.raises(AssertionError, match="did not find fuser method"):
        quant.fuse_modules_qat(copy.deepcopy(model).train(), [["0", "1"]])
    model.qconfig = quant.get_default_qat_qconfig("fbgemm")
    prepared = quant.prepare_qat(copy.deepcopy(model).train())
    assert type(prepared[1]) is BatchRenorm2d  # no QAT swap for it: it trains renormalized
