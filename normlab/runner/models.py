"""The networks of the PWS paper's comparisons, built from the layer registry.

``build_model(name, norm, conv, in_channels, num_classes, input_shape, width, norm_kwargs, conv_kwargs, **kw)``

- ``plain`` / ``plain1d``: the paper's plain CIFAR net (2-D) and the same net in 1-D (MNIST-1D): 3x conv3-96,
  maxpool 2, 3x conv3-192, maxpool 2, conv3-192 (valid), conv1-192, conv1-192, global average pool, conv1-classes.
  The norm sits between conv and ReLU. Spatial size at least 12 (two 2x pools, then a valid 3-conv).
- ``resnet``: the paper's pre-activation bottleneck ResNet: stem conv3x3-64, 3 stages of ``blocks`` bottlenecks
  (widths 16/32/64, outputs 64/128/256), stride 2 on the last unit of stages 1 and 2. Each block: ``ReLU(norm(x))``
  (``ReLU(x / sqrt 2)`` without a norm), then the residual ``branch`` conv1x1 -> norm -> ReLU -> conv3x3 -> norm ->
  ReLU -> conv1x1; a 1x1 projection shortcut where the shape changes. Head: norm -> ReLU -> pool -> linear.
- ``resnet_pws``: the official PWS layout: every conv with bias, GroupNorm(1) only after the stem and before the
  head, each block starts with ``ReLU(x)`` and has no ReLU after the add.
- ``cnn1d``: the MNIST-1D paper's CNN: conv(k5, s2, p1), 2x conv(k3, s2, p1), 25 channels, linear head.

Every residual block exposes its residual branch as ``branch`` (signal propagation plots). Width multipliers scale
every hidden channel count (rounded, at least 1). Plain and weight-normed convs start from He initialization
(``n Var[W] = 2``, :func:`he_init_`): under torch's default (``n Var[W] = 1/3``) a deep net without normalization
shrinks its signal ~6x per layer and does not train.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from normlab._checks import number_problem
from normlab.nn import CONV_KINDS, NORM_NAMES, create_conv, create_norm
from normlab.runner.errors import UsageError

__all__ = [
    "MAX_WIDTH",
    "MODELS",
    "MODEL_DIMS",
    "build_model",
    "he_init_",
    "LayerFactory",
    "PlainNet",
    "PreActResNet",
    "PWSResNet",
    "CNN1d",
    "PreActBottleneck",
    "PWSBottleneck",
]

#: The widest channel multiplier of the built-in models (the plain net at width 16 has about 2 GB of weights).
MAX_WIDTH = 16.0
#: The spatial dimensions of the input each model takes (1 for a sequence, 2 for an image).
MODEL_DIMS = {"plain": 2, "plain1d": 1, "resnet": 2, "resnet_pws": 2, "cnn1d": 1}
#: The names :func:`build_model` takes.
MODELS = tuple(MODEL_DIMS)
_MODEL_KWARGS = {"resnet": {"blocks"}, "resnet_pws": {"blocks"}, "cnn1d": {"channels"}}


@dataclass(frozen=True)
class LayerFactory:
    """Makes the norm and conv layers of one model: ``norm``/``conv`` names, ``dim``, and extra constructor
    arguments (``norm_kwargs`` only reach layers of kind ``norm``, e.g. a BatchRenorm schedule)."""

    norm: str = "bn"
    conv: str = "conv"
    dim: int = 2
    norm_kwargs: dict = field(default_factory=dict)
    conv_kwargs: dict = field(default_factory=dict)

    @property
    def has_norm(self) -> bool:
        return self.norm != "none"

    def make_norm(self, channels: int) -> nn.Module:
        return create_norm(self.norm, channels, dim=self.dim, **self.norm_kwargs)

    def make_conv(self, cin: int, cout: int, kernel_size: int, **kwargs) -> nn.Module:
        return create_conv(self.conv, cin, cout, kernel_size, dim=self.dim, **self.conv_kwargs, **kwargs)


@torch.no_grad()
def he_init_(model: nn.Module) -> nn.Module:
    """He normal init (fan_in, ReLU gain, ``n Var[W] = 2``) and zero bias for every plain or weight-normed conv.

    Weight-normed convs get it on ``v`` with ``g = |v|`` per filter, so their effective kernel is the He kernel;
    WS/PWS convs (they have ``effective_weight``) standardize their kernel themselves. Returns ``model``.
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


