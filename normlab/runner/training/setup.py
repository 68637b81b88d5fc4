"""A run's inputs, loaded and built once: its data, its model with the comparison's normalization, its loss and its
metric, checked on a real batch before anything is written.

:func:`prepare` is the one place that does it: ``normlab train`` prepares once and hands the result to the trainer
(:func:`~normlab.runner.training.train.train` takes ``inputs=``); a grid prepares one cell of each kind in the
parent (``normlab.runner.training.checks.check_grid``) and each cell again in its worker.

A **model factory** (``pkg.module:function``, or a function of the Python API) is called with the keyword
arguments its signature names among ``num_classes`` (the data's classes; also passed to a factory that takes
``**kwargs``), ``in_channels`` and ``input_shape`` (one sample's shape, channels first), ``norm_layer``
(:class:`~normlab.runner.training.norms.NormLayer`: the factory builds the comparison's norm itself), plus the
config's ``model_kwargs``, and returns an ``nn.Module``. ``timm:NAME`` is built by ``timm.create_model(NAME,
pretrained=False, num_classes=C, in_chans=channels)`` and ``torchvision:NAME`` by ``torchvision.models.get_model
(NAME, weights=None, num_classes=C)``, both without weights. A model is built with torch's generator seeded by the
run's seed, so every run of a seed starts from the same weights, and its dry run (eval mode, no gradient, on two
training samples) must give an output the loss and the metric accept; a classifier's output must have one value per
class.
"""

from __future__ import annotations

import inspect
import random
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from normlab.nn import RenormSchedule
from normlab.runner.data.datasets import get_dataset
from normlab.runner.data.user import load_user_data
from normlab.runner.errors import FieldError, UsageError, error_line
from normlab.runner.factories import resolve
from normlab.runner.models import build_model as build_builtin
from normlab.runner.training.config import TrainConfig
from normlab.runner.training.norms import NormLayer, put_norm
from normlab.runner.training.task import Task, make_task

__all__ = [
    "RunInputs",
    "prepare",
    "load_data",
    "build_model",
    "steps_per_epoch",
    "norm_kwargs",
    "seed_everything",
]

_MEMORY: dict[tuple, tuple] = {}  # data sets of this process by source (a grid's cells in one worker load once)
_MEMORY_SIZE = 4


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


@dataclass
class RunInputs:
    """What a run trains on and what it trains, built once: ``train``/``test`` (``len`` and ``batch(indices,
    generator)``), ``info`` (:func:`~normlab.runner.data.datasets.get_dataset`'s), the ``model`` (on the CPU, in
    train mode, its weights from the seed), the ``task`` (loss and metric) and ``rng``, torch's generator state right
    after the model was built (a fresh run starts from it, as if it had built the model itself)."""

    train: Any
    test: Any
    info: dict[str, Any]
    model: nn.Module
    task: Task
    rng: torch.Tensor


def _source(config: TrainConfig) -> tuple:
    """What decides a data set: its name and arguments, and a factory's function itself (one redefined in a notebook
    under the same name is another data set)."""
    factory = resolve("data", config.dataset)
    fn = None if factory.builtin else factory.fn
    return (config.dataset, config.data_dir, config.num_samples, config.num_train, fn)


def load_data(config: TrainConfig) -> tuple[Any, Any, dict[str, Any]]:
    """``(train, test, info)`` of the config's data set as its run sees it (generated size, the first
    ``num_train`` training samples); kept in this process for the next config of the same source."""
    key = _source(config)
    if key in _MEMORY:
        return _MEMORY[key]
    factory = resolve("data", config.dataset)
    if factory.builtin:
        data = get_dataset(config.dataset, config.data_dir, num_samples=config.num_samples, num_train=None)
    else:
        data = load_user_data(config.dataset, factory.fn)
    if config.num_train is not None:
        data = _first(config, *data)
    while len(_MEMORY) >= _MEMORY_SIZE:
        _MEMORY.pop(next(iter(_MEMORY)))
    _MEMORY[key] = data
    return data


