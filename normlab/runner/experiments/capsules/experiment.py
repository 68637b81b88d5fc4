"""The capsule routing experiment (seed 001, docs/capsules.md): routing iterations x gradient through the inner
iterations x reconstruction x seeds, on CapsNet models of :mod:`normlab.runner.experiments.capsules.capsnet`.

``CapsSpec`` describes the grid, :func:`expand_cells` turns it into :class:`CapsCell` objects (one training run
each, written to ``<out>/runs/<cell id>/summary.json``), :func:`run_capsules` runs them (in worker processes when
``workers > 1``), skips finished cells, writes ``results.json`` after every finished cell and the report at the end.

Protocol (fixed before the measurements; docs/capsules.md):

- A variant is (routing iterations r, gradient ``detached`` = naturomics' stop_gradient or ``full`` = the
  official code, reconstruction ``off``/``on``). With r = 1 the two gradients are the same computation (there is
  no inner iteration), so r = 1 is run once and labelled ``-``.
- Per seed, every variant starts from the same weights (the encoder is built first from ``torch.manual_seed(seed)``;
  the decoder after it) and sees the same batches in the same order (a generator seeded with the seed): the
  per-seed differences between variants are paired.
- Adam (lr 1e-3, torch defaults otherwise), batch 64, a fixed number of epochs, no learning-rate schedule, no
  early stopping; the measured quantity is the test error of the **last** epoch (never the best epoch).
- Also recorded: the test margin loss, the coupling coefficients' entropy over the parents after routing (mean over
  test examples and primary capsules; uniform is ln 10 = 2.303 nats), the entropy after each routing iteration of
  the trained model, how much detaching changes the trained model's gradient (relative difference and cosine of
  the full parameter gradient on 256 training examples, same weights, and their norm ratio), how strongly the
  reconstruction loss pushes the encoder (its gradient on the conv, primary and routing weights relative to the
  margin loss's), and the median wall time of a training step (1 torch thread per process).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from normlab.nn import dynamic_routing, margin_loss
from normlab.runner.data.datasets import get_dataset
from normlab.runner.errors import UsageError
from normlab.runner.experiments.capsules.capsnet import build_capsnet
from normlab.runner.experiments.capsules.report import render_report
from normlab.runner.experiments.capsules.stats import RESULTS_KIND, collect, variant_name
from normlab.runner.grid.pool import default_workers, run_jobs
from normlab.runner.grid.results import read_summary
from normlab.runner.io import DictSpec, atomic_write_json

__all__ = ["CapsSpec", "CapsCell", "GRADS", "RECONS", "DATASETS", "expand_cells", "run_cell", "run_capsules",
           "coupling_entropy", "quick_spec", "step_benchmark", "RESULTS_KIND"]

GRADS = ("detached", "full")  # detach_inner=True (naturomics' stop_gradient) / False (the paper's code)
RECONS = ("off", "on")
DATASETS = ("digits", "mnist1d")  # datasets with a CapsNet preset of the same name


def _unique(what: str, seq: Sequence, allowed: Sequence | None = None) -> tuple:
    seq = tuple(seq)
    if not seq:
        raise UsageError(f"capsules: {what} must not be empty")
    if len(set(seq)) != len(seq):
        raise UsageError(f"capsules: {what} has duplicates: {list(seq)}")
    if allowed is not None:
        bad = [s for s in seq if s not in allowed]
        if bad:
            raise UsageError(f"capsules: unknown {what} {bad}; valid: {', '.join(allowed)}")
    return seq


@dataclass
class CapsSpec(DictSpec):
    """A capsule routing grid: every (iterations, grad, recon) variant x seed, trained for ``epochs``.

    ``max_steps_per_epoch`` caps the training steps of an epoch and ``test_subset`` the test examples (quick runs).
    """

    LIST_FIELDS: ClassVar[tuple[str, ...]] = ("iterations", "grads", "recons", "seeds")  # stored as JSON lists

    iterations: Sequence[int] = (1, 2, 3, 5)
    grads: Sequence[str] = GRADS
    recons: Sequence[str] = RECONS
    seeds: Sequence[int] = (0, 1, 2, 3, 4)
    epochs: int = 12
    dataset: str = "digits"
    batch_size: int = 64
    lr: float = 1e-3
    max_steps_per_epoch: int | None = None
    test_subset: int | None = None
    data_dir: str | None = None

    def __post_init__(self) -> None:
        if any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in self.iterations):
            raise UsageError(f"capsules: routing iterations must be integers >= 1, got {list(self.iterations)}")
        self.iterations = _unique("iterations", self.iterations)
        self.grads = _unique("gradient variants", (str(g).lower() for g in self.grads), GRADS)
        self.recons = _unique("reconstruction settings", (str(r).lower() for r in self.recons), RECONS)
        self.seeds = _unique("seeds", (int(s) for s in self.seeds))
        if self.dataset not in DATASETS:
            raise UsageError(f"capsules: unknown dataset {self.dataset!r}; valid: {', '.join(DATASETS)}")
        for what, val in (("epochs", self.epochs), ("batch_size", self.batch_size)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise UsageError(f"capsules: {what} must be an integer >= 1, got {val!r}")
        if any(s < 0 for s in self.seeds):
            raise UsageError(f"capsules: seeds must be >= 0, got {list(self.seeds)}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise UsageError(f"capsules: lr must be a positive finite number, got {self.lr!r}")
        for what in ("max_steps_per_epoch", "test_subset"):
            v = getattr(self, what)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise UsageError(f"capsules: {what} must be an integer >= 1, got {v!r}")

    def variants(self) -> list[tuple[int, str, str]]:
        """(iterations, grad, recon) of every variant; r = 1 once with grad ``-`` (detaching changes nothing)."""
        out = []
        for recon in self.recons:
            for r in self.iterations:
                for g in ("-",) if r == 1 else self.grads:
                    out.append((r, g, recon))
        return out


@dataclass(frozen=True)
class CapsCell:
    """One training run: a variant at one seed, and everything else that decides its result."""

    iterations: int
    grad: str
    recon: str
    seed: int
    config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def variant(self) -> str:
        return variant_name(self.iterations, self.grad, self.recon)

    @property
    def cell_id(self) -> str:
        g = "" if self.grad == "-" else f"_{self.grad}"
        return f"r{self.iterations}{g}_rec-{self.recon}_s{self.seed}"


def expand_cells(spec: CapsSpec) -> list[CapsCell]:
    """Every (variant, seed) cell of ``spec`` with its config (the keys a finished cell is checked against)."""
    shared = {k: v for k, v in spec.to_dict().items() if k not in ("iterations", "grads", "recons", "seeds")}
    cells = []
    for r, g, rec in spec.variants():
        for s in spec.seeds:
            cfg = {**shared, "iterations": r, "detach_inner": g == "detached", "reconstruction": rec == "on",
                   "seed": s}
            cells.append(CapsCell(r, g, rec, s, cfg))
    return cells


# --------------------------------------------------------------------------------------------------
# One cell
# --------------------------------------------------------------------------------------------------

_DATA_CACHE: dict[tuple[str, str | None], tuple] = {}


def _data(name: str, data_dir: str | None):
    """(train, test, (lo, hi)) with the training inputs' range as the decoder's target range; cached per process."""
    key = (name, data_dir)
    if key not in _DATA_CACHE:
        train_ds, test_ds, _ = get_dataset(name, data_dir=data_dir)
        rng = (float(train_ds.x.min()), float(train_ds.x.max()))
        _DATA_CACHE[key] = (train_ds, test_ds, rng)
    return _DATA_CACHE[key]


def coupling_entropy(c: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each child's coupling coefficients over the parents, averaged over examples and children.

    ``H = mean_{n, i} -sum_j c_nij ln c_nij`` for c (N, in_caps, out_caps); ln(out_caps) for uniform coupling,
    0 when every child sends everything to one parent.
    """
    return -(c * torch.log(c.clamp_min(1e-30))).sum(-1).mean()


