"""How long a grid will take here, measured before it starts (``normlab compare`` says it, and asks for ``--yes``
past :data:`CONFIRM_MINUTES`).

The estimate is ``sum over cells of the cell's seconds / workers``, a cell's seconds being

    steps x (seconds per step) + evaluations x (seconds per evaluation)
    + recorded steps x (the monitor's seconds per recorded step) + :data:`RUN_OVERHEAD_S`

The steps of a cell are its epochs times its steps per epoch (capped by ``max_steps_per_epoch``), its evaluations
``evals_per_epoch`` per epoch, its recorded steps those of its monitor's schedule. The seconds are timed here with
one torch thread (what a pool worker uses), each once per what it depends on, on the cell's own model and data
(:func:`~normlab.runner.training.setup.load_data` and :func:`~normlab.runner.training.setup.build_model`, so a
model or data set from a factory is timed like a built-in one): the median of a few SGD steps on a batch of
training samples, of the train-mode pass (``eval_train_mode``) and of a few steps with a
:class:`~normlab.monitor.VarianceMonitor` recording, less the plain step, once per model (norm, conv, width, data
set) and batch size; the eval-mode pass over the test set once per model. :data:`RUN_OVERHEAD_S`
(starting a run, building its data and model, writing its files) is a constant (how it was measured: the
documentation's page on the defaults).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from normlab.monitor import VarianceMonitor
from normlab.monitor.options import RecordSchedule
from normlab.runner.data.datasets import DATASET_SIZES
from normlab.runner.data.mnist1d import DEFAULT_SAMPLES, TRAIN_SPLIT
from normlab.runner.grid.spec import Cell
from normlab.runner.training.config import TrainConfig, resolve_device
from normlab.runner.training.evaluation import TRAIN_MODE_SAMPLES
from normlab.runner.training.setup import build_model, load_data, norm_kwargs, steps_per_epoch
from normlab.runner.training.task import make_task

__all__ = [
    "CONFIRM_MINUTES",
    "RUN_OVERHEAD_S",
    "cell_steps",
    "cell_evals",
    "cell_recorded_steps",
    "step_seconds",
    "eval_seconds",
    "eval_mode_seconds",
    "train_mode_seconds",
    "monitor_seconds",
    "cell_seconds",
    "estimate_seconds",
    "estimate_minutes",
    "plan_text",
]

#: A grid estimated longer than this many minutes starts only with ``--yes``.
CONFIRM_MINUTES = 15.0
#: Seconds of a run besides its steps, evaluations and monitor (starting it, building its data and model, writing its
#: files).
RUN_OVERHEAD_S = 0.15


def _sizes(cfg: TrainConfig) -> tuple[int, int]:
    """(training, test) samples of a cell's data: a built-in set's known sizes (mnist1d: split from its samples),
    else the loaded data's."""
    if cfg.dataset == "mnist1d":
        n = cfg.num_samples or DEFAULT_SAMPLES
        train, test = int(TRAIN_SPLIT * n), n - int(TRAIN_SPLIT * n)
    elif cfg.dataset in DATASET_SIZES:
        train, test = DATASET_SIZES[cfg.dataset]
    else:
        train_ds, test_ds, _ = load_data(cfg)
        train, test = len(train_ds), len(test_ds)
    return min(train, cfg.num_train or train), test


def cell_steps(cfg: TrainConfig) -> int:
    """Optimizer steps of one run: epochs x steps per epoch (``max_steps_per_epoch`` caps the latter)."""
    return max(1, steps_per_epoch(cfg, _sizes(cfg)[0])) * cfg.epochs


def cell_evals(cfg: TrainConfig) -> int:
    """Evaluations of one run: ``evals_per_epoch`` per epoch (at most one per step)."""
    per_epoch = cell_steps(cfg) // max(1, cfg.epochs)
    return max(1, min(cfg.evals_per_epoch, per_epoch)) * cfg.epochs


