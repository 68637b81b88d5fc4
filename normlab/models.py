"""Models of the PWS paper's comparisons; every norm and conv layer comes from :mod:`normlab.nn.factory`.

``build_model(name, norm="bn", conv="conv", in_channels=..., num_classes=..., input_shape=..., width=1.0, **kw)``

- ``plain``: the paper's plain CIFAR net: 3x conv3x3-96, maxpool 2x2, 3x conv3x3-192, maxpool 2x2,
  conv3x3-192 (valid), conv1x1-192, conv1x1-192, global average pool, conv1x1-classes. The norm sits
  between conv and ReLU. Needs inputs of at least 12x12 (digits are upsampled to 16x16 for this).
- ``resnet``: pre-activation bottleneck ResNet in the paper's layout: stem conv3x3-64, 3 stages of
  ``blocks`` bottlenecks (widths 16/32/64, outputs 64/128/256), stride 2 on the last unit of stages 1 and 2.
  Each block: pre-activation ``ReLU(norm(x))`` (``ReLU(x / sqrt(2))`` without a norm), then the residual
  ``branch`` conv1x1 -> norm -> ReLU -> conv3x3 -> norm -> ReLU -> conv1x1; a 1x1 projection shortcut of the
  pre-activation where the shape changes. Head: norm -> ReLU -> global average pool -> linear.
- ``resnet_pws``: the official PWS layout with the same stages: every conv (shortcuts included) of kind
  ``conv`` (pass ``conv="pws"`` for the official net) with bias; the only norm layers are GroupNorm(1) after the stem
  and before the head; each block starts with ``ReLU(x)`` and there is no ReLU after the residual add.
- ``cnn1d``: the MNIST-1D paper's CNN: conv(k5, s2, p1) then 2x conv(k3, s2, p1), 25 channels each,
  norm between conv and ReLU, then a linear layer on the flattened features.

Every residual block exposes its residual branch as the attribute ``branch`` (used by signal
propagation plots). Width multipliers scale every hidden channel count (rounded, at least 1).
Convs start from the paper's He initialization (:func:`he_init_`), not torch's default (``n Var[W] = 1/3``, under
which a deep net without normalization shrinks its signal ~6x per layer and cannot train).
"""

from __future__ import annotations

import math

import torch
from torch import nn

MODELS = ("plain", "resnet", "resnet_pws", "cnn1d")
MODEL_DIMS = {"plain": 2, "resnet": 2, "resnet_pws": 2, "cnn1d": 1}  # spatial dimensions each model takes


def _factory():
    from normlab.nn import factory

    return factory


@torch.no_grad()
def he_init_(model: nn.Module) -> nn.Module:
    """The paper's initialization: He normal (fan_in, ReLU gain, ``n Var[W] = 2``) and zero bias for every conv.

    Plain convs get ``kaiming_normal_``; weight-normed convs get it on ``v`` with ``g = |v|`` per filter (so the
    effective kernel is the He kernel); WS/PWS convs (they have ``effective_weight``) standardize their kernel
    themselves and keep their own init. Returns ``model``.
    """
    for m in model.modules():
        if not isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) or hasattr(m, "effective_weight"):
            continue
        if nn.utils.parametrize.is_parametrized(m, "weight"):
            g, v = m.parametrizations.weight.original0, m.parametrizations.weight.original1
            nn.init.kaiming_normal_(v, mode="fan_in", nonlinearity="relu")
            g.copy_(v.flatten(1).norm(dim=1).reshape(g.shape))
        else:
            nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
        if m.bias is not None:
            m.bias.zero_()
    return model


def _ch(c: int, width: float) -> int:
    return max(1, int(round(c * width)))


def _spatial(name: str, input_shape, in_channels: int, ndim: int) -> tuple[int, ...]:
    """Spatial size from ``input_shape``: (C, *spatial) or just spatial (``ndim`` entries)."""
    shape = tuple(int(s) for s in input_shape)
    if len(shape) == ndim + 1:
        if shape[0] != in_channels:
            raise ValueError(
                f"build_model({name!r}): input_shape {shape} has {shape[0]} channels but in_channels={in_channels}"
            )
        shape = shape[1:]
    if len(shape) != ndim:
        raise ValueError(
            f"build_model({name!r}): expected input_shape (C, {'L' if ndim == 1 else 'H, W'}) or its spatial "
            f"part for a {ndim}D model, got {tuple(input_shape)}"
        )
    if min(shape) < 1:
        raise ValueError(f"build_model({name!r}): input_shape {tuple(input_shape)} has an empty dimension")
    return shape


class ConvNormAct(nn.Sequential):
    """conv -> norm -> ReLU. Conv bias only when there is no norm (the norm's shift replaces it)."""

    def __init__(self, conv, norm, cin, cout, k, dim=2, stride=1, padding=0):
        f = _factory()
        super().__init__()
        self.conv = f.create_conv(conv, cin, cout, k, dim=dim, stride=stride, padding=padding, bias=norm == "none")
        self.norm = f.create_norm(norm, cout, dim=dim)
        self.act = nn.ReLU()


