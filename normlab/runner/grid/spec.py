"""Grids of training runs: comparison name x learning rate x batch size x seed.

A :class:`GridSpec` describes the grid; :func:`expand_grid` turns it into :class:`Cell` objects, one
:func:`~normlab.runner.training.train.train` call each (:mod:`normlab.runner.grid.execute` runs them).

Comparison names are resolved by :func:`normlab.nn.resolve_comparison` (``bn``, ``pws``, ``ws+gn``, ...) and may
carry constructor arguments of their conv layers after colons: ``pws:gamma=1e-2``,
``pws:gamma=1e-3:relative_gamma=true`` (see :func:`parse_variant`).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from normlab.nn import resolve_comparison
from normlab.runner.errors import UsageError
from normlab.runner.io import DictSpec
from normlab.runner.training.config import TrainConfig

__all__ = ["GridSpec", "Cell", "expand_grid", "parse_variant", "DEFAULT_NORMS", "LAYOUTS", "LR_SCALINGS"]

DEFAULT_NORMS = ("none", "bn", "brn", "gn", "sn", "wn", "ws", "pws")
LAYOUTS = ("product", "cross")
LR_SCALINGS = ("none", "linear", "sqrt")


def _fmt_num(x: float) -> str:
    """Compact, filesystem-safe number for cell ids (0.05 -> 0.05, 1e-3 -> 0.001)."""
    return f"{x:g}".replace("+", "")


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


def _unique(what: str, seq: Sequence) -> tuple:
    seq = tuple(seq)
    if not seq:
        raise UsageError(f"GridSpec: {what} must not be empty")
    if len(set(seq)) != len(seq):
        raise UsageError(f"GridSpec: {what} has duplicates: {list(seq)}")
    return seq


@dataclass
class GridSpec(DictSpec):
    """A comparison grid.

    ``layout="product"`` runs every (norm, lr, batch size, seed); ``"cross"`` runs a learning-rate sweep at
    ``base_batch_size`` plus a batch-size sweep at ``base_lr`` (defaults: the first value of each list).
    ``lr_scaling`` (``none``, ``linear``, ``sqrt``) scales a cell's learning rate by ``batch_size /
    base_batch_size`` (or its square root); the unscaled lr stays the cell's grid coordinate. ``train_kwargs`` are
    further :class:`~normlab.runner.training.config.TrainConfig` fields shared by every cell.
    """

    LIST_FIELDS: ClassVar[tuple[str, ...]] = ("norms", "lrs", "batch_sizes", "seeds")  # a rerun may add to these

    norms: Sequence[str] = DEFAULT_NORMS
    lrs: Sequence[float] = (0.05,)
    batch_sizes: Sequence[int] = (64,)
    seeds: Sequence[int] = (0,)
    epochs: int = 10
    dataset: str = "digits"
    model: str = "plain"
    width: float = 1.0
    layout: str = "product"
    base_lr: float | None = None
    base_batch_size: int | None = None
    lr_scaling: str = "none"
    target_acc: float | None = None
    max_steps_per_epoch: int | None = None
    train_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.norms = _unique("norms", (str(n).strip().lower() for n in self.norms))
        self.lrs = _unique("lrs", (float(x) for x in self.lrs))
        self.batch_sizes = _unique("batch_sizes", (int(x) for x in self.batch_sizes))
        self.seeds = _unique("seeds", (int(x) for x in self.seeds))
        for n in self.norms:
            parse_variant(n)
        self._check_values()
        self.base_lr = float(self.lrs[0] if self.base_lr is None else self.base_lr)
        self.base_batch_size = int(self.batch_sizes[0] if self.base_batch_size is None else self.base_batch_size)
        if self.layout == "cross" and self.base_lr not in self.lrs:
            raise UsageError(f"GridSpec: base_lr {self.base_lr} is not in lrs {list(self.lrs)}")
        if self.layout == "cross" and self.base_batch_size not in self.batch_sizes:
            raise UsageError(f"GridSpec: base_batch_size {self.base_batch_size} is not in batch_sizes "
                             f"{list(self.batch_sizes)}")

    def _check_values(self) -> None:
        if any(not (lr > 0 and math.isfinite(lr)) for lr in self.lrs):
            raise UsageError(f"GridSpec: lrs must be positive finite numbers, got {list(self.lrs)}")
        if any(b < 1 for b in self.batch_sizes):
            raise UsageError(f"GridSpec: batch_sizes must be >= 1, got {list(self.batch_sizes)}")
        if any(s < 0 for s in self.seeds):
            raise UsageError(f"GridSpec: seeds must be >= 0, got {list(self.seeds)}")
        if self.epochs < 1:
            raise UsageError(f"GridSpec: epochs must be >= 1, got {self.epochs}")
        if self.layout not in LAYOUTS:
            raise UsageError(f"GridSpec: layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.lr_scaling not in LR_SCALINGS:
            raise UsageError(f"GridSpec: lr_scaling must be one of {', '.join(LR_SCALINGS)}, got {self.lr_scaling!r}")
        if self.base_batch_size is not None and int(self.base_batch_size) < 1:
            raise UsageError(f"GridSpec: base_batch_size must be >= 1, got {self.base_batch_size}")

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


_VARIANT_ARGS = {"gamma": float, "relative_gamma": bool, "init_alpha": bool, "eps": float, "fan_mode": str}


def _parse_value(kind: type, text: str):
    if kind is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(text)
        return text.lower() in ("true", "1")
    return kind(text)


def parse_variant(name: str) -> tuple[str, str, dict[str, Any]]:
    """``"pws:gamma=1e-2:relative_gamma=true"`` -> ``("none", "pws", {"gamma": 0.01, "relative_gamma": True})``.

    The part before the first colon is a comparison name; each further part is ``key=value`` for the conv layers
    (``gamma``, ``relative_gamma``, ``init_alpha``, ``eps``, ``fan_mode``; only for ws/pws convs).
    """
    base, *parts = str(name).strip().lower().split(":")
    try:
        norm, conv = resolve_comparison(base)
    except ValueError as e:
        raise UsageError(str(e)) from None
    kwargs: dict[str, Any] = {}
    for part in parts:
        key, _, text = part.partition("=")
        if key not in _VARIANT_ARGS or not text or conv not in ("ws", "pws"):
            raise UsageError(f"variant {name!r}: expected <name>:key=value with key in {', '.join(_VARIANT_ARGS)} "
                             f"for a ws/pws conv, got {part!r}")
        try:
            kwargs[key] = _parse_value(_VARIANT_ARGS[key], text)
        except ValueError:
            raise UsageError(f"variant {name!r}: {key} must be a {_VARIANT_ARGS[key].__name__}, got {text!r}") from None
    return norm, conv, kwargs


def expand_grid(spec: GridSpec) -> list[Cell]:
    """All cells of ``spec``: one per (comparison name, grid point, seed), each with its :class:`TrainConfig`."""
    cells = []
    for name in spec.norms:
        norm, conv, conv_kwargs = parse_variant(name)
        for (lr, bs), seed in itertools.product(spec.points(), spec.seeds):
            cfg = TrainConfig.from_dict({
                **spec.train_kwargs, "conv_kwargs": conv_kwargs, "dataset": spec.dataset, "model": spec.model,
                "norm": norm, "conv": conv,
                "width": spec.width, "lr": spec.cell_lr(lr, bs), "batch_size": bs, "epochs": spec.epochs,
                "seed": seed, "target_acc": spec.target_acc, "max_steps_per_epoch": spec.max_steps_per_epoch,
            })
            cells.append(Cell(name=name, lr=lr, batch_size=bs, seed=seed, config=cfg))
    return cells
