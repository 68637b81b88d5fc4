"""Refuse impossible runs before any training: a batch larger than the data, a model that cannot run on the data's
input shape. The configs come validated (:meth:`~normlab.runner.training.config.TrainConfig.validate`); these are
the facts that need the data and the model. Each refusal is a one-line :class:`~normlab.runner.errors.UsageError`
(a :class:`~normlab.runner.errors.FieldError` where one field decides it)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from normlab.runner.data.datasets import get_dataset
from normlab.runner.errors import FieldError, UsageError
from normlab.runner.training.config import TrainConfig

__all__ = ["check_feasible", "check_grid", "load_data"]


def check_feasible(config: TrainConfig, *, data: tuple | None = None) -> None:
    """Build the model of a validated ``config`` on the data's input shape; a dry forward pass catches whatever
    else cannot run. ``data`` may pass the already loaded ``(train_ds, test_ds, info)``."""
    train_ds, _test_ds, info = data if data is not None else load_data(config)
    if config.batch_size > len(train_ds):
        raise FieldError(
            "TrainConfig",
            "batch_size",
            f"batch size {config.batch_size} is larger than the "
            f"{config.dataset} training set ({len(train_ds)} samples)",
        )
    shape = tuple(info["input_shape"])
    try:
        net = config.make_model().eval()
    except (ValueError, TypeError) as e:  # a layer refusing its arguments (e.g. a PWS gamma <= 0)
        raise UsageError(str(e).strip().splitlines()[0]) from None
    try:
        with torch.no_grad():
            out = net(torch.zeros(2, *shape))
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(
            f"model {config.model!r} (norm={config.norm}, conv={config.conv}, width={config.width}) "
            f"cannot run on {config.dataset} input of shape {shape}: {first}"
        ) from None
    if out.shape[-1] != info["num_classes"]:
        raise UsageError(
            f"model {config.model!r} outputs {out.shape[-1]} classes, {config.dataset} has {info['num_classes']}"
        )


def load_data(config: TrainConfig):
    """The data set as the run will see it (generated size, first ``num_train`` training samples)."""
    return get_dataset(config.dataset, config.data_dir, num_samples=config.num_samples, num_train=config.num_train)


def check_grid(cells: Iterable) -> None:
    """:func:`check_feasible` once per distinct (data, norm, conv, batch size, model, width) among ``cells``
    (their configs validated by :func:`~normlab.runner.grid.spec.expand_grid`), each data set loaded once."""
    seen, data = set(), {}
    for c in cells:
        cfg = c.config
        source = (cfg.dataset, cfg.data_dir, cfg.num_samples, cfg.num_train)
        key = (source, cfg.norm, cfg.conv, cfg.batch_size, cfg.model, cfg.width, str(cfg.conv_kwargs))
        if key in seen:
            continue
        seen.add(key)
        if source not in data:
            data[source] = load_data(cfg)
        check_feasible(cfg, data=data[source])
