"""The ``normlab`` command line: ``demo | train | compare | report | monitor | bench``.

Bad input (unknown names, impossible combinations such as a batch size larger than the data set or an
input too small for the model) is refused before any training with a one-line reason and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

EXIT_USAGE = 2

TRAIN_DEFAULTS = dict(  # mirrors normlab.train.TrainConfig (API contract); used for help text and flags
    dataset="digits", model="plain", norm="bn", conv="conv", width=1.0, lr=0.05, batch_size=64, epochs=10,
    momentum=0.9, weight_decay=5e-4, lr_gamma=0.1, seed=0, device="cpu", monitor_every=0, num_workers=0,
)


class UsageError(Exception):
    """Invalid user input: reported as one line on stderr, exit code 2."""


class RunError(Exception):
    """A run that cannot go on (e.g. a corrupt checkpoint): one line on stderr, exit code 1."""


def _guarded(fn, *a, **kw):
    """Run training; the runner's own refusals (messages starting with ``train:`` / ``run_grid:``: corrupt
    checkpoint, results of another config in the output directory) become one-line errors, not tracebacks."""
    try:
        return fn(*a, **kw)
    except (RuntimeError, ValueError) as e:
        msg = str(e).strip()
        if msg.startswith(("train:", "run_grid:")):
            raise (UsageError if isinstance(e, ValueError) else RunError)(msg) from None
        raise


# --------------------------------------------------------------------------------------------------
# Argument types
# --------------------------------------------------------------------------------------------------

def _list_of(kind, what: str):
    def parse(s: str):
        try:
            vals = [kind(x) for x in s.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, got {s!r}") from None
        if not vals:
            raise argparse.ArgumentTypeError(f"expected at least one {what}")
        return vals
    return parse


def _names(s: str) -> list[str]:
    vals = [x.strip().lower() for x in s.split(",") if x.strip()]
    if not vals:
        raise argparse.ArgumentTypeError("expected a comma-separated list of names")
    return vals


def _fraction(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {s!r}") from None
    if v > 1.0:  # allow percent
        v = v / 100.0
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected an accuracy in (0, 1] (or a percent), got {s!r}")
    return v


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return v


# --------------------------------------------------------------------------------------------------
# Parser
# --------------------------------------------------------------------------------------------------

def _add_common_data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", default="digits",
                   help="data set: digits (bundled 8x8 digits, default), mnist1d (generated locally), "
                        "cifar10 (python batches in --data-dir)")
    p.add_argument("--model", default="plain",
                   help="network: plain (the paper's plain net), resnet (pre-activation), resnet_pws (official "
                        "PWS layout), cnn1d (for mnist1d)")
    p.add_argument("--width", type=float, default=1.0, help="channel width multiplier (default 1.0)")
    p.add_argument("--data-dir", default=None, help="directory with the data set files (cifar10)")
    p.add_argument("--max-steps-per-epoch", type=_positive_int, default=None,
                   help="cap on training steps per epoch (for quick runs)")
    p.add_argument("--target-acc", type=_fraction, default=None,
                   help="test accuracy (fraction or percent) for the 'epochs to target' column")


def _add_optim_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    p.add_argument("--weight-decay", type=float, default=5e-4, help="weight decay (default 5e-4)")
    p.add_argument("--wd-norm-alpha", action="store_true",
                   help="also apply weight decay to norm parameters and PWS alpha (default: not)")
    p.add_argument("--milestones", type=_list_of(int, "epochs"), default=[],
                   help="epochs after which the lr is multiplied by --lr-gamma, e.g. 100,150,180")
    p.add_argument("--lr-gamma", type=float, default=0.1, help="lr decay factor at milestones (default 0.1)")
    p.add_argument("--brn-schedule", choices=("run", "paper"), default="run",
                   help="rmax/dmax schedule of BatchRenorm layers: 'run' (default: the paper's schedule compressed "
                        "to reach rmax 3 / dmax 5 halfway through the run) or 'paper' (5k-step warm-up, rmax 3 at "
                        "40k, dmax 5 at 25k steps)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--num-workers", type=int, default=0, help="data loader workers (default 0)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch threads per training process (default: torch's choice for a single process, 1 per "
                        "worker when several run in parallel; use 1 for small models on a busy machine)")


def build_parser(with_monitor: bool = False) -> argparse.ArgumentParser:
    """The full argument parser. The monitor subcommand's own parser is built only when needed."""
    parser = argparse.ArgumentParser(
        prog="normlab",
        description="Normalization layers, a variance-transmission monitor and an experiment runner that "
                    "compares normalizations (none, BN, BRN, GN, SN, WN, WS, PWS) across learning rates and "
                    "batch sizes.",
        epilog="Start with `normlab demo` (a few minutes on 2 CPU cores). `normlab <command> --help` for details.",
    )
    sub = parser.add_subparsers(dest="command", metavar="command")

    d = sub.add_parser("demo", help="main job: compare normalizations on digits, write a report with plots",
                       description="Run the default comparison grid on the bundled digits data (about 3 minutes "
                                   "on 2 CPU cores) and write results.json, results.md and PNG plots. The "
                                   "report says whether the PWS paper's headline effects appeared.")
    d.add_argument("--out", default="runs/demo", help="output directory (default runs/demo); rerun to resume")
    d.add_argument("--quick", action="store_true", help="tiny grid (seconds), only to check the pipeline works")
    d.add_argument("--workers", type=int, default=0, help="worker processes (default 0: one per usable core)")
    d.add_argument("--threads", type=_positive_int, default=None,
                   help="torch threads per worker (default 1 when several workers run)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")

    t = sub.add_parser("train", help="train one network (flags mirror normlab.train.TrainConfig)",
                       description="Train one network. Killing it and rerunning with the same --out resumes "
                                   "from the last checkpoint.")
    _add_common_data_args(t)
    t.add_argument("--norm", default="bn",
                   help="output normalization: none, bn, brn, gn, ln, in, sn; or a weight reparametrization "
                        "(wn, ws, pws) which then sets --conv and uses no output norm (default bn)")
    t.add_argument("--conv", default=None, help="conv kind: conv, wn, ws, pws (default conv)")
    t.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    t.add_argument("--batch-size", type=_positive_int, default=64, help="mini-batch size (default 64)")
    t.add_argument("--epochs", type=_positive_int, default=10, help="epochs (default 10)")
    t.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    t.add_argument("--monitor-every", type=int, default=0,
                   help="record variance-monitor statistics every N steps (0: off)")
    t.add_argument("--stop-on-collapse", action="store_true", help="stop at the first non-finite loss")
    t.add_argument("--download", action="store_true", help="download the data set first (cifar10 only)")
    _add_optim_args(t)
    t.add_argument("--out", default="runs/train", help="output directory (default runs/train)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")

    c = sub.add_parser("compare", help="run a grid of normalizations x learning rates x batch sizes x seeds",
                       description="Run (or resume) a comparison grid; each cell is one training run in "
                                   "OUT/runs/<cell>. Writes OUT/results.json, OUT/results.md and PNG plots.")
    c.add_argument("--norms", type=_names, default=["none", "bn", "brn", "gn", "sn", "wn", "ws", "pws"],
                   help="comma-separated comparison names: none,bn,brn,gn,ln,in,sn (output norms), wn,ws,pws "
                        "(weight reparametrizations, no output norm), or combinations like ws+gn "
                        "(default none,bn,brn,gn,sn,wn,ws,pws)")
    c.add_argument("--lrs", type=_list_of(float, "learning rates"), default=[0.05],
                   help="comma-separated learning rates (default 0.05)")
    c.add_argument("--batch-sizes", type=_list_of(int, "batch sizes"), default=[64],
                   help="comma-separated batch sizes (default 64)")
    c.add_argument("--seeds", type=_list_of(int, "seeds"), default=[0, 1, 2],
                   help="comma-separated seeds (default 0,1,2)")
    c.add_argument("--epochs", type=_positive_int, default=10, help="epochs per run (default 10)")
    c.add_argument("--layout", choices=("product", "cross"), default="product",
                   help="product: every lr x batch size; cross: lr sweep at the base batch size plus batch-size "
                        "sweep at the base lr (default product)")
    c.add_argument("--base-lr", type=float, default=None, help="lr of the batch-size sweep (default: first of --lrs)")
    c.add_argument("--base-batch-size", type=int, default=None,
                   help="batch size of the lr sweep and of the lr scaling (default: first of --batch-sizes)")
    c.add_argument("--lr-scaling", choices=("none", "linear", "sqrt"), default="none",
                   help="scale each cell's lr with batch_size / base batch size (default none)")
    _add_common_data_args(c)
    _add_optim_args(c)
    c.add_argument("--download", action="store_true", help="download the data set first (cifar10 only)")
    c.add_argument("--out", default="runs/compare", help="output directory (default runs/compare); rerun to resume")
    c.add_argument("--workers", type=int, default=0,
                   help="parallel worker processes, 1 torch thread each (default 0: one per usable core)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")

    r = sub.add_parser("report", help="re-render results.md and plots from DIR/results.json",
                       description="Re-render the markdown report and PNG plots of a finished or partial grid.")
    r.add_argument("dir", help="output directory of `normlab compare` or `normlab demo`")

    if with_monitor:
        from normlab.monitor import cli as monitor_cli

        monitor_cli.add_parser(sub)
    else:
        m = sub.add_parser("monitor", help="variance-transmission monitor (see `normlab monitor --help`)",
                           add_help=False)
        m.add_argument("rest", nargs=argparse.REMAINDER)

    b = sub.add_parser("bench", help="how to run the benchmarks in benchmarks/; --steps times training steps",
                       description="Without options: print how to run the side-by-side layer benchmarks. With "
                                   "--steps: time one SGD step of the model with each normalization, interleaved "
                                   "(median over repeats, 1 torch thread).")
    b.add_argument("--steps", action="store_true", help="time a training step per normalization")
    b.add_argument("--norms", type=_names, default=["none", "bn", "brn", "gn", "sn", "wn", "ws", "pws"],
                   help="comparison names (default none,bn,brn,gn,sn,wn,ws,pws)")
    b.add_argument("--dataset", default="digits", help="data set (default digits)")
    b.add_argument("--model", default="plain", help="model (default plain)")
    b.add_argument("--width", type=float, default=0.25, help="width multiplier (default 0.25)")
    b.add_argument("--batch-size", type=_positive_int, default=64, help="batch size (default 64)")
    b.add_argument("--repeats", type=_positive_int, default=7, help="interleaved repeats (default 7)")
    b.add_argument("--iters", type=_positive_int, default=5, help="steps per timing (default 5)")
    b.add_argument("--threads", type=_positive_int, default=1, help="torch threads (default 1)")
    return parser


