"""Argument types and the option groups shared by several commands; defaults come from the runner's configs.

The command line parses: every option value is turned into its type where argparse reads it (a bad value ends
the command with one line naming the option, exit code 2). What the values mean together is checked once, by the
runner's spec or config that owns the fact (:class:`~normlab.runner.grid.spec.GridSpec`,
:meth:`~normlab.runner.training.config.TrainConfig.validate`, the feasibility checks); their refusals name a
field (:class:`~normlab.runner.errors.FieldError`), which :func:`options_named` says as the command's option.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import math
import os
import re
import sys

from normlab.monitor.collapse import WINDOW_EXAMPLES, CollapseCriteria
from normlab.runner.data.cifar10 import download_cifar10
from normlab.runner.data.datasets import DATASETS
from normlab.runner.data.mnist1d import DEFAULT_SAMPLES, MIN_SAMPLES
from normlab.runner.errors import FieldError, UsageError
from normlab.runner.factories import LOSSES, METRICS
from normlab.runner.io import check_dir_option
from normlab.runner.models import MAX_WIDTH, MODELS
from normlab.runner.training.config import BRN_SCHEDULES, GROUPS, MAX_THREADS, STOP_ON, TrainConfig, resolve_device

__all__ = [
    "OneLineParser",
    "list_of",
    "names",
    "fraction",
    "positive_int",
    "finite_float",
    "threads_int",
    "number",
    "integer",
    "device",
    "add_data_args",
    "add_optim_args",
    "add_out_arg",
    "add_run_args",
    "train_kwargs",
    "option_name",
    "options_named",
    "check_name",
    "check_paths",
    "importable_from_here",
    "fetch_data",
    "DEFAULTS",
    "MAX_WORKERS",
    "MAX_SEED",
]

DEFAULTS = TrainConfig()
MAX_WORKERS = 256
MAX_SEED = 2**32 - 1


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``normlab <command>: error: ...`` (exit code 2) instead of
    a usage block; ``--help`` is unchanged. Subparsers inherit the class. Options are never abbreviated
    (``--epoch`` is not ``--epochs``), and an unknown option is refused by the command that owns the options, with
    the closest known ones: ``unrecognized arguments: --lrr 0.1 (did you mean --lr?)``."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        unknown = [a.split("=")[0] for a in extras if a.startswith("-") and a != "-"]
        if unknown:  # refused here, where the options are known (the top parser would not know a command's)
            known = [o for o in self._option_string_actions if o.startswith("--")]
            near = [m for u in unknown for m in difflib.get_close_matches(u, known, n=2, cutoff=0.7)]
            hint = f" (did you mean {' or '.join(dict.fromkeys(near))}?)" if near else ""
            self.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return namespace, extras

    def error(self, message: str):
        message = " ".join(str(message).split())
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if choice:  # a mistyped command or choice: the closest ones
            options = [c.strip(" '") for c in choice.group(2).split(",")]
            near = difflib.get_close_matches(choice.group(1), options, n=2, cutoff=0.6)
            message += f" (did you mean {' or '.join(near)}?)" if near else ""
        self.exit(2, f"{self.prog}: error: {message}\n")


def _interval(low, high, low_open: bool, high_open: bool) -> str:
    if high is None:
        return f"> {low:g}" if low_open else f">= {low:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def number(
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    what: str = "a number",
):
    """A finite float in the given interval (None: unbounded on that side)."""
    rng = "" if low is None else " " + _interval(low, high, low_open, high_open)

    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            v = math.nan
        ok = (
            math.isfinite(v)
            and (low is None or (v > low if low_open else v >= low))
            and (high is None or (v < high if high_open else v <= high))
        )
        if not ok:
            raise argparse.ArgumentTypeError(f"expected {what}{rng}, got {s!r}")
        return v

    return parse


def integer(low: int, high: int | None = None, what: str = "an integer"):
    """An integer in [low, high] (high None: no upper bound)."""
    rng = f">= {low}" if high is None else f"in [{low}, {high}]"

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} {rng}, got {s!r}") from None
        if v < low or (high is not None and v > high):
            raise argparse.ArgumentTypeError(f"expected {what} {rng}, got {s!r}")
        return v

    return parse


def list_of(kind, what: str, increasing: bool = False):
    """A comma-separated list of ``kind`` values (at least one; strictly increasing if asked)."""

    def parse(s: str):
        _no_empty_items(s, what)
        try:
            vals = [kind(x.strip()) for x in s.split(",")]
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}: {e}") from None
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, got {s!r}") from None
        if not vals:
            raise argparse.ArgumentTypeError(f"expected at least one of {what}, got {s!r}")
        if increasing and any(a >= b for a, b in zip(vals, vals[1:])):
            raise argparse.ArgumentTypeError(f"expected increasing {what}, got {s!r}")
        return vals

    return parse


def _no_empty_items(s: str, what: str) -> None:
    """Refuse ``a,,b``, ``a,`` and ``""`` instead of dropping the empty item (a typo that would shrink the grid)."""
    items = s.split(",")
    if any(not x.strip() for x in items):
        where = "an empty list" if not s.strip() else f"an empty item in {s!r}"
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, got {where}")


def names(s: str) -> list[str]:
    """A comma-separated list of names, lower-cased."""
    _no_empty_items(s, "names")
    vals = [x.strip().lower() for x in s.split(",")]
    if not vals:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of names, got {s!r}")
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


positive_int = integer(1)
finite_float = number(what="a finite number")
threads_int = integer(1, MAX_THREADS, what="a number of threads")
width_float = number(0, MAX_WIDTH, low_open=True, what="a width multiplier")


def device(s: str) -> str:
    """A torch device that exists here (cpu, cuda, cuda:N, mps, xpu) or ``auto``."""
    try:
        resolve_device(s)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def check_name(value: str, valid, option: str, what: str) -> str:
    """``value`` if it is one of ``valid``, else a one-line refusal naming ``option`` and the valid names."""
    if value not in valid:
        raise UsageError(f"{option}: unknown {what} {value!r}; expected one of {', '.join(valid)}")
    return value


def add_out_arg(
    p: argparse.ArgumentParser, default: str, what: str = "output directory", quick: tuple[str, str] | None = None
) -> None:
    """``--out`` (default ``default``). ``quick``: ``(flag, directory)`` of the command's quick mode, which gets a
    directory of its own: ``--out`` then defaults to None and the command picks one of the two."""
    mode = f", with {quick[0]} {quick[1]}" if quick else ""
    p.add_argument(
        "--out",
        default=None if quick else default,
        help=f"{what} (default {default}{mode}); rerun the same command to resume",
    )


def add_data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dataset",
        default=DEFAULTS.dataset,
        help=f"data set: {', '.join(DATASETS)} (default {DEFAULTS.dataset}; mnist1d is generated locally, "
        f"cifar10 reads the python batches in --data-dir), or your data factory pkg.module:function returning "
        "(train, test) datasets or data loaders (docs/compare.md)",
    )
    p.add_argument(
        "--model",
        default=DEFAULTS.model,
        help=f"network: {', '.join(MODELS)} (default {DEFAULTS.model}), timm:NAME or torchvision:NAME (built "
        "without weights), or your model factory pkg.module:function; the norm is put in by "
        "normlab.convert.convert_norm (or passed as norm_layer= where the factory takes one)",
    )
    p.add_argument(
        "--loss",
        default=DEFAULTS.loss,
        help=f"loss: {', '.join(LOSSES)} or pkg.module:function(output, target) (default {DEFAULTS.loss})",
    )
    p.add_argument(
        "--metric",
        default=DEFAULTS.metric,
        help=f"metric reported: {', '.join(METRICS)} or pkg.module:function(output, target) -> the batch's mean "
        f"(default {DEFAULTS.metric})",
    )
    p.add_argument(
        "--width",
        type=width_float,
        default=DEFAULTS.width,
        help=f"channel width multiplier in (0, {MAX_WIDTH:g}] (default {DEFAULTS.width})",
    )
    p.add_argument("--data-dir", default=None, help="directory with the data set files (cifar10) or its cache")
    p.add_argument(
        "--max-steps-per-epoch", type=positive_int, default=None, help="cap on training steps per epoch (quick runs)"
    )
    p.add_argument(
        "--target-acc",
        type=fraction,
        default=None,
        help="test accuracy (fraction or percent) for the 'epochs to target' column",
    )
    p.add_argument("--download", action="store_true", help="download the data set first (cifar10 only)")


def add_run_args(p: argparse.ArgumentParser) -> None:
    """Options of what one run records and on how much data: shared by ``train`` and ``compare``."""
    d = DEFAULTS
    p.add_argument(
        "--num-samples",
        type=integer(MIN_SAMPLES, what="a number of samples"),
        default=None,
        help=f"mnist1d: samples to generate, train + test split 80/20 (default {DEFAULT_SAMPLES})",
    )
    p.add_argument(
        "--num-train", type=positive_int, default=None, help="use only the first N training samples (default: all)"
    )
    p.add_argument(
        "--evals-per-epoch",
        type=positive_int,
        default=d.evals_per_epoch,
        help=f"test evaluations per epoch, for training curves (default {d.evals_per_epoch})",
    )
    p.add_argument(
        "--eval-train-mode",
        action="store_true",
        help="also report test accuracy with batch statistics (train mode) at the training batch size",
    )
    p.add_argument(
        "--monitor-every",
        type=integer(0),
        default=d.monitor_every,
        help="record variance-monitor statistics every N steps (0: off; default %(default)s)",
    )
    p.add_argument(
        "--monitor-dense-steps",
        type=integer(0),
        default=d.monitor_dense_steps,
        help="also record every --monitor-dense-every steps during the first N steps (default 0)",
    )
    p.add_argument(
        "--monitor-dense-every",
        type=positive_int,
        default=d.monitor_dense_every,
        help=f"see --monitor-dense-steps (default {d.monitor_dense_every})",
    )
    p.add_argument(
        "--stop-on",
        choices=STOP_ON,
        default=d.stop_on,
        help="what stops a run early: non_finite (a non-finite loss; always), confirmed (also the monitor's alarm "
        "once the loss has collapsed: back to chance, or to where it started), alarm (also the monitor's alarm "
        "alone); default %(default)s",
    )


def add_optim_args(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    p.add_argument(
        "--momentum",
        type=number(0, 1, high_open=True),
        default=d.momentum,
        help=f"SGD momentum in [0, 1) (default {d.momentum})",
    )
    p.add_argument(
        "--weight-decay", type=number(0), default=d.weight_decay, help=f"weight decay >= 0 (default {d.weight_decay})"
    )
    p.add_argument(
        "--wd-norm-alpha",
        action="store_true",
        help="also apply weight decay to norm parameters, biases and PWS alpha (default: not)",
    )
    p.add_argument(
        "--milestones",
        type=list_of(positive_int, "epochs", increasing=True),
        default=list(d.milestones),
        help="epochs after which the lr is multiplied by --lr-gamma, e.g. 100,150,180",
    )
    p.add_argument(
        "--lr-gamma",
        type=number(0, low_open=True),
        default=d.lr_gamma,
        help=f"lr decay factor at milestones, > 0 (default {d.lr_gamma})",
    )
    p.add_argument(
        "--brn-schedule",
        choices=BRN_SCHEDULES,
        default=d.brn_schedule,
        help="rmax/dmax schedule of BatchRenorm layers: 'run' (default: the paper's schedule compressed to "
        "reach rmax 3 / dmax 5 halfway through the run) or 'paper' (5k-step warm-up, rmax 3 at 40k, "
        "dmax 5 at 25k steps)",
    )
    p.add_argument(
        "--device", type=device, default=d.device, help=f"torch device: cpu, cuda, cuda:N or auto (default {d.device})"
    )
    p.add_argument(
        "--amp",
        action="store_true",
        help="mixed precision: bfloat16 autocast on CPU, float16 autocast + GradScaler on CUDA (normlab's "
        "layers keep float32 statistics; evaluation runs in float32)",
    )
    guard = CollapseCriteria()
    p.add_argument(
        "--guard",
        action="store_true",
        help="rescue a failing run (normlab.monitor.CollapseGuard at its defaults): on a non-finite loss, gradient or "
        "test loss, an exploded loss or a return to chance, or a monitor alarm (with --monitor-every) that such a "
        "failure confirms, go back to a snapshot from before the trouble with a lower learning rate; the failures: "
        f"{guard.describe(examples=WINDOW_EXAMPLES)}",
    )
    p.add_argument(
        "--guard-dead",
        action="store_true",
        help="implies --guard; the guard knows chance (ln of the number of classes) instead of estimating it by the "
        "first loss: a monitor alarm on a network that has not learned waits, and is confirmed once the net is "
        "judged never to have learned. It saves dead networks, and it also rolls back slow learners that would "
        "have learned later",
    )
    p.add_argument(
        "--threads",
        type=threads_int,
        default=None,
        help=f"torch threads per training process, 1 to {MAX_THREADS} (default: torch's choice for one "
        f"process, 1 per worker when several run in parallel; 1 is often fastest for these small "
        f"models)",
    )


# TrainConfig fields that the options of a grid's cells set (compare: its GridSpec fields and --norms; train: its own
# options); every other field with an option of its own name is shared by the cells (:func:`train_kwargs`)
CELL_FIELDS = ("dataset", "model", "norm", "conv", "conv_kwargs", "width", "lr", "batch_size", "epochs", "seed")
CELL_FIELDS += ("target_acc", "max_steps_per_epoch")
# recorded only when not their default, so that grids and checkpoints written before the option existed stay resumable
_ONLY_WHEN_SET = ("data_dir", "amp", "guard", "guard_dead", "stop_on", "loss", "metric")


def train_kwargs(args: argparse.Namespace) -> dict:
    """The TrainConfig fields the options set besides :data:`CELL_FIELDS`: every field with an option of its name
    (``--weight-decay`` -> ``weight_decay``), and ``nowd_norm_alpha`` (``--wd-norm-alpha`` turns it off); ``guard`` is
    on with ``--guard-dead`` too."""
    fields = [f for group in GROUPS.values() for f in group if f not in CELL_FIELDS and hasattr(args, f)]
    kw = {f: getattr(args, f) for f in fields}
    kw.update(nowd_norm_alpha=not args.wd_norm_alpha, milestones=tuple(args.milestones))
    kw["guard"] = args.guard or args.guard_dead
    return {k: v for k, v in kw.items() if k not in _ONLY_WHEN_SET or v != getattr(DEFAULTS, k)}


def option_name(field: str, renames: dict[str, str] | None = None) -> str:
    """The option that sets a spec or config field: ``batch_size`` -> ``--batch-size`` unless ``renames`` says
    otherwise (``compare`` sets every cell's ``batch_size`` with ``--batch-sizes``)."""
    return (renames or {}).get(field, "--" + field.replace("_", "-"))


@contextlib.contextmanager
def options_named(renames: dict[str, str] | None = None):
    """Inside the block, a :class:`~normlab.runner.errors.FieldError` becomes the same refusal naming options."""
    try:
        yield
    except FieldError as e:
        raise e.for_options(lambda f: option_name(f, renames)) from None


def importable_from_here() -> None:
    """Put the current directory first on the import path (once), as ``python -m`` does, so that a
    ``pkg.module:function`` of ``--model``/``--dataset``/``--loss``/``--metric`` is found where the command runs
    (worker processes inherit the path)."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)


def check_paths(args: argparse.Namespace) -> None:
    """Refuse a bad ``--out`` / ``--data-dir`` and options that do not fit ``--dataset`` before anything is
    written (the names of ``--dataset`` and ``--model`` are the config's to check)."""
    check_dir_option(args.out, "--out")
    importable_from_here()
    if args.data_dir is not None:
        check_dir_option(args.data_dir, "--data-dir", writable=args.dataset == "mnist1d" or args.download)
    if args.num_samples is not None and args.dataset != "mnist1d":
        raise UsageError(f"--num-samples applies to --dataset mnist1d (generated data), not to {args.dataset}")
    if args.download and args.dataset != "cifar10":
        raise UsageError(f"--download applies to --dataset cifar10, not to {args.dataset}")


def fetch_data(args: argparse.Namespace) -> None:
    """``--download``: fetch the data set into ``--data-dir`` first (cifar10; :func:`check_paths` refused it for the
    others); loading it is the runner's, once."""
    if args.download:
        if args.data_dir is None:
            raise UsageError("--download: expected a --data-dir to download cifar10 into")
        download_cifar10(args.data_dir)
