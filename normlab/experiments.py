"""Grids of training runs: normalization x learning rate x batch size x seed.

A grid is described by a :class:`GridSpec`. :func:`expand_grid` turns it into :class:`Cell` objects, one
:func:`normlab.train.train` call each, written to ``<out>/runs/<cell id>/``. :func:`run_grid` runs the
cells (in worker processes when ``workers > 1``), skips cells that already have a ``summary.json``
(a partially trained cell resumes from its checkpoint inside ``train``), then aggregates the per-cell
summaries over seeds into ``results.json`` and renders the report (:mod:`normlab.report`).

Comparison names are the vocabulary of the PWS paper: ``none``, ``bn``, ``brn``, ``gn``, ``sn`` (and
``ln``, ``in``) are output normalizations used with a plain conv; ``wn``, ``ws``, ``pws`` are weight
reparametrizations used without an output normalization. ``<conv>+<norm>`` (e.g. ``ws+gn``) combines them.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Fallbacks used only if normlab.nn.factory is not importable (names from the shared API contract).
_FALLBACK_NORM_NAMES = ("none", "bn", "brn", "gn", "ln", "in", "sn")
_FALLBACK_CONV_KINDS = ("conv", "wn", "ws", "pws")

DEFAULT_NORMS = ("none", "bn", "brn", "gn", "sn", "wn", "ws", "pws")
LAYOUTS = ("product", "cross")
RESULTS_VERSION = 1


def norm_names() -> tuple[str, ...]:
    """Output-normalization names known to the factory (``none``, ``bn``, ``brn``, ...)."""
    try:
        from normlab.nn.factory import NORM_NAMES

        return tuple(NORM_NAMES)
    except ImportError:
        return _FALLBACK_NORM_NAMES


def conv_kinds() -> tuple[str, ...]:
    """Conv kinds known to the factory (``conv``, ``wn``, ``ws``, ``pws``)."""
    try:
        from normlab.nn.factory import CONV_KINDS

        return tuple(CONV_KINDS)
    except ImportError:
        return _FALLBACK_CONV_KINDS


def comparison_names() -> tuple[str, ...]:
    """All single comparison names: every norm (with a plain conv) and every non-plain conv kind (no norm)."""
    return tuple(norm_names()) + tuple(k for k in conv_kinds() if k != "conv")


def resolve_norm(name: str) -> tuple[str, str]:
    """Map a comparison name to ``(norm, conv)`` for :class:`normlab.train.TrainConfig`.

    ``bn -> (bn, conv)``, ``pws -> (none, pws)``, ``ws+gn -> (gn, ws)``. Unknown names raise ValueError
    listing the valid ones.
    """
    norms, convs = norm_names(), conv_kinds()
    key = name.strip().lower()
    parts = [p for p in key.split("+") if p]
    if len(parts) == 1:
        (p,) = parts
        if p in norms:
            return p, "conv"
        if p in convs and p != "conv":
            return "none", p
    elif len(parts) == 2:
        conv = [p for p in parts if p in convs]
        norm = [p for p in parts if p in norms and p not in convs]
        if len(conv) == 1 and len(norm) == 1:
            return norm[0], conv[0]
    raise ValueError(
        f"resolve_norm: unknown normalization {name!r}; valid names: {', '.join(comparison_names())} "
        f"or '<conv>+<norm>' with conv in {{{', '.join(c for c in convs if c != 'conv')}}} "
        f"and norm in {{{', '.join(n for n in norms if n != 'none')}}} (e.g. ws+gn)"
    )


def _fmt_num(x: float) -> str:
    """Compact, filesystem-safe number formatting for cell ids (0.05 -> 0.05, 1e-3 -> 0.001)."""
    s = f"{x:g}"
    return s.replace("+", "")


@dataclass(frozen=True)
class Cell:
    """One training run of a grid: comparison ``name`` at (lr, batch_size, seed) with a full config dict."""

    name: str
    lr: float
    batch_size: int
    seed: int
    config: dict[str, Any]

    @property
    def cell_id(self) -> str:
        return f"{self.name}_lr{_fmt_num(self.lr)}_bs{self.batch_size}_s{self.seed}"


@dataclass
class GridSpec:
    """A comparison grid.

    ``layout="product"`` runs every (norm, lr, batch size, seed). ``layout="cross"`` runs a learning-rate
    sweep at ``base_batch_size`` plus a batch-size sweep at ``base_lr`` (defaults: the first value of each
    list), which is what the paper's two headline comparisons need and costs far less.
    ``lr_scaling`` ("none" | "linear" | "sqrt") scales the learning rate of a cell by
    (batch_size / base_batch_size) or its square root; the unscaled lr stays the cell's grid coordinate.
    ``train_kwargs`` are extra :class:`normlab.train.TrainConfig` fields shared by every cell.
    """

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
        self.norms = tuple(self.norms)
        self.lrs = tuple(float(x) for x in self.lrs)
        self.batch_sizes = tuple(int(x) for x in self.batch_sizes)
        self.seeds = tuple(int(x) for x in self.seeds)
        for what, seq in (("norms", self.norms), ("lrs", self.lrs), ("batch_sizes", self.batch_sizes),
                          ("seeds", self.seeds)):
            if not seq:
                raise ValueError(f"GridSpec: {what} must not be empty")
            if len(set(seq)) != len(seq):
                raise ValueError(f"GridSpec: {what} has duplicates: {list(seq)}")
        for n in self.norms:
            resolve_norm(n)
        if any(not (lr > 0 and math.isfinite(lr)) for lr in self.lrs):
            raise ValueError(f"GridSpec: lrs must be positive finite numbers, got {list(self.lrs)}")
        if any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"GridSpec: batch_sizes must be >= 1, got {list(self.batch_sizes)}")
        if self.epochs < 1:
            raise ValueError(f"GridSpec: epochs must be >= 1, got {self.epochs}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"GridSpec: layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.lr_scaling not in ("none", "linear", "sqrt"):
            raise ValueError(f"GridSpec: lr_scaling must be none, linear or sqrt, got {self.lr_scaling!r}")
        if self.base_lr is None:
            self.base_lr = self.lrs[0]
        if self.base_batch_size is None:
            self.base_batch_size = self.batch_sizes[0]
        self.base_lr = float(self.base_lr)
        self.base_batch_size = int(self.base_batch_size)
        if self.layout == "cross":
            if self.base_lr not in self.lrs:
                raise ValueError(f"GridSpec: base_lr {self.base_lr} is not in lrs {list(self.lrs)}")
            if self.base_batch_size not in self.batch_sizes:
                raise ValueError(
                    f"GridSpec: base_batch_size {self.base_batch_size} is not in batch_sizes {list(self.batch_sizes)}"
                )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("norms", "lrs", "batch_sizes", "seeds"):
            d[k] = list(d[k])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GridSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def points(self) -> list[tuple[float, int]]:
        """The (lr, batch size) points of the grid, in run order."""
        if self.layout == "product":
            return list(itertools.product(self.lrs, self.batch_sizes))
        pts = [(lr, self.base_batch_size) for lr in self.lrs]
        pts += [(self.base_lr, b) for b in self.batch_sizes if b != self.base_batch_size]
        return pts

    def cell_lr(self, lr: float, batch_size: int) -> float:
        """Learning rate actually used by a cell at grid point (lr, batch_size)."""
        ratio = batch_size / self.base_batch_size
        if self.lr_scaling == "linear":
            return lr * ratio
        if self.lr_scaling == "sqrt":
            return lr * math.sqrt(ratio)
        return lr


def expand_grid(spec: GridSpec) -> list[Cell]:
    """All cells of ``spec``: one per (comparison name, grid point, seed), each with its TrainConfig dict."""
    cells = []
    for name in spec.norms:
        norm, conv = resolve_norm(name)
        for lr, bs in spec.points():
            for seed in spec.seeds:
                cfg = dict(spec.train_kwargs)
                cfg.update(
                    dataset=spec.dataset, model=spec.model, norm=norm, conv=conv, width=spec.width,
                    lr=spec.cell_lr(lr, bs), batch_size=bs, epochs=spec.epochs, seed=seed,
                    target_acc=spec.target_acc, max_steps_per_epoch=spec.max_steps_per_epoch,
                )
                cells.append(Cell(name=name, lr=lr, batch_size=bs, seed=seed, config=cfg))
    return cells


# --------------------------------------------------------------------------------------------------
# Feasibility checks (before any training starts)
# --------------------------------------------------------------------------------------------------

def check_feasible(config: dict[str, Any], *, data: tuple | None = None) -> None:
    """Refuse impossible runs before training: unknown names, batch size larger than the training set,
    input too small for the model. Raises ValueError with a one-line reason.

    ``data`` may pass an already loaded ``(train_ds, test_ds, info)`` to avoid reloading.
    """
    import torch

    from normlab import data as nl_data
    from normlab import models as nl_models

    name = config.get("dataset", "digits")
    if name not in nl_data.DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid datasets: {', '.join(nl_data.DATASETS)}")
    model = config.get("model", "plain")
    if model not in nl_models.MODELS:
        raise ValueError(f"unknown model {model!r}; valid models: {', '.join(nl_models.MODELS)}")
    norm, conv = config.get("norm", "bn"), config.get("conv", "conv")
    if norm not in norm_names():
        raise ValueError(f"unknown norm {norm!r}; valid norms: {', '.join(norm_names())}")
    if conv not in conv_kinds():
        raise ValueError(f"unknown conv kind {conv!r}; valid conv kinds: {', '.join(conv_kinds())}")
    if data is None:
        data = nl_data.get_dataset(name, data_dir=config.get("data_dir"))
    train_ds, _test_ds, info = data
    n_train = len(train_ds)
    bs = int(config.get("batch_size", 64))
    if bs > n_train:
        raise ValueError(f"batch size {bs} is larger than the {name} training set ({n_train} examples)")
    if bs < 1:
        raise ValueError(f"batch size must be >= 1, got {bs}")
    input_shape = tuple(info["input_shape"])
    # build_model itself refuses known impossible shapes with a one-line ValueError; a dry forward pass
    # catches whatever else cannot run (e.g. a kernel larger than the remaining feature map).
    net = nl_models.build_model(
        model, norm=norm, conv=conv, in_channels=info["in_channels"], num_classes=info["num_classes"],
        input_shape=input_shape, width=config.get("width", 1.0),
    )
    net.eval()
    try:
        with torch.no_grad():
            out = net(torch.zeros(2, *input_shape))
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"model {model!r} (norm={norm}, conv={conv}, width={config.get('width', 1.0)}) cannot run on "
            f"{name} input of shape {input_shape}: {first}"
        ) from e
    if out.shape[-1] != info["num_classes"]:
        raise ValueError(f"model {model!r} outputs {out.shape[-1]} classes, {name} has {info['num_classes']}")


# --------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------

def check_grid(spec: GridSpec, cells: Sequence[Cell] | None = None) -> None:
    """Run :func:`check_feasible` once per distinct (norm, conv, batch size) of the grid."""
    from normlab import data as nl_data

    if spec.dataset not in nl_data.DATASETS:
        raise ValueError(f"unknown dataset {spec.dataset!r}; valid datasets: {', '.join(nl_data.DATASETS)}")
    data = nl_data.get_dataset(spec.dataset, data_dir=spec.train_kwargs.get("data_dir"))
    seen = set()
    for c in cells if cells is not None else expand_grid(spec):
        key = (c.config["norm"], c.config["conv"], c.batch_size)
        if key not in seen:
            seen.add(key)
            check_feasible(c.config, data=data)


_RESUME_FREE = ("num_workers", "data_dir", "device")  # config fields that may change between runs of a cell


def _cell_done(cell_dir: Path, cell: Cell) -> dict[str, Any] | None:
    """The cell's summary if ``summary.json`` exists, else None.

    A summary written by a different config (e.g. the grid was rerun with more epochs into the same
    directory) raises ValueError: results are never silently overwritten, as in :func:`normlab.train.train`.
    """
    path = cell_dir / "summary.json"
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"run_grid: {path} is unreadable ({e}); move the cell directory away to rerun it") from e
    saved = summary.get("config", {})
    want = json.loads(json.dumps(cell.config, default=_json_default))
    diff = []
    for k, v in want.items():
        if k in _RESUME_FREE or k not in saved:
            continue
        w = saved[k]
        same = math.isclose(float(w), float(v), rel_tol=1e-9) if isinstance(v, float) and w is not None else w == v
        if not same:
            diff.append(f"{k}: {w!r} -> {v!r}")
    if diff:
        raise ValueError(
            f"run_grid: cell {cell.cell_id} in {cell_dir.parent.parent} was run with a different config "
            f"({', '.join(diff)}); use another output directory"
        )
    return summary


def _init_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _run_cell(config: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """Worker entry: one train() call. Returns the summary dict."""
    from normlab.train import TrainConfig, train

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(config) - names)
    if unknown:
        raise ValueError(f"run_grid: TrainConfig has no field(s) {unknown}")
    cfg = dict(config)
    if isinstance(cfg.get("milestones"), list):
        cfg["milestones"] = tuple(cfg["milestones"])
    return train(TrainConfig(**cfg), out_dir, progress=False)


def default_workers() -> int:
    """Number of CPU cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def run_grid(
    spec: GridSpec,
    out_dir: str | os.PathLike,
    *,
    workers: int | None = None,
    progress: bool = True,
    check: bool = True,
    render: bool = True,
    threads: int | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run (or resume) every cell of ``spec`` under ``out_dir/runs`` and write results + report.

    Cells with a matching ``summary.json`` are not rerun. ``workers`` > 1 runs cells in that many spawned
    processes with ``threads`` torch threads each (default 1); ``workers`` defaults to the number of usable
    cores, capped by the number of cells left. With one worker the cells run in this process, with
    ``threads`` torch threads if given (small models on a busy machine run far faster with 1 thread).
    Returns the results dict also written to ``out_dir/results.json``.
    """
    from tqdm.auto import tqdm

    out = Path(out_dir)
    runs = out / "runs"
    cells = expand_grid(spec)
    say = log or (lambda s: tqdm.write(s, file=sys.stderr))

    if check:
        check_grid(spec, cells)

    summaries: dict[str, dict[str, Any]] = {}
    todo: list[Cell] = []
    for c in cells:
        s = _cell_done(runs / c.cell_id, c)
        if s is None:
            todo.append(c)
        else:
            summaries[c.cell_id] = s
    if summaries:
        say(f"normlab compare: {len(summaries)} of {len(cells)} cells already done (skipped)")
    runs.mkdir(parents=True, exist_ok=True)
    (out / "grid.json").write_text(json.dumps(spec.to_dict(), indent=2))

    n_workers = default_workers() if workers in (None, 0) else int(workers)
    n_workers = max(1, min(n_workers, len(todo))) if todo else 1
    t0 = time.perf_counter()
    bar = tqdm(total=len(cells), initial=len(summaries), desc="grid", unit="run", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)

    n_classes = _num_classes(spec)

    def _done(c: Cell, s: dict[str, Any]) -> None:
        summaries[c.cell_id] = s
        # partial results after every cell, so `normlab report DIR` works while the grid runs or after a kill
        finished = [(x, summaries[x.cell_id]) for x in cells if x.cell_id in summaries]
        write_results(collect_results(spec, finished, n_classes, complete=False), out)
        bar.update(1)
        flag = " COLLAPSED" if s.get("collapsed") else ""
        acc = s.get("final_test_acc")
        bar.set_postfix_str(f"last {c.cell_id}: acc {'n/a' if acc is None else f'{acc:.3f}'}{flag}")

    import torch

    saved_threads = torch.get_num_threads()
    try:
        if n_workers == 1:
            if threads:
                torch.set_num_threads(int(threads))
            for c in todo:
                _done(c, _run_cell(c.config, str(runs / c.cell_id)))
        else:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor, as_completed

            ctx = mp.get_context("spawn")
            with ProcessPoolExecutor(max_workers=n_workers, mp_context=ctx, initializer=_init_worker,
                                     initargs=(int(threads or 1),)) as pool:
                futs = {pool.submit(_run_cell, c.config, str(runs / c.cell_id)): c for c in todo}
                try:
                    for f in as_completed(futs):
                        _done(futs[f], f.result())
                except BaseException:
                    # a failed cell (or Ctrl-C) stops the grid now: queued cells are cancelled instead of all
                    # being run before the error shows; cells already running finish (or resume next time)
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise
    finally:
        torch.set_num_threads(saved_threads)
        bar.close()
    if todo:
        say(f"normlab compare: ran {len(todo)} cells with {n_workers} worker(s) in "
            f"{time.perf_counter() - t0:.1f} s")

    results = collect_results(spec, [(c, summaries[c.cell_id]) for c in cells], n_classes)
    write_results(results, out)
    if render:
        from normlab.report import render_report

        render_report(results, out)
    return results


# --------------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------------

def _mean_std(xs: Sequence[float]) -> tuple[float | None, float | None]:
    xs = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    if len(xs) == 1:
        return m, 0.0
    v = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)  # sample std over seeds
    return m, math.sqrt(v)


def _num_classes(spec: GridSpec) -> int | None:
    try:
        from normlab import data as nl_data

        _tr, _te, info = nl_data.get_dataset(spec.dataset, data_dir=spec.train_kwargs.get("data_dir"))
        return int(info["num_classes"])
    except Exception:  # noqa: BLE001 - only used to annotate chance level in the report
        return None


def collect_results(
    spec: GridSpec, pairs: Sequence[tuple[Cell, dict[str, Any]]], num_classes: int | None = None, complete: bool = True
) -> dict[str, Any]:
    """Aggregate per-cell summaries over seeds into groups keyed by (name, lr, batch size).

    ``complete=False`` marks a grid still running (results.json is rewritten after every finished cell).
    """
    cells_out = []
    groups: dict[tuple[str, float, int], list[dict[str, Any]]] = {}
    for c, s in pairs:
        rec = {
            "cell": c.cell_id, "name": c.name, "lr": c.lr, "batch_size": c.batch_size, "seed": c.seed,
            "norm": c.config["norm"], "conv": c.config["conv"], "train_lr": c.config["lr"],
            "final_test_acc": s.get("final_test_acc"), "best_test_acc": s.get("best_test_acc"),
            "collapsed": bool(s.get("collapsed")), "collapse_epoch": s.get("collapse_epoch"),
            "epochs_to_target": s.get("epochs_to_target"), "step_time_s": s.get("step_time_s"),
            "epochs_run": s.get("epochs_run"),
            "history": [
                {k: h.get(k) for k in ("epoch", "train_loss", "train_acc", "test_loss", "test_acc")}
                for h in s.get("history", [])
            ],
        }
        cells_out.append(rec)
        groups.setdefault((c.name, c.lr, c.batch_size), []).append(rec)

    group_out = []
    for (name, lr, bs), recs in groups.items():
        def acc(key: str, recs=recs) -> list[float]:
            # A collapsed run's accuracy counts as recorded (chance level), non-finite values are dropped.
            return [r[key] for r in recs if r[key] is not None]

        fm, fs = _mean_std(acc("final_test_acc"))
        bm, bsd = _mean_std(acc("best_test_acc"))
        ett = [r["epochs_to_target"] for r in recs if r["epochs_to_target"] is not None]
        em, _ = _mean_std(ett)
        st, _ = _mean_std([r["step_time_s"] for r in recs if r["step_time_s"] is not None])
        group_out.append({
            "name": name, "lr": lr, "batch_size": bs, "n_seeds": len(recs),
            "final_mean": fm, "final_std": fs, "best_mean": bm, "best_std": bsd,
            "collapsed_count": sum(r["collapsed"] for r in recs),
            "target_reached": len(ett), "epochs_to_target_mean": em, "step_time_s": st,
        })
    return {
        "version": RESULTS_VERSION,
        "spec": spec.to_dict(),
        "num_classes": num_classes if num_classes is not None else _num_classes(spec),
        "complete": complete,
        "groups": group_out,
        "cells": cells_out,
    }


def write_results(results: dict[str, Any], out_dir: str | os.PathLike) -> Path:
    """Write ``results.json`` atomically (temp file then rename)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_finite(results), indent=1, allow_nan=False, default=_json_default))
    os.replace(tmp, path)
    return path


