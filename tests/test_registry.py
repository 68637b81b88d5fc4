"""The registry takes a user's norm (and conv): usable by name in create_norm, convert_norm, the comparison runner,
the timm adapter, param_groups and the monitor; every built-in name resolves as before; bad registrations are
refused in one line; every table the converter and the adapter used to keep is an attribute of an entry."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from normlab.convert import CONVERT_TARGETS, convert_norm
from normlab.nn import (
    CONV_KINDS,
    NORM_NAMES,
    BatchRenorm1d,
    BatchRenorm2d,
    BatchRenorm3d,
    InstanceNorm1d,
    InstanceNorm2d,
    InstanceNorm3d,
    PWSConv1d,
    PWSConv2d,
    PWSConv3d,
    SwitchableNorm1d,
    SwitchableNorm2d,
    SwitchableNorm3d,
    SyncBatchRenorm,
    WSConv1d,
    WSConv2d,
    WSConv3d,
    comparison_names,
    create_conv,
    create_norm,
    get_conv_class,
    get_norm_class,
    is_norm_layer,
    norm_entry,
    param_groups,
    register_conv,
    register_norm,
    resolve_comparison,
    unregister_conv,
    unregister_norm,
)

SEED = 100


# --- a user's norm: per sample and channel over the positions (FRN without its threshold), one class per dim ---
class _ChannelRMS(nn.Module):
    dims = 2

    def __init__(self, num_features: int, eps: float = 1e-6, affine: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_features)) if affine else None
        self.bias = nn.Parameter(torch.zeros(num_features)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != self.dims + 2:
            raise ValueError(f"{type(self).__name__}: expected a {self.dims + 2}-D input, got {x.dim()}-D")
        y = x * torch.rsqrt(x.square().mean(dim=tuple(range(2, x.dim())), keepdim=True) + self.eps)
        shape = (1, -1) + (1,) * self.dims
        return y if self.weight is None else y * self.weight.view(shape) + self.bias.view(shape)


class ChannelRMS1d(_ChannelRMS):
    dims = 1


class ChannelRMS2d(_ChannelRMS):
    dims = 2


class ChannelRMS3d(_ChannelRMS):
    dims = 3


RMS = {1: ChannelRMS1d, 2: ChannelRMS2d, 3: ChannelRMS3d}


class MeanOnlyBN(nn.Module):
    """A user's batch norm keeping BatchNorm's running statistics (subtracts the batch mean only)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1, affine: bool = True) -> None:
        super().__init__()
        self.eps, self.momentum = eps, momentum
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = (0, *range(2, x.dim()))
        mean = x.mean(dim=dims) if self.training else self.running_mean
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return (x - mean.view(shape)) * self.weight.view(shape) + self.bias.view(shape)


class SyncMeanOnlyBN(MeanOnlyBN):
    pass


class PairGroupNorm(nn.GroupNorm):
    """A user's group norm with the registry's constructor: (num_features, num_groups, ...)."""

    def __init__(self, num_features: int, num_groups: int = 2, eps: float = 1e-5, affine: bool = True) -> None:
        super().__init__(num_groups, num_features, eps, affine)


class ScaledConv2d(nn.Conv2d):
    """A user's conv: the kernel times a fixed ``scale``."""

    def __init__(self, in_channels, out_channels, kernel_size, *, scale: float = 1.0, **kw) -> None:
        super().__init__(in_channels, out_channels, kernel_size, **kw)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.weight * self.scale, self.bias)


@pytest.fixture
def rms():
    """``rms`` registered for one test."""
    entry = register_norm("rms", RMS, statistics="instance")
    yield entry
    unregister_norm("rms")


