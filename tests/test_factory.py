"""The create_norm / create_conv registry: every name builds the right layer and bad names are refused."""

import pytest
import torch
from torch import nn

from normlab.nn import CONV_KINDS, NORM_NAMES, create_conv, create_norm
from normlab.nn.factory import default_groups


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
        (lambda: create_norm("bn", 0), "num_channels must be a positive int"),
        (lambda: create_norm("bn", 4, dim=4), "dim must be 1, 2 or 3"),
        (lambda: create_conv("deform", 3, 4, 3), "expected one of conv, wn, ws, pws"),
        (lambda: create_conv("conv", 3, -1, 3), "out_channels must be a positive int"),
    ],
)
def test_bad_names_and_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()
