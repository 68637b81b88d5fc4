"""The layer registry: every name builds the right class for every dim, classes are explicit, bad names refused."""

import pytest
import torch
from torch import nn

from normlab.nn import CONV_KINDS, NORM_NAMES, create_conv, create_norm, default_groups


@pytest.mark.parametrize("name", NORM_NAMES)
@pytest.mark.parametrize("dim", [1, 2, 3])
def test_every_norm_builds_and_keeps_shape(name, dim):
    norm = create_norm(name, 8, dim=dim)
    x = torch.randn((4, 8) + (5,) * dim)
    assert norm(x).shape == x.shape


def test_norm_classes():
    from normlab.nn import BatchRenorm2d, InstanceNorm2d, SwitchableNorm2d

    assert isinstance(create_norm("none", 4), nn.Identity)
    assert type(create_norm("bn", 4)) is nn.BatchNorm2d
    assert type(create_norm("brn", 4)) is BatchRenorm2d
    assert type(create_norm("in", 4)) is InstanceNorm2d
    assert type(create_norm("sn", 4)) is SwitchableNorm2d
    gn = create_norm("gn", 96)
    assert isinstance(gn, nn.GroupNorm) and gn.num_groups == 32
    assert create_norm("gn", 24).num_groups == 24
    assert create_norm("gn", 64, num_groups=4).num_groups == 4
    assert create_norm("ln", 64).num_groups == 1
    assert create_norm("BN", 4, momentum=0.3).momentum == 0.3


def test_default_groups_divides():
    for c in range(1, 200):
        g = default_groups(c)
        assert c % g == 0 and 1 <= g <= 32


@pytest.mark.parametrize("kind", CONV_KINDS)
@pytest.mark.parametrize("dim", [1, 2, 3])
def test_every_conv_builds(kind, dim):
    conv = create_conv(kind, 3, 6, 3, dim=dim, padding=1)
    x = torch.randn((2, 3) + (5,) * dim)
    assert conv(x).shape == (2, 6) + (5,) * dim


def test_weight_norm_conv_is_parametrized_per_output_channel():
    conv = create_conv("wn", 3, 6, 3)
    g = conv.parametrizations.weight.original0
    v = conv.parametrizations.weight.original1
    expected = g * v / v.flatten(1).norm(dim=1).reshape(-1, 1, 1, 1)
    torch.testing.assert_close(conv.weight, expected)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: create_norm("batchnorm", 4), "expected one of none, bn, brn, gn, ln, in, sn"),
        (lambda: create_norm("bn", 0), "num_channels must be an int >= 1"),
        (lambda: create_norm("bn", 4, dim=4), "dim must be 1, 2 or 3"),
        (lambda: create_conv("deform", 3, 4, 3), "expected one of conv, wn, ws, pws"),
        (lambda: create_conv("conv", 3, -1, 3), "out_channels must be an int >= 1"),
    ],
)
def test_bad_names_and_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_get_class_is_the_class_create_builds(dim):
    from normlab.nn import get_conv_class, get_norm_class

    for name in NORM_NAMES:
        assert type(create_norm(name, 8, dim=dim)) is get_norm_class(name, dim)
    for kind in CONV_KINDS:  # wn: torch's parametrization makes a subclass of the plain conv
        conv = create_conv(kind, 3, 4, 3, dim=dim)
        assert type(conv) is get_conv_class(kind, dim) or (kind == "wn" and isinstance(conv, get_conv_class(kind, dim)))
    with pytest.raises(ValueError, match="get_norm_class: unknown name 'bnx'"):
        get_norm_class("bnx", dim)
    with pytest.raises(ValueError, match="get_conv_class: dim must be 1, 2 or 3"):
        get_conv_class("pws", 4)


def test_comparison_names_resolve_through_the_registry():
    from normlab.nn import comparison_names, resolve_comparison

    assert comparison_names() == NORM_NAMES + ("wn", "ws", "pws")
    assert resolve_comparison("ws+gn") == ("gn", "ws") and resolve_comparison("PWS") == ("none", "pws")


@pytest.mark.parametrize("name", ["WSConv1d", "WSConv2d", "WSConv3d", "PWSConv1d", "PWSConv2d", "PWSConv3d"])
def test_weight_std_classes_are_explicit_and_pickle(name):
    import inspect
    import io
    import pickle

    import normlab.nn as nlnn
    from normlab.nn import weight_std

    cls = getattr(nlnn, name)
    assert cls.__name__ == cls.__qualname__ == name and cls.__module__ == "normlab.nn.weight_std"
    assert getattr(weight_std, name) is cls  # found by its name in its module (IDEs, autodoc, pickle)
    base = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[int(name[-2])]
    assert issubclass(cls, base) and "class " + name in inspect.getsource(weight_std)
    torch.manual_seed(0)
    m = cls(3, 4, 3, padding=1)
    x = torch.randn((2, 3) + (5,) * int(name[-2]))
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    assert type(again) is cls and set(again.state_dict()) == set(m.state_dict())
    torch.testing.assert_close(again(x), m(x), rtol=0, atol=0)
    assert type(pickle.loads(pickle.dumps(m))) is cls