def cell_recorded_steps(cfg: TrainConfig) -> int:
    """Steps of one run that its monitor records (0 without a monitor), by the run's record schedule."""
    if cfg.monitor_every <= 0:
        return 0
    schedule = RecordSchedule(cfg.monitor_every, cfg.monitor_dense_steps, cfg.monitor_dense_every)
    return sum(schedule.is_due(s) for s in range(cell_steps(cfg)))


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after one warm-up call, with one torch thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        for _ in range(repeats + 1):  # the first call warms up (allocations, one-time initialisation)
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])
    finally:
        torch.set_num_threads(threads)


def _model_and_batch(cfg: TrainConfig, n: int, train: bool = True):
    """``cfg``'s model (its run's norm layers and seed) on its device, and ``n`` samples of its data there (the
    training set's first, repeated if it has fewer; the test set's with ``train=False``)."""
    dev = resolve_device(cfg.device)
    train_ds, test_ds, info = load_data(cfg)
    ds = train_ds if train else test_ds
    x, y = ds.batch(torch.arange(n) % len(ds))
    model = build_model(cfg, info, x[:2], norm_kwargs(cfg, steps_per_epoch(cfg, len(train_ds))))
    return model.to(dev), x.to(dev), y.to(dev), dev


def _sgd_step(cfg: TrainConfig, monitored: bool):
    """A function taking one SGD step of ``cfg``'s model on a batch of its data (``monitored``: a monitor records
    it)."""
    model, x, y, dev = _model_and_batch(cfg, cfg.batch_size)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, foreach=True)  # as the trainer
    monitor = VarianceMonitor(model, every=1, optimizer=opt) if monitored else None
    loss_fn = make_task(cfg.loss, cfg.metric).loss_fn

    def step() -> None:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        if monitor is not None:
            monitor.observe_loss(loss)
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    return step


def step_seconds(cfg: TrainConfig, repeats: int = 2) -> float:
    """Median seconds of one SGD step of ``cfg``'s model at its batch size on its device (one torch thread on the
    CPU), random input."""
    return _timed(_sgd_step(cfg, monitored=False), repeats)


def monitor_seconds(cfg: TrainConfig, repeats: int = 2, plain: float | None = None) -> float:
    """Seconds a :class:`~normlab.monitor.VarianceMonitor` adds to a step it records: a monitored step less a plain
    one (``plain``: its seconds, already timed; else timed here), at least 0."""
    if plain is None:
        plain = step_seconds(cfg, repeats)
    return max(0.0, _timed(_sgd_step(cfg, monitored=True), repeats) - plain)


def eval_seconds(cfg: TrainConfig, repeats: int = 1) -> float:
    """Seconds of one evaluation of ``cfg``'s run: :func:`eval_mode_seconds` plus, with ``eval_train_mode``,
    :func:`train_mode_seconds`."""
    total = eval_mode_seconds(cfg, repeats)
    if cfg.eval_train_mode:
        total += train_mode_seconds(cfg, repeats)
    return total


def _forward(cfg: TrainConfig, n: int, train: bool):
    """A function running ``cfg``'s model forward on ``n`` test samples without gradient (``train``: train mode)."""
    model, x, _, dev = _model_and_batch(cfg, n, train=False)
    model.train(train)

    @torch.no_grad()
    def run() -> None:
        model(x)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    return run


def _test_size(cfg: TrainConfig) -> int:
    return _sizes(cfg)[1]


def eval_mode_seconds(cfg: TrainConfig, repeats: int = 1) -> float:
    """Seconds of the eval-mode pass over a test set of the run's size (batches of 512; one full batch and the
    remainder timed, median, and counted). It does not depend on the training batch size."""
    full, rest = divmod(_test_size(cfg), 512)
    total = full * _timed(_forward(cfg, 512, False), repeats) if full else 0.0
    return total + (_timed(_forward(cfg, rest, False), repeats) if rest else 0.0)


