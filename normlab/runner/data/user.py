"""A user's data as the trainer reads it: a data factory's datasets or data loaders behind the
:class:`~normlab.runner.data.datasets.ArrayDataset` interface (``len`` and ``batch(indices, generator)``).

A data factory (``pkg.module:function``, or a function in the Python API) takes no argument and returns the
training and the test data: ``(train, test)``, or a dict ``{"train": ..., "test": ..., "num_classes": C}``. Each is
a map-style ``torch.utils.data.Dataset`` of ``(input, target)`` pairs or a ``DataLoader`` over one. normlab draws the
batches itself, so that the batch size is the grid's, the order is reproducible and a killed run resumes with the
same batches (and, under ``torchrun``, each process takes its share, as Lightning's distributed sampler does): of a
``DataLoader`` it keeps the dataset and the ``collate_fn``; its batch size, sampler and workers are not used. A
``TensorDataset`` is indexed directly; any other dataset one sample at a time (``dataset[i]``), the samples collated.
The number of classes is the dict's ``num_classes``, else the dataset's ``num_classes`` or ``len(classes)`` (as
torchvision's datasets have), else, for a ``TensorDataset`` of integer targets, the largest target + 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, default_collate

from normlab.runner.errors import FieldError

__all__ = ["MapData", "load_user_data"]


class MapData:
    """A map-style dataset read in batches: ``batch(indices, generator)`` -> ``(inputs, targets)`` (the generator is
    not used: a dataset's own random transforms draw from torch's global generator, which a checkpoint restores)."""

    def __init__(self, dataset: Dataset, collate: Callable | None = None) -> None:
        self.dataset = dataset
        self.collate = collate or default_collate

    def __len__(self) -> int:
        return len(self.dataset)

    def batch(self, idx: torch.Tensor, generator: torch.Generator | None = None):
        if isinstance(self.dataset, TensorDataset) and self.collate is default_collate:
            x, y, *_ = (t[idx] for t in self.dataset.tensors)
            return x, y
        x, y, *_ = self.collate([self.dataset[i] for i in idx.tolist()])
        return x, y


def _refuse(name: str, problem: str) -> FieldError:
    return FieldError("TrainConfig", "dataset", f"{name!r}: {problem}")


def _split(name: str, value: Any) -> tuple[Any, Any, dict]:
    """(train, test, extra) of what a data factory returned."""
    if isinstance(value, dict):
        if "train" not in value or "test" not in value:
            raise _refuse(name, f"returned a dict with keys {sorted(value)}; expected 'train' and 'test'")
        return value["train"], value["test"], {k: v for k, v in value.items() if k not in ("train", "test")}
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return value[0], value[1], {}
    raise _refuse(name, f"returned {type(value).__name__}; expected (train, test) datasets or data loaders")


def _wrap(name: str, part: str, data: Any) -> MapData:
    collate = None
    if isinstance(data, DataLoader):
        data, collate = data.dataset, data.collate_fn
    if isinstance(data, IterableDataset) or not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise _refuse(
            name,
            f"its {part} data is a {type(data).__name__}; expected a map-style dataset (len and [i]) or a "
            "DataLoader over one",
        )
    if len(data) == 0:
        raise _refuse(name, f"its {part} data is empty")
    source = MapData(data, collate)
    try:
        x, y = source.batch(torch.tensor([0]))
    except Exception as e:  # noqa: BLE001 - the user's dataset: one line says what failed
        raise _refuse(name, f"cannot read a {part} sample as (input, target): {type(e).__name__}: {e}") from None
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise _refuse(name, f"its {part} samples collate to {type(x).__name__}, {type(y).__name__}; expected tensors")
    return source


def _num_classes(train: MapData, extra: dict) -> int | None:
    if extra.get("num_classes") is not None:
        return int(extra["num_classes"])
    ds = train.dataset
    if getattr(ds, "num_classes", None) is not None:
        return int(ds.num_classes)
    if getattr(ds, "classes", None) is not None:
        return len(ds.classes)
    if isinstance(ds, TensorDataset) and len(ds.tensors) > 1 and not ds.tensors[1].is_floating_point():
        return int(ds.tensors[1].max()) + 1 if ds.tensors[1].dim() == 1 else None
    return None


def load_user_data(name: str, factory: Callable) -> tuple[MapData, MapData, dict[str, Any]]:
    """``(train, test, info)`` from a data factory (the module docstring); ``info`` as
    :func:`~normlab.runner.data.datasets.get_dataset` gives it (``input_shape`` of one sample, ``num_classes`` or
    None, sizes, a description). Anything it cannot use is a one-line :class:`~normlab.runner.errors.FieldError` of
    ``dataset``."""
    try:
        value = factory()
    except Exception as e:  # noqa: BLE001 - the user's factory: one line says what failed
        raise _refuse(name, f"the data factory raised {type(e).__name__}: {e}") from None
    train_raw, test_raw, extra = _split(name, value)
    train, test = _wrap(name, "training", train_raw), _wrap(name, "test", test_raw)
    x, _ = train.batch(torch.tensor([0]))
    shape = tuple(x.shape[1:])
    info = {
        "name": name,
        "in_channels": shape[0] if shape else 1,
        "num_classes": _num_classes(train, extra),
        "input_shape": shape,
        "num_train": len(train),
        "num_test": len(test),
        "classes": None,
        "description": f"{name}: {len(train)} training / {len(test)} test samples of shape {shape}",
    }
    return train, test, info
