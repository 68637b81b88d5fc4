"""Refuse impossible runs before any training: unknown names, a batch larger than the data, a model that cannot
run on the data's input shape. Each refusal is a one-line :class:`~normlab.runner.errors.UsageError`."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from normlab.runner.data.datasets import get_dataset
from normlab.runner.errors import UsageError
from normlab.runner.models import build_model
from normlab.runner.training.config import TrainConfig

__all__ = ["check_feasible", "check_grid"]


def check_feasible(config: TrainConfig, *, data: tuple | None = None) -> None:
    """Validate ``config`` and build its model on the data's input shape; a dry forward pass catches whatever
    else cannot run. ``data`` may pass an already loaded ``(train_ds, test_ds, info)``."""
    config.validate()
    train_ds, _test_ds, info = data if data is not None else _load(config)
    if config.batch_size > len(train_ds):
        raise UsageError(f"batch size {config.batch_size} is larger than the {config.dataset} training set "
                         f"({len(train_ds)} examples)")
    shape = tuple(info["input_shape"])
    try:
        net = build_model(config.model, config.norm, config.conv, info["in_channels"], info["num_classes"], shape,
                          config.width, conv_kwargs=config.conv_kwargs, **config.model_kwargs).eval()
    except (ValueError, TypeError) as e:  # a layer refusing its arguments (e.g. a PWS gamma <= 0)
        raise UsageError(str(e).strip().splitlines()[0]) from None
    try:
        with torch.no_grad():
            out = net(torch.zeros(2, *shape))
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"model {config.model!r} (norm={config.norm}, conv={config.conv}, width={config.width}) "
                         f"cannot run on {config.dataset} input of shape {shape}: {first}") from None
    if out.shape[-1] != info["num_classes"]:
        raise UsageError(f"model {config.model!r} outputs {out.shape[-1]} classes, {config.dataset} has "
                         f"{info['num_classes']}")


def _load(config: TrainConfig):
    """The data set as the run will see it (generated size, first ``num_train`` training samples)."""
    return get_dataset(config.dataset, config.data_dir, num_samples=config.num_samples, num_train=config.num_train)


def check_grid(cells: Iterable) -> None:
    """:func:`check_feasible` once per distinct (data, norm, conv, batch size, model, width) among ``cells``."""
    seen, data = set(), {}
    for c in cells:
        cfg = c.config
        source = (cfg.dataset, cfg.data_dir, cfg.num_samples, cfg.num_train)
        key = (source, cfg.norm, cfg.conv, cfg.batch_size, cfg.model, cfg.width, str(cfg.conv_kwargs))
        if key in seen:
            continue
        seen.add(key)
        cfg.validate()
        if source not in data:
            data[source] = _load(cfg)
        check_feasible(cfg, data=data[source])