# --------------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------------

def _train_kwargs(args: argparse.Namespace) -> dict:
    kw = dict(
        momentum=args.momentum, weight_decay=args.weight_decay, nowd_norm_alpha=not args.wd_norm_alpha,
        milestones=tuple(args.milestones), lr_gamma=args.lr_gamma, device=args.device,
        num_workers=args.num_workers, brn_schedule=args.brn_schedule,
    )
    if args.data_dir is not None:
        kw["data_dir"] = args.data_dir
    return kw


def _validated(fn, *a, **kw):
    """Call a validation step; its ValueError/FileNotFoundError becomes a one-line UsageError (exit 2)."""
    try:
        return fn(*a, **kw)
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None


def cmd_train(args: argparse.Namespace) -> int:
    from normlab.experiments import check_feasible, conv_kinds, resolve_norm

    norm, conv = args.norm, args.conv
    if conv is None:
        norm, conv = _validated(resolve_norm, norm)
    elif conv not in conv_kinds():
        raise UsageError(f"unknown conv kind {conv!r}; valid conv kinds: {', '.join(conv_kinds())}")
    cfg = dict(
        dataset=args.dataset, model=args.model, norm=norm, conv=conv, width=args.width, lr=args.lr,
        batch_size=args.batch_size, epochs=args.epochs, seed=args.seed, monitor_every=args.monitor_every,
        stop_on_collapse=args.stop_on_collapse, target_acc=args.target_acc,
        max_steps_per_epoch=args.max_steps_per_epoch, **_train_kwargs(args),
    )
    data = None
    if args.download:
        from normlab import data as nl_data

        if args.dataset not in nl_data.DATASETS:
            raise UsageError(f"unknown dataset {args.dataset!r}; valid datasets: {', '.join(nl_data.DATASETS)}")
        data = _validated(nl_data.get_dataset, args.dataset, data_dir=args.data_dir, download=True)
    _validated(check_feasible, cfg, data=data)

    from normlab.train import TrainConfig, train

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    summary = _guarded(train, TrainConfig(**cfg), args.out, progress=not args.quiet)
    acc = summary.get("final_test_acc")
    msg = f"final test acc {100 * acc:.2f} %" if acc is not None else "no test accuracy"
    if summary.get("collapsed"):
        msg += f"; COLLAPSED at epoch {summary.get('collapse_epoch')}"
    print(f"normlab train: {msg}; best {100 * (summary.get('best_test_acc') or 0):.2f} %; "
          f"summary in {Path(args.out) / 'summary.json'}")
    return 0


