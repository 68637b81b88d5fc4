"""Compare normalizations on your own model and data: :func:`compare` (and ``normlab compare``), the comparison as
an experiment of the grid engine (:data:`COMPARE`: a :class:`~normlab.runner.grid.spec.GridSpec` and
:func:`~normlab.runner.training.train.train` for each of its cells).

:func:`compare` takes a model and data by name or as functions (:mod:`normlab.runner.factories`: a built-in name,
``timm:NAME``, ``torchvision:NAME``, ``pkg.module:function``), puts each requested normalization into the model
(:mod:`normlab.runner.training.norms`) and trains it over the learning rates, batch sizes and seeds, each run with
the variance monitor (``monitor_every``) and, with ``guard=True``, the collapse guard. A run whose monitor alarm is
confirmed by a collapse of its loss stops there and is recorded as collapsed (``stop_on="confirmed"``), so a sweep
spends its time on the runs that train. It says how many runs and about how long before it starts, resumes when
called again on the same ``out``, runs on a pool of local processes or on Ray, and under ``torchrun`` trains each
run with DDP over the launched processes. The report (``out/results.md``, PNG plots) gives per normalization the
highest learning rate that trained, the loss and metric, the cost per step and the monitor's view.

**Functions in worker processes.** Worker processes (and Ray tasks) rebuild the model and data from their names. A
function passed to :func:`compare` is recorded by its import path (``module:function``), so a function defined at
module level of an importable module runs anywhere. A lambda, a nested function or a function of ``__main__`` (a
notebook) has none: the comparison then runs in this process (``workers`` left unset, or 1), and asking for more
workers or Ray with such a function is refused in one line.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from normlab.runner.errors import UsageError
from normlab.runner.factories import is_local, name_of
from normlab.runner.grid.estimate import cell_steps, plan_text
from normlab.runner.grid.execute import Experiment, GridRun, default_workers, plan_grid, run_experiment
from normlab.runner.grid.report import render_report
from normlab.runner.grid.results import collect_results
from normlab.runner.grid.spec import DEFAULT_NORMS, DEFAULT_SEEDS, Cell, GridSpec, expand_grid
from normlab.runner.training.checks import check_grid
from normlab.runner.training.config import TrainConfig
from normlab.runner.training.train import train

__all__ = ["COMPARE", "COMPARE_DEFAULTS", "compare", "comparison", "run_grid", "run_grid_ddp", "train_cell"]

_DEFAULTS = TrainConfig()
#: The options a comparison's runs take unless told otherwise, the monitor recording every 10 steps and a run
#: stopping when the monitor's alarm is confirmed by a collapse of its loss.
COMPARE_DEFAULTS = {"monitor_every": 10, "stop_on": "confirmed"}
_SPEC_FIELDS = {f.name for f in dataclasses.fields(GridSpec)} - {"train_kwargs", "dataset", "model"}
_CONFIG_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}


def train_cell(config, out_dir: str) -> dict[str, Any]:
    """One cell: a :func:`~normlab.runner.training.train.train` call without its progress bar; the summary."""
    return train(config, out_dir, progress=False)


def _cost(cell: Cell) -> float:
    """Rough CPU cost of a cell (steps x per-step cost growing with the batch): the pool starts the largest first."""
    return cell_steps(cell.config) * (12 + cell.config.batch_size)


def _describe(summary: dict[str, Any]) -> str:
    acc = summary.get("final_test_acc")
    metric = (summary.get("config") or {}).get("metric", "accuracy")
    value = "n/a" if acc is None else (f"{100 * acc:.1f} %" if metric == "accuracy" else f"{acc:.4g}")
    flag = f" COLLAPSED ({summary.get('collapse_reason')})" if summary.get("collapsed") else ""
    stop = " stopped early" if summary.get("stopped_early") else ""
    return f"test {'acc' if metric == 'accuracy' else metric.rsplit(':', 1)[-1]} {value}{flag}{stop}"


#: The normalization comparison as an experiment of the grid engine (``normlab compare``).
COMPARE = Experiment(
    name="compare",
    spec_file="grid.json",
    spec_type=GridSpec,
    expand=expand_grid,
    train=train_cell,
    collect=collect_results,
    render=render_report,
    check=check_grid,
    cost=_cost,
    describe=_describe,
)


def run_grid(
    spec: GridSpec,
    out_dir: str | os.PathLike,
    *,
    workers: int | None = None,
    progress: bool = True,
    render: bool = True,
    threads: int | None = None,
    log: Callable[[str], None] | None = None,
    backend: str = "process",
    address: str | None = None,
    announce: Callable[[GridRun], None] | None = None,
    option: str = "out_dir",
) -> dict[str, Any]:
    """Run (or resume) every cell of ``spec`` under ``out_dir/runs``; write results.json and the report.

    Cells with a matching ``summary.json`` are not rerun; a half-trained cell resumes from its checkpoint; a grid
    already in ``out_dir`` is extended. ``backend``/``address``: see :func:`~normlab.runner.grid.execute.run_cells`;
    ``announce``/``option``: see :func:`~normlab.runner.grid.execute.run_experiment`, which holds the directory's
    lock throughout. Under ``torchrun`` (``WORLD_SIZE`` > 1) every process runs each cell together, with DDP
    (:func:`run_grid_ddp`). Returns the results dict (None on a process other than rank 0 under ``torchrun``).

    Raises:
        CellsFailed: some cells raised; the report of the others is written first.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return run_grid_ddp(spec, out_dir, progress=progress, threads=threads, announce=announce, option=option)
    return run_experiment(
        COMPARE,
        spec,
        out_dir,
        render=render,
        announce=announce,
        option=option,
        workers=workers,
        threads=threads,
        progress=progress,
        log=log,
        backend=backend,
        address=address,
    )