class ConvNormAct(nn.Sequential):
    """conv -> norm -> ReLU. The conv has a bias only without a norm (the norm's shift replaces it)."""

    def __init__(self, layers: LayerFactory, cin: int, cout: int, k: int, stride: int = 1, padding: int = 0):
        super().__init__()
        self.conv = layers.make_conv(cin, cout, k, stride=stride, padding=padding, bias=not layers.has_norm)
        self.norm = layers.make_norm(cout)
        self.act = nn.ReLU()


class PlainNet(nn.Module):
    """The paper's plain net in ``layers.dim`` (1 or 2) spatial dimensions.

    Shape: input (N, C, H, W) or (N, C, L) with every spatial size >= 12; output logits (N, num_classes).
    """

    MIN_SIZE = 12

    def __init__(self, layers: LayerFactory, in_channels: int = 3, num_classes: int = 10, width: float = 1.0):
        super().__init__()
        pool = nn.MaxPool1d if layers.dim == 1 else nn.MaxPool2d
        c1, c2 = _ch(96, width), _ch(192, width)
        blocks = [ConvNormAct(layers, cin, c1, 3, padding=1) for cin in (in_channels, c1, c1)]
        blocks += [pool(2)]
        blocks += [ConvNormAct(layers, cin, c2, 3, padding=1) for cin in (c1, c2, c2)]
        blocks += [pool(2), ConvNormAct(layers, c2, c2, 3)]
        blocks += [ConvNormAct(layers, c2, c2, 1) for _ in range(2)]
        self.features = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool1d(1) if layers.dim == 1 else nn.AdaptiveAvgPool2d(1)
        self.head = layers.make_conv(c2, num_classes, 1, bias=True)

    def forward(self, x):
        return self.head(self.pool(self.features(x))).flatten(1)


class PreActBottleneck(nn.Module):
    """Pre-activation bottleneck (paper layout). x: (N, cin, H, W) -> (N, cout, H/stride, W/stride)."""

    def __init__(self, cin: int, cmid: int, cout: int, stride: int, layers: LayerFactory):
        super().__init__()
        bias = not layers.has_norm
        self.has_norm = layers.has_norm
        self.preact_norm = layers.make_norm(cin)
        self.branch = nn.Sequential(
            layers.make_conv(cin, cmid, 1, bias=bias),
            layers.make_norm(cmid),
            nn.ReLU(),
            layers.make_conv(cmid, cmid, 3, stride=stride, padding=1, bias=bias),
            layers.make_norm(cmid),
            nn.ReLU(),
            layers.make_conv(cmid, cout, 1, bias=True),
        )
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = layers.make_conv(cin, cout, 1, stride=stride, bias=bias)

    def forward(self, x):
        h = torch.relu(self.preact_norm(x) if self.has_norm else x / math.sqrt(2.0))
        sc = x if self.shortcut is None else self.shortcut(h)
        return sc + self.branch(h)


class PWSBottleneck(nn.Module):
    """Official PWS bottleneck: h = ReLU(x); out = shortcut(h) + branch(h); no norms, no ReLU after the add."""

    def __init__(self, cin: int, cmid: int, cout: int, stride: int, layers: LayerFactory):
        super().__init__()
        self.branch = nn.Sequential(
            layers.make_conv(cin, cmid, 1, bias=True),
            nn.ReLU(),
            layers.make_conv(cmid, cmid, 3, stride=stride, padding=1, bias=True),
            nn.ReLU(),
            layers.make_conv(cmid, cout, 1, bias=True),
        )
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = layers.make_conv(cin, cout, 1, stride=stride, bias=True)

    def forward(self, x):
        h = torch.relu(x)
        sc = x if self.shortcut is None else self.shortcut(h)
        return sc + self.branch(h)


