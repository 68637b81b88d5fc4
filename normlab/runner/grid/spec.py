"""Grids of training runs: comparison name x learning rate x batch size x seed, on any model and data.

A :class:`GridSpec` describes the grid and checks it once; :func:`expand_grid` turns it into :class:`Cell` objects,
each with its validated :class:`~normlab.runner.training.config.TrainConfig`, one
:func:`~normlab.runner.training.train.train` call each (:mod:`normlab.runner.grid.execute` runs them).
:class:`DictSpec` is the base of every experiment's spec (its JSON record, the lists a later run may extend).

``dataset`` and ``model`` are names of :func:`normlab.runner.factories.resolve` (a built-in name, ``timm:NAME``,
``pkg.module:function``); every default of a field a cell's config shares is :class:`TrainConfig`'s. They are
resolved (their modules imported) before the comparison names are checked, so a norm that the model's or the
data's module registers (:func:`normlab.nn.register_norm`) is a name the grid takes.

Comparison names are resolved by :func:`normlab.nn.resolve_comparison` (``bn``, ``pws``, ``ws+gn``, ...) and may
carry constructor arguments of their conv layers after colons: ``pws:gamma=1e-2``,
``pws:gamma=1e-3:relative_gamma=true`` (see :func:`parse_variant`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from normlab.nn import conv_entry
from normlab.runner.errors import FieldError
from normlab.runner.factories import resolve
from normlab.runner.io import from_fields, to_jsonable
from normlab.runner.training.config import RESUME_FREE, TrainConfig, resolve_name

_DEFAULTS = TrainConfig()

__all__ = [
    "DictSpec",
    "GridSpec",
    "Cell",
    "expand_grid",
    "parse_variant",
    "unique",
    "DEFAULT_NORMS",
    "DEFAULT_SEEDS",
    "LAYOUTS",
    "LR_SCALINGS",
]

DEFAULT_NORMS = ("none", "bn", "brn", "gn", "sn", "wn", "ws", "pws")
DEFAULT_SEEDS = (0, 1, 2)
LAYOUTS = ("product", "cross")
LR_SCALINGS = ("none", "linear", "sqrt")


def _fmt_num(x: float) -> str:
    """Compact, filesystem-safe number for cell ids (0.05 -> 0.05, 1e-3 -> 0.001)."""
    return f"{x:g}".replace("+", "")


class DictSpec:
    """The base of an experiment's spec (a dataclass): its JSON record and what a later run may change.

    ``LIST_FIELDS`` are sequences stored as JSON lists, which a later run in the same directory may extend;
    ``NEWER_FIELDS`` are decided by the latest run (options that do not change results). ``from_dict`` refuses
    unknown keys (:func:`~normlab.runner.io.from_fields`); the spec's own ``__post_init__`` judges the values.
    """

    LIST_FIELDS: ClassVar[tuple[str, ...]] = ()
    NEWER_FIELDS: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in self.LIST_FIELDS:
            d[k] = list(d[k])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        return from_fields(cls, d)

    def settings(self) -> dict[str, Any]:
        """What must agree between the grids that share a directory (JSON values): every field but the lists and
        the newer fields."""
        skip = (*self.LIST_FIELDS, *self.NEWER_FIELDS)
        return to_jsonable({k: v for k, v in self.to_dict().items() if k not in skip})


def unique(owner: str, what: str, seq: Sequence) -> tuple:
    """``seq`` as a tuple: at least one value, no value twice (a :class:`FieldError` naming ``what``)."""
    seq = tuple(seq)
    if not seq:
        raise FieldError(owner, what, "expected at least one value, got none")
    if len(set(seq)) != len(seq):
        raise FieldError(owner, what, f"expected distinct values, got duplicates in {','.join(map(str, seq))}")
    return seq


@dataclass(frozen=True)
class Cell:
    """One training run of a grid: comparison ``name`` at (``lr``, ``batch_size``, ``seed``) and its config."""

    name: str
    lr: float
    batch_size: int
    seed: int
    config: TrainConfig

    @property
    def cell_id(self) -> str:
        name = re.sub(r"[^A-Za-z0-9.+-]+", "-", self.name.replace("=", ""))
        return f"{name}_lr{_fmt_num(self.lr)}_bs{self.batch_size}_s{self.seed}"


@dataclass
class GridSpec(DictSpec):
    """A comparison grid, checked once when it is made (a :class:`FieldError` naming the field).

    ``layout="product"`` runs every (norm, lr, batch size, seed); ``"cross"`` runs a learning-rate sweep at
    ``base_batch_size`` plus a batch-size sweep at ``base_lr`` (defaults: the first value of each list).
    ``lr_scaling`` (``none``, ``linear``, ``sqrt``) scales a cell's learning rate by ``batch_size /
    base_batch_size`` (or its square root); the unscaled lr stays the cell's grid coordinate. ``train_kwargs`` are
    further :class:`~normlab.runner.training.config.TrainConfig` fields shared by every cell (checked by it).
    """

    LIST_FIELDS: ClassVar[tuple[str, ...]] = ("norms", "lrs", "batch_sizes", "seeds")  # a rerun may add to these
    NEWER_FIELDS: ClassVar[tuple[str, ...]] = ("train_kwargs",)  # its RESUME_FREE options: see settings()

    norms: Sequence[str] = DEFAULT_NORMS
    lrs: Sequence[float] = (_DEFAULTS.lr,)
    batch_sizes: Sequence[int] = (_DEFAULTS.batch_size,)
    seeds: Sequence[int] = DEFAULT_SEEDS
    epochs: int = _DEFAULTS.epochs
    dataset: str = _DEFAULTS.dataset
    model: str = _DEFAULTS.model
    width: float = _DEFAULTS.width
    layout: str = "product"
    base_lr: float | None = None
    base_batch_size: int | None = None
    lr_scaling: str = "none"
    target_acc: float | None = None
    max_steps_per_epoch: int | None = None
    train_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.norms = unique("GridSpec", "norms", (str(n).strip().lower() for n in self.norms))
        self.lrs = unique("GridSpec", "lrs", (float(x) for x in self.lrs))
        self.batch_sizes = unique("GridSpec", "batch_sizes", (int(x) for x in self.batch_sizes))
        self.seeds = unique("GridSpec", "seeds", (int(x) for x in self.seeds))
        self._import_factories()
        self._variants = {n: parse_variant(n) for n in self.norms}  # each name parsed once, here
        self._check_values()
        self.base_lr = float(self.lrs[0] if self.base_lr is None else self.base_lr)
        self.base_batch_size = int(self.batch_sizes[0] if self.base_batch_size is None else self.base_batch_size)
        self._check_cross()

    def _bad(self, name: str, problem: str, refs: tuple[str, ...] = ()) -> None:
        raise FieldError("GridSpec", name, problem, refs)

    def _import_factories(self) -> None:
        """Resolve the data, model, loss and metric names (importing a ``pkg.module:function``'s module) before
        the norms are parsed: the module may register a norm the grid names."""
        resolve("data", self.dataset, owner="GridSpec", field="dataset")
        resolve("model", self.model, owner="GridSpec", field="model")
        for kind in ("loss", "metric"):
            if isinstance(self.train_kwargs.get(kind), str):
                resolve(kind, self.train_kwargs[kind], owner="GridSpec", field=kind)

    def _check_values(self) -> None:
        if any(not (lr > 0 and math.isfinite(lr)) for lr in self.lrs):
            self._bad("lrs", f"expected positive finite learning rates, got {','.join(map(str, self.lrs))}")
        if any(b < 1 for b in self.batch_sizes):
            self._bad("batch_sizes", f"expected batch sizes >= 1, got {','.join(map(str, self.batch_sizes))}")
        if any(s < 0 for s in self.seeds):
            self._bad("seeds", f"expected seeds >= 0, got {','.join(map(str, self.seeds))}")
        if self.epochs < 1:
            self._bad("epochs", f"expected an integer >= 1, got {self.epochs}")
        if self.layout not in LAYOUTS:
            self._bad("layout", f"expected one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.lr_scaling not in LR_SCALINGS:
            self._bad("lr_scaling", f"expected one of {', '.join(LR_SCALINGS)}, got {self.lr_scaling!r}")
        if self.base_batch_size is not None and int(self.base_batch_size) < 1:
            self._bad("base_batch_size", f"expected an integer >= 1, got {self.base_batch_size}")

    def _check_cross(self) -> None:
        if self.layout != "cross":
            return
        if self.base_lr not in self.lrs:
            self._bad(
                "base_lr",
                f"expected one of {{lrs}} ({','.join(map(str, self.lrs))}) with {{layout}} cross, got {self.base_lr:g}",
                ("lrs", "layout"),
            )
        if self.base_batch_size not in self.batch_sizes:
            values = ",".join(map(str, self.batch_sizes))
            self._bad(
                "base_batch_size",
                f"expected one of {{batch_sizes}} ({values}) with {{layout}} cross, got {self.base_batch_size}",
                ("batch_sizes", "layout"),
            )

    def settings(self) -> dict[str, Any]:
        """What must agree between grids that share a directory: every field but the lists and the RESUME_FREE
        options (as JSON values, the run options flattened in)."""
        d = to_jsonable({k: v for k, v in self.to_dict().items() if k not in self.LIST_FIELDS})
        d.update({k: v for k, v in d.pop("train_kwargs").items() if k not in RESUME_FREE})
        if self.layout == "product":
            d.pop("base_lr")  # only a report coordinate in a product grid
            if self.lr_scaling == "none":
                d.pop("base_batch_size")
        return d

    def variant(self, name: str) -> tuple[str, str, dict[str, Any]]:
        """``(norm, conv, conv_kwargs)`` of one of :attr:`norms`, as parsed when the spec was made."""
        norm, conv, kwargs = self._variants[name]
        return norm, conv, dict(kwargs)

    def points(self) -> list[tuple[float, int]]:
        """The (lr, batch size) points of the grid, in run order."""
        if self.layout == "product":
            return list(itertools.product(self.lrs, self.batch_sizes))
        pts = [(lr, self.base_batch_size) for lr in self.lrs]
        return pts + [(self.base_lr, b) for b in self.batch_sizes if b != self.base_batch_size]

    def cell_lr(self, lr: float, batch_size: int) -> float:
        """Learning rate actually used by a cell at grid point (lr, batch_size)."""
        ratio = batch_size / self.base_batch_size
        return lr * {"linear": ratio, "sqrt": math.sqrt(ratio)}.get(self.lr_scaling, 1.0)


def _parse_value(kind: type, text: str):
    if kind is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(text)
        return text.lower() in ("true", "1")
    return kind(text)


def parse_variant(name: str) -> tuple[str, str, dict[str, Any]]:
    """``"pws:gamma=1e-2:relative_gamma=true"`` -> ``("none", "pws", {"gamma": 0.01, "relative_gamma": True})``.

    The part before the first colon is a comparison name; each further part is ``key=value`` for the conv layers,
    with a key among the conv kind's options (:attr:`normlab.nn.ConvEntry.options`: ``eps`` for ws; ``gamma``,
    ``relative_gamma``, ``init_alpha``, ``fan_mode`` for pws; those of a registered conv).
    """
    base, *parts = str(name).strip().lower().split(":")
    norm, conv = resolve_name(base, "norms", "GridSpec")
    options = conv_entry(conv).options
    kwargs: dict[str, Any] = {}
    for part in parts:
        key, _, text = part.partition("=")
        if key not in options or not text:
            takes = f"<name>:key=value with key in {', '.join(options)}" if options else "no options"
            raise FieldError("GridSpec", "norms", f"variant {name!r}: expected {takes} for a {conv} conv, got {part!r}")
        try:
            kwargs[key] = _parse_value(options[key], text)
        except ValueError:
            raise FieldError(
                "GridSpec", "norms", f"variant {name!r}: {key} must be a {options[key].__name__}, got {text!r}"
            ) from None
    return norm, conv, kwargs


def expand_grid(spec: GridSpec, data_cache: str | os.PathLike | None = None) -> list[Cell]:
    """All cells of ``spec``: one per (comparison name, grid point, seed), each with its :class:`TrainConfig`,
    built and validated here once (the cells' trainers trust it). ``data_cache``: where the cells of a generated
    data set (mnist1d) without a ``data_dir`` cache it."""
    shared = dict(spec.train_kwargs)
    if data_cache is not None and spec.dataset == "mnist1d" and shared.get("data_dir") is None:
        shared["data_dir"] = str(data_cache)
    cells = []
    for name in spec.norms:
        norm, conv, conv_kwargs = spec.variant(name)
        for (lr, bs), seed in itertools.product(spec.points(), spec.seeds):
            cfg = TrainConfig.from_dict(
                {
                    **shared,
                    "conv_kwargs": conv_kwargs,
                    "dataset": spec.dataset,
                    "model": spec.model,
                    "norm": norm,
                    "conv": conv,
                    "width": spec.width,
                    "lr": spec.cell_lr(lr, bs),
                    "batch_size": bs,
                    "epochs": spec.epochs,
                    "seed": seed,
                    "target_acc": spec.target_acc,
                    "max_steps_per_epoch": spec.max_steps_per_epoch,
                }
            ).validate()
            cells.append(Cell(name=name, lr=lr, batch_size=bs, seed=seed, config=cfg))
    return cells