def run_grid_ddp(
    spec: GridSpec,
    out_dir: str | os.PathLike,
    *,
    progress: bool = True,
    threads: int | None = None,
    announce: Callable[[GridRun], None] | None = None,
    option: str = "out_dir",
) -> dict[str, Any] | None:
    """Under ``torchrun``: every process trains each cell in turn, the cell's run spread over the processes by DDP
    (the batch size is per process, as for ``normlab train``). Rank 0 holds the directory's lock and writes every
    file; the others plan the same grid (read only) and train the same cells in the same order. The process group
    is joined here (gloo on the CPU, nccl on CUDA) and left at the end if this call joined it."""
    import torch
    import torch.distributed as dist

    cuda = str(spec.train_kwargs.get("device", "cpu")).startswith("cuda") or (
        spec.train_kwargs.get("device") == "auto" and torch.cuda.is_available()
    )
    joined = not dist.is_initialized()
    if joined:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    finished = False
    try:
        if dist.get_rank() == 0:
            kw = {"workers": 1, "threads": threads, "progress": progress, "announce": announce, "option": option}
            results = run_experiment(COMPARE, spec, out_dir, **kw)
        else:
            grid = plan_grid(COMPARE, spec, out_dir)
            for cell in sorted(grid.todo(), key=lambda c: -COMPARE.cost(c)):  # run_cells' order
                train_cell(cell.config, str(grid.cell_dir(cell)))
            results = None
        finished = True
        return results
    finally:
        if joined:
            if finished:
                dist.barrier()
            dist.destroy_process_group()


def _split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(GridSpec fields, TrainConfig fields shared by every cell) of :func:`compare`'s further options."""
    spec = {k: v for k, v in options.items() if k in _SPEC_FIELDS}
    shared = {k: v for k, v in options.items() if k not in _SPEC_FIELDS}
    unknown = sorted(k for k in shared if k not in _CONFIG_FIELDS or k in ("norm", "conv", "lr", "batch_size", "seed"))
    if unknown:
        raise UsageError(
            f"compare: unknown option {unknown[0]!r}; the grid's: {', '.join(sorted(_SPEC_FIELDS))}; every run's: the "
            "fields of normlab.runner.training.config.TrainConfig"
        )
    return spec, shared


