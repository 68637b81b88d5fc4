"""CIFAR-10 from its python batches, read with an unpickler that only rebuilds plain arrays.

The python batches (``cifar-10-batches-py/data_batch_1..5``, ``test_batch``) are pickles, and an ordinary
``pickle.load`` of a crafted file runs arbitrary code. :func:`read_batch` uses an unpickler, which
builds only dicts, lists, bytes/str/numbers and numpy arrays and refuses every other global in one line.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tarfile
import urllib.request
from pathlib import Path

import numpy as np

from normlab.runner.errors import RunError, UsageError, error_line
from normlab.runner.io import atomic_write

__all__ = [
    "read_batch",
    "load_cifar10",
    "download_cifar10",
    "CIFAR10_DIRNAME",
    "CIFAR10_TRAIN_FILES",
    "CIFAR10_TEST_FILE",
    "CIFAR10_CLASSES",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
]

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
#: The directory of the python batches inside ``data_dir`` (as the archive unpacks).
CIFAR10_DIRNAME = "cifar-10-batches-py"
#: The five training batches' file names in :data:`CIFAR10_DIRNAME`.
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
#: The test batch's file name in :data:`CIFAR10_DIRNAME`.
CIFAR10_TEST_FILE = "test_batch"
#: The class names, in label order.
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
#: Per-channel mean of the CIFAR-10 training set (pixels scaled to [0, 1]).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
#: Per-channel standard deviation of the CIFAR-10 training set (pixels scaled to [0, 1]).
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
}


class _BatchUnpickler(pickle.Unpickler):
    """Rebuilds builtin containers, bytes/str/numbers and numpy arrays; refuses any other global."""

    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(
                f"refusing to load {module}.{name} (only numpy arrays and builtin "
                f"containers are allowed in a CIFAR-10 batch)"
            )
        return super().find_class(module, name)


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One python batch -> images (N, 3, 32, 32) uint8 and labels (N,) int64; one-line errors for bad files."""
    if not path.exists():
        raise UsageError(
            f"cifar10: missing file {path}; expected the python batches ({', '.join(CIFAR10_TRAIN_FILES)},"
            f" {CIFAR10_TEST_FILE}) in --data-dir; use --download to fetch them"
        )
    try:
        with open(path, "rb") as f:
            d = _BatchUnpickler(f, encoding="bytes").load()
        data = np.asarray(d[b"data"], dtype=np.uint8)
        labels = np.asarray(d[b"labels"], dtype=np.int64)
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise UsageError(f"cifar10: {path} is not a CIFAR-10 python batch ({error_line(e)})") from None
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or labels.shape != (data.shape[0],):
        raise UsageError(
            f"cifar10: {path} holds data of shape {data.shape} and labels of shape {labels.shape}, "
            f"expected (N, 3072) and (N,)"
        )
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise UsageError(f"cifar10: {path} has labels outside 0..9")
    return data.reshape(-1, 3, 32, 32), labels


def _md5(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_cifar10(data_dir: str | os.PathLike) -> Path:
    """Fetch the official CIFAR-10 python tarball into ``data_dir``, verify its md5 and extract the batches."""
    root = Path(data_dir)
    tar_path = root / "cifar-10-python.tar.gz"
    if not tar_path.exists() or _md5(tar_path) != CIFAR10_MD5:
        try:
            with urllib.request.urlopen(CIFAR10_URL) as response:
                atomic_write(tar_path, lambda f: _copy(response, f))
        except OSError as e:
            raise RunError(f"cifar10: download of {CIFAR10_URL} failed: {error_line(e)}") from None
    digest = _md5(tar_path)
    if digest != CIFAR10_MD5:
        raise RunError(f"cifar10: md5 of {tar_path} is {digest}, expected {CIFAR10_MD5}")
    with tarfile.open(tar_path, "r:gz") as tf:
        members = [m for m in tf.getmembers() if m.name.startswith(CIFAR10_DIRNAME + "/") and m.isfile()]
        tf.extractall(root, members=members, filter="data")  # refuses links and absolute paths
    return root / CIFAR10_DIRNAME


def _copy(src, dst) -> None:
    for chunk in iter(lambda: src.read(1 << 20), b""):
        dst.write(chunk)


def load_cifar10(data_dir: str | os.PathLike | None, download: bool = False):
    """(x_train, y_train, x_test, y_test) as uint8 images and int64 labels from ``data_dir``."""
    if data_dir is None:
        raise UsageError(
            "cifar10: --data-dir is required (the directory holding cifar-10-batches-py; add "
            "--download to fetch the 170 MB archive into it)"
        )
    if download:
        download_cifar10(data_dir)
    root = Path(data_dir)
    d = root if (root / CIFAR10_TEST_FILE).exists() else root / CIFAR10_DIRNAME
    parts = [read_batch(d / f) for f in CIFAR10_TRAIN_FILES]
    x_te, y_te = read_batch(d / CIFAR10_TEST_FILE)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), x_te, y_te