@pytest.fixture
def user_layers():
    """``rms`` (instance), ``mbn`` (batch, running statistics, a sync class), ``pgn`` (group) and the conv
    ``scaled`` registered for one test."""
    register_norm("rms", RMS, statistics="instance")
    register_norm("mbn", MeanOnlyBN, statistics="batch", running_stats=True, sync=SyncMeanOnlyBN)
    register_norm("pgn", PairGroupNorm, statistics="group")
    register_conv("scaled", {2: ScaledConv2d}, options={"scale": float})
    yield
    for name in ("rms", "mbn", "pgn"):
        unregister_norm(name)
    unregister_conv("scaled")


# --- every built-in name resolves as before ---
def _largest_divisor(c: int) -> int:
    return max(g for g in range(1, 33) if c % g == 0)


OLD_NORMS = {  # the table of the registry before entries: name -> ({dim: class}, how create_norm built it)
    "none": ({d: nn.Identity for d in (1, 2, 3)}, lambda cls, c: cls()),
    "bn": ({1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}, lambda cls, c: cls(c)),
    "brn": ({1: BatchRenorm1d, 2: BatchRenorm2d, 3: BatchRenorm3d}, lambda cls, c: cls(c)),
    "gn": ({d: nn.GroupNorm for d in (1, 2, 3)}, lambda cls, c: cls(_largest_divisor(c), c)),
    "ln": ({d: nn.GroupNorm for d in (1, 2, 3)}, lambda cls, c: cls(1, c)),
    "in": ({1: InstanceNorm1d, 2: InstanceNorm2d, 3: InstanceNorm3d}, lambda cls, c: cls(c, affine=True)),
    "sn": ({1: SwitchableNorm1d, 2: SwitchableNorm2d, 3: SwitchableNorm3d}, lambda cls, c: cls(c)),
}
OLD_CONVS = {
    "conv": {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d},
    "wn": {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d},
    "ws": {1: WSConv1d, 2: WSConv2d, 3: WSConv3d},
    "pws": {1: PWSConv1d, 2: PWSConv2d, 3: PWSConv3d},
}


def _same_module(a: nn.Module, b: nn.Module) -> None:
    same_type = type(a) is type(b) or type(a).__name__.startswith("Parametrized")  # torch makes one class per call
    assert same_type and type(a).__mro__[1:] == type(b).__mro__[1:] and repr(a) == repr(b)
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0)
    assert {k: v for k, v in vars(a).items() if not k.startswith("_")} == {
        k: v for k, v in vars(b).items() if not k.startswith("_")
    }


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("name", list(OLD_NORMS))
def test_every_builtin_norm_resolves_as_before(name, dim):
    classes, build = OLD_NORMS[name]
    assert get_norm_class(name, dim) is classes[dim] and get_norm_class(name.upper(), dim) is classes[dim]
    for c in (1, 7, 48, 96):
        torch.manual_seed(SEED)
        new = create_norm(name, c, dim=dim)
        torch.manual_seed(SEED)
        _same_module(new, build(classes[dim], c))


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("kind", list(OLD_CONVS))
def test_every_builtin_conv_resolves_as_before(kind, dim):
    cls = OLD_CONVS[kind][dim]
    assert get_conv_class(kind, dim) is cls
    torch.manual_seed(SEED)
    new = create_conv(kind, 3, 8, 3, dim=dim, padding=1)
    torch.manual_seed(SEED)
    old = cls(3, 8, 3, padding=1)
    if kind == "wn":
        old = nn.utils.parametrizations.weight_norm(old, name="weight", dim=0)
    _same_module(new, old)


def test_builtin_names_and_comparison_names_as_before():
    assert NORM_NAMES == ("none", "bn", "brn", "gn", "ln", "in", "sn") and tuple(NORM_NAMES) == tuple(OLD_NORMS)
    assert CONV_KINDS == ("conv", "wn", "ws", "pws")
    assert comparison_names() == ("none", "bn", "brn", "gn", "ln", "in", "sn", "wn", "ws", "pws")
    assert tuple(CONVERT_TARGETS) == (*OLD_NORMS, "pws", "ws")


