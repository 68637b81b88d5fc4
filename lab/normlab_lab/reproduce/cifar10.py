"""The PWS paper's CIFAR-10 classification table as a preset (``normlab-lab reproduce --preset cifar10-pws``).

The paper's protocol (Liu et al., AAAI 2021, classification experiments): CIFAR-10 with the simple augmentation
(random crop of the 4-pixel zero-padded image and a random horizontal flip), the plain ConvPool-CNN-C net without
dropout (``plain``) and the pre-activation bottleneck ResNet (``resnet``), each with BN, GN, SN, WN and PWS (gamma
1e-3), learning rates 1e-2 and 1e-1, 200 epochs with the learning rate x0.1 after epochs 100, 150 and 180, SGD
momentum 0.9, weight decay 5e-4, batch 128. Each model is one grid of the grid engine under ``<out>/<model>/``, and
both share one pool of workers (or one Ray cluster).

:func:`cifar10_grids` builds the two grids; ``smoke=True`` keeps every setting but trains one short epoch (2 steps)
on a subset of 256 training images at width 1/8, on the CIFAR-10 python batches when ``data_dir`` holds them, else
on CIFAR-shaped random images (:func:`write_synthetic_cifar10`): a check of the pipeline, not a result.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np

from normlab.runner.data.cifar10 import CIFAR10_DIRNAME, CIFAR10_TEST_FILE, CIFAR10_TRAIN_FILES
from normlab.runner.grid.spec import GridSpec

__all__ = ["PAPER", "SMOKE", "cifar10_grids", "write_synthetic_cifar10", "has_cifar10"]

PAPER = {
    "models": ("plain", "resnet"),
    "norms": ("bn", "gn", "sn", "wn", "pws"),
    "lrs": (0.01, 0.1),
    "batch_size": 128,
    "epochs": 200,
    "milestones": (100, 150, 180),
    "lr_gamma": 0.1,
    "momentum": 0.9,
    "weight_decay": 5e-4,
    "gamma": 1e-3,  # PWS's gamma: the paper's value and PWSConv's default, so the grid's "pws" is it
    "width": 1.0,
}
SMOKE = {"epochs": 1, "max_steps_per_epoch": 2, "num_train": 256, "width": 0.125, "batch_size": 16}


def cifar10_grids(
    seeds: tuple[int, ...], data_dir: str, *, smoke: bool = False, device: str = "auto"
) -> dict[str, GridSpec]:
    """One :class:`~normlab.runner.grid.spec.GridSpec` per model of the paper's table (``{"plain": ..., "resnet":
    ...}``), every cell a run of the protocol above on the data in ``data_dir``; ``smoke``: see the module doc."""
    p = {**PAPER, **(SMOKE if smoke else {})}
    kwargs = {
        "data_dir": str(data_dir),
        "device": device,
        "momentum": p["momentum"],
        "weight_decay": p["weight_decay"],
        "lr_gamma": p["lr_gamma"],
        "milestones": () if smoke else p["milestones"],
        **({"num_train": p["num_train"]} if smoke else {}),
    }
    return {
        model: GridSpec(
            norms=p["norms"],
            lrs=p["lrs"],
            batch_sizes=(p["batch_size"],),
            seeds=seeds,
            epochs=p["epochs"],
            dataset="cifar10",
            model=model,
            width=p["width"],
            max_steps_per_epoch=p.get("max_steps_per_epoch"),
            train_kwargs=kwargs,
        )
        for model in p["models"]
    }


def has_cifar10(data_dir: str | os.PathLike | None) -> bool:
    """Whether ``data_dir`` (or its ``cifar-10-batches-py``) holds CIFAR-10's test batch."""
    if data_dir is None:
        return False
    root = Path(data_dir)
    return (root / CIFAR10_TEST_FILE).is_file() or (root / CIFAR10_DIRNAME / CIFAR10_TEST_FILE).is_file()


def write_synthetic_cifar10(data_dir: str | os.PathLike, per_file: int = 64, seed: int = 0) -> Path:
    """CIFAR-shaped random images and labels in the official python-batch format under
    ``data_dir/cifar-10-batches-py`` (5 training batches and a test batch of ``per_file`` images each): the smoke
    run's data where no CIFAR-10 is present. Returns the directory."""
    d = Path(data_dir) / CIFAR10_DIRNAME
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name in (*CIFAR10_TRAIN_FILES, CIFAR10_TEST_FILE):
        batch = {
            b"data": rng.integers(0, 256, (per_file, 3 * 32 * 32), dtype=np.uint8),
            b"labels": rng.integers(0, 10, per_file).tolist(),
        }
        with open(d / name, "wb") as f:
            pickle.dump(batch, f)
    return d