@torch.no_grad()
def _evaluate(model, ds, limit: int | None, batch_size: int = 256) -> dict[str, float]:
    """Test error, margin loss, reconstruction SSE (eval-mode mask) and coupling entropy over ``ds``."""
    model.eval()
    n = len(ds) if limit is None else min(limit, len(ds))
    wrong = margin = sse = ent = 0.0
    for start in range(0, n, batch_size):
        x, y = ds.batch(torch.arange(start, min(start + batch_size, n)))
        out = model(x)
        _, parts = model.loss(out, x, y)
        k = len(y)
        wrong += (out.lengths.argmax(1) != y).sum().item()
        margin += parts["margin"] * k
        sse += parts["recon"] * k
        ent += coupling_entropy(out.coupling).item() * k
    return {"test_err": wrong / n, "test_margin": margin / n, "test_recon": sse / n, "entropy": ent / n}


@torch.no_grad()
def _entropy_by_iteration(model, ds, limit: int | None) -> list[float]:
    """Coupling entropy after routing iteration k = 1..r of the trained model (same predictions u_hat)."""
    model.eval()
    n = len(ds) if limit is None else min(limit, len(ds))
    x, _ = ds.batch(torch.arange(n))
    u_hat = model.digits.predictions(model.primary_capsules(x))
    return [coupling_entropy(dynamic_routing(u_hat, k)[1]).item() for k in range(1, model.digits.iterations + 1)]