def test_entries_hold_what_the_old_tables_said():
    """convert/norms.py's _NEEDS_LENGTH, _INSTANCE_STATS, _SYNC, the names whose running statistics and momentum
    were copied, and integrations/timm.py's NORM_ACT_CLASSES, as attributes of the entries."""
    entries = {n: norm_entry(n) for n in NORM_NAMES}
    assert {n for n, e in entries.items() if e.per_sample} == {"gn", "ln", "in", "sn"}
    assert {n for n, e in entries.items() if e.statistics == "instance"} == {"in", "sn"}
    assert {n: e.sync for n, e in entries.items() if e.sync} == {"brn": SyncBatchRenorm, "bn": nn.SyncBatchNorm}
    assert {n for n, e in entries.items() if e.running_stats} == {"brn", "bn", "sn"}
    assert {n for n, e in entries.items() if "momentum" in e.carries} == {"brn", "bn", "sn"}
    assert {n for n, e in entries.items() if "track_running_stats" in e.carries} == {"brn", "bn"}
    assert {n for n, e in entries.items() if "affine" not in e.carries} == {"sn"}  # always affine
    assert [entries[n].groups(48, {}) for n in ("gn", "ln", "in")] == [24, 1, 48]
    assert entries["gn"].groups(48, {"num_groups": 4}) == 4
    assert all(e.builtin for e in entries.values())


# --- a user's norm everywhere normlab takes a norm name ---
@pytest.mark.parametrize("dim", [1, 2, 3])
def test_user_norm_through_create_norm(rms, dim):
    norm = create_norm("rms", 6, dim=dim, eps=1e-3)
    assert type(norm) is RMS[dim] and get_norm_class("RMS", dim) is RMS[dim] and norm.eps == 1e-3
    x = torch.randn((4, 6) + (5,) * dim, generator=torch.Generator().manual_seed(SEED), dtype=torch.float64)
    norm.double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2)
        norm.bias.uniform_(-1, 1)
    axes = tuple(range(2, x.dim()))
    shape = (1, -1) + (1,) * dim
    expected = x / (x.square().mean(axes, keepdim=True) + 1e-3).sqrt() * norm.weight.view(shape) + norm.bias.view(shape)
    torch.testing.assert_close(norm(x), expected)
    assert "rms" in NORM_NAMES and "rms" in CONVERT_TARGETS and "rms" in comparison_names()
    assert rms.classes[dim] is RMS[dim] and not rms.builtin


def test_names_imported_before_registration_see_it(rms):
    from normlab.runner import models
    from normlab.runner.training import config

    assert "rms" in models.NORM_NAMES and "rms" in config.NORM_NAMES  # imported when normlab was


def test_user_norm_is_a_norm_layer_without_weight_decay_and_watched_as_norm(rms):
    from normlab.monitor.layers import layer_kind

    model = nn.Sequential(nn.Conv2d(3, 6, 3, bias=False), create_norm("rms", 6), nn.ReLU())
    assert is_norm_layer(model[1]) and layer_kind(model[1]) == "norm"
    decay, no_decay = param_groups(model, weight_decay=5e-4)
    assert {id(p) for p in no_decay["params"]} == {id(model[1].weight), id(model[1].bias)}
    assert {id(p) for p in decay["params"]} == {id(model[0].weight)}
    unregister_norm("rms")
    try:  # unregistered (the old registry): the class is no norm layer, its weight decays
        assert not is_norm_layer(model[1]) and layer_kind(model[1]) is None
        assert len(param_groups(model, weight_decay=5e-4)[0]["params"]) == 2
    finally:
        register_norm("rms", RMS, statistics="instance")