def _stages(width: float, blocks: int):
    """(cin, cmid, cout, stride) for every block: 3 stages, stride 2 on the last unit of stages 1-2."""
    stem = _ch(64, width)
    specs, cin = [], stem
    for s, (mid, out) in enumerate(((16, 64), (32, 128), (64, 256))):
        mid, out = _ch(mid, width), _ch(out, width)
        for b in range(blocks):
            specs.append((cin, mid, out, 2 if (s < 2 and b == blocks - 1) else 1))
            cin = out
    return stem, specs, cin


class PreActResNet(nn.Module):
    """Pre-activation bottleneck ResNet (paper layout). x: (N, C, H, W) -> logits (N, num_classes)."""

    def __init__(self, layers: LayerFactory, in_channels=3, num_classes=10, width=1.0, blocks=6):
        super().__init__()
        stem, specs, cout = _stages(width, blocks)
        self.stem = layers.make_conv(in_channels, stem, 3, padding=1, bias=not layers.has_norm)
        self.blocks = nn.Sequential(*[PreActBottleneck(*s, layers=layers) for s in specs])
        self.head_norm = layers.make_norm(cout)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cout, num_classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(self.pool(torch.relu(self.head_norm(x))).flatten(1))


class PWSResNet(nn.Module):
    """Official PWS ResNet layout: GroupNorm(1) only after the stem and before the head."""

    def __init__(self, layers: LayerFactory, in_channels=3, num_classes=10, width=1.0, blocks=6):
        super().__init__()
        stem, specs, cout = _stages(width, blocks)
        self.stem = layers.make_conv(in_channels, stem, 3, padding=1, bias=True)
        self.stem_norm = create_norm("ln", stem)
        self.blocks = nn.Sequential(*[PWSBottleneck(*s, layers=layers) for s in specs])
        self.head_norm = create_norm("ln", cout)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cout, num_classes)

    def forward(self, x):
        x = self.blocks(self.stem_norm(self.stem(x)))
        return self.fc(self.pool(torch.relu(self.head_norm(x))).flatten(1))


class CNN1d(nn.Module):
    """MNIST-1D CNN. x: (N, C, L) -> logits (N, num_classes)."""

    SPECS = ((5, 2, 1), (3, 2, 1), (3, 2, 1))  # (kernel, stride, padding)

    def __init__(self, layers: LayerFactory, in_channels=1, num_classes=10, length=40, width=1.0, channels=25):
        super().__init__()
        c = _ch(channels, width)
        blocks, cin = [], in_channels
        for k, s, p in self.SPECS:
            blocks.append(ConvNormAct(layers, cin, c, k, stride=s, padding=p))
            cin = c
        self.features = nn.Sequential(*blocks)
        self.fc = nn.Linear(c * self.out_length(length), num_classes)

    @classmethod
    def out_length(cls, length: int) -> int:
        for k, s, p in cls.SPECS:
            length = (length + 2 * p - k) // s + 1
        return length

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


def _spatial(name: str, input_shape, in_channels: int) -> tuple[int, ...]:
    """Spatial size from ``input_shape``: (C, *spatial) or just the spatial part."""
    ndim = MODEL_DIMS[name]
    shape = tuple(int(s) for s in input_shape)
    if len(shape) == ndim + 1:
        if shape[0] != in_channels:
            raise UsageError(
                f"build_model({name!r}): input_shape {shape} has {shape[0]} channels but in_channels={in_channels}"
            )
        shape = shape[1:]
    if len(shape) != ndim:
        raise UsageError(
            f"build_model({name!r}): expected input_shape (C, {'L' if ndim == 1 else 'H, W'}) or its spatial "
            f"part for a {ndim}-D model, got {tuple(input_shape)}"
        )
    if min(shape) < 1:
        raise UsageError(f"build_model({name!r}): input_shape {tuple(input_shape)} has an empty dimension")
    return shape


def _check_size(name: str, spatial: tuple[int, ...]) -> None:
    if name in ("plain", "plain1d") and min(spatial) < PlainNet.MIN_SIZE:
        raise UsageError(
            f"build_model({name!r}): input {'x'.join(map(str, spatial))} is too small for the plain net (two 2x "
            f"max-pools then a valid 3-conv need at least {PlainNet.MIN_SIZE})"
        )
    if name == "cnn1d" and CNN1d.out_length(spatial[0]) < 1:
        raise UsageError(
            f"build_model('cnn1d'): input length {spatial[0]} is too small (the three strided convs leave nothing)"
        )