def _flat_grad(loss: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params, retain_graph=True)])


def _compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """|a - b| / |b|, cosine(a, b) and |a| / |b| of two flattened gradients."""
    return {"rel_diff": ((a - b).norm() / b.norm()).item(),
            "cosine": torch.nn.functional.cosine_similarity(a, b, dim=0).item(),
            "norm_ratio": (a.norm() / b.norm()).item()}


def _detach_effect(model, ds, n: int = 256) -> dict[str, float] | None:
    """How much the stop_gradient changes the trained model's gradient: the loss gradient over all parameters on
    the first ``n`` training examples with ``detach_inner`` on and off (same weights), compared as
    detached-vs-full by :func:`_compare`; None for one iteration."""
    if model.digits.iterations == 1:
        return None
    model.train()
    x, y = ds.batch(torch.arange(min(n, len(ds))))
    params = [p for p in model.parameters() if p.requires_grad]
    saved, grads = model.digits.detach_inner, {}
    try:
        for detach in (True, False):
            model.digits.detach_inner = detach
            grads[detach] = _flat_grad(model.loss(model(x, y), x, y)[0], params)
    finally:
        model.digits.detach_inner = saved
    return _compare(grads[True], grads[False])


def _recon_share(model, ds, n: int = 256) -> dict[str, float] | None:
    """How much the reconstruction loss pushes the encoder (conv stem, primary and routing weights) of the trained
    model: its gradient there compared with the margin loss's (:func:`_compare`, recon vs margin) on the first
    ``n`` training examples; None without a decoder."""
    if model.decoder is None:
        return None
    model.train()
    x, y = ds.batch(torch.arange(min(n, len(ds))))
    encoder = [p for m in (model.stem, model.primary, model.digits) for p in m.parameters()]
    out = model(x, y)
    total, _ = model.loss(out, x, y)
    margin = margin_loss(out.lengths, y)
    return _compare(_flat_grad(total - margin, encoder), _flat_grad(margin, encoder))