def test_convert_norm_to_a_user_norm_on_a_torchvision_model(rms):
    tv_models = pytest.importorskip("torchvision.models")
    torch.manual_seed(SEED)
    model = tv_models.resnet18(weights=None, num_classes=4)
    bns = {n: m for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)}
    with torch.no_grad():
        for m in bns.values():
            m.weight.uniform_(0.5, 2)
    convert_norm(model, to="rms")
    new = dict(model.named_modules())
    for name, bn in bns.items():
        assert type(new[name]) is ChannelRMS2d and torch.equal(new[name].weight, bn.weight)
    x = torch.randn(2, 3, 64, 64)
    loss = model(x).logsumexp(1).mean()
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_convert_norm_to_a_user_norm_on_a_timm_model(rms):
    timm = pytest.importorskip("timm")
    from timm.layers import BatchNormAct2d

    from normlab.integrations.timm import norm_act_class

    torch.manual_seed(SEED)
    model = timm.create_model("efficientnet_b0", pretrained=False, num_classes=4)
    old = {n: m for n, m in model.named_modules() if isinstance(m, BatchNormAct2d)}
    convert_norm(model, "rms")
    new = dict(model.named_modules())
    cls = norm_act_class("rms")
    assert cls.__name__ == "ChannelRMS2dAct" and issubclass(cls, ChannelRMS2d)
    for name, bn in old.items():
        assert type(new[name]) is cls and new[name].act is bn.act and new[name].drop is bn.drop
    y = new[next(iter(old))]
    inner = ChannelRMS2d(y.weight.numel(), eps=y.eps)  # eps: the BatchNorm's (1e-3 in efficientnet)
    inner.load_state_dict(y.state_dict())  # the norm's parameters at the top level: its keys are the norm's
    z = torch.randn(2, y.weight.numel(), 4, 4)
    torch.testing.assert_close(y(z), y.act(y.drop(inner(z))))
    x = torch.randn(2, 3, 64, 64)
    assert torch.isfinite(model(x)).all()
    again = pickle.loads(pickle.dumps(model))  # the made class is found by name
    torch.testing.assert_close(again.eval()(x), model.eval()(x))


def test_convert_refusals_follow_the_entry(user_layers):
    mlp = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    with pytest.raises(ValueError, match=r"input is an nn.Linear output \(N, C\), ChannelRMS1d needs \(N, C, L\)"):
        convert_norm(mlp, "rms", inplace=False)
    assert type(convert_norm(mlp, "mbn", inplace=False)[1]) is MeanOnlyBN  # batch statistics: (N, C) is fine
    pooled = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.BatchNorm2d(4))
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(ValueError, match="sees a single position per channel on example_input"):
        convert_norm(pooled, "rms", example_input=x, inplace=False)
    with pytest.raises(ValueError, match=r"PairGroupNorm\(4, 4\)\): sees one value per group"):
        convert_norm(
            nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.BatchNorm2d(4)), "pgn", example_input=x
        )
    with pytest.raises(ValueError, match="channels not divisible by num_groups=3"):
        convert_norm(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), "pgn", num_groups=3)
    gn = convert_norm(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)), "pgn", inplace=False)[1]
    assert type(gn) is PairGroupNorm and gn.num_groups == 8  # create_norm's default: the largest divisor <= 32


def test_convert_copies_running_statistics_and_keeps_sync(user_layers):
    bn = nn.BatchNorm2d(4, momentum=0.3, eps=1e-3)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    bn.num_batches_tracked += 7
    new = convert_norm(nn.Sequential(bn), "mbn", inplace=False)[0]
    assert type(new) is MeanOnlyBN and (new.momentum, new.eps) == (0.3, 1e-3)
    for k in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(new, k), getattr(bn, k)), k
    assert not torch.equal(convert_norm(nn.Sequential(bn), "rms", inplace=False)[0].weight, bn.running_mean)
    sync = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
    assert type(convert_norm(sync, "mbn", inplace=False)[1]) is SyncMeanOnlyBN
    assert type(convert_norm(sync, "rms", inplace=False)[1]) is ChannelRMS2d  # per sample: nothing to synchronize


