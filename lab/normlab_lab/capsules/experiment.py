"""The capsule routing experiment (seed 001, lab/docs/capsules.md) as an experiment of the grid engine: routing
iterations x gradient through the inner iterations x reconstruction x seeds.

:class:`CapsSpec` describes the grid (checked once, when it is made), :func:`expand_cells` turns it into
:class:`CapsCell` objects, each with its :class:`CapsConfig`, and :data:`CAPSULES` hands them to
:mod:`normlab.runner.grid.execute` with the training function of one cell
(:func:`~normlab_lab.capsules.train.run_cell`): worker processes or Ray, failed-cell records,
resuming and extending a grid in the same directory (``capsules.json``) work as for ``normlab compare``.
:func:`run_capsules` runs one grid and adds the experiment's own timings (wall and CPU time of every invocation
that ran cells, kept across resumes, and a round-robin timing of one training step of every variant, measured
once).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from normlab.runner.errors import FieldError
from normlab.runner.grid.execute import Experiment, GridRun, run_experiment
from normlab.runner.grid.spec import DictSpec, unique
from normlab_lab import PROG
from normlab_lab.capsules.report import render_report
from normlab_lab.capsules.stats import RESULTS_KIND, collect, variant_name
from normlab_lab.capsules.train import coupling_entropy, load_data, run_cell, step_benchmark

__all__ = [
    "CapsSpec",
    "CapsConfig",
    "CapsCell",
    "CAPSULES",
    "GRADS",
    "RECONS",
    "DATASETS",
    "expand_cells",
    "run_cell",
    "run_capsules",
    "coupling_entropy",
    "quick_spec",
    "step_benchmark",
    "RESULTS_KIND",
]

GRADS = ("detached", "full")  # detach_inner=True (naturomics' stop_gradient) / False (the paper's code)
RECONS = ("off", "on")
DATASETS = ("digits", "mnist1d")  # datasets with a CapsNet preset of the same name


def _is_int(v, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


@dataclass
class CapsSpec(DictSpec):
    """A capsule routing grid: every (iterations, grad, recon) variant x seed, trained for ``epochs``.

    ``max_steps_per_epoch`` caps the training steps of an epoch and ``test_subset`` the test examples (quick runs).
    A refused value is a :class:`~normlab.runner.errors.FieldError` naming the field.
    """

    LIST_FIELDS: ClassVar[tuple[str, ...]] = ("iterations", "grads", "recons", "seeds")  # a rerun may add to these

    iterations: tuple = (1, 2, 3, 5)
    grads: tuple = GRADS
    recons: tuple = RECONS
    seeds: tuple = (0, 1, 2, 3, 4)
    epochs: int = 12
    dataset: str = "digits"
    batch_size: int = 64
    lr: float = 1e-3
    max_steps_per_epoch: int | None = None
    test_subset: int | None = None
    data_dir: str | None = None

    def __post_init__(self) -> None:
        self.iterations = unique("CapsSpec", "iterations", self.iterations)
        if not all(_is_int(r, 1) for r in self.iterations):
            self._bad("iterations", f"expected integers >= 1, got {','.join(map(str, self.iterations))}")
        self.grads = self._names("grads", self.grads, GRADS)
        self.recons = self._names("recons", self.recons, RECONS)
        self.seeds = unique("CapsSpec", "seeds", self.seeds)
        if not all(_is_int(s, 0) for s in self.seeds):
            self._bad("seeds", f"expected integers >= 0, got {','.join(map(str, self.seeds))}")
        if self.dataset not in DATASETS:
            self._bad("dataset", f"unknown dataset {self.dataset!r}; valid: {', '.join(DATASETS)}")
        for name in ("epochs", "batch_size"):
            if not _is_int(getattr(self, name), 1):
                self._bad(name, f"expected an integer >= 1, got {getattr(self, name)!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            self._bad("lr", f"expected a positive finite number, got {self.lr!r}")
        for name in ("max_steps_per_epoch", "test_subset"):
            if getattr(self, name) is not None and not _is_int(getattr(self, name), 1):
                self._bad(name, f"expected an integer >= 1, got {getattr(self, name)!r}")

    def _bad(self, name: str, problem: str) -> None:
        raise FieldError("CapsSpec", name, problem)

    def _names(self, name: str, values, valid: tuple[str, ...]) -> tuple:
        values = unique("CapsSpec", name, (str(v).lower() for v in values))
        bad = [v for v in values if v not in valid]
        if bad:
            self._bad(name, f"unknown value {bad[0]!r}; valid: {', '.join(valid)}")
        return values

    def variants(self) -> list[tuple[int, str, str]]:
        """(iterations, grad, recon) of every variant; r = 1 once with grad ``-`` (detaching changes nothing)."""
        out = []
        for recon in self.recons:
            for r in self.iterations:
                for g in ("-",) if r == 1 else self.grads:
                    out.append((r, g, recon))
        return out


@dataclass(frozen=True)
class CapsConfig:
    """Everything that decides one cell's result (``summary.json``'s ``config``); it runs on the CPU."""

    epochs: int
    dataset: str
    batch_size: int
    lr: float
    max_steps_per_epoch: int | None
    test_subset: int | None
    data_dir: str | None
    iterations: int
    detach_inner: bool
    reconstruction: bool
    seed: int

    device: ClassVar[str] = "cpu"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def differences(self, saved: dict[str, Any]) -> list[str]:
        """``"field: saved -> now"`` for every field that differs from a saved :meth:`to_dict`."""
        now = self.to_dict()
        return [
            f"{k}: {saved.get(k)!r} -> {now.get(k)!r}"
            for k in sorted(set(now) | set(saved))
            if saved.get(k) != now.get(k)
        ]


@dataclass(frozen=True)
class CapsCell:
    """One training run: a variant at one seed, and everything else that decides its result."""

    iterations: int
    grad: str
    recon: str
    seed: int
    config: CapsConfig = dataclasses.field(compare=False, hash=False)

    @property
    def variant(self) -> str:
        return variant_name(self.iterations, self.grad, self.recon)

    @property
    def cell_id(self) -> str:
        g = "" if self.grad == "-" else f"_{self.grad}"
        return f"r{self.iterations}{g}_rec-{self.recon}_s{self.seed}"


def expand_cells(spec: CapsSpec, data_cache: str | os.PathLike | None = None) -> list[CapsCell]:
    """Every (variant, seed) cell of ``spec`` with its config (``data_cache`` is not used: the data set is read
    from ``spec.data_dir``)."""
    shared = {k: v for k, v in spec.to_dict().items() if k not in CapsSpec.LIST_FIELDS}
    return [
        CapsCell(
            r,
            g,
            rec,
            s,
            CapsConfig(**shared, iterations=r, detach_inner=g == "detached", reconstruction=rec == "on", seed=s),
        )
        for r, g, rec in spec.variants()
        for s in spec.seeds
    ]


def quick_spec() -> CapsSpec:
    """The ``--quick`` grid: iterations 1 and 3, both gradients, reconstruction off/on, 2 seeds, 2 short epochs
    (a pipeline check in well under a minute on 2 cores; its numbers mean nothing)."""
    return CapsSpec(iterations=(1, 3), seeds=(0, 1), epochs=2, max_steps_per_epoch=6, test_subset=120)


def _check(cells: list[CapsCell]) -> None:
    """Refuse a missing data set before any cell starts (loaded once per source, as the cells will read it)."""
    for source in {(c.config.dataset, c.config.data_dir) for c in cells}:
        load_data(*source)


def _cost(cell: CapsCell) -> float:
    """Relative cost of a cell (routing dominates): longest first keeps the workers busy to the end."""
    return cell.iterations + 0.5 + (0.2 if cell.recon == "on" else 0.0)


def _describe(summary: dict[str, Any]) -> str:
    return f"test error {100 * summary['final_test_err']:.2f} % ({summary['wall_s']:.0f} s)"


CAPSULES = Experiment(
    name="capsules",
    spec_file="capsules.json",
    spec_type=CapsSpec,
    expand=expand_cells,
    train=run_cell,
    collect=collect,
    render=render_report,
    check=_check,
    cost=_cost,
    describe=_describe,
    noun="cells",
    label=f"{PROG} capsules",
    command=f"{PROG} capsules",
)


def run_capsules(
    spec: CapsSpec,
    out_dir: str | os.PathLike,
    *,
    workers: int | None = None,
    threads: int = 1,
    progress: bool = True,
    render: bool = True,
    log: Callable[[str], None] | None = None,
    backend: str = "process",
    address: str | None = None,
    option: str = "out_dir",
    command: str | None = None,
) -> dict[str, Any]:
    """Run (or resume) every cell of ``spec`` under ``out_dir/runs``; write results.json and the report.

    Finished cells (a ``summary.json`` with the same config) are skipped; a grid already in ``out_dir`` is
    extended. ``workers`` processes (default: one per usable core) with ``threads`` torch threads each, or Ray
    (``backend``, ``address``: :func:`~normlab.runner.grid.execute.run_cells`). Returns the results dict
    (:func:`normlab_lab.capsules.stats.collect`) with ``timings`` (every invocation that ran cells,
    kept across resumes) and ``step_bench`` (:func:`step_benchmark`, measured once). ``command`` claims
    ``out_dir`` (default ``normlab-lab capsules``; the CLI's ``--quick`` claims its own).
    """
    say = log or (lambda s: print(s, file=sys.stderr))

    def before(grid: GridRun) -> None:
        grid.extra.update(zip(("timings", "step_bench"), _previous(grid.out, grid.spec)))

    def timings(grid: GridRun, ran: dict[str, Any]) -> dict[str, Any]:
        extra = dict(grid.extra)
        if ran["cells_run"]:
            extra["timings"] = [*extra["timings"], {**ran, "load_avg": _load_avg()}]
        if extra["step_bench"] is None:
            say(f"{PROG} capsules: timing one training step of every variant, round-robin (seconds)")
            extra["step_bench"] = step_benchmark(grid.spec, threads=int(threads))
        return extra

    return run_experiment(
        CAPSULES,
        spec,
        out_dir,
        render=render,
        announce=before,
        extras=timings,
        option=option,
        command=command,
        workers=workers,
        threads=threads,
        progress=progress,
        log=say,
        backend=backend,
        address=address,
    )


def _previous(out: Path, spec: CapsSpec) -> tuple[list[dict[str, Any]], dict[str, float] | None]:
    """From an existing results.json of the same spec: the timings of earlier invocations that ran cells (kept
    across resumes) and the round-robin step timing (measured once)."""
    try:
        old = json.loads((out / "results.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return [], None
    if not isinstance(old, dict) or old.get("spec") != spec.to_dict():
        return [], None
    runs, bench = old.get("timings"), old.get("step_bench")
    timings = [t for t in runs if isinstance(t, dict) and t.get("cells_run")] if isinstance(runs, list) else []
    names = {variant_name(*v) for v in spec.variants()}
    ok = isinstance(bench, dict) and set(bench) == names
    return timings, (bench if ok else None)


def _load_avg() -> float | None:
    """The 1-minute load average at the end of a run (how busy the machine was), where the OS has one."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
