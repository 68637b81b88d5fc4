"""``normlab-lab demo``: the main job, the seeds' phenomena on MNIST-1D with a report and plots."""

from __future__ import annotations

import argparse

from normlab.cli.args import MAX_WORKERS, add_out_arg, integer, threads_int
from normlab.cli.plan import announce_grids
from normlab.runner.io import check_dir_option, remove_stale_temps
from normlab.runner.lock import out_lock
from normlab_lab import DEMO_MINUTES, PROG
from normlab_lab.demo.experiment import run_demo
from normlab_lab.demo.terminal import claims_terminal

__all__ = ["add_parser", "run"]

NAME = "demo"
#: The output directories of the demo and of its quick version (never the same: each claims its own).
OUT, QUICK_OUT = "runs/demo", "runs/demo-quick"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        NAME,
        help="main job: normalization and collapse on MNIST-1D, a report with plots",
        description=f"Run the demo (about {DEMO_MINUTES:g} minutes on 2 idle CPU cores): (a) a learning-rate sweep "
        "of none, BN, BRN, GN, SN, WN, WS+GN and PWS, (b) batch sizes 128, 4 and 2 with the "
        "learning rate scaled linearly, (c) the monitor's collapse diagnosis (regime warning, countdown alarm) "
        "and the unnormalized runs again with --guard and with --guard-dead beside their unguarded twins, (d) the cost "
        "of a training step. Writes OUT/report.md with its plots; rerun to resume.",
    )
    add_out_arg(p, OUT, quick=("--quick", QUICK_OUT))
    p.add_argument("--quick", action="store_true", help="tiny version (seconds), only to check the pipeline works")
    p.add_argument(
        "--workers",
        type=integer(0, MAX_WORKERS, what="a number of workers"),
        default=0,
        help="worker processes (default 0: one per usable core)",
    )
    p.add_argument(
        "--threads",
        type=threads_int,
        default=None,
        help="torch threads per worker (default 1 when several workers run)",
    )
    p.add_argument(
        "--no-progress", action="store_true", help="no progress line (runs remaining and ETA after each run)"
    )
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    out = check_dir_option(args.out or (QUICK_OUT if args.quick else OUT), "--out")
    claim = f"{PROG} {NAME}" + (" --quick" if args.quick else "")
    with out_lock(out, NAME, claim=claim, record="demo.json"):
        for d in (out, out / "data"):  # temporaries of a writer killed in an earlier run (the grids clean their own)
            remove_stale_temps(d)
        demo = run_demo(
            out,
            quick=args.quick,
            workers=args.workers,
            threads=args.threads,
            progress=not args.no_progress,
            announce=lambda grids, after_s: announce_grids(NAME, grids, args.workers, after_s=after_s, prog=PROG),
        )
    print("\n".join(claims_terminal(demo)))  # the full table opens report.md
    print(
        f"\nreport: {out / 'report.md'} (the criteria of each verdict, every section's numbers, the plots "
        f"{', '.join(p.name for p in sorted(out.glob('*.png')))})"
    )
    return 0