def test_comparison_runner_resolves_user_names(user_layers):
    from normlab.runner.grid.spec import GridSpec, expand_grid, parse_variant
    from normlab.runner.models import build_model
    from normlab.runner.training.config import resolve_name

    assert resolve_comparison("rms") == ("rms", "conv") and resolve_comparison("scaled") == ("none", "scaled")
    assert resolve_comparison("RMS+ws") == ("rms", "ws") and resolve_name("scaled+rms") == ("rms", "scaled")
    assert parse_variant("scaled+rms:scale=2") == ("rms", "scaled", {"scale": 2.0})
    spec = GridSpec(norms=["rms", "scaled+mbn:scale=0.5", "pgn"], seeds=[100], epochs=1)
    cells = expand_grid(spec)
    assert [(c.config.norm, c.config.conv, c.config.conv_kwargs) for c in cells] == [
        ("rms", "conv", {}),
        ("mbn", "scaled", {"scale": 0.5}),
        ("pgn", "conv", {}),
    ]
    model = build_model("plain", norm="rms", conv="scaled", conv_kwargs={"scale": 0.5})
    assert any(type(m) is ChannelRMS2d for m in model.modules())
    assert any(type(m) is ScaledConv2d and m.scale == 0.5 for m in model.modules())


def test_variant_options_are_the_conv_kinds_own():
    from normlab.runner.errors import FieldError
    from normlab.runner.grid.spec import parse_variant

    assert parse_variant("ws:eps=1e-4") == ("none", "ws", {"eps": 1e-4})
    with pytest.raises(FieldError, match="key in gamma, relative_gamma, init_alpha, fan_mode for a pws conv"):
        parse_variant("pws:eps=1e-4")  # PWSConv2d takes no eps: it used to fail only when the model was built
    with pytest.raises(FieldError, match="expected no options for a conv conv, got 'gamma=2'"):
        parse_variant("bn:gamma=2")


def test_timm_adapter_takes_a_user_norm(rms, timm_registered):
    timm = pytest.importorskip("timm")

    from normlab.integrations.timm import norm_act_class, register

    cls = norm_act_class("rms")
    register()  # again, now that rms is registered: adds its NormAct class
    model = timm.create_model("regnetx_002", pretrained=False, num_classes=4, norm_layer=cls)
    ref = timm.create_model("regnetx_002", pretrained=False, num_classes=4)
    acts = [type(m.act).__name__ for m in model.modules() if isinstance(m, cls)]
    assert acts and acts == [type(m.act).__name__ for m in ref.modules() if hasattr(m, "act") and m.act]
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert torch.isfinite(model(torch.randn(2, 3, 64, 64))).all()


# --- bad registrations: one line each, nothing registered ---
def _factory(num_features, **kw):
    return nn.GroupNorm(2, num_features, **kw)


class _NeedsGroupsFirst(nn.Module):
    def __init__(self, num_groups, num_channels):
        super().__init__()


