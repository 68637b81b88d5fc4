"""Converters keep the module's state, say when there is nothing to do, and say it in one readable line.

* ``convert_norm`` keeps, from each layer it replaces, each parameter's ``requires_grad``, the training flag,
  device, dtype and memory format: every target x every source kind (torch's BatchNorm1d/2d/3d and SyncBatchNorm,
  timm's BatchNormAct2d, torchvision's FrozenBatchNorm2d, normlab's BatchRenorm1d/2d/3d, SyncBatchRenorm and
  BatchRenormAct2d) x frozen / partly frozen / trainable x train / eval / norm_eval, in float64 with channels_last
  kernels. Old code: every converted parameter came back trainable, float64 statistics went through float32, a
  channels_last kernel came back contiguous, BatchRenorm was not converted at all.
* A model without anything to convert gets one ``UserWarning`` naming what was looked for (old code: silence).
* A refusal or warning naming many layers gives each reason once, the first few names and the count (old code: a
  2,900-character line for 21 layers).
* ``fold_for_inference`` names, with the reason, every BatchNorm it leaves unfolded (old code: a conv -> ReLU -> BN
  BatchNorm, a BatchNorm on the model's input or after a Linear, ... were left without a word).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import needs
from torch import nn

from normlab.convert import CONVERT_TARGETS, convert_norm, fold_for_inference
from normlab.nn import BatchRenorm1d, BatchRenorm2d, BatchRenorm3d, RenormSchedule, SyncBatchRenorm

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
SIZE = {1: (10,), 2: (6, 6), 3: (3, 5, 5)}


def _timm(name: str):
    return getattr(needs("timm.layers"), name)


def _normlab_timm(name: str):
    return getattr(needs("normlab.integrations.timm"), name)


# source kind -> (dim, factory)
SOURCES = {
    "bn1d": (1, lambda: nn.BatchNorm1d(4)),
    "bn2d": (2, lambda: nn.BatchNorm2d(4)),
    "bn3d": (3, lambda: nn.BatchNorm3d(4)),
    "sync_bn": (2, lambda: nn.SyncBatchNorm(4)),
    "timm_bn_act": (2, lambda: _timm("BatchNormAct2d")(4, act_layer=nn.SiLU)),
    "frozen_bn": (2, lambda: needs("torchvision.ops.misc").FrozenBatchNorm2d(4)),
    "brn1d": (1, lambda: BatchRenorm1d(4, rmax=2.0, dmax=0.5)),
    "brn2d": (2, lambda: BatchRenorm2d(4, schedule=RenormSchedule.scaled(80))),
    "brn3d": (3, lambda: BatchRenorm3d(4, rmax=2.0, dmax=0.5)),
    "sync_brn": (2, lambda: SyncBatchRenorm(4, rmax=2.0, dmax=0.5)),
    "brn_act": (2, lambda: _normlab_timm("BatchRenormAct2d")(4, act_layer=nn.SiLU, rmax=2.0)),
}
# (what is frozen, the modes): the fine-tuning recipes (everything frozen, norms in eval: mmdet's norm_eval),
# a partly frozen norm in an eval model, a trainable model
STATES = [("all", "train"), ("all", "norm_eval"), ("weight", "eval"), ("none", "train")]


def _randomize(m: nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name in ("weight", "bias", "running_mean"):
            t = getattr(m, name, None)
            if isinstance(t, torch.Tensor):
                t.copy_(torch.rand(t.shape, generator=gen, dtype=t.dtype) - 0.5)
        if isinstance(getattr(m, "running_var", None), torch.Tensor):
            m.running_var.copy_(torch.rand(4, generator=gen, dtype=m.running_var.dtype) + 0.5)
        if isinstance(getattr(m, "num_batches_tracked", None), torch.Tensor):
            m.num_batches_tracked.fill_(37)


def build(source: str, frozen: str, mode: str, seed: int = 120) -> tuple[nn.Sequential, torch.Tensor]:
    """conv -> source -> conv in float64 with channels_last kernels (2d/3d), frozen and in the mode asked for;
    and an input."""
    dim, make = SOURCES[source]
    torch.manual_seed(seed)
    model = nn.Sequential(CONV[dim](3, 4, 3, padding=1), make(), CONV[dim](4, 4, 1)).double()
    _randomize(model[1], torch.Generator().manual_seed(seed))
    if dim > 1:
        fmt = torch.channels_last if dim == 2 else torch.channels_last_3d
        for conv in (model[0], model[2]):
            conv.weight.data = conv.weight.data.contiguous(memory_format=fmt)
    if frozen == "all":
        model.requires_grad_(False)
    elif frozen == "weight":
        for p in model[1].parameters(recurse=False):
            p.requires_grad_(p is not model[1].weight)
    model.train(mode != "eval")
    if mode == "norm_eval":
        model[1].eval()
    return model, torch.randn(2, 3, *SIZE[dim], dtype=torch.float64)


def _frozen_kind(source: str) -> bool:
    return source == "frozen_bn"


def _check_replacement(old: nn.Module, new: nn.Module, frozen_layer: bool) -> None:
    assert new.training == old.training, (type(old).__name__, type(new).__name__)
    before = dict(old.named_parameters(recurse=False))
    for name, p in new.named_parameters(recurse=False):
        expected = before[name].requires_grad if name in before else not frozen_layer
        assert p.requires_grad == expected, (type(new).__name__, name)
    for name, t in [*new.named_parameters(), *new.named_buffers()]:
        if t.is_floating_point():
            assert t.dtype == torch.float64, (type(new).__name__, name, t.dtype)


def _check_values(old: nn.Module, new: nn.Module, to: str) -> None:
    """The state that carries, exactly (float64 values were once rounded through float32)."""
    names = ("weight", "bias") + (("running_mean", "running_var", "num_batches_tracked") if to != "gn" else ())
    for name in names:
        a, b = getattr(old, name, None), getattr(new, name, None)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.numel() == b.numel():
            assert torch.equal(a.reshape(b.shape).to(b.dtype), b), name


@pytest.mark.parametrize("frozen, mode", STATES)
@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("to", CONVERT_TARGETS)
def test_convert_norm_keeps_the_state_of_every_layer_it_replaces(to, source, frozen, mode):
    model, x = build(source, frozen, mode)
    old = list(model)
    frozen_norm = frozen == "all" or _frozen_kind(source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pws/ws on a frozen source etc.: tested elsewhere
        out = convert_norm(model, to, example_input=x)
    if to in ("pws", "ws"):
        for i in (0, 2):
            _check_replacement(old[i], out[i], frozen == "all")
            assert out[i].weight.stride() == old[i].weight.stride()  # channels_last kept
            assert torch.equal(out[i].weight, old[i].weight)
        if to == "pws" and source != "frozen_bn":  # removed: its conv gets a bias (zero), frozen like the conv
            assert out[0].bias.requires_grad == (frozen != "all")
        return
    assert out[1] is not old[1] and (to != "bn" or not isinstance(old[1], nn.BatchNorm2d) or out[1] is not old[1])
    _check_replacement(old[1], out[1], frozen_norm)
    if hasattr(old[1], "act"):
        assert out[1].act is old[1].act or out[1][1] is old[1].act
    if to in ("bn", "brn", "sn", "gn", "in", "ln"):
        _check_values(old[1], out[1], to if to in ("bn", "brn", "sn") else "gn")
    out.train()
    y = out(x)  # it trains
    assert y.dtype == torch.float64 and torch.isfinite(y).all()


@pytest.mark.parametrize("to", ["bn", "brn"])
@pytest.mark.parametrize("source", list(SOURCES))
def test_batch_renorm_and_batchnorm_sources_keep_their_eval_output(to, source):
    """BatchRenorm is converted by what it computes (BatchNorm in eval; old code: not converted at all)."""
    model, x = build(source, "none", "eval")
    with torch.no_grad():
        expected = model(x)
        out = convert_norm(model, to, example_input=x, inplace=False)
        torch.testing.assert_close(out.eval()(x), expected)
    sync = source in ("sync_bn", "sync_brn")
    expected_type = {"bn": nn.SyncBatchNorm, "brn": SyncBatchRenorm}[to] if sync else None
    if expected_type is not None:
        assert type(out[1]) is expected_type
    if to == "brn" and source.startswith(("brn", "sync_brn")):
        assert (out[1].schedule, out[1].rmax, out[1].dmax) == (model[1].schedule, model[1].rmax, model[1].dmax)


def test_batch_renorm_limits_given_to_convert_replace_the_old_ones():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), BatchRenorm2d(4, schedule=RenormSchedule()))
    assert convert_norm(model, "brn", rmax=3.0)[1].rmax == 3.0


def test_a_batch_renorm_subclass_with_its_own_forward_is_left_and_named():
    class Doubled(BatchRenorm2d):
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(nn.Conv2d(3, 4, 1), Doubled(4), nn.Conv2d(4, 4, 1), BatchRenorm2d(4))
    with pytest.warns(UserWarning, match=r"own forward.*: 1 \(Doubled\)$"):
        convert_norm(model, "gn")
    assert type(model[1]) is Doubled and type(model[3]) is nn.GroupNorm


@pytest.mark.parametrize("to", ["bn", "brn", "gn", "in"])
def test_a_batchnorm_without_bias_gives_a_layer_without_bias(to):
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, bias=False))
    out = convert_norm(model, to, example_input=torch.randn(2, 3, 4, 4))
    assert out[1].bias is None and out[1].weight is not None


@pytest.mark.parametrize("to", ["bn", "brn", "gn", "pws"])
def test_convert_norm_keeps_the_meta_device(to):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).to("meta")
    out = convert_norm(model, to)
    assert all(t.device.type == "meta" for t in [*out.parameters(), *out.buffers()])


# ---------------------------------------------------------------- nothing to convert


@pytest.mark.parametrize("to", CONVERT_TARGETS)
def test_a_model_without_anything_to_convert_gets_one_line(to):
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    with pytest.warns(UserWarning) as record:
        out = convert_norm(model, to)
    msgs = [str(w.message) for w in record]
    assert len(msgs) == 1 and "\n" not in msgs[0] and msgs[0].startswith(f"convert_norm(to={to!r}): nothing to convert")
    assert ("nn.Conv1d/2d/3d" if to in ("pws", "ws") else "BatchNorm1d/2d/3d") in msgs[0]
    assert out is model and type(model[1]) is nn.LayerNorm


# ---------------------------------------------------------------- one readable line


def test_a_refusal_of_many_layers_gives_the_reason_once_with_the_count():
    mlp = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in range(21)])
    with pytest.raises(ValueError) as err:
        convert_norm(mlp, "in")
    msg = str(err.value)
    assert msg == (
        "convert_norm(to='in'): cannot replace 0.1 (BatchNorm1d), 1.1 (BatchNorm1d), 2.1 (BatchNorm1d) and 18 more "
        "(21): its input is an nn.Linear output (N, C), InstanceNorm1d needs (N, C, L)"
    )


def test_warnings_about_many_layers_name_the_first_few_and_count_the_rest():
    class OwnForward(nn.BatchNorm2d):
        def forward(self, x):
            return super().forward(x) + 1

    layers = [nn.Conv2d(3, 3, 1)] + [OwnForward(3) for _ in range(10)] + [nn.BatchNorm2d(3) for _ in range(10)]
    for m in layers[11:]:
        m.register_forward_hook(lambda *a: None)
    with pytest.warns(UserWarning) as record:
        convert_norm(nn.Sequential(*layers), "gn", example_input=torch.randn(2, 3, 4, 4))
    msgs = sorted(str(w.message) for w in record)
    assert len(msgs) == 2 and all(len(m) < 300 and "and 7 more (10)" in m for m in msgs), msgs


# ---------------------------------------------------------------- fold_for_inference: every BatchNorm it leaves


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.bn = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.a(x) + self.b(x))


class Twice(nn.Module):  # one BatchNorm called on two conv outputs
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)

    def forward(self, x):
        return self.bn(self.conv(x)) + self.bn(x)


class Branching(nn.Module):  # data-dependent: no torch.fx trace, the hooks trace one path
    def __init__(self):
        super().__init__()
        self.conv, self.act, self.bn = nn.Conv2d(3, 4, 1), nn.ReLU(), nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.act(self.conv(x))
        return self.bn(y) if y.sum() > -1e9 else y


class OwnForwardBN(nn.BatchNorm2d):
    def forward(self, x):
        return super().forward(x) * 2


# pattern -> (model, input, the BatchNorm's name, the reason in the warning)
UNFOLDABLE = {
    "conv_relu_bn": (
        lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.BatchNorm2d(4)),
        (2, 3, 6, 6),
        "2 (BatchNorm2d)",
        "its input is a ReLU output, not a conv's output",
    ),
    "conv_relu_brn": (
        lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), BatchRenorm2d(4, rmax=2.0)),
        (2, 3, 6, 6),
        "2 (BatchRenorm2d)",
        "its input is a ReLU output, not a conv's output",
    ),
    "bn_on_input": (
        lambda: nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 4, 3)),
        (2, 3, 6, 6),
        "0 (BatchNorm2d)",
        "its input is the model's input, not a conv's output",
    ),
    "linear_bn": (
        lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(64, 8), nn.BatchNorm1d(8)),
        (2, 3, 6, 6),
        "3 (BatchNorm1d)",
        "its input is a Linear output, not a conv's output",
    ),
    "sum_bn": (Residual, (2, 3, 6, 6), "b -> bn", "its input is the output of add, not the conv's output"),
    "bn_twice": (Twice, (2, 3, 6, 6), "conv -> bn", "the BatchNorm runs 2 times per forward"),
    "no_running_stats": (
        lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.BatchNorm2d(4, track_running_stats=False)),
        (2, 3, 6, 6),
        "2 (BatchNorm2d)",
        "no running statistics",
    ),
    "own_forward": (
        lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), OwnForwardBN(4)),
        (2, 3, 6, 6),
        "2 (OwnForwardBN)",
        "a BatchNorm subclass with its own forward",
    ),
    "no_conv": (
        lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)),
        (5, 3),
        "1 (BatchNorm1d)",
        "the model has no conv to fold it into",
    ),
    "hook_trace": (Branching, (2, 3, 6, 6), "bn (BatchNorm2d)", "its input is not a conv's output"),
}


@pytest.mark.parametrize("pattern", list(UNFOLDABLE))
def test_fold_names_every_batchnorm_it_leaves_unfolded(pattern):
    """Old code: each of these was left without a word (the docstring promised a warning for conv -> ReLU -> BN)."""
    make, shape, name, reason = UNFOLDABLE[pattern]
    torch.manual_seed(121)
    model, x = make().eval(), torch.randn(*shape)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        folded = fold_for_inference(model, example_input=x)
    msgs = [str(w.message) for w in record if "left unfolded" in str(w.message)]
    assert len(msgs) == 1 and "\n" not in msgs[0], [str(w.message) for w in record]
    assert msgs[0].startswith(f"fold_for_inference: left unfolded: {name}") and reason in msgs[0], msgs[0]
    with torch.no_grad():
        torch.testing.assert_close(folded(x), model(x))


def test_fold_gives_each_reason_once_for_many_batchnorms():
    blocks = [nn.Sequential(nn.Conv2d(3, 3, 1), nn.ReLU(), nn.BatchNorm2d(3)) for _ in range(12)]
    with pytest.warns(UserWarning) as record:
        fold_for_inference(nn.Sequential(*blocks), example_input=torch.randn(2, 3, 4, 4))
    (msg,) = [str(w.message) for w in record]
    assert msg == (
        "fold_for_inference: left unfolded: 0.2 (BatchNorm2d), 1.2 (BatchNorm2d), 2.2 (BatchNorm2d) and 9 more (12): "
        "its input is a ReLU output, not a conv's output"
    )


@pytest.mark.parametrize("hook", ["forward", "forward_pre", "state_dict", "load_state_dict_pre"])
def test_a_layer_whose_hooks_are_not_carried_is_named(hook):
    """torch's convert_sync_batchnorm carries no hook either (tests/test_batchnorm_tools.py); old code: a
    state-dict hook was dropped without a word."""
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    register = {
        "forward": lambda m: m.register_forward_hook(lambda *a: None),
        "forward_pre": lambda m: m.register_forward_pre_hook(lambda *a: None),
        "state_dict": lambda m: m.register_state_dict_post_hook(lambda *a: None),
        "load_state_dict_pre": lambda m: m.register_load_state_dict_pre_hook(lambda *a: None),
    }
    register[hook](model[1])
    with pytest.warns(UserWarning, match=r"hooks on these layers are not carried over .*: 1 \(BatchNorm2d\)$"):
        convert_norm(model, "gn")


def test_convert_norm_on_a_copy_leaves_the_original_state():
    model, x = build("bn2d", "all", "norm_eval")
    before = copy.deepcopy(model.state_dict())
    convert_norm(model, "gn", inplace=False, example_input=x)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(p.requires_grad for p in model.parameters()) and not model[1].training