def train_mode_seconds(cfg: TrainConfig, repeats: int = 1) -> float:
    """Seconds of the train-mode pass (``eval_train_mode``): batches of the training batch size over the first
    ``TRAIN_MODE_SAMPLES`` (``normlab.runner.training.evaluation``) test samples (0 for a batch over 512)."""
    if cfg.batch_size > 512:
        return 0.0
    batches = min(_test_size(cfg), TRAIN_MODE_SAMPLES) // cfg.batch_size
    return batches * _timed(_forward(cfg, cfg.batch_size, True), repeats) if batches else 0.0


def cell_seconds(cfg: TrainConfig, timed: dict[str, float]) -> float:
    """Estimated seconds of one run from its timed ``{"step", "eval", "monitor"}`` seconds (see the module doc)."""
    return (
        cell_steps(cfg) * timed["step"]
        + cell_evals(cfg) * timed["eval"]
        + cell_recorded_steps(cfg) * timed["monitor"]
        + RUN_OVERHEAD_S
    )


def estimate_seconds(cells: Sequence[Cell]) -> list[float]:
    """Estimated seconds of each of ``cells`` in one worker (see the module doc). Each kind of work is timed once
    per model it depends on: the eval-mode pass once per model, the step, the train-mode pass and the monitor once
    per model and batch size."""
    steps: dict[tuple, dict[str, float]] = {}
    eval_mode: dict[tuple, float] = {}
    out = []
    for cell in cells:
        c = cell.config
        model_key = (c.model, c.norm, c.conv, repr(c.conv_kwargs), repr(c.model_kwargs), c.width, c.dataset)
        model_key += (c.device, c.num_samples)
        key = (*model_key, c.batch_size)
        if key not in steps:
            steps[key] = {"step": step_seconds(c)}
        timed = steps[key]
        if cell_evals(c) and c.eval_train_mode and "train_mode" not in timed:
            timed["train_mode"] = train_mode_seconds(c)
        if cell_evals(c) and model_key not in eval_mode:
            eval_mode[model_key] = eval_mode_seconds(c)
        if cell_recorded_steps(c) and "monitor" not in timed:
            timed["monitor"] = monitor_seconds(c, plain=timed["step"])
        evaluation = eval_mode.get(model_key, 0.0) + (timed.get("train_mode", 0.0) if c.eval_train_mode else 0.0)
        out.append(cell_seconds(c, {"step": timed["step"], "eval": evaluation, "monitor": timed.get("monitor", 0.0)}))
    return out


def estimate_minutes(cells: Sequence[Cell], workers: int) -> float:
    """Estimated wall-clock minutes to train ``cells`` with ``workers`` parallel workers (see the module doc)."""
    return sum(estimate_seconds(cells)) / max(1, min(workers, len(cells))) / 60.0


def plan_text(
    cells: Sequence[Cell], todo: Sequence[Cell], workers: int, remote: bool = False, after_s: float | None = None
) -> tuple[str, float]:
    """What a command prints before it starts, and the estimate in minutes: ``"12 runs to train (3 already done):
    about 9 min with 2 worker(s) here"`` (``remote``: on a Ray cluster, timed here; ``after_s``: seconds of work after
    the runs, added and named: ``"about 3.3 min with 2 worker(s) here (runs 2.8 min, then 30 s of reporting)"``)."""
    minutes = estimate_minutes(todo, workers) if todo else 0.0
    where = "on the Ray cluster (timed here)" if remote else f"with {max(1, min(workers, len(todo)))} worker(s) here"
    done = f", {len(cells) - len(todo)} already done" if len(todo) < len(cells) else ""
    runs = f"{len(todo)} run" + ("s" if len(todo) != 1 else "")
    if not after_s:
        return f"{runs} to train{done}: about {_minutes(minutes)} min {where}", minutes
    total = minutes + after_s / 60.0
    text = f"about {_minutes(total)} min {where} (runs {_minutes(minutes)} min, then {after_s:.0f} s of reporting)"
    return f"{runs} to train{done}: {text}", total


def _minutes(m: float) -> str:
    """Whole minutes, or one decimal under 10 (a 2-minute demo said as 2.4, not 2)."""
    return f"{m:.1f}" if m < 10 else f"{m:.0f}"
