"""``normlab train``: one training run (options mirror :class:`normlab.runner.training.config.TrainConfig`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from normlab.nn import CONV_KINDS, comparison_names
from normlab.runner.errors import UsageError
from normlab.runner.io import check_dir_option, remove_stale_temps
from normlab.runner.lock import out_lock
from normlab.runner.training.checks import check_feasible
from normlab.runner.training.config import TrainConfig, resolve_name
from normlab.runner.training.train import train

from .args import (
    DEFAULTS,
    MAX_SEED,
    add_data_args,
    add_optim_args,
    add_out_arg,
    add_run_args,
    check_paths,
    fetch_data,
    integer,
    number,
    options_named,
    positive_int,
    train_kwargs,
)

NAME = "train"


def add_parser(sub) -> argparse.ArgumentParser:
    d = DEFAULTS
    p = sub.add_parser(
        NAME,
        help="train one network",
        description="Train one network. Killing it and rerunning with the same --out resumes from the last checkpoint.",
    )
    add_data_args(p)
    p.add_argument(
        "--norm",
        default=d.norm,
        help=f"output normalization or comparison name: {', '.join(comparison_names())} or e.g. ws+gn; "
        f"a weight reparametrization (wn, ws, pws) sets --conv and no output norm (default {d.norm})",
    )
    p.add_argument("--conv", default=None, help=f"conv kind: {', '.join(CONV_KINDS)} (default {d.conv})")
    p.add_argument(
        "--lr",
        type=number(0, low_open=True, what="a learning rate"),
        default=d.lr,
        help=f"learning rate > 0 (default {d.lr})",
    )
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size, help=f"batch size (default {d.batch_size})")
    p.add_argument("--epochs", type=positive_int, default=d.epochs, help=f"epochs (default {d.epochs})")
    p.add_argument(
        "--seed", type=integer(0, MAX_SEED, what="a seed"), default=d.seed, help=f"random seed (default {d.seed})"
    )
    add_run_args(p)
    add_optim_args(p)
    add_out_arg(p, "runs/train")
    p.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="also write TensorBoard event files to DIR: loss, accuracy and lr of the run, and with "
        "--monitor-every the monitor's per-layer scalars and histograms (pip install "
        "'normlab[tensorboard]')",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)
    return p


def _config(args: argparse.Namespace) -> TrainConfig:
    """The run's config from the options (TrainConfig checks it; ``--norm`` alone is a comparison name)."""
    norm, conv = resolve_name(args.norm) if args.conv is None else (args.norm, args.conv)
    return TrainConfig(
        dataset=args.dataset,
        model=args.model,
        norm=norm,
        conv=conv,
        width=args.width,
        lr=args.lr,
        batch_size=args.batch_size,
        epochs=args.epochs,
        seed=args.seed,
        target_acc=args.target_acc,
        max_steps_per_epoch=args.max_steps_per_epoch,
        **train_kwargs(args),
    ).validate()


def _check_tensorboard(args: argparse.Namespace) -> None:
    if args.tensorboard is None:
        return
    check_dir_option(args.tensorboard, "--tensorboard")
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        raise UsageError("--tensorboard needs TensorBoard: pip install 'normlab[tensorboard]'") from None


def run(args: argparse.Namespace) -> int:
    check_paths(args)
    _check_tensorboard(args)
    fetch_data(args)
    with options_named():  # the run's data and model, loaded and built once, here (before anything is written)
        cfg = _config(args)
        inputs = check_feasible(cfg, world=int(os.environ.get("WORLD_SIZE", "1")))
    if args.threads:
        torch.set_num_threads(args.threads)
    kw = {"progress": not args.quiet, "tensorboard": args.tensorboard, "inputs": inputs}
    if int(os.environ.get("RANK", "0")) != 0:  # torchrun: rank 0 holds the lock and writes every file
        summary = train(cfg, args.out, **kw)
    else:
        with out_lock(args.out, NAME, claim=f"normlab {NAME}", record="summary.json") as out:
            remove_stale_temps(out)  # left by a writer killed in an earlier run; no live writer holds the lock
            summary = train(cfg, out, **kw)
    acc = summary.get("final_test_acc")
    msg = f"final test acc {100 * acc:.2f} %" if acc is not None else "no test accuracy"
    if summary.get("collapsed"):
        msg += f"; COLLAPSED at epoch {summary.get('collapse_epoch')}"
    print(
        f"normlab train: {msg}; best {100 * (summary.get('best_test_acc') or 0):.2f} %; "
        f"summary in {Path(args.out) / 'summary.json'}"
    )
    return 0
