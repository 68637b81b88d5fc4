"""MNIST-1D (Greydanus 2020) generated locally at any size, cached on disk under a checksum of its arguments.

``mnist1d.data.make_dataset`` builds the data set from ten templates with random shifts, scaling, shear and noise
(length 40). Generating 25,000 samples takes about 10 s on one core (less with ``workers``,
:mod:`normlab.runner.data.mnist1d_parallel`), so the arrays are cached as
``<cache_dir>/mnist1d_<key>.npz``, where ``key`` is a SHA-256 of the generation arguments; each file also holds a
SHA-256 of its arrays and is regenerated when that does not match. Generation is deterministic for a given set of
arguments (mnist1d seeds its generators from ``seed``; normlab restores python's and numpy's global generators
afterwards).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
from pathlib import Path

import numpy as np

from normlab._checks import number_problem
from normlab.runner.errors import UsageError
from normlab.runner.io import atomic_write

__all__ = [
    "DEFAULT_SAMPLES",
    "MIN_SAMPLES",
    "TRAIN_SPLIT",
    "generation_args",
    "cache_key",
    "load_mnist1d",
    "arrays_checksum",
]

DEFAULT_SAMPLES = 25_000  # 20,000 train / 5,000 test
MIN_SAMPLES = 50  # the generator needs a few per class
TRAIN_SPLIT = 0.8
_KEYS = ("x", "y", "x_test", "y_test")
_memory: dict[str, dict[str, np.ndarray]] = {}  # per process: cells of a grid in one worker load once


def generation_args(num_samples: int = DEFAULT_SAMPLES) -> dict:
    """mnist1d's generation arguments with ``num_samples`` (train + test, split 80/20)."""
    expected = number_problem(num_samples, integer=True, low=MIN_SAMPLES)
    if expected is not None:
        raise UsageError(f"mnist1d: num_samples must be {expected}, got {num_samples!r}")
    from mnist1d.data import get_dataset_args

    args = get_dataset_args(as_dict=True)
    args.pop("url", None)
    args.update(num_samples=num_samples, train_split=TRAIN_SPLIT)
    return args


def cache_key(args: dict) -> str:
    """SHA-256 (16 hex digits) of the generation arguments."""
    return hashlib.sha256(json.dumps(args, sort_keys=True, default=str).encode()).hexdigest()[:16]


def arrays_checksum(arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 of the data arrays (dtype, shape and bytes)."""
    h = hashlib.sha256()
    for k in _KEYS:
        a = np.ascontiguousarray(arrays[k])
        h.update(f"{k}:{a.dtype}:{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


PARALLEL_MIN_SAMPLES = 5000  # below this, starting a worker costs more than it saves


def _generate(args: dict, workers: int = 1) -> dict[str, np.ndarray]:
    """mnist1d's ``make_dataset(args)``, by ``workers`` processes when there are enough samples (bit for bit the
    same arrays, :mod:`normlab.runner.data.mnist1d_parallel`; serially if its replay does not match)."""
    from mnist1d.data import make_dataset
    from mnist1d.utils import ObjectView

    from normlab.runner.data.mnist1d_parallel import ReplayMismatch, generate

    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        d = None
        if workers > 1 and args["num_samples"] >= PARALLEL_MIN_SAMPLES:
            try:
                d = generate(args, workers)
            except ReplayMismatch:
                d = None
        if d is None:
            d = make_dataset(ObjectView(dict(args)))
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    return {
        "x": d["x"].astype(np.float32),
        "y": d["y"].astype(np.int64),
        "x_test": d["x_test"].astype(np.float32),
        "y_test": d["y_test"].astype(np.int64),
    }


def _read_cache(path: Path) -> dict[str, np.ndarray] | None:
    """The cached arrays if the file is readable and its checksum matches, else None."""
    try:
        with np.load(path) as z:
            arrays = {k: z[k] for k in _KEYS}
            stored = str(z["checksum"])
    except (OSError, KeyError, ValueError, EOFError):
        return None
    return arrays if stored == arrays_checksum(arrays) else None


def _write_cache(path: Path, arrays: dict[str, np.ndarray]) -> None:
    buf = io.BytesIO()
    np.savez(buf, checksum=np.array(arrays_checksum(arrays)), **arrays)
    atomic_write(path, lambda f: f.write(buf.getvalue()))


def load_mnist1d(num_samples: int = DEFAULT_SAMPLES, cache_dir: str | os.PathLike | None = None, workers: int = 1):
    """``{"x", "y", "x_test", "y_test"}``: float32 (N, 40) signals and int64 labels, 80/20 split.

    Read from ``cache_dir`` when a valid cache file exists there, else generated (and cached when ``cache_dir``
    is given), by ``workers`` processes (the same arrays, bit for bit, as one generates).
    """
    args = generation_args(num_samples)
    key = cache_key(args)
    path = Path(cache_dir) / f"mnist1d_{key}.npz" if cache_dir is not None else None
    arrays = _memory.get(key)
    if arrays is None and path is not None and path.is_file():
        arrays = _read_cache(path)
    if arrays is None:
        arrays = _generate(args, workers)
    if path is not None and not path.is_file():
        _write_cache(path, arrays)
    _memory[key] = arrays
    return arrays
