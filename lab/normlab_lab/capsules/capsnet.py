"""CapsNet models for the routing experiment (Sabour, Frosst, Hinton 2017; docs/design.md section 6).

``build_capsnet(preset, iterations=3, detach_inner=False, reconstruction=True, **overrides) -> CapsNet``

A :class:`CapsNet` is a conv stem (ReLU) -> :class:`~normlab.nn.PrimaryCapsules` (squashed) ->
:class:`~normlab.nn.RoutingCapsules` (one 16-D capsule per class, dynamic routing) -> capsule lengths, plus the
paper's masked reconstruction decoder (fully connected, ReLU, ReLU, sigmoid). Presets (:data:`CAPSNET_PRESETS`):

- ``mnist``: the paper's configuration: 28x28 input, conv 256 9x9, primary capsules 32 x 8D 9x9 stride 2 (1152
  capsules), 10 x 16D digit capsules, decoder 512-1024-784 (8.2 M parameters; built and stepped on random input
  in the tests, not trained here).
- ``digits``: sized for the bundled 16x16 digits: conv 64 5x5, primary capsules 8 x 8D 5x5 stride 2 (4x4 grid:
  128 capsules), 10 x 16D, decoder 256-512-256.
- ``mnist1d``: the same with 1-D convolutions for MNIST-1D (length 40): conv 64 k5, primary 8 x 8D k5 stride 2
  (16 positions: 128 capsules), decoder 256-512-40. The primary capsules are a
  :class:`~normlab.nn.PrimaryCapsules` with a (k, 1) kernel on the signal viewed as (N, C, L, 1): a 1-D conv.

Loss (:meth:`CapsNet.loss`): margin loss (m+ 0.9, m- 0.1, lambda 0.5, summed over classes, mean over the batch)
plus, with ``reconstruction=True``, ``0.0005 * sum over pixels (decoder(x) - target(x))^2`` (mean over the batch;
naturomics' ``0.0005 * 784 * mean`` is the same number on MNIST). The target is the input mapped linearly to
[0, 1] with the data set's range (``target_range``), since the decoder ends in a sigmoid.
The decoder reads the digit capsules masked to one capsule: the **true label's** in training mode (a target is
then required) and the **longest** capsule's in eval mode (the paper's test-time reconstruction).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from normlab.nn import PrimaryCapsules, RoutingCapsules, margin_loss
from normlab.runner.errors import UsageError

__all__ = ["CapsNet", "CapsNetSpec", "CapsNetOutput", "CAPSNET_PRESETS", "build_capsnet", "RECON_SCALE"]

RECON_SCALE = 0.0005  # the paper's weight of the sum-squared reconstruction error


@dataclass(frozen=True)
class CapsNetSpec:
    """The architecture of a :class:`CapsNet` (everything except the routing options).

    ``input_shape`` is (C, H, W) for 2-D or (C, L) for 1-D convolutions; ``target_range`` = (lo, hi) maps an input
    linearly onto the decoder's [0, 1] target.
    """

    input_shape: tuple[int, ...] = (1, 28, 28)
    num_classes: int = 10
    stem_channels: int = 256
    stem_kernel: int = 9
    primary_types: int = 32
    primary_dim: int = 8
    primary_kernel: int = 9
    primary_stride: int = 2
    digit_dim: int = 16
    decoder_hidden: tuple[int, ...] = (512, 1024)
    target_range: tuple[float, float] = (0.0, 1.0)

    @property
    def conv_dim(self) -> int:
        return len(self.input_shape) - 1

    def primary_grid(self) -> tuple[int, ...]:
        """Spatial size of the primary capsule grid (valid convolutions)."""
        out = []
        for n in self.input_shape[1:]:
            n = n - self.stem_kernel + 1
            out.append((n - self.primary_kernel) // self.primary_stride + 1)
        return tuple(out)

    @property
    def num_primary(self) -> int:
        return self.primary_types * math.prod(self.primary_grid())


CAPSNET_PRESETS = {
    "mnist": CapsNetSpec(),
    "digits": CapsNetSpec(
        input_shape=(1, 16, 16),
        stem_channels=64,
        stem_kernel=5,
        primary_types=8,
        primary_kernel=5,
        decoder_hidden=(256, 512),
    ),
    "mnist1d": CapsNetSpec(
        input_shape=(1, 40),
        stem_channels=64,
        stem_kernel=5,
        primary_types=8,
        primary_kernel=5,
        decoder_hidden=(256, 512),
    ),
}


class CapsNetOutput(NamedTuple):
    """``lengths`` (N, K) capsule lengths; ``capsules`` (N, K, D); ``coupling`` (N, in_caps, K) of the last
    routing iteration; ``reconstruction`` (N, *input_shape) in [0, 1] or None without a decoder."""

    lengths: Tensor
    capsules: Tensor
    coupling: Tensor
    reconstruction: Tensor | None


class CapsNet(nn.Module):
    """Capsule network with dynamic routing and an optional masked reconstruction decoder.

    ``v = RoutingCapsules(PrimaryCapsules(relu(conv(x))))``, class scores ``|v_k|``; decoder input
    ``v * onehot(mask)`` flattened, ``mask`` = true label (training) or ``argmax_k |v_k|`` (eval).

    Args:
        spec: the architecture (:class:`CapsNetSpec`).
        iterations: routing iterations r >= 1.
        detach_inner: naturomics' stop_gradient: the inner routing iterations see ``u_hat.detach()``.
        reconstruction: build the decoder and add its loss.

    Shape:
        x (N, *spec.input_shape) -> :class:`CapsNetOutput`.

    Example:
        >>> net = CapsNet(CAPSNET_PRESETS["digits"], iterations=3)
        >>> x, y = torch.rand(4, 1, 16, 16), torch.tensor([0, 1, 2, 3])
        >>> out = net(x, y)  # training mode: the decoder reads the capsule of the true class
        >>> loss, parts = net.loss(out, x, y)  # margin + 0.0005 * SSE
    """

    def __init__(
        self, spec: CapsNetSpec, iterations: int = 3, detach_inner: bool = False, reconstruction: bool = True
    ) -> None:
        super().__init__()
        self.spec = spec
        c_in, conv = spec.input_shape[0], (nn.Conv1d if spec.conv_dim == 1 else nn.Conv2d)
        self.stem = conv(c_in, spec.stem_channels, spec.stem_kernel)
        k, s = spec.primary_kernel, spec.primary_stride
        self.primary = PrimaryCapsules(
            spec.stem_channels,
            spec.primary_types,
            spec.primary_dim,
            kernel_size=(k, 1) if spec.conv_dim == 1 else k,
            stride=(s, 1) if spec.conv_dim == 1 else s,
        )
        self.digits = RoutingCapsules(
            spec.num_primary,
            spec.primary_dim,
            spec.num_classes,
            spec.digit_dim,
            iterations=iterations,
            detach_inner=detach_inner,
        )
        self.decoder = self._decoder(spec) if reconstruction else None
        lo, hi = spec.target_range
        self.register_buffer("target_lo", torch.tensor(float(lo)), persistent=False)
        self.register_buffer("target_scale", torch.tensor(1.0 / (float(hi) - float(lo))), persistent=False)

    @staticmethod
    def _decoder(spec: CapsNetSpec) -> nn.Sequential:
        sizes = (spec.num_classes * spec.digit_dim, *spec.decoder_hidden)
        layers: list[nn.Module] = []
        for a, b in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(sizes[-1], math.prod(spec.input_shape)), nn.Sigmoid())

    def primary_capsules(self, x: Tensor) -> Tensor:
        """x (N, *input_shape) -> primary capsules u (N, num_primary, primary_dim)."""
        h = F.relu(self.stem(x))
        return self.primary(h.unsqueeze(-1) if self.spec.conv_dim == 1 else h)

    def mask(self, capsules: Tensor, labels: Tensor) -> Tensor:
        """Keep capsule ``labels[n]`` of each example, zero the others: (N, K, D) -> (N, K * D)."""
        onehot = F.one_hot(labels, self.spec.num_classes).to(capsules.dtype)
        return (capsules * onehot.unsqueeze(-1)).flatten(1)

    def forward(self, x: Tensor, target: Tensor | None = None) -> CapsNetOutput:
        v, c = self.digits(self.primary_capsules(x), return_coupling=True)
        lengths = v.norm(dim=-1)
        recon = None
        if self.decoder is not None:
            if self.training and target is None:
                raise ValueError("CapsNet: training with reconstruction needs the target labels (masking)")
            labels = target if self.training else lengths.detach().argmax(1)
            recon = self.decoder(self.mask(v, labels)).view(x.shape)
        return CapsNetOutput(lengths, v, c, recon)

    def recon_target(self, x: Tensor) -> Tensor:
        """The input mapped onto the decoder's [0, 1] range."""
        return (x - self.target_lo) * self.target_scale

    def loss(self, out: CapsNetOutput, x: Tensor, target: Tensor) -> tuple[Tensor, dict[str, float]]:
        """``margin + 0.0005 * mean_n sum_pixels (recon - target(x))^2``; returns (total, {margin, recon})."""
        margin = margin_loss(out.lengths, target)
        if out.reconstruction is None:
            return margin, {"margin": margin.item(), "recon": 0.0}
        sse = (out.reconstruction - self.recon_target(x)).square().flatten(1).sum(1).mean()
        return margin + RECON_SCALE * sse, {"margin": margin.item(), "recon": sse.item()}