BAD = [
    (("bn", nn.BatchNorm2d), {"statistics": "batch"}, ValueError, "name 'bn' is taken by the built-in norm 'bn'"),
    (("pws", nn.GroupNorm), {"statistics": "group"}, ValueError, "name 'pws' is taken by the built-in conv 'pws'"),
    (("My-Norm", RMS), {"statistics": "instance"}, ValueError, "name must be lower-case letters, digits and '_'"),
    (("ws+rms", RMS), {"statistics": "instance"}, ValueError, "name must be lower-case letters"),
    (("f", _factory), {"statistics": "group"}, TypeError, "got function '_factory' \\(a factory: register a subclass"),
    (("i", ChannelRMS2d(3)), {"statistics": "instance"}, TypeError, "layer must be an nn.Module subclass"),
    (("t", int), {"statistics": "none"}, TypeError, "layer must be an nn.Module subclass .*, got type 'int'"),
    (("d", {4: ChannelRMS2d}), {"statistics": "instance"}, ValueError, "got a mapping with keys \\[4\\]"),
    (
        ("s", _NeedsGroupsFirst),
        {"statistics": "layer"},
        TypeError,
        "constructor must take \\(num_features, \\*\\*kw\\)",
    ),
    (("g", ChannelRMS2d), {"statistics": "group"}, TypeError, "take \\(num_features, num_groups=..., \\*\\*kw\\)"),
    (("q", RMS), {"statistics": "channel"}, ValueError, "statistics must be one of batch, instance, group, layer"),
    (("q", RMS), {"statistics": "instance", "sync": ChannelRMS2d}, ValueError, "sync is for batch statistics"),
    (("q", RMS), {"statistics": "batch", "sync": "x"}, TypeError, "sync must be None, an nn.Module subclass"),
    (("q", RMS), {"statistics": "batch", "running_stats": 1}, TypeError, "running_stats must be True or False"),
    (("q", RMS), {"statistics": "instance", "norm_act": "nope"}, TypeError, "norm_act must be None, an nn.Module"),
]


@pytest.mark.parametrize("args, kw, error, message", BAD, ids=[f"{a[0]}-{m[:20]}" for a, _, _, m in BAD])
def test_bad_registrations_are_refused_in_one_line(args, kw, error, message):
    before = tuple(NORM_NAMES)
    with pytest.raises(error, match=message) as e:
        register_norm(*args, **kw)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"register_norm({args[0]!r}): ")
    assert tuple(NORM_NAMES) == before


def test_taken_names_and_unregistering_are_refused_in_one_line(rms):
    assert register_norm("rms", RMS, statistics="instance") is rms  # the same registration again: nothing changes
    with pytest.raises(ValueError, match=r"name 'rms' is taken by the norm 'rms' registered \(unregister_norm it"):
        register_norm("rms", ChannelRMS2d, statistics="instance")
    with pytest.raises(ValueError, match="name 'rms' is taken by the norm 'rms'"):
        register_conv("rms", nn.Conv2d)
    with pytest.raises(ValueError, match=r"unregister_norm\('bn'\): a built-in; registered: rms"):
        unregister_norm("bn")
    with pytest.raises(ValueError, match=r"unregister_conv\('scaled'\): not registered; registered: none"):
        unregister_conv("scaled")
    with pytest.raises(TypeError, match="constructor must take \\(in_channels, out_channels, kernel_size, \\*\\*kw\\)"):
        register_conv("bad", _NeedsGroupsFirst)
    with pytest.raises(TypeError, match="options must map argument names to bool, int, float or str"):
        register_conv("bad", nn.Conv2d, options={"scale": list})
    with pytest.raises(ValueError, match=r"create_norm: 'rms' has no 4d|dim must be 1, 2 or 3"):
        create_norm("rms", 4, dim=4)


def test_a_norm_registered_for_some_dims_refuses_the_others():
    register_norm("rms2", {2: ChannelRMS2d}, statistics="instance")
    try:
        with pytest.raises(ValueError, match=r"create_norm: 'rms2' has no 3d class \(registered for 2d\)"):
            create_norm("rms2", 4, dim=3)
        assert type(create_norm("rms2", 4)) is ChannelRMS2d
    finally:
        unregister_norm("rms2")


def test_the_guides_example_runs(capsys):
    """docs/own_norm.md's example, as written; the norm it registers is unregistered after it."""
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parents[1] / "docs" / "own_norm.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    assert len(blocks) == 1
    try:
        exec(compile(blocks[0], str(page), "exec"), {"__name__": "own_norm_example"})
        assert capsys.readouterr().out.strip() == "FilterResponseNorm True ('frn', 'ws')"
    finally:
        if "frn" in NORM_NAMES:
            unregister_norm("frn")
    assert tuple(NORM_NAMES) == tuple(OLD_NORMS)