def _where(names: dict[str, str], workers: int | None, backend: str) -> int:
    """The workers to use: a function of this process only runs here (refused with more workers or on Ray)."""
    local = [(kind, name) for kind, name in names.items() if is_local(kind, name)]
    in_torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if local and (backend == "ray" or workers not in (None, 1)):
        kind, name = local[0]
        where = "Ray tasks" if backend == "ray" else f"{workers} worker processes"
        raise UsageError(
            f"{'data' if kind == 'data' else kind}: {name} has no import path (a lambda, a nested function or a "
            f"function of __main__), so {where} cannot rebuild it; define it at module level of an importable module, "
            "or leave workers unset (it then runs in this process)"
        )
    if workers is None:
        return 1 if local or in_torchrun else default_workers()
    return workers


def compare(
    model: str | Callable = _DEFAULTS.model,
    data: str | Callable = _DEFAULTS.dataset,
    *,
    norms: Sequence[str] = DEFAULT_NORMS,
    lrs: Sequence[float] = (_DEFAULTS.lr,),
    batch_sizes: Sequence[int] = (_DEFAULTS.batch_size,),
    seeds: Sequence[int] = DEFAULT_SEEDS,
    epochs: int = _DEFAULTS.epochs,
    loss: str | Callable = _DEFAULTS.loss,
    metric: str | Callable = _DEFAULTS.metric,
    out: str | os.PathLike = "runs/compare",
    monitor_every: int = COMPARE_DEFAULTS["monitor_every"],
    stop_on: str = COMPARE_DEFAULTS["stop_on"],
    guard: bool = False,
    workers: int | None = None,
    backend: str = "process",
    address: str | None = None,
    threads: int | None = None,
    progress: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """Compare normalizations on a model and data: train every (norm, lr, batch size, seed), report per norm.

    Args:
        model: a model by name (``timm:resnet18``, ``torchvision:resnet18``, ``pkg.module:function``, or a
            built-in: ``plain``, ``resnet``, ...) or a function returning an ``nn.Module`` (called with the
            arguments its signature names among ``num_classes``, ``in_channels``, ``input_shape``, ``norm_layer``:
            :mod:`normlab.runner.training.setup`).
        data: data by name (``pkg.module:function``, or ``digits``, ``mnist1d``, ``cifar10``) or a function
            returning ``(train, test)`` datasets or data loaders, or ``{"train", "test", "num_classes"}``
            (:mod:`normlab.runner.data.user`).
        norms: comparison names (``bn``, ``gn``, ``ws+gn``, ``pws``, ``pws:gamma=1e-2``, ...), each put into the
            model by :func:`normlab.convert.convert_norm` (or built with ``norm_layer=`` where the model's function
            takes one).
        lrs, batch_sizes, seeds, epochs: the grid (``layout="cross"``: a learning-rate sweep at the base batch
            size plus a batch-size sweep at the base learning rate).
        loss, metric: by name (``cross_entropy``, ``mse``; ``accuracy``, ``none``) or functions ``(output,
            target) -> scalar``.
        out: the output directory (calling again with the same arguments resumes; other lists extend the grid).
        monitor_every: the variance monitor records every N steps (0: off). stop_on: ``"confirmed"`` (default: a
            monitor alarm confirmed by a collapse stops the run), ``"non_finite"``, ``"alarm"``.
        guard: each run with a :class:`normlab.monitor.CollapseGuard` (rollback on a collapse).
        workers: processes training at once (default: one per usable core; 1 for a function without an import
            path, and under ``torchrun``). backend, address: ``"process"`` or ``"ray"`` (and the cluster).
        threads: torch threads per run. progress: say what runs and how long it will take (stderr).
        **options: any other :class:`~normlab.runner.grid.spec.GridSpec` field (``width``, ``layout``,
            ``base_lr``, ``base_batch_size``, ``lr_scaling``, ``target_acc``, ``max_steps_per_epoch``) or
            :class:`~normlab.runner.training.config.TrainConfig` field shared by every run (``momentum``,
            ``weight_decay``, ``milestones``, ``model_kwargs``, ``amp``, ``device``, ...).

    Returns:
        The results dict (``results.json``): ``norms`` (one record per norm,
        :func:`~normlab.runner.grid.results.per_norm`), ``groups``, ``cells``. Under ``torchrun``, None on the
        processes other than rank 0.

    Raises:
        UsageError: a bad option, a factory that cannot be imported or built, a model whose output the loss does
            not take (one line, before anything is written).
        CellsFailed: some runs raised; the report of the others is written first.

    Example::

        results = compare("timm:resnet18", "mypkg.data:images", norms=["bn", "gn", "pws"], lrs=[0.01, 0.1])
    """
    spec = comparison(
        model, data, norms=norms, lrs=lrs, batch_sizes=batch_sizes, seeds=seeds, epochs=epochs, loss=loss,
        metric=metric, monitor_every=monitor_every, stop_on=stop_on, guard=guard, **options,
    )  # fmt: skip
    names = {
        "model": spec.model,
        "data": spec.dataset,
        "loss": name_of("loss", loss),
        "metric": name_of("metric", metric),
    }
    workers = _where(names, workers, backend)
    announce = _announcer(progress, workers, remote=backend == "ray" and address is not None)
    kw = {"workers": workers, "threads": threads, "backend": backend, "address": address}
    return run_grid(spec, out, progress=progress, announce=announce, **kw)


def comparison(
    model: str | Callable = _DEFAULTS.model,
    data: str | Callable = _DEFAULTS.dataset,
    *,
    norms: Sequence[str] = DEFAULT_NORMS,
    lrs: Sequence[float] = (_DEFAULTS.lr,),
    batch_sizes: Sequence[int] = (_DEFAULTS.batch_size,),
    seeds: Sequence[int] = DEFAULT_SEEDS,
    epochs: int = _DEFAULTS.epochs,
    loss: str | Callable = _DEFAULTS.loss,
    metric: str | Callable = _DEFAULTS.metric,
    monitor_every: int = COMPARE_DEFAULTS["monitor_every"],
    stop_on: str = COMPARE_DEFAULTS["stop_on"],
    guard: bool = False,
    **options: Any,
) -> GridSpec:
    """The grid :func:`compare` trains, for the same arguments (without where and how it runs): a
    :class:`~normlab.runner.grid.spec.GridSpec` of the :data:`COMPARE` experiment, checked when made. A run option
    (``loss``, ``metric``, ``monitor_every``, ``stop_on``, ``guard``) is recorded among the grid's shared
    ``train_kwargs`` only where it is not :class:`~normlab.runner.training.config.TrainConfig`'s default; ``options``
    go to the grid's fields or to every run's, as in :func:`compare`.

    Example:
        >>> spec = comparison("plain1d", "mnist1d", norms=["bn", "pws"], lrs=[0.02, 0.1], batch_sizes=[128])
        >>> [c.cell_id for c in expand_grid(spec)][:2], spec.train_kwargs["stop_on"]
        (['bn_lr0.02_bs128_s0', 'bn_lr0.02_bs128_s1'], 'confirmed')
    """
    grid_options, shared = _split_options(options)
    runs = {"loss": name_of("loss", loss), "metric": name_of("metric", metric), "monitor_every": monitor_every}
    runs.update(stop_on=stop_on, guard=guard)
    shared.update({k: v for k, v in runs.items() if v != getattr(_DEFAULTS, k)})
    grid = {"norms": norms, "lrs": lrs, "batch_sizes": batch_sizes, "seeds": seeds, "epochs": epochs}
    data_name, model_name = name_of("data", data), name_of("model", model)
    return GridSpec(**grid, dataset=data_name, model=model_name, train_kwargs=shared, **grid_options)


def _announcer(progress: bool, workers: int, remote: bool) -> Callable[[GridRun], None]:
    """What :func:`compare` says before it starts: how many runs and about how long (stderr)."""

    def announce(grid: GridRun) -> None:
        if progress and grid.todo():
            cells = [c for c in grid.cells if grid.wanted is None or c.cell_id in grid.wanted]
            text, _ = plan_text(cells, grid.todo(), workers, remote=remote)
            print(f"normlab compare: {text}", file=sys.stderr)

    return announce