class PlainNet(nn.Module):
    """The paper's plain net. Input (N, C, H, W) with H, W >= 12; output logits (N, num_classes)."""

    def __init__(self, norm="bn", conv="conv", in_channels=3, num_classes=10, width=1.0):
        super().__init__()
        c1, c2 = _ch(96, width), _ch(192, width)
        layers = [ConvNormAct(conv, norm, in_channels, c1, 3, padding=1)]
        layers += [ConvNormAct(conv, norm, c1, c1, 3, padding=1) for _ in range(2)]
        layers += [nn.MaxPool2d(2)]
        layers += [ConvNormAct(conv, norm, c1 if i == 0 else c2, c2, 3, padding=1) for i in range(3)]
        layers += [nn.MaxPool2d(2)]
        layers += [ConvNormAct(conv, norm, c2, c2, 3, padding=0)]
        layers += [ConvNormAct(conv, norm, c2, c2, 1) for _ in range(2)]
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = _factory().create_conv(conv, c2, num_classes, 1, bias=True)

    @staticmethod
    def check_input(hw):
        h, w = hw
        oh, ow = h // 2 // 2 - 2, w // 2 // 2 - 2
        if oh < 1 or ow < 1:
            raise ValueError(
                f"build_model('plain'): input {h}x{w} is too small for the plain net (two 2x2 max-pools then "
                f"a valid 3x3 conv need at least 12x12)"
            )

    def forward(self, x):
        return self.head(self.pool(self.features(x))).flatten(1)


class PreActBottleneck(nn.Module):
    """Pre-activation bottleneck (paper layout). x: (N, cin, H, W) -> (N, cout, H/stride, W/stride)."""

    def __init__(self, cin, cmid, cout, stride, norm, conv):
        super().__init__()
        f = _factory()
        bias = norm == "none"
        self.has_norm = norm != "none"
        self.preact_norm = f.create_norm(norm, cin)
        self.branch = nn.Sequential(
            f.create_conv(conv, cin, cmid, 1, bias=bias),
            f.create_norm(norm, cmid),
            nn.ReLU(),
            f.create_conv(conv, cmid, cmid, 3, stride=stride, padding=1, bias=bias),
            f.create_norm(norm, cmid),
            nn.ReLU(),
            f.create_conv(conv, cmid, cout, 1, bias=True),
        )
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = f.create_conv(conv, cin, cout, 1, stride=stride, bias=bias)

    def forward(self, x):
        h = torch.relu(self.preact_norm(x) if self.has_norm else x / math.sqrt(2.0))
        sc = x if self.shortcut is None else self.shortcut(h)
        return sc + self.branch(h)


class PWSBottleneck(nn.Module):
    """Official PWS bottleneck: h = ReLU(x); out = shortcut(h) + branch(h); no norms, no ReLU after the add."""

    def __init__(self, cin, cmid, cout, stride, conv):
        super().__init__()
        f = _factory()
        self.branch = nn.Sequential(
            f.create_conv(conv, cin, cmid, 1, bias=True),
            nn.ReLU(),
            f.create_conv(conv, cmid, cmid, 3, stride=stride, padding=1, bias=True),
            nn.ReLU(),
            f.create_conv(conv, cmid, cout, 1, bias=True),
        )
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = f.create_conv(conv, cin, cout, 1, stride=stride, bias=True)

    def forward(self, x):
        h = torch.relu(x)
        sc = x if self.shortcut is None else self.shortcut(h)
        return sc + self.branch(h)


def _stages(width, blocks):
    """(cin, cmid, cout, stride) for every block: 3 stages, stride 2 on the last unit of stages 1-2."""
    stem = _ch(64, width)
    specs, cin = [], stem
    for s, (mid, out) in enumerate(((16, 64), (32, 128), (64, 256))):
        mid, out = _ch(mid, width), _ch(out, width)
        for b in range(blocks):
            stride = 2 if (s < 2 and b == blocks - 1) else 1
            specs.append((cin, mid, out, stride))
            cin = out
    return stem, specs, cin


class PreActResNet(nn.Module):
    """Pre-activation bottleneck ResNet (paper layout). x: (N, C, H, W) -> logits (N, num_classes)."""

    def __init__(self, norm="bn", conv="conv", in_channels=3, num_classes=10, width=1.0, blocks=6):
        super().__init__()
        f = _factory()
        stem, specs, cout = _stages(width, blocks)
        self.stem = f.create_conv(conv, in_channels, stem, 3, padding=1, bias=norm == "none")
        self.blocks = nn.Sequential(*[PreActBottleneck(*s, norm=norm, conv=conv) for s in specs])
        self.head_norm = f.create_norm(norm, cout)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cout, num_classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(self.pool(torch.relu(self.head_norm(x))).flatten(1))