def _finite(o: Any) -> Any:
    """Replace non-finite floats (a diverged run's loss) by None so results.json stays strict JSON."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def _json_default(o: Any) -> Any:
    if isinstance(o, tuple):
        return list(o)
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"write_results: cannot serialise {type(o).__name__}")


def load_results(out_dir: str | os.PathLike) -> dict[str, Any]:
    """Read ``results.json`` from a compare/demo output directory (clear error if missing or corrupt)."""
    path = Path(out_dir) / "results.json"
    if not path.is_file():
        raise FileNotFoundError(f"load_results: no results.json in {Path(out_dir)} (run `normlab compare` first)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"load_results: {path} is not valid JSON: {e}") from e


# --------------------------------------------------------------------------------------------------
# The demo grid (`normlab demo`, `make demo`)
# --------------------------------------------------------------------------------------------------

def demo_spec(quick: bool = False) -> GridSpec:
    """The default grid of ``normlab demo`` on digits (chosen by measurement, see docs/reproduction.md).

    Plain net at width 0.25 (24/48 channels), 2 epochs, seeds 0 and 1, layout "cross":
    a learning-rate sweep 0.01 / 0.03 / 0.1 at batch size 64 (effect 1: which nets fail at a high lr), and
    batch sizes 64 and 2 at lr 0.01 with the same hyperparameters (effect 2: batch-size robustness), for
    none, BN, BRN, GN, SN, WN, WS and PWS. Measured with ``make demo``: 180 CPU seconds, 3 minutes wall on two
    cores shared with other jobs. ``quick=True`` is a seconds-long smoke version that only checks the pipeline.
    """
    if quick:
        return GridSpec(norms=("none", "bn", "gn", "pws"), lrs=(0.01, 0.1), batch_sizes=(64, 8), seeds=(0,),
                        epochs=1, width=0.125, layout="cross", max_steps_per_epoch=5)
    return GridSpec(norms=DEFAULT_NORMS, lrs=(0.01, 0.03, 0.1), batch_sizes=(64, 2), seeds=(0, 1), epochs=2,
                    width=0.25, layout="cross", target_acc=0.9)


# --------------------------------------------------------------------------------------------------
# Training-step cost, measured side by side (`normlab bench --steps`)
# --------------------------------------------------------------------------------------------------

def step_times(
    norms: Sequence[str] = DEFAULT_NORMS,
    *,
    dataset: str = "digits",
    model: str = "plain",
    width: float = 0.25,
    batch_size: int = 64,
    repeats: int = 7,
    iters: int = 5,
    threads: int | None = 1,
) -> dict[str, dict[str, float]]:
    """Seconds per SGD training step (forward, backward, update) of ``model`` with each norm, interleaved.

    Every repeat times ``iters`` steps of every norm, in an order rotated by one each repeat, so slow phases of
    a shared machine hit all norms alike; returns ``{name: {"median_s", "min_s", "ratio_to_pws"?}}`` with the
    median over repeats. Same batch for every step (data loading is not timed).
    """
    import statistics

    import torch
    import torch.nn.functional as F

    from normlab import data as nl_data
    from normlab import models as nl_models

    if threads:
        torch.set_num_threads(int(threads))
    train_ds, _te, info = nl_data.get_dataset(dataset)
    if batch_size > len(train_ds):
        raise ValueError(f"step_times: batch size {batch_size} is larger than the {dataset} training set")
    x, y = train_ds.batch(torch.arange(batch_size))
    nets = {}
    for name in norms:
        norm, conv = resolve_norm(name)
        torch.manual_seed(0)
        net = nl_models.build_model(model, norm=norm, conv=conv, in_channels=info["in_channels"],
                                    num_classes=info["num_classes"], input_shape=info["input_shape"], width=width)
        opt = torch.optim.SGD(net.parameters(), lr=1e-4, momentum=0.9)
        nets[name] = (net.train(), opt)

    def run(name: str, n: int) -> float:
        net, opt = nets[name]
        t0 = time.perf_counter()
        for _ in range(n):
            loss = F.cross_entropy(net(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return (time.perf_counter() - t0) / n

    for name in norms:  # warm-up
        run(name, 2)
    samples: dict[str, list[float]] = {n: [] for n in norms}
    order = list(norms)
    for r in range(repeats):
        for name in order[r % len(order):] + order[: r % len(order)]:
            samples[name].append(run(name, iters))
    out = {n: {"median_s": statistics.median(v), "min_s": min(v)} for n, v in samples.items()}
    if "pws" in out:
        for v in out.values():
            v["ratio_to_pws"] = v["median_s"] / out["pws"]["median_s"]
    return out
