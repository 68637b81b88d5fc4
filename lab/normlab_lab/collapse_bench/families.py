"""The collapse benchmark's round-4 families: models, data and losses that no rule of the monitor was tuned on.

Calibration family added in round 4 (beside the round-1-3 set-ups, :mod:`~normlab_lab.collapse_bench.setups`):

- ``mlp_reg``: the 5-layer ReLU MLP (width 128, He init) regressing the disease progression of sklearn's diabetes
  data (10 standardized features, standardized target, mean squared error).

Held-out families (report only; lab/docs/monitor_benchmark.md, round 4), each under SGD (momentum 0.9) and AdamW:

- ``vit``: a small vision transformer on the digits: 4x4 patches (a strided conv), 16 tokens, d 32, 2 pre-LN
  blocks of 4 heads (no causal mask), final LayerNorm, mean over the tokens, linear head; init std 0.02;
- ``gru``: a character-level GRU language model on the repository's text: embedding 32, one ``nn.GRU`` layer of
  64, a readout MLP (linear 64-128, GELU, linear 128-96); torch's default init;
- ``unet``: a U-Net without normalization that denoises the digits (input: the image plus Gaussian noise of std
  0.5; target: the image; mean squared error): two 3x3 convs of 16, max-pool, two of 32, a transposed conv back,
  the skip concatenated, a 3x3 conv of 16 and a 1x1 conv to one channel; He init;
- ``resmlp_ln``: a residual MLP with pre-LayerNorm blocks on the flattened digits: linear 256-128, 3 blocks
  ``x + fc2(GELU(fc1(LN(x))))`` of hidden width 256, final LayerNorm, linear head; torch's default init.

The *chance loss* of a regression (the collapse label's reference) is the mean squared error of the best constant
prediction, the targets' variance per output (1 for the standardized diabetes target; the mean per-pixel variance of
the digits for the U-Net); of a classifier ``ln C``; of the language model ``ln V``.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GRU_CONTEXT",
    "NOISE",
    "diabetes",
    "Block",
    "TinyViT",
    "GRULM",
    "TinyUNet",
    "res_mlp_ln",
    "mse",
    "regression_chance",
]

GRU_CONTEXT = 32  # characters per sequence of the GRU language model
NOISE = 0.5  # std of the Gaussian noise the U-Net removes


@lru_cache(maxsize=1)
def diabetes() -> tuple[torch.Tensor, torch.Tensor]:
    """sklearn's bundled diabetes data, features and target each standardized: ``(x (442, 10), y (442, 1))``."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)[:, None]
    return (x - x.mean(0)) / x.std(0), (y - y.mean()) / y.std()


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error over every entry."""
    return F.mse_loss(out, y)


class Block(nn.Module):
    """A pre-LN transformer block: x + attn(LN(x)), then x + MLP(LN(x)); attention through SDPA, causal (a language
    model's, the default) or not (a ViT's)."""

    def __init__(self, d: int, heads: int, causal: bool = True) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyViT(nn.Module):
    """A small ViT for 1x16x16 images: 4x4 patch embedding, learned positions, pre-LN blocks, mean pooling."""

    def __init__(self, d: int = 32, layers: int = 2, heads: int = 4, patch: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Conv2d(1, d, patch, stride=patch)
        self.pos = nn.Parameter(torch.zeros(1, (16 // patch) ** 2, d))
        self.blocks = nn.Sequential(*[Block(d, heads, causal=False) for _ in range(layers)])
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, classes)
        nn.init.normal_(self.pos, std=0.02)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        return self.head(self.ln_f(self.blocks(x)).mean(1))


class GRULM(nn.Module):
    """A character GRU language model: embedding, one GRU layer, a readout MLP to the vocabulary."""

    def __init__(self, vocab: int, d: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = nn.GRU(d, hidden, batch_first=True)
        self.fc, self.head = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(idx))
        return self.head(F.gelu(self.fc(h)))


class TinyUNet(nn.Module):
    """A one-level U-Net without normalization for 1x16x16 images (He init)."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.e1, self.e2 = nn.Conv2d(1, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)
        self.m1, self.m2 = nn.Conv2d(c, 2 * c, 3, padding=1), nn.Conv2d(2 * c, 2 * c, 3, padding=1)
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.d1, self.out = nn.Conv2d(2 * c, c, 3, padding=1), nn.Conv2d(c, 1, 1)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = F.relu(self.e2(F.relu(self.e1(x))))
        mid = F.relu(self.m2(F.relu(self.m1(F.max_pool2d(skip, 2)))))
        return self.out(F.relu(self.d1(torch.cat([self.up(mid), skip], 1))))


class _LNBlock(nn.Module):
    """x + fc2(GELU(fc1(LN(x))))."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def res_mlp_ln(d_in: int = 256, d: int = 128, hidden: int = 256, blocks: int = 3, classes: int = 10) -> nn.Module:
    """A residual MLP with pre-LayerNorm blocks (torch's default init)."""
    return nn.Sequential(
        nn.Linear(d_in, d), *[_LNBlock(d, hidden) for _ in range(blocks)], nn.LayerNorm(d), nn.Linear(d, classes)
    )


def regression_chance(y: torch.Tensor) -> float:
    """The mean squared error of the best constant prediction: the targets' variance per entry, averaged.

    Example:
        >>> regression_chance(torch.tensor([[1.0], [-1.0]]))
        1.0
    """
    return float(y.flatten(1).var(0, unbiased=False).mean())
