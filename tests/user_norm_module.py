"""A user's module that registers its own norm on import and defines the model a comparison trains with it:
``normlab compare --model user_norm_module:small_net --norms user_frn`` (tests/test_compare.py). Imported only by
that test, which unregisters the norm afterwards."""

from __future__ import annotations

import torch
from torch import nn

from normlab.nn import register_norm

NAME = "user_frn"


class UserFRN(nn.Module):
    """x / sqrt(mean over the positions of x^2 + eps), per sample and channel, then a per-channel affine."""

    def __init__(self, num_features, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))

    def forward(self, x):
        nu2 = x.square().mean(dim=tuple(range(2, x.dim())), keepdim=True)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return x * torch.rsqrt(nu2 + self.eps) * self.weight.view(shape) + self.bias.view(shape)


register_norm(NAME, UserFRN, statistics="instance")


def small_net(num_classes: int, in_channels: int) -> nn.Module:
    """A conv net with BatchNorms (each replaced by the comparison's norm)."""
    return nn.Sequential(
        nn.Conv2d(in_channels, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, num_classes),
    )
