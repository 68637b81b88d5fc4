"""One resolver for what a run trains: its model, its data, its loss and its metric, each named the same way.

A name is one of

- a name in a table: the built-in models (:data:`~normlab.runner.models.MODELS`: ``plain``, ``resnet``, ...),
  data sets (:data:`~normlab.runner.data.datasets.DATASETS`: ``digits``, ``mnist1d``, ``cifar10``), losses
  (:data:`LOSSES`) and metrics (:data:`METRICS`);
- ``timm:NAME`` (models): ``timm.create_model(NAME, pretrained=False, num_classes=..., in_chans=...)``, no weights;
- ``torchvision:NAME`` (models): ``torchvision.models.get_model(NAME, weights=None, num_classes=...)``;
- ``pkg.module:function``: a function imported by its name, so that worker processes and Ray tasks can import it
  again (the run's config records the name, never the function).

The Python API also takes the function itself (:func:`name_of`): one with an import path is recorded under it; a
lambda, a nested function or a function of ``__main__`` has none, so it is kept in this process only
(:func:`is_local`) and a run that needs it elsewhere (worker processes, Ray) is refused in one line.

What each kind of function is called with and must return: :mod:`normlab.runner.training.setup` (models, data)
and :mod:`normlab.runner.training.task` (losses, metrics).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from normlab.runner.data.datasets import DATASETS
from normlab.runner.errors import FieldError
from normlab.runner.models import MODELS

__all__ = [
    "KINDS",
    "LOSSES",
    "METRICS",
    "Factory",
    "resolve",
    "name_of",
    "is_local",
    "is_builtin",
]

#: What the resolver resolves.
KINDS = ("model", "data", "loss", "metric")
#: The losses by name (:mod:`normlab.runner.training.task`).
LOSSES = ("cross_entropy", "mse")
#: The metrics by name (``none``, the runs report their loss only).
METRICS = ("accuracy", "none")
_TABLES = {"model": MODELS, "data": DATASETS, "loss": LOSSES, "metric": METRICS}
_HUBS = {"model": ("timm", "torchvision")}  # prefixes that name a model of a library
_FIELDS = {"model": "model", "data": "dataset", "loss": "loss", "metric": "metric"}  # the TrainConfig fields
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_local: dict[tuple[str, str], Callable] = {}  # (kind, name) -> a function that has no import path (this process)
_cache: dict[tuple[str, str], Factory] = {}


@dataclass(frozen=True)
class Factory:
    """A resolved name: ``kind`` (model, data, loss, metric), the ``name`` a config records, where it comes from
    (``source``: ``table``, ``timm``, ``torchvision``, ``import`` or ``local``) and the callable (``fn``; for a
    hub, the library's model name)."""

    kind: str
    name: str
    source: str
    fn: Callable | str

    @property
    def builtin(self) -> bool:
        """A name of normlab's own table."""
        return self.source == "table"


def _refuse(kind: str, name: str, problem: str, owner: str, field: str | None) -> FieldError:
    return FieldError(owner, field or _FIELDS[kind], f"{name!r}: {problem}")


def _hub(kind: str, name: str, owner: str, field: str | None) -> Factory:
    """``timm:NAME`` or ``torchvision:NAME``, checked against the library's list of models."""
    hub, _, model = name.partition(":")
    try:
        lib = importlib.import_module(hub if hub == "timm" else "torchvision.models")
    except ImportError as e:
        extra = "timm" if hub == "timm" else "models"
        raise _refuse(
            kind, name, f"{hub} is not installed ({e}); pip install 'normlab[{extra}]'", owner, field
        ) from None
    known = lib.is_model(model) if hub == "timm" else model in lib.list_models()
    if not known:
        where = "timm.list_models()" if hub == "timm" else "torchvision.models.list_models()"
        raise _refuse(kind, name, f"{hub} has no model {model!r} (the names: {where})", owner, field)
    return Factory(kind, name, hub, model)


def _imported(kind: str, name: str, owner: str, field: str | None) -> Factory:
    """``pkg.module:function``: the module imported, the attribute path followed, a callable expected."""
    module, _, attr = name.partition(":")
    try:
        obj = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - a user's module can raise anything on import: one line says what
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise _refuse(
            kind, name, f"cannot import module {module!r} ({type(e).__name__}: {first})", owner, field
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise _refuse(kind, name, f"module {module!r} has no {attr!r}", owner, field)
        obj = getattr(obj, part)
    if not callable(obj):
        raise _refuse(kind, name, f"expected a function, got a {type(obj).__name__}", owner, field)
    return Factory(kind, name, "import", obj)


def _expected(kind: str) -> str:
    table = ", ".join(_TABLES[kind])
    hubs = "".join(f", {h}:NAME" for h in _HUBS.get(kind, ()))
    return f"expected one of {table}{hubs} or pkg.module:function"


def resolve(kind: str, name: str, *, owner: str = "TrainConfig", field: str | None = None) -> Factory:
    """The :class:`Factory` a ``kind`` name stands for (the module docstring); an unknown name, a module that does
    not import or an attribute that is missing or not callable is a one-line
    :class:`~normlab.runner.errors.FieldError` of ``owner``'s ``field`` (default: the config field of ``kind``).

    Example:
        >>> resolve("model", "plain").source, resolve("loss", "torch.nn.functional:l1_loss").source
        ('table', 'import')
    """
    if kind not in KINDS:
        raise ValueError(f"resolve: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if not isinstance(name, str) or not name.strip():
        raise _refuse(kind, name, f"{_expected(kind)}; got {type(name).__name__}", owner, field)
    if name in _TABLES[kind]:
        return Factory(kind, name, "table", name)
    if (kind, name) in _local:
        return Factory(kind, name, "local", _local[(kind, name)])
    key = (kind, name)
    if key not in _cache:
        if name.split(":", 1)[0] in _HUBS.get(kind, ()):
            _cache[key] = _hub(kind, name, owner, field)
        elif _IMPORT_PATH.match(name):
            _cache[key] = _imported(kind, name, owner, field)
        else:
            noun = "dataset" if kind == "data" else kind
            raise FieldError(owner, field or _FIELDS[kind], f"unknown {noun} {name!r}; {_expected(kind)}")
    return _cache[key]


def _import_path(fn: Callable) -> str | None:
    """``module:qualname`` when importing it gives back ``fn`` itself, else None."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        return None
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception:  # noqa: BLE001 - not importable by name, whatever the reason
        return None
    return f"{module}:{qualname}" if obj is fn else None


def name_of(kind: str, value) -> str:
    """The name a config records for ``value``: a string as it is; a callable by its import path
    (``module:qualname``), or, without one (a lambda, a nested function, a function of ``__main__``, a callable
    object), under ``module:qualname`` of this process only (:func:`is_local`).

    Example:
        >>> import torch.nn.functional as F
        >>> name_of("loss", F.l1_loss), is_local("loss", name_of("loss", lambda out, y: (out - y).abs().mean()))
        ('torch.nn.functional:l1_loss', True)
    """
    if isinstance(value, str):
        return value
    if kind == "model" and isinstance(value, nn.Module):
        raise _refuse(
            kind,
            type(value).__name__,
            "pass the function (or class) that builds the model, not a built module: "
            "each run builds its own, from its seed",
            "TrainConfig",
            None,
        )
    if not callable(value):
        raise _refuse(
            kind, value, f"{_expected(kind)}, or a function; got a {type(value).__name__}", "TrainConfig", None
        )
    path = _import_path(value)
    if path is not None:
        return path
    module = getattr(value, "__module__", None) or "local"
    qualname = getattr(value, "__qualname__", None) or type(value).__qualname__
    name = f"{module}:{qualname}"
    _local[(kind, name)] = value
    _cache.pop((kind, name), None)
    return name


def is_local(kind: str, name: str) -> bool:
    """``name`` stands for a function of this process that another process cannot import (:func:`name_of`)."""
    return (kind, name) in _local


def is_builtin(kind: str, name: str) -> bool:
    """``name`` is in normlab's own table of ``kind``."""
    return name in _TABLES[kind]
