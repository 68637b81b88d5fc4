"""``normlab compare``: a grid of normalizations x learning rates x batch sizes x seeds, on a built-in or your own
model and data (:func:`normlab.runner.experiments.compare.compare` is the same in Python)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from normlab.runner.errors import UsageError
from normlab.runner.experiments.compare import COMPARE_DEFAULTS, run_grid
from normlab.runner.grid.estimate import CONFIRM_MINUTES, estimate_minutes
from normlab.runner.grid.execute import BACKENDS, GridRun
from normlab.runner.grid.pool import default_workers
from normlab.runner.grid.ray_backend import check_address, check_device, require_ray
from normlab.runner.grid.report import print_summary
from normlab.runner.grid.spec import DEFAULT_NORMS, DEFAULT_SEEDS, LAYOUTS, LR_SCALINGS, GridSpec

from .args import (
    MAX_SEED,
    MAX_WORKERS,
    add_data_args,
    add_optim_args,
    add_out_arg,
    add_run_args,
    check_paths,
    fetch_data,
    integer,
    list_of,
    names,
    number,
    options_named,
    positive_int,
    train_kwargs,
)

_LR = number(0, low_open=True, what="a learning rate")

NAME = "compare"


def add_parser(sub) -> argparse.ArgumentParser:
    g = GridSpec()
    p = sub.add_parser(
        NAME,
        help="compare normalizations on a model and data: norms x learning rates x batch sizes x seeds",
        description="Run (or resume) a comparison grid on a built-in model and data set or your own "
        "(--model timm:resnet18, --model pkg.module:function, --dataset pkg.module:function); each cell is one "
        "training run in OUT/runs/<cell>, with the variance monitor. Writes OUT/results.json, OUT/results.md (one "
        "row per norm: the highest learning rate that trained, loss and metric, cost per step, the monitor's "
        "alarms) and PNG plots.",
    )
    _add_grid_args(p, g)
    add_data_args(p)
    add_run_args(p)
    add_optim_args(p)
    add_out_arg(p, "runs/compare")
    _add_execution_args(p)
    p.set_defaults(run=run, **COMPARE_DEFAULTS)
    return p


def _add_grid_args(p: argparse.ArgumentParser, g: GridSpec) -> None:
    """The options that span the grid: norms, learning rates, batch sizes, seeds, epochs, layout, lr scaling."""
    p.add_argument(
        "--norms",
        type=names,
        default=list(DEFAULT_NORMS),
        help="comma-separated comparison names: none,bn,brn,gn,ln,in,sn (output norms), wn,ws,pws "
        "(weight reparametrizations, no output norm), or e.g. ws+gn "
        f"(default {','.join(DEFAULT_NORMS)})",
    )
    p.add_argument(
        "--lrs",
        type=list_of(_LR, "learning rates"),
        default=list(g.lrs),
        help=f"comma-separated learning rates > 0 (default {','.join(map(str, g.lrs))})",
    )
    p.add_argument(
        "--batch-sizes",
        type=list_of(positive_int, "batch sizes"),
        default=list(g.batch_sizes),
        help=f"comma-separated batch sizes (default {','.join(map(str, g.batch_sizes))})",
    )
    p.add_argument(
        "--seeds",
        type=list_of(integer(0, MAX_SEED, what="a seed"), "seeds"),
        default=list(DEFAULT_SEEDS),
        help=f"comma-separated seeds (default {','.join(map(str, DEFAULT_SEEDS))})",
    )
    p.add_argument("--epochs", type=positive_int, default=g.epochs, help=f"epochs per run (default {g.epochs})")
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        default=g.layout,
        help="product: every lr x batch size; cross: lr sweep at the base batch size plus batch-size sweep "
        "at the base lr (default product)",
    )
    p.add_argument("--base-lr", type=_LR, default=None, help="lr of the batch-size sweep (default: first of --lrs)")
    p.add_argument(
        "--base-batch-size",
        type=positive_int,
        default=None,
        help="batch size of the lr sweep and of the lr scaling (default: first of --batch-sizes)",
    )
    p.add_argument(
        "--lr-scaling",
        choices=LR_SCALINGS,
        default=g.lr_scaling,
        help="scale each cell's lr with batch_size / base batch size (default none)",
    )


def _add_execution_args(p: argparse.ArgumentParser) -> None:
    """Where and how the cells run: workers, backend, Ray address, progress, confirmation of long grids."""
    p.add_argument(
        "--workers",
        type=integer(0, MAX_WORKERS, what="a number of workers"),
        default=0,
        help="parallel worker processes, 1 torch thread each (default 0: one per usable core)",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="process",
        help="process: local worker processes (default); ray: each cell a Ray task, on a local Ray "
        "started here or on the cluster at --address (pip install 'normlab[ray]')",
    )
    p.add_argument(
        "--address",
        default=None,
        help="with --backend ray: the Ray cluster to run on (host:port from `ray start --head`, or auto); "
        "several machines need --out on a shared filesystem",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--yes",
        action="store_true",
        help=f"start a grid estimated to take more than {CONFIRM_MINUTES:g} minutes here (without it, "
        "such a grid is refused after its size and estimated time are printed)",
    )


# every cell's TrainConfig field that a compare option sets for the whole grid
_RENAMES = {
    "batch_size": "--batch-sizes",
    "lr": "--lrs",
    "seed": "--seeds",
    "norm": "--norms",
    "conv": "--norms",
    "conv_kwargs": "--norms",
    "out_dir": "--out",
}


def _spec(args: argparse.Namespace) -> GridSpec:
    """The grid of the options (GridSpec checks it: lists, names, the cross layout's base point)."""
    return GridSpec(
        norms=args.norms,
        lrs=args.lrs,
        batch_sizes=args.batch_sizes,
        seeds=args.seeds,
        epochs=args.epochs,
        dataset=args.dataset,
        model=args.model,
        width=args.width,
        layout=args.layout,
        base_lr=args.base_lr,
        base_batch_size=args.base_batch_size,
        lr_scaling=args.lr_scaling,
        target_acc=args.target_acc,
        max_steps_per_epoch=args.max_steps_per_epoch,
        train_kwargs=train_kwargs(args),
    )


def _check_backend(args: argparse.Namespace) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and (args.workers > 1 or args.backend != "process"):
        raise UsageError(
            "--workers: under torchrun every process trains each run together (DDP); drop --workers and --backend"
        )
    if args.address is not None and args.backend != "ray":
        raise UsageError("--address applies to --backend ray")
    if args.address is not None and not args.address.strip():
        raise UsageError("--address: expected a Ray cluster address (host:port or auto), got an empty string")
    if args.address is not None and args.workers:
        raise UsageError("--workers: the Ray cluster at --address decides how many cells run at once; drop --workers")
    if args.backend == "ray":  # refused before anything is written
        require_ray(local=args.address is None)
        check_device(args.device)
        if args.address is not None:
            check_address(args.address)


def _announce(args: argparse.Namespace, grid: GridRun) -> None:
    """Say how many runs and about how long before starting; refuse a long grid without --yes (in one line)."""
    cells, todo = [c for c in grid.cells if c.cell_id in grid.wanted], grid.todo()
    if not todo:
        return
    workers = args.workers or default_workers()
    minutes = estimate_minutes(todo, workers)
    where = "on the Ray cluster (timed here)" if args.address else f"with {min(workers, len(todo))} worker(s) here"
    done = f", {len(cells) - len(todo)} already done" if len(todo) < len(cells) else ""
    runs = f"{len(todo)} run" + ("s" if len(todo) != 1 else "")
    plan = f"{runs} to train{done} ({spec_text(args)}): about {minutes:.0f} min {where}"
    if minutes > CONFIRM_MINUTES and not args.yes:
        raise UsageError(
            f"--yes: {plan}; pass --yes to start it, or make it smaller (--norms, --seeds, --epochs, --width)"
        )
    print(f"normlab compare: {plan}", file=sys.stderr)


def spec_text(args: argparse.Namespace) -> str:
    return (
        f"{len(args.norms)} norms x {len(args.lrs)} lrs x {len(args.batch_sizes)} batch sizes x "
        f"{len(args.seeds)} seeds, {args.epochs} epochs each, width {args.width:g}"
    )


def run(args: argparse.Namespace) -> int:
    check_paths(args)
    _check_backend(args)
    fetch_data(args)
    with options_named(_RENAMES):
        results = run_grid(
            _spec(args),
            args.out,
            workers=args.workers,
            progress=not args.no_progress,
            threads=args.threads,
            backend=args.backend,
            address=args.address,
            announce=lambda grid: _announce(args, grid),
            option="--out",
        )
    if results is not None:  # under torchrun: rank 0's
        print_summary(results, Path(args.out))
    return 0
