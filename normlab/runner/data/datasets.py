"""Data sets that work offline: ``digits`` (default), ``mnist1d`` and ``cifar10``.

``get_dataset(name, data_dir=None, download=False, num_samples=None, num_train=None) -> (train, test, info)``

All three live in memory as tensors inside an :class:`ArrayDataset`; the training loop asks for whole batches
with :meth:`ArrayDataset.batch` and passes a ``torch.Generator`` so that augmentation is reproducible.

- ``digits``: scikit-learn's bundled 8x8 handwritten digits (1,797 images), a fixed stratified split (seed 0) of
  1,437 train / 360 test, standardised with the training mean and std and upsampled to 16x16 by nearest
  neighbour (the paper's plain net needs at least 12x12).
- ``mnist1d``: MNIST-1D generated locally (:mod:`normlab.runner.data.mnist1d`), ``num_samples`` in all (default
  25,000: 20,000 train / 5,000 test), shape (1, 40), cached in ``data_dir``.
- ``cifar10``: the python batches in ``data_dir`` (:mod:`normlab.runner.data.cifar10`); ``download=True`` fetches the
  official tarball. Training batches are augmented with a random flip and a random crop of the image padded by 4.

``num_train`` keeps only the first ``num_train`` training samples (the test set is unchanged).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from normlab._checks import number_problem
from normlab.runner.errors import FieldError, UsageError

from . import cifar10, mnist1d

__all__ = [
    "DATASETS",
    "DATASET_CLASSES",
    "DATASET_DIMS",
    "DATASET_SIZES",
    "INPUT_SHAPES",
    "ArrayDataset",
    "flip_crop",
    "get_dataset",
]

#: The number of classes of each data set.
DATASET_CLASSES = {"digits": 10, "mnist1d": 10, "cifar10": 10}
#: The spatial dimensions of a sample of each data set (1 for a sequence, 2 for an image).
DATASET_DIMS = {"digits": 2, "mnist1d": 1, "cifar10": 2}
#: The shape of one sample of each data set, channels first.
INPUT_SHAPES = {"digits": (1, 16, 16), "mnist1d": (1, 40), "cifar10": (3, 32, 32)}
#: The training and test sizes of the data sets whose size is fixed (mnist1d has ``num_samples``, split 80/20).
DATASET_SIZES = {"digits": (1437, 360), "cifar10": (50_000, 10_000)}
#: The names :func:`get_dataset` takes.
DATASETS = tuple(DATASET_CLASSES)


def flip_crop(x: torch.Tensor, generator: torch.Generator | None = None, pad: int = 4) -> torch.Tensor:
    """Random horizontal flip and random crop of the zero-padded image, per sample.

    x: (N, C, H, W) float; returns (N, C, H, W). Randomness comes only from ``generator``.
    """
    if x.dim() != 4:
        raise ValueError(f"flip_crop: expected 4D input (N, C, H, W), got {x.dim()}D")
    n, _, h, w = x.shape
    flip = torch.rand(n, generator=generator) < 0.5
    x = torch.where(flip.view(n, 1, 1, 1), x.flip(3), x)
    xp = F.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    dx = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    rows = (dy.view(n, 1) + torch.arange(h).view(1, h)).view(n, 1, h, 1).expand(n, x.shape[1], h, w + 2 * pad)
    xp = xp.gather(2, rows)
    cols = (dx.view(n, 1) + torch.arange(w).view(1, w)).view(n, 1, 1, w).expand(n, x.shape[1], h, w)
    return xp.gather(3, cols)


@dataclass(eq=False)
class ArrayDataset(torch.utils.data.Dataset):
    """An in-memory labelled data set.

    x: (N, C, *spatial), float32 (already normalised) or uint8 (normalised on access with mean/std,
    after scaling to [0, 1]); y: (N,) int64. ``augment=True`` applies :func:`flip_crop` in :meth:`batch`
    when a generator is given (training).
    """

    x: torch.Tensor
    y: torch.Tensor
    mean: tuple | None = None
    std: tuple | None = None
    augment: bool = False

    def __post_init__(self):
        if self.x.shape[0] != self.y.shape[0]:
            raise ValueError(f"ArrayDataset: x has {self.x.shape[0]} samples but y has {self.y.shape[0]}")

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.uint8:
            x = x.float().div_(255.0)
        if self.mean is not None:
            shape = (1, -1) + (1,) * (x.dim() - 2)
            x = (x - torch.tensor(self.mean).view(shape)) / torch.tensor(self.std).view(shape)
        return x

    def batch(self, idx: torch.Tensor, generator: torch.Generator | None = None):
        """Return (x, y) for the sample indices ``idx`` (1D int64): x (B, C, *spatial) float32, y (B,).

        Augmentation (if enabled) is applied only when ``generator`` is given.
        """
        x = self._prepare(self.x[idx])
        if self.augment and generator is not None:
            x = flip_crop(x, generator)
        return x, self.y[idx]

    def __getitem__(self, i: int):
        x = self._prepare(self.x[i : i + 1])[0]
        return x, self.y[i]


def _digits() -> tuple[ArrayDataset, ArrayDataset, str]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = d.images.astype(np.float32) / 16.0  # (1797, 8, 8)
    y = d.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=360, stratify=y, random_state=0)
    mean, std = float(x_tr.mean()), float(x_tr.std())

    def prep(a):
        t = torch.from_numpy((a - mean) / std).unsqueeze(1)  # (N, 1, 8, 8)
        return t.repeat_interleave(2, dim=2).repeat_interleave(2, dim=3).contiguous()  # (N, 1, 16, 16)

    desc = "sklearn digits, 8x8 upsampled to 16x16 (nearest), standardised; stratified split seed 0"
    return ArrayDataset(prep(x_tr), torch.from_numpy(y_tr)), ArrayDataset(prep(x_te), torch.from_numpy(y_te)), desc


def _mnist1d(data_dir, num_samples: int | None) -> tuple[ArrayDataset, ArrayDataset, str]:
    n = mnist1d.DEFAULT_SAMPLES if num_samples is None else num_samples
    a = mnist1d.load_mnist1d(n, data_dir)

    def mk(x, y):
        return ArrayDataset(torch.from_numpy(x).unsqueeze(1), torch.from_numpy(y))

    desc = f"MNIST-1D generated locally ({len(a['y'])} train / {len(a['y_test'])} test, length 40)"
    return mk(a["x"], a["y"]), mk(a["x_test"], a["y_test"]), desc


def _cifar10(data_dir, download: bool) -> tuple[ArrayDataset, ArrayDataset, str]:
    x_tr, y_tr, x_te, y_te = cifar10.load_cifar10(data_dir, download)
    mean, std = cifar10.CIFAR10_MEAN, cifar10.CIFAR10_STD
    train = ArrayDataset(torch.from_numpy(x_tr), torch.from_numpy(y_tr), mean, std, augment=True)
    test = ArrayDataset(torch.from_numpy(x_te), torch.from_numpy(y_te), mean, std)
    return train, test, f"CIFAR-10 python batches from {data_dir}; train: random flip + pad-4 crop"


def get_dataset(
    name: str = "digits",
    data_dir: str | os.PathLike | None = None,
    download: bool = False,
    num_samples: int | None = None,
    num_train: int | None = None,
):
    """Load a data set by name: returns ``(train_ds, test_ds, info)``.

    Args:
        name: ``digits``, ``mnist1d`` or ``cifar10``.
        data_dir: cifar10: the directory holding the python batches; mnist1d: where the generated arrays are cached.
        download: cifar10 only: fetch the official tarball into ``data_dir`` first.
        num_samples: mnist1d only: samples to generate (train + test, 80/20; default 25,000).
        num_train: keep only the first ``num_train`` training samples.

    Returns:
        ``info`` holds ``name``, ``in_channels``, ``num_classes``, ``input_shape`` (per sample, channels first),
        ``num_train``, ``num_test``, ``classes`` and ``description``.
    """
    if name not in DATASETS:
        raise UsageError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")
    if num_samples is not None and name != "mnist1d":
        raise UsageError(f"num_samples applies to generated data sets (mnist1d), not to {name}")
    if name == "digits":
        train_ds, test_ds, desc = _digits()
    elif name == "mnist1d":
        train_ds, test_ds, desc = _mnist1d(data_dir, num_samples)
    else:
        train_ds, test_ds, desc = _cifar10(data_dir, download)
    if num_train is not None:
        expected = number_problem(num_train, integer=True, low=1, high=len(train_ds))
        if expected is not None:
            raise FieldError(
                "get_dataset", "num_train", f"expected {expected} (the {name} training set), got {num_train!r}"
            )
        train_ds = ArrayDataset(
            train_ds.x[:num_train], train_ds.y[:num_train], train_ds.mean, train_ds.std, train_ds.augment
        )
    input_shape = tuple(train_ds.x.shape[1:])
    classes = cifar10.CIFAR10_CLASSES if name == "cifar10" else tuple(str(i) for i in range(10))
    info = {
        "name": name,
        "in_channels": input_shape[0],
        "num_classes": len(classes),
        "input_shape": input_shape,
        "num_train": len(train_ds),
        "num_test": len(test_ds),
        "classes": classes,
        "description": desc,
    }
    return train_ds, test_ds, info
