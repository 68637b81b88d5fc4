"""Refuse impossible runs before any training: a batch larger than the data, a model that cannot be built or run on
the data, an output the loss or the metric does not take. The configs come validated
(:meth:`~normlab.runner.training.config.TrainConfig.validate`); these are the facts that need the data and the model,
established by :func:`~normlab.runner.training.setup.prepare`. Each refusal is a one-line
:class:`~normlab.runner.errors.UsageError` (a :class:`~normlab.runner.errors.FieldError` where one field decides
it)."""

from __future__ import annotations

from collections.abc import Iterable

from normlab.runner.training.config import TrainConfig
from normlab.runner.training.setup import RunInputs, load_data, prepare

__all__ = ["check_feasible", "check_grid", "load_data"]


def check_feasible(config: TrainConfig, *, world: int = 1, data: tuple | None = None) -> RunInputs:
    """Prepare the run of a validated ``config`` (:func:`~normlab.runner.training.setup.prepare`: its data, its
    model, a dry run) and return what was built, for the trainer to use (``train(..., inputs=...)``). ``data`` may
    pass the already loaded ``(train, test, info)``; ``world``: the processes that share the data (DDP)."""
    return prepare(config, world=world, data=data)


def _model_key(config: TrainConfig) -> tuple:
    """What decides whether a cell's model can be built and run: its data, model, norm and batch size."""
    source = (config.dataset, config.data_dir, config.num_samples, config.num_train)
    return (
        source,
        config.model,
        config.norm,
        config.conv,
        config.width,
        config.batch_size,
        str(config.conv_kwargs),
        str(config.model_kwargs),
        config.loss,
        config.metric,
    )


def check_grid(cells: Iterable) -> None:
    """:func:`check_feasible` once per distinct (data, model, norm, batch size, loss, metric) among ``cells``
    (their configs validated by :func:`~normlab.runner.grid.spec.expand_grid`), each data set loaded once."""
    seen = set()
    for c in cells:
        key = _model_key(c.config)
        if key not in seen:
            seen.add(key)
            check_feasible(c.config)
