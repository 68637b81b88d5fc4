"""Argument types and the option groups shared by several commands; defaults come from the runner's configs."""

from __future__ import annotations

import argparse
import math

from normlab.nn import resolve_comparison
from normlab.runner.config import BRN_SCHEDULES, TrainConfig
from normlab.runner.data import DATASETS, get_dataset
from normlab.runner.errors import UsageError
from normlab.runner.models import MODELS

__all__ = ["list_of", "names", "fraction", "positive_int", "finite_float", "add_data_args", "add_optim_args",
           "add_out_arg", "add_run_args", "train_kwargs", "resolve_name", "load_data", "DEFAULTS"]

DEFAULTS = TrainConfig()


def list_of(kind, what: str):
    """A comma-separated list of ``kind`` values (at least one)."""

    def parse(s: str):
        try:
            vals = [kind(x) for x in s.split(",") if x.strip()]
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, got {s!r}") from None
        if not vals:
            raise argparse.ArgumentTypeError(f"expected at least one of {what}")
        return vals

    return parse


def names(s: str) -> list[str]:
    """A comma-separated list of names, lower-cased."""
    vals = [x.strip().lower() for x in s.split(",") if x.strip()]
    if not vals:
        raise argparse.ArgumentTypeError("expected a comma-separated list of names")
    return vals


def fraction(s: str) -> float:
    """An accuracy in (0, 1], or a percent in (1, 100]."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {s!r}") from None
    if v > 1.0:
        v = v / 100.0
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected an accuracy in (0, 1] (or a percent), got {s!r}")
    return v


def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return v


def finite_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {s!r}")
    return v


def add_out_arg(p: argparse.ArgumentParser, default: str, what: str = "output directory") -> None:
    p.add_argument("--out", default=default, help=f"{what} (default {default}); rerun the same command to resume")


def add_data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", default=DEFAULTS.dataset,
                   help=f"data set: {', '.join(DATASETS)} (default {DEFAULTS.dataset}; mnist1d is generated locally, "
                        f"cifar10 reads the python batches in --data-dir)")
    p.add_argument("--model", default=DEFAULTS.model,
                   help=f"network: {', '.join(MODELS)} (default {DEFAULTS.model})")
    p.add_argument("--width", type=finite_float, default=DEFAULTS.width,
                   help=f"channel width multiplier (default {DEFAULTS.width})")
    p.add_argument("--data-dir", default=None, help="directory with the data set files (cifar10) or its cache")
    p.add_argument("--max-steps-per-epoch", type=positive_int, default=None,
                   help="cap on training steps per epoch (quick runs)")
    p.add_argument("--target-acc", type=fraction, default=None,
                   help="test accuracy (fraction or percent) for the 'epochs to target' column")
    p.add_argument("--download", action="store_true", help="download the data set first (cifar10 only)")


def add_run_args(p: argparse.ArgumentParser) -> None:
    """Options of what one run records and on how much data: shared by ``train`` and ``compare``."""
    d = DEFAULTS
    p.add_argument("--num-samples", type=positive_int, default=None,
                   help="mnist1d: samples to generate, train + test split 80/20 (default 25000)")
    p.add_argument("--num-train", type=positive_int, default=None,
                   help="use only the first N training samples (default: all)")
    p.add_argument("--evals-per-epoch", type=positive_int, default=d.evals_per_epoch,
                   help=f"test evaluations per epoch, for training curves (default {d.evals_per_epoch})")
    p.add_argument("--eval-train-mode", action="store_true",
                   help="also report test accuracy with batch statistics (train mode) at the training batch size")
    p.add_argument("--monitor-every", type=int, default=d.monitor_every,
                   help="record variance-monitor statistics every N steps (0: off)")
    p.add_argument("--monitor-dense-steps", type=int, default=d.monitor_dense_steps,
                   help="also record every --monitor-dense-every steps during the first N steps (default 0)")
    p.add_argument("--monitor-dense-every", type=positive_int, default=d.monitor_dense_every,
                   help=f"see --monitor-dense-steps (default {d.monitor_dense_every})")
    p.add_argument("--stop-on-collapse", action="store_true", help="stop a run when the monitor raises its alarm")


def add_optim_args(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    p.add_argument("--momentum", type=finite_float, default=d.momentum, help=f"SGD momentum (default {d.momentum})")
    p.add_argument("--weight-decay", type=finite_float, default=d.weight_decay,
                   help=f"weight decay (default {d.weight_decay})")
    p.add_argument("--wd-norm-alpha", action="store_true",
                   help="also apply weight decay to norm parameters, biases and PWS alpha (default: not)")
    p.add_argument("--milestones", type=list_of(int, "epochs"), default=list(d.milestones),
                   help="epochs after which the lr is multiplied by --lr-gamma, e.g. 100,150,180")
    p.add_argument("--lr-gamma", type=finite_float, default=d.lr_gamma,
                   help=f"lr decay factor at milestones (default {d.lr_gamma})")
    p.add_argument("--brn-schedule", choices=BRN_SCHEDULES, default=d.brn_schedule,
                   help="rmax/dmax schedule of BatchRenorm layers: 'run' (default: the paper's schedule compressed to "
                        "reach rmax 3 / dmax 5 halfway through the run) or 'paper' (5k-step warm-up, rmax 3 at 40k, "
                        "dmax 5 at 25k steps)")
    p.add_argument("--device", default=d.device, help=f"torch device: cpu, cuda, cuda:N or auto (default {d.device})")
    p.add_argument("--num-workers", type=int, default=d.num_workers,
                   help="accepted for compatibility (data sets are in-memory tensors)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads per training process (default: torch's choice for one process, 1 per worker "
                        "when several run in parallel; 1 is often fastest for these small models)")


def train_kwargs(args: argparse.Namespace) -> dict:
    """The TrainConfig fields the optimisation and data options set."""
    kw = dict(momentum=args.momentum, weight_decay=args.weight_decay, nowd_norm_alpha=not args.wd_norm_alpha,
              milestones=tuple(args.milestones), lr_gamma=args.lr_gamma, device=args.device,
              num_workers=args.num_workers, brn_schedule=args.brn_schedule, num_samples=args.num_samples,
              num_train=args.num_train, evals_per_epoch=args.evals_per_epoch, eval_train_mode=args.eval_train_mode,
              monitor_every=args.monitor_every, monitor_dense_steps=args.monitor_dense_steps,
              monitor_dense_every=args.monitor_dense_every, stop_on_collapse=args.stop_on_collapse)
    if args.data_dir is not None:
        kw["data_dir"] = args.data_dir
    return kw


def resolve_name(name: str) -> tuple[str, str]:
    """:func:`normlab.nn.resolve_comparison` with its refusal as a :class:`UsageError`."""
    try:
        return resolve_comparison(name)
    except ValueError as e:
        raise UsageError(str(e)) from None


def load_data(args: argparse.Namespace):
    """Load (and with ``--download`` fetch) the data set named by ``--dataset``."""
    return get_dataset(args.dataset, data_dir=args.data_dir, download=args.download)