class PWSResNet(nn.Module):
    """Official PWS ResNet layout: GroupNorm(1) only after the stem and before the head."""

    def __init__(self, conv="pws", in_channels=3, num_classes=10, width=1.0, blocks=6):
        super().__init__()
        f = _factory()
        stem, specs, cout = _stages(width, blocks)
        self.stem = f.create_conv(conv, in_channels, stem, 3, padding=1, bias=True)
        self.stem_norm = f.create_norm("ln", stem)
        self.blocks = nn.Sequential(*[PWSBottleneck(*s, conv=conv) for s in specs])
        self.head_norm = f.create_norm("ln", cout)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cout, num_classes)

    def forward(self, x):
        x = self.blocks(self.stem_norm(self.stem(x)))
        return self.fc(self.pool(torch.relu(self.head_norm(x))).flatten(1))


class CNN1d(nn.Module):
    """MNIST-1D CNN. x: (N, C, L) -> logits (N, num_classes)."""

    SPECS = ((5, 2, 1), (3, 2, 1), (3, 2, 1))  # (kernel, stride, padding)

    def __init__(self, norm="bn", conv="conv", in_channels=1, num_classes=10, length=40, width=1.0, channels=25):
        super().__init__()
        c = _ch(channels, width)
        layers, cin = [], in_channels
        for k, s, p in self.SPECS:
            layers.append(ConvNormAct(conv, norm, cin, c, k, dim=1, stride=s, padding=p))
            cin = c
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(c * self.out_length(length), num_classes)

    @classmethod
    def out_length(cls, length: int) -> int:
        for k, s, p in cls.SPECS:
            length = (length + 2 * p - k) // s + 1
        return length

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


def build_model(
    name: str,
    norm: str = "bn",
    conv: str = "conv",
    in_channels: int = 3,
    num_classes: int = 10,
    input_shape=(3, 32, 32),
    width: float = 1.0,
    **kw,
) -> nn.Module:
    """Build a model by name (see :data:`MODELS`).

    input_shape: per-sample shape (C, H, W) / (C, L), or only its spatial part. Extra keyword: ``blocks``
    (bottlenecks per stage, resnet / resnet_pws, default 6), ``channels`` (cnn1d, default 25).
    Raises ValueError with a one-line reason for unknown names or impossible combinations.
    """
    if name not in MODELS:
        raise ValueError(f"build_model: unknown model {name!r}; valid names: {', '.join(MODELS)}")
    f = _factory()
    if norm not in f.NORM_NAMES:
        raise ValueError(f"build_model({name!r}): unknown norm {norm!r}; valid names: {', '.join(f.NORM_NAMES)}")
    if conv not in f.CONV_KINDS:
        raise ValueError(f"build_model({name!r}): unknown conv {conv!r}; valid kinds: {', '.join(f.CONV_KINDS)}")
    if not (isinstance(width, (int, float)) and width > 0 and math.isfinite(width)):
        raise ValueError(f"build_model({name!r}): width must be a positive number, got {width!r}")
    if int(in_channels) < 1 or int(num_classes) < 1:
        raise ValueError(f"build_model({name!r}): in_channels and num_classes must be >= 1")
    allowed = {"resnet": {"blocks"}, "resnet_pws": {"blocks"}, "cnn1d": {"channels"}}.get(name, set())
    unknown = set(kw) - allowed
    if unknown:
        raise ValueError(f"build_model({name!r}): unexpected keyword(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    if "blocks" in kw and int(kw["blocks"]) < 1:
        raise ValueError(f"build_model({name!r}): blocks must be >= 1, got {kw['blocks']}")

    if name == "cnn1d":
        (length,) = _spatial(name, input_shape, in_channels, 1)
        if CNN1d.out_length(length) < 1:
            raise ValueError(
                f"build_model('cnn1d'): input length {length} is too small (the three strided convs leave nothing)"
            )
        return he_init_(CNN1d(norm, conv, in_channels, num_classes, length=length, width=width, **kw))
    hw = _spatial(name, input_shape, in_channels, 2)
    if name == "plain":
        PlainNet.check_input(hw)
        return he_init_(PlainNet(norm, conv, in_channels, num_classes, width))
    if name == "resnet":
        return he_init_(PreActResNet(norm, conv, in_channels, num_classes, width, **kw))
    # resnet_pws: the layout fixes its norm layers (GroupNorm(1) at stem and head).
    if norm not in ("none", "ln"):
        raise ValueError(
            f"build_model('resnet_pws'): the official PWS layout has fixed GroupNorm(1) layers; norm must be "
            f"'none' or 'ln', got {norm!r}"
        )
    return he_init_(PWSResNet(conv, in_channels, num_classes, width, **kw))