def _check_args(name, norm, conv, in_channels, num_classes, width, kw) -> None:
    if name not in MODELS:
        raise UsageError(f"build_model: unknown model {name!r}; valid names: {', '.join(MODELS)}")
    if norm not in NORM_NAMES:
        raise UsageError(f"build_model({name!r}): unknown norm {norm!r}; valid names: {', '.join(NORM_NAMES)}")
    if conv not in CONV_KINDS:
        raise UsageError(f"build_model({name!r}): unknown conv {conv!r}; valid kinds: {', '.join(CONV_KINDS)}")
    expected = number_problem(width, low=0, high=MAX_WIDTH, low_open=True)
    if expected is not None:
        raise UsageError(f"build_model({name!r}): width must be {expected}, got {width!r}")
    if int(in_channels) < 1 or int(num_classes) < 1:
        raise UsageError(f"build_model({name!r}): in_channels and num_classes must be >= 1")
    unknown = set(kw) - _MODEL_KWARGS.get(name, set())
    if unknown:
        raise UsageError(
            f"build_model({name!r}): unexpected keyword(s) {sorted(unknown)}; "
            f"allowed: {sorted(_MODEL_KWARGS.get(name, set()))}"
        )
    if "blocks" in kw and int(kw["blocks"]) < 1:
        raise UsageError(f"build_model({name!r}): blocks must be >= 1, got {kw['blocks']}")
    if name == "resnet_pws" and norm not in ("none", "ln"):
        raise UsageError(
            f"build_model('resnet_pws'): the official PWS layout has fixed GroupNorm(1) layers; norm "
            f"must be 'none' or 'ln', got {norm!r}"
        )


def build_model(
    name: str,
    norm: str = "bn",
    conv: str = "conv",
    in_channels: int = 3,
    num_classes: int = 10,
    input_shape=(3, 32, 32),
    width: float = 1.0,
    norm_kwargs: dict | None = None,
    conv_kwargs: dict | None = None,
    **kw,
) -> nn.Module:
    """Build a model by name (:data:`MODELS`) with He init.

    Args:
        name: ``plain``, ``plain1d``, ``resnet``, ``resnet_pws`` or ``cnn1d``.
        norm, conv: layer names of :func:`normlab.nn.create_norm` and :func:`normlab.nn.create_conv` (``resnet_pws``
            takes norm ``none`` or ``ln``).
        in_channels, num_classes: input channels and classes.
        input_shape: per-sample shape (C, H, W) / (C, L), or only its spatial part.
        width: channel multiplier in (0, :data:`MAX_WIDTH`].
        norm_kwargs, conv_kwargs: extra constructor arguments for every norm / conv of the chosen kinds (e.g.
            ``{"schedule": RenormSchedule(...)}`` for brn, ``{"gamma": 1e-2}`` for pws).
        **kw: ``blocks`` (resnet, resnet_pws; default 6), ``channels`` (cnn1d; default 25).

    Raises:
        UsageError: one line, for unknown names and impossible combinations.

    Example:
        >>> net = build_model("plain1d", "bn", "conv", in_channels=1, num_classes=10, input_shape=(1, 40), width=0.5)
        >>> net(torch.randn(4, 1, 40)).shape
        torch.Size([4, 10])
    """
    _check_args(name, norm, conv, in_channels, num_classes, width, kw)
    spatial = _spatial(name, input_shape, in_channels)
    _check_size(name, spatial)
    layers = LayerFactory(norm, conv, MODEL_DIMS[name], dict(norm_kwargs or {}), dict(conv_kwargs or {}))
    if name == "cnn1d":
        model = CNN1d(layers, in_channels, num_classes, length=spatial[0], width=width, **kw)
    elif name in ("plain", "plain1d"):
        model = PlainNet(layers, in_channels, num_classes, width)
    elif name == "resnet":
        model = PreActResNet(layers, in_channels, num_classes, width, **kw)
    else:
        model = PWSResNet(layers, in_channels, num_classes, width, **kw)
    return he_init_(model)