def _finish(results: dict, out: Path) -> None:
    from normlab.report import markdown_table, summary_lines

    print(markdown_table(results))
    print()
    for line in summary_lines(results):
        print(line)
    print(f"\nreport: {out / 'results.md'}  plots: {', '.join(str(p) for p in sorted(out.glob('*.png')))}")


def cmd_compare(args: argparse.Namespace) -> int:
    from normlab.experiments import GridSpec, check_grid, run_grid

    spec = _validated(
        GridSpec,
        norms=args.norms, lrs=args.lrs, batch_sizes=args.batch_sizes, seeds=args.seeds, epochs=args.epochs,
        dataset=args.dataset, model=args.model, width=args.width, layout=args.layout, base_lr=args.base_lr,
        base_batch_size=args.base_batch_size, lr_scaling=args.lr_scaling, target_acc=args.target_acc,
        max_steps_per_epoch=args.max_steps_per_epoch, train_kwargs=_train_kwargs(args),
    )
    if args.download:
        from normlab import data as nl_data

        _validated(nl_data.get_dataset, args.dataset, data_dir=args.data_dir, download=True)
    _validated(check_grid, spec)
    out = Path(args.out)
    results = _guarded(run_grid, spec, out, workers=args.workers, progress=not args.no_progress, check=False,
                       threads=args.threads)
    _finish(results, out)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from normlab.experiments import check_grid, demo_spec, run_grid

    spec = demo_spec(quick=args.quick)
    _validated(check_grid, spec)
    out = Path(args.out)
    print(f"normlab demo: {len(spec.norms)} normalizations on {spec.dataset}, lrs {list(spec.lrs)} at batch size "
          f"{spec.base_batch_size}, batch sizes {list(spec.batch_sizes)} at lr {spec.base_lr:g}, "
          f"seeds {list(spec.seeds)}, {spec.epochs} epochs -> {out}", file=sys.stderr)
    results = _guarded(run_grid, spec, out, workers=args.workers, progress=not args.no_progress, check=False,
                       threads=args.threads)
    _finish(results, out)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from normlab.experiments import load_results
    from normlab.report import render_report, summary_lines

    results = _validated(load_results, args.dir)
    paths = render_report(results, args.dir)
    for line in summary_lines(results):
        print(line)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.steps:
        from normlab.experiments import resolve_norm, step_times

        for n in args.norms:
            _validated(resolve_norm, n)
        res = _validated(step_times, args.norms, dataset=args.dataset, model=args.model, width=args.width,
                         batch_size=args.batch_size, repeats=args.repeats, iters=args.iters, threads=args.threads)
        print(f"training step, {args.model} (width {args.width:g}) on {args.dataset}, batch {args.batch_size}, "
              f"{args.threads} thread(s); median of {args.repeats} interleaved repeats x {args.iters} steps")
        print("| norm | ms / step (median) | ms / step (min) | relative to PWS |")
        print("|---|---|---|---|")
        for n, v in res.items():
            rel = f"{v['ratio_to_pws']:.2f}x" if "ratio_to_pws" in v else "-"
            print(f"| {n} | {1000 * v['median_s']:.2f} | {1000 * v['min_s']:.2f} | {rel} |")
        return 0
    here = Path(__file__).resolve().parent.parent / "benchmarks"
    scripts = sorted(p.name for p in here.glob("*.py")) if here.is_dir() else []
    print("Benchmarks time the normlab layer and its reference side by side and write a table.")
    print("From a source checkout run:  make bench   (or: python benchmarks/run_all.py)")
    if scripts:
        print("Individual scripts: " + ", ".join(f"python benchmarks/{s}" for s in scripts))
    return 0


COMMANDS = {"demo": cmd_demo, "train": cmd_train, "compare": cmd_compare, "report": cmd_report,
            "bench": cmd_bench}


def _first_command(argv: Sequence[str]) -> str | None:
    for a in argv:
        if not a.startswith("-"):
            return a
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    with_monitor = _first_command(argv) == "monitor"
    try:
        parser = build_parser(with_monitor=with_monitor)
    except ImportError as e:
        print(f"normlab monitor: error: the monitor is not available ({e})", file=sys.stderr)
        return EXIT_USAGE
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        if args.command == "monitor":
            from normlab.monitor import cli as monitor_cli

            rc = monitor_cli.run(args)
            return int(rc or 0)
        return COMMANDS[args.command](args)
    except UsageError as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"normlab {args.command}: error: {msg}", file=sys.stderr)
        return EXIT_USAGE
    except RunError as e:
        print(f"normlab {args.command}: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"normlab {args.command}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