def build_capsnet(
    preset: str, iterations: int = 3, detach_inner: bool = False, reconstruction: bool = True, **overrides
) -> CapsNet:
    """A :class:`CapsNet` from a preset of :data:`CAPSNET_PRESETS` with some spec fields replaced.

    Raises:
        UsageError: unknown preset or field, iterations < 1, an input too small for the convolutions.

    Example:
        >>> build_capsnet("mnist", iterations=1).spec.num_primary
        1152
    """
    if preset not in CAPSNET_PRESETS:
        raise UsageError(f"build_capsnet: unknown preset {preset!r}; valid names: {', '.join(CAPSNET_PRESETS)}")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise UsageError(f"build_capsnet: routing iterations must be integers >= 1, got {iterations!r}")
    fields = {f.name for f in dataclasses.fields(CapsNetSpec)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise UsageError(f"build_capsnet: unknown spec field(s) {unknown}; valid: {', '.join(sorted(fields))}")
    spec = dataclasses.replace(CAPSNET_PRESETS[preset], **overrides)
    if min(spec.primary_grid()) < 1:
        raise UsageError(
            f"build_capsnet({preset!r}): input {spec.input_shape} is too small for the stem "
            f"({spec.stem_kernel}) and primary ({spec.primary_kernel}) kernels"
        )
    return CapsNet(spec, iterations=iterations, detach_inner=detach_inner, reconstruction=reconstruction)