def _step(model, opt, x: torch.Tensor, y: torch.Tensor):
    """One training step (forward, loss, backward, Adam); returns the output, the loss and its parts."""
    out = model(x, y)
    loss, parts = model.loss(out, x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return out, loss, parts


def step_benchmark(spec: CapsSpec, rounds: int = 15, warmup: int = 3, threads: int = 1) -> dict[str, float]:
    """Median seconds per training step of every variant of ``spec``, measured **round-robin** in this process
    (one step of each variant in turn, on one fixed batch, ``threads`` torch threads): a busy machine slows every
    variant alike, so the ratios between variants hold even when the absolute times do not."""
    train_ds, _, rng = _data(spec.dataset, spec.data_dir)
    x, y = train_ds.batch(torch.arange(min(spec.batch_size, len(train_ds))))
    models = {}
    for r, g, rec in spec.variants():
        torch.manual_seed(0)
        m = build_capsnet(spec.dataset, iterations=r, detach_inner=g == "detached", reconstruction=rec == "on",
                          target_range=rng)
        models[variant_name(r, g, rec)] = (m.train(), torch.optim.Adam(m.parameters(), lr=spec.lr))
    times: dict[str, list[float]] = {name: [] for name in models}
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k in range(warmup + rounds):
            for name, (m, opt) in models.items():
                t0 = time.perf_counter()
                _step(m, opt, x, y)
                if k >= warmup:
                    times[name].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(saved)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _train_epoch(model, opt, ds, perm: torch.Tensor, cfg: dict[str, Any]) -> dict[str, Any]:
    """One pass over ``perm`` in batches; returns the mean losses, train error and each step's seconds."""
    model.train()
    bs, cap = cfg["batch_size"], cfg["max_steps_per_epoch"]
    starts = list(range(0, len(perm), bs))[: cap or None]
    totals = {"loss": 0.0, "margin": 0.0, "recon": 0.0, "wrong": 0.0, "seen": 0}
    times = []
    for start in starts:
        x, y = ds.batch(perm[start:start + bs])
        t0 = time.perf_counter()
        out, loss, parts = _step(model, opt, x, y)
        times.append(time.perf_counter() - t0)
        k = len(y)
        totals["loss"] += loss.item() * k
        totals["margin"] += parts["margin"] * k
        totals["recon"] += parts["recon"] * k
        totals["wrong"] += (out.lengths.detach().argmax(1) != y).sum().item()
        totals["seen"] += k
    seen = max(totals["seen"], 1)
    return {"train_loss": totals["loss"] / seen, "train_margin": totals["margin"] / seen,
            "train_recon": totals["recon"] / seen, "train_err": totals["wrong"] / seen, "step_times": times}


def run_cell(cfg: dict[str, Any], out_dir: str | os.PathLike) -> dict[str, Any]:
    """Train one cell (see the module's protocol); write and return ``out_dir/summary.json``."""
    t_wall, t_cpu = time.perf_counter(), time.process_time()
    train_ds, test_ds, rng = _data(cfg["dataset"], cfg.get("data_dir"))
    torch.manual_seed(cfg["seed"])
    model = build_capsnet(cfg["dataset"], iterations=cfg["iterations"], detach_inner=cfg["detach_inner"],
                          reconstruction=cfg["reconstruction"], target_range=rng)
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    order = torch.Generator().manual_seed(cfg["seed"])  # same batches in the same order for every variant
    history, step_times = [], []
    for epoch in range(1, cfg["epochs"] + 1):
        rec = _train_epoch(model, opt, train_ds, torch.randperm(len(train_ds), generator=order), cfg)
        step_times += rec.pop("step_times")
        rec.update(_evaluate(model, test_ds, cfg["test_subset"]))
        if not math.isfinite(rec["train_loss"]):
            history.append({"epoch": epoch, **rec})
            break
        history.append({"epoch": epoch, **rec})
    last = history[-1]
    summary = {
        "config": cfg, "history": history, "epochs_run": len(history),
        "final_test_err": last["test_err"], "final_test_margin": last["test_margin"],
        "final_train_loss": last["train_loss"], "final_entropy": last["entropy"],
        "entropy_by_iteration": _entropy_by_iteration(model, test_ds, cfg["test_subset"]),
        "detach_effect": _detach_effect(model, train_ds),
        "recon_share": _recon_share(model, train_ds),
        "diverged": not math.isfinite(last["train_loss"]),
        "step_time_s": statistics.median(step_times[1:] or step_times),  # the first step warms up
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "num_primary": model.spec.num_primary,
        "wall_s": time.perf_counter() - t_wall, "cpu_s": time.process_time() - t_cpu,
    }
    atomic_write_json(Path(out_dir) / "summary.json", summary)
    return summary


# --------------------------------------------------------------------------------------------------
# The grid
# --------------------------------------------------------------------------------------------------

def quick_spec() -> CapsSpec:
    """The ``--quick`` grid: iterations 1 and 3, both gradients, reconstruction off/on, 2 seeds, 2 short epochs
    (a pipeline check in well under a minute on 2 cores; its numbers mean nothing)."""
    return CapsSpec(iterations=(1, 3), seeds=(0, 1), epochs=2, max_steps_per_epoch=6, test_subset=120)


def _cell_done(cell: CapsCell, cell_dir: Path) -> dict[str, Any] | None:
    """The cell's summary when it finished with the same config; a one-line refusal when the config differs."""
    summary = read_summary(cell_dir)
    if summary is None:
        return None
    old = summary.get("config", {})
    diff = sorted(k for k in set(cell.config) | set(old) if cell.config.get(k) != old.get(k))
    if diff:
        raise UsageError(f"capsules: cell {cell.cell_id} in {cell_dir.parent.parent} was run with a different "
                         f"config ({', '.join(diff)}); use another output directory")
    return summary


class _Progress:
    """results.json after every finished cell; a progress bar with the last cell's test error."""

    def __init__(self, spec: CapsSpec, cells: list[CapsCell], summaries: dict, out: Path, progress: bool):
        from tqdm.auto import tqdm

        self.spec, self.cells, self.summaries, self.out = spec, cells, summaries, out
        self.bar = tqdm(total=len(cells), initial=len(summaries), desc="capsules", unit="run",
                        disable=not progress, file=sys.stderr, dynamic_ncols=True)

    def done(self, cell: CapsCell, summary: dict[str, Any]) -> None:
        self.summaries[cell.cell_id] = summary
        pairs = [(c, self.summaries[c.cell_id]) for c in self.cells if c.cell_id in self.summaries]
        atomic_write_json(self.out / "results.json", collect(self.spec, pairs, complete=False))
        self.bar.update(1)
        self.bar.set_postfix_str(f"last {cell.cell_id}: test error {100 * summary['final_test_err']:.2f} % "
                                 f"({summary['wall_s']:.0f} s)")


def _run_cells(todo: list[CapsCell], runs: Path, workers: int, threads: int, record: _Progress) -> None:
    try:
        run_jobs([(run_cell, (c.config, str(runs / c.cell_id))) for c in todo], workers=workers, threads=threads,
                 on_done=lambda i, summary: record.done(todo[i], summary))
    finally:
        record.bar.close()


def _cost(cell: CapsCell) -> float:
    """Relative cost of a cell (routing dominates): longest first keeps the workers busy to the end."""
    return cell.iterations + 0.5 + (0.2 if cell.recon == "on" else 0.0)


def run_capsules(
    spec: CapsSpec,
    out_dir: str | os.PathLike,
    *,
    workers: int | None = None,
    threads: int = 1,
    progress: bool = True,
    render: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run (or resume) every cell of ``spec`` under ``out_dir/runs``; write results.json and the report.

    Finished cells (a ``summary.json`` with the same config) are skipped. ``workers`` processes (default: one per
    usable core, capped by the cells left) with ``threads`` torch threads each. Returns the results dict
    (:func:`normlab.runner.experiments.capsules.stats.collect`), which also records the wall and CPU time of every
    invocation that ran cells (``timings``, kept across resumes) and a round-robin timing of one training step of every
    variant (:func:`step_benchmark`, measured once).
    """
    out, say = Path(out_dir), log or (lambda s: print(s, file=sys.stderr))
    runs = out / "runs"
    cells = expand_cells(spec)
    get_dataset(spec.dataset, data_dir=spec.data_dir)  # refuse a missing data set before any cell starts
    summaries = {c.cell_id: s for c in cells if (s := _cell_done(c, runs / c.cell_id)) is not None}
    todo = sorted((c for c in cells if c.cell_id not in summaries), key=_cost, reverse=True)
    if summaries:
        say(f"normlab capsules: {len(summaries)} of {len(cells)} cells already done (skipped)")
    runs.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "capsules.json", spec.to_dict(), indent=2)
    n_workers = default_workers() if workers in (None, 0) else int(workers)
    n_workers = max(1, min(n_workers, len(todo))) if todo else 1
    t_wall, cpu0 = time.perf_counter(), _cpu_times()
    _run_cells(todo, runs, n_workers, int(threads), _Progress(spec, cells, summaries, out, progress))
    timings, bench = _previous(out, spec)
    if todo:
        t = {"cells_run": len(todo), "workers": n_workers, "wall_s": time.perf_counter() - t_wall,
             "cpu_s": _cpu_times() - cpu0, "load_avg": _load_avg()}
        timings.append(t)
        say(f"normlab capsules: ran {len(todo)} cells with {n_workers} worker(s) in {t['wall_s']:.1f} s wall, "
            f"{t['cpu_s']:.1f} s CPU")
    if bench is None:
        say("normlab capsules: timing one training step of every variant, round-robin (seconds)")
        bench = step_benchmark(spec, threads=int(threads))
    results = collect(spec, [(c, summaries[c.cell_id]) for c in cells], timings=timings, step_bench=bench)
    atomic_write_json(out / "results.json", results)
    if render:
        render_report(results, out)
    return results


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


def _cpu_times() -> float:
    """CPU seconds of this process and its finished children (the worker processes)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system