def _first(config: TrainConfig, train, test, info: dict) -> tuple:
    """The first ``num_train`` training samples."""
    n = config.num_train
    if n > len(train):
        raise FieldError(
            "TrainConfig",
            "num_train",
            f"must be at most the {len(train)} training samples of {config.dataset}, got {n}",
        )
    if hasattr(train, "x"):  # an ArrayDataset
        train = type(train)(train.x[:n], train.y[:n], train.mean, train.std, train.augment)
    else:
        train = type(train)(torch.utils.data.Subset(train.dataset, range(n)), train.collate)
    return train, test, {**info, "num_train": n}


def steps_per_epoch(config: TrainConfig, num_train: int, world: int = 1) -> int:
    """Optimizer steps of an epoch: the batches of one process's share, capped by ``max_steps_per_epoch``."""
    steps = (num_train // world) // config.batch_size
    cap = config.max_steps_per_epoch
    return steps if cap is None else min(steps, cap)


def norm_kwargs(config: TrainConfig, steps: int) -> dict:
    """Further arguments of every norm layer: the BatchRenorm schedule of ``brn_schedule="run"`` (the paper's,
    compressed to reach its final limits halfway through the ``steps`` of an epoch times the epochs)."""
    if config.norm == "brn" and config.brn_schedule == "run":
        return {"schedule": RenormSchedule.scaled(config.epochs * steps // 2)}
    return {}


def _offered(fn, info: dict, layer: NormLayer | None) -> dict:
    """The keyword arguments a model factory's signature names (``num_classes`` also for ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {"num_classes": info["num_classes"]} if info["num_classes"] else {}
    anything = any(p.kind is p.VAR_KEYWORD for p in params.values())
    offer = {"num_classes": info["num_classes"], "in_channels": info["in_channels"]}
    offer["input_shape"] = tuple(info["input_shape"])
    if layer is not None:
        offer["norm_layer"] = layer
    out = {k: v for k, v in offer.items() if k in params and v is not None}
    if anything and "num_classes" not in out and info["num_classes"]:
        out["num_classes"] = info["num_classes"]
    return out


def _takes_norm_layer(fn) -> bool:
    try:
        return "norm_layer" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _factory_model(config: TrainConfig, info: dict, example: torch.Tensor, norm_kw: dict | None) -> nn.Module:
    """A model of a factory, timm or torchvision, with the config's normalization put in."""
    factory, extra = resolve("model", config.model), dict(config.model_kwargs)
    classes = {"num_classes": info["num_classes"]} if info["num_classes"] else {}
    built_with_norm = False
    if factory.source == "timm":
        import timm

        model = timm.create_model(factory.fn, pretrained=False, in_chans=info["in_channels"], **classes, **extra)
    elif factory.source == "torchvision":
        import torchvision

        model = torchvision.models.get_model(factory.fn, weights=None, **classes, **extra)
    else:
        built_with_norm = _takes_norm_layer(factory.fn)
        norm = config.norm if config.conv != "wn" else "none"
        layer = NormLayer(norm, max(1, len(info["input_shape"]) - 1), dict(norm_kw or {})) if built_with_norm else None
        model = factory.fn(**_offered(factory.fn, info, layer), **extra)
        if not isinstance(model, nn.Module):
            raise FieldError(
                "TrainConfig", "model", f"{config.model!r} returned {type(model).__name__}; expected an nn.Module"
            )
    kw = {"norm_kwargs": norm_kw, "conv_kwargs": config.conv_kwargs}
    return put_norm(model, config.norm, config.conv, example, built_with_norm=built_with_norm, **kw)


def build_model(
    config: TrainConfig, info: dict[str, Any], example: torch.Tensor, norm_kw: dict | None = None
) -> nn.Module:
    """The model of ``config`` for data ``info`` (torch's generator seeded with the config's seed first), with the
    comparison's normalization; ``example``: a batch of inputs (the shapes its layers see); ``norm_kw``: further
    arguments of its norm layers (:func:`norm_kwargs`). A refusal is one line naming ``model``."""
    seed_everything(config.seed)
    if config.builtin_model:
        shape = tuple(info["input_shape"])
        try:
            return build_builtin(
                config.model,
                config.norm,
                config.conv,
                shape[0],
                info["num_classes"],
                shape,
                config.width,
                norm_kwargs=norm_kw,
                conv_kwargs=config.conv_kwargs,
                **config.model_kwargs,
            )
        except (ValueError, TypeError) as e:  # a layer refusing its arguments (e.g. a PWS gamma <= 0)
            raise UsageError(error_line(e)) from None
    try:
        return _factory_model(config, info, example, norm_kw)
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's factory or a conversion: one line says what failed
        raise FieldError(
            "TrainConfig", "model", f"{config.model!r} with norm {_name(config)}: {error_line(e, with_type=True)}"
        ) from None


def _name(config: TrainConfig) -> str:
    return config.norm if config.conv == "conv" else f"{config.conv}+{config.norm}"


def _dry_run(config: TrainConfig, model: nn.Module, task: Task, info: dict, x, y) -> None:
    """The model's output on two samples must be what the loss and the metric take (one line naming what not)."""
    what = f"{config.model!r} (norm={config.norm}, conv={config.conv}, width={config.width:g})"
    try:
        with torch.no_grad():
            out = model.eval()(x)
    except Exception as e:  # noqa: BLE001 - the user's model: one line says what failed
        raise FieldError(
            "TrainConfig",
            "model",
            f"{what} cannot run on {config.dataset} input of shape {tuple(x.shape[1:])}: {error_line(e)}",
        ) from None
    finally:
        model.train()
    classes = info.get("num_classes")
    if config.metric == "accuracy" and classes and (out.dim() != 2 or out.shape[-1] != classes):
        raise FieldError(
            "TrainConfig", "model", f"{what} outputs shape {tuple(out.shape)}, {config.dataset} has {classes} classes"
        )
    if config.loss == "mse" and out.shape != y.shape:  # torch would broadcast them, and warn
        raise FieldError(
            "TrainConfig",
            "loss",
            f"'mse' compares the output of model {what} (shape {tuple(out.shape)}) with targets of its own shape, got "
            f"{tuple(y.shape)}",
        )
    for name, fn in (("loss", task.loss_sum), ("metric", task.metric_sum)):
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("error")  # a warning on the first batch (torch broadcasting shapes) is a misfit
                value = fn(out, y)
        except Exception as e:  # noqa: BLE001 - the user's loss or metric: one line says what failed
            raise FieldError(
                "TrainConfig",
                name,
                f"{getattr(task, name)!r} does not take the output of model {what} (shape {tuple(out.shape)}) and the "
                f"targets (shape {tuple(y.shape)}, {y.dtype}): {error_line(e)}",
            ) from None
        if value is not None and torch.as_tensor(value).numel() != 1:
            raise FieldError("TrainConfig", name, f"{getattr(task, name)!r} must give one number per batch")


def prepare(config: TrainConfig, *, world: int = 1, data: tuple | None = None) -> RunInputs:
    """Load the data (or take ``data``, a ``(train, test, info)``), check the batch size against each process's
    share of it, build the model with the seed, check a dry run; the :class:`RunInputs` of a validated ``config``.

    Raises:
        UsageError: one line (a :class:`~normlab.runner.errors.FieldError` naming the field where one decides it).
    """
    train, test, info = data if data is not None else load_data(config)
    share = len(train) // world
    if config.batch_size > share:
        where = f"{config.dataset} training set" if world == 1 else f"share of each of {world} processes"
        raise FieldError(
            "TrainConfig", "batch_size", f"batch size {config.batch_size} is larger than the {where} ({share} samples)"
        )
    task = make_task(config.loss, config.metric)
    x, y = train.batch(torch.arange(min(2, len(train))))
    kw = norm_kwargs(config, steps_per_epoch(config, len(train), world))
    model = build_model(config, info, x, kw)
    rng = torch.get_rng_state()
    _dry_run(config, model, task, info, x, y)
    return RunInputs(train, test, info, model, task, rng)
