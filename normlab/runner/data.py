"""Data sets that work offline: ``digits`` (default), ``mnist1d`` and ``cifar10``.

``get_dataset(name, data_dir=None, download=False) -> (train_ds, test_ds, info)``

All three live in memory as tensors inside an :class:`ArrayDataset`. The training loop asks for whole
batches with :meth:`ArrayDataset.batch` (fast: no per-sample Python calls) and passes a ``torch.Generator``
so that augmentation is reproducible; ``__getitem__`` is also there for ``torch.utils.data`` users.

- ``digits``: scikit-learn's bundled 8x8 handwritten digits (1,797 images). A fixed stratified split
  (seed 0): 1,437 train / 360 test. Pixels (0..16) are scaled to [0, 1] and standardised with the
  training mean and std. Each image is upsampled to 16x16 by nearest neighbour (every pixel becomes a
  2x2 block): the paper's plain net needs at least 12x12 (two 2x2 max-pools, then a valid 3x3 conv).
- ``mnist1d``: generated locally with ``mnist1d.data.make_dataset(get_dataset_args())`` (4,000 train /
  1,000 test, length 40, shape (1, 40)); the arrays are cached in ``data_dir`` when given.
- ``cifar10``: the standard python pickle batches (``cifar-10-batches-py/data_batch_1..5``,
  ``test_batch``) from ``data_dir``; ``download=True`` fetches the official tarball and checks its md5.
  Training batches are augmented with a random horizontal flip and a random 32x32 crop of the image
  zero-padded by 4 (done in torch).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .errors import UsageError

DATASET_CLASSES = {"digits": 10, "mnist1d": 10, "cifar10": 10}  # number of classes of each data set
DATASETS = tuple(DATASET_CLASSES)

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR10_DIRNAME = "cifar-10-batches-py"
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_FILE = "test_batch"
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
# Per-channel statistics of the CIFAR-10 training set (pixels scaled to [0, 1]).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


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


def get_dataset(name: str = "digits", data_dir: str | os.PathLike | None = None, download: bool = False):
    """Load a data set by name: returns ``(train_ds, test_ds, info)``.

    info: dict with ``name``, ``in_channels``, ``num_classes``, ``input_shape`` (per-sample shape without
    the batch dimension, channels first, e.g. (1, 16, 16)), ``num_train``, ``num_test``, ``classes``
    and ``description``.
    """
    if name not in DATASETS:
        raise UsageError(f"get_dataset: unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")
    if name == "digits":
        train_ds, test_ds, desc = _digits()
        classes = tuple(str(i) for i in range(10))
    elif name == "mnist1d":
        train_ds, test_ds, desc = _mnist1d(data_dir)
        classes = tuple(str(i) for i in range(10))
    else:
        train_ds, test_ds, desc = _cifar10(data_dir, download)
        classes = CIFAR10_CLASSES
    input_shape = tuple(train_ds.x.shape[1:])
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


def _digits():
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

    train = ArrayDataset(prep(x_tr), torch.from_numpy(y_tr))
    test = ArrayDataset(prep(x_te), torch.from_numpy(y_te))
    desc = "sklearn digits, 8x8 upsampled to 16x16 (nearest), standardised; stratified split seed 0"
    return train, test, desc


def _mnist1d(data_dir):
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("get_dataset('mnist1d'): needs the 'mnist1d' package (pip install mnist1d)") from e
    args = get_dataset_args()
    key = hashlib.md5(repr(sorted(vars(args).items())).encode()).hexdigest()[:10]
    cache = Path(data_dir) / f"mnist1d_{key}.npz" if data_dir is not None else None
    arrays = None
    if cache is not None and cache.exists():
        try:
            with np.load(cache) as z:
                arrays = {k: z[k] for k in ("x", "y", "x_test", "y_test")}
        except Exception as e:
            raise ValueError(f"get_dataset('mnist1d'): cache file {cache} is corrupt ({e}); delete it") from e
    if arrays is None:
        # make_dataset seeds numpy's and python's global RNGs; restore them so callers are unaffected.
        import random

        np_state, py_state = np.random.get_state(), random.getstate()
        try:
            d = make_dataset(args)
        finally:
            np.random.set_state(np_state)
            random.setstate(py_state)
        arrays = {k: np.asarray(d[k]) for k in ("x", "y", "x_test", "y_test")}
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cache.parent, suffix=".npz")
            os.close(fd)
            np.savez(tmp, **arrays)
            os.replace(tmp, cache)

    def mk(x, y):
        return ArrayDataset(torch.from_numpy(x.astype(np.float32)).unsqueeze(1), torch.from_numpy(y.astype(np.int64)))

    desc = "MNIST-1D generated locally with make_dataset(get_dataset_args()), length 40"
    return mk(arrays["x"], arrays["y"]), mk(arrays["x_test"], arrays["y_test"]), desc


def _md5(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_cifar10(data_dir: str | os.PathLike) -> Path:
    """Fetch the official CIFAR-10 python tarball into ``data_dir``, verify its md5 and extract it."""
    root = Path(data_dir)
    root.mkdir(parents=True, exist_ok=True)
    tar_path = root / "cifar-10-python.tar.gz"
    if not tar_path.exists() or _md5(tar_path) != CIFAR10_MD5:
        tmp = tar_path.with_suffix(".part")
        try:
            urllib.request.urlretrieve(CIFAR10_URL, tmp)
        except OSError as e:
            raise RuntimeError(f"get_dataset('cifar10'): download of {CIFAR10_URL} failed: {e}") from e
        os.replace(tmp, tar_path)
    digest = _md5(tar_path)
    if digest != CIFAR10_MD5:
        raise ValueError(f"get_dataset('cifar10'): md5 of {tar_path} is {digest}, expected {CIFAR10_MD5}")
    with tarfile.open(tar_path, "r:gz") as tf:
        members = [m for m in tf.getmembers() if m.name.startswith(CIFAR10_DIRNAME + "/") and m.isfile()]
        try:
            tf.extractall(root, members=members, filter="data")  # refuse links/absolute paths (py >= 3.11.4)
        except TypeError:  # pragma: no cover - older Pythons without extraction filters
            tf.extractall(root, members=members)
    return root / CIFAR10_DIRNAME


def _find_cifar_dir(data_dir) -> Path:
    root = Path(data_dir)
    if (root / CIFAR10_TEST_FILE).exists():
        return root
    return root / CIFAR10_DIRNAME


def _read_cifar_batch(path: Path):
    if not path.exists():
        raise FileNotFoundError(
            f"get_dataset('cifar10'): missing file {path}; expected the python batches "
            f"({', '.join(CIFAR10_TRAIN_FILES)}, {CIFAR10_TEST_FILE}); use download=True (CLI --download)"
        )
    try:
        with open(path, "rb") as f:
            d = pickle.load(f, encoding="bytes")
        data = np.asarray(d[b"data"], dtype=np.uint8)
        labels = np.asarray(d[b"labels"], dtype=np.int64)
        if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or labels.shape != (data.shape[0],):
            raise ValueError(f"data shape {data.shape}, labels shape {labels.shape}")
        if labels.size and (labels.min() < 0 or labels.max() > 9):
            raise ValueError("labels outside 0..9")
    except Exception as e:
        raise ValueError(
            f"get_dataset('cifar10'): file {path} is corrupt or not a CIFAR-10 python batch ({e})"
        ) from e
    return data.reshape(-1, 3, 32, 32), labels


def _cifar10(data_dir, download):
    if data_dir is None:
        raise UsageError("get_dataset('cifar10'): data_dir is required (directory holding cifar-10-batches-py)")
    if download:
        download_cifar10(data_dir)
    d = _find_cifar_dir(data_dir)
    parts = [_read_cifar_batch(d / f) for f in CIFAR10_TRAIN_FILES]
    x_tr = np.concatenate([p[0] for p in parts])
    y_tr = np.concatenate([p[1] for p in parts])
    x_te, y_te = _read_cifar_batch(d / CIFAR10_TEST_FILE)
    train = ArrayDataset(torch.from_numpy(x_tr), torch.from_numpy(y_tr), CIFAR10_MEAN, CIFAR10_STD, augment=True)
    test = ArrayDataset(torch.from_numpy(x_te), torch.from_numpy(y_te), CIFAR10_MEAN, CIFAR10_STD)
    desc = f"CIFAR-10 python batches from {d}; train: random flip + pad-4 crop"
    return train, test, desc
