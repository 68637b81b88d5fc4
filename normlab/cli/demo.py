"""``normlab demo``: the main job, a comparison of normalizations with a report and plots."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from normlab.runner.checks import check_grid
from normlab.runner.demo import demo_spec
from normlab.runner.execute import run_grid
from normlab.runner.grid import expand_grid
from normlab.runner.report import print_summary

from .args import add_out_arg, positive_int

NAME = "demo"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(NAME, help="main job: compare normalizations, write a report with plots",
                       description="Run the default comparison grid and write results.json, results.md and PNG "
                                   "plots; the report says whether the PWS paper's headline effects appeared.")
    add_out_arg(p, "runs/demo")
    p.add_argument("--quick", action="store_true", help="tiny grid (seconds), only to check the pipeline works")
    p.add_argument("--workers", type=int, default=0, help="worker processes (default 0: one per usable core)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads per worker (default 1 when several workers run)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    spec = demo_spec(quick=args.quick)
    check_grid(expand_grid(spec))
    out = Path(args.out)
    print(f"normlab demo: {len(spec.norms)} normalizations on {spec.dataset}, lrs {list(spec.lrs)} at batch size "
          f"{spec.base_batch_size}, batch sizes {list(spec.batch_sizes)} at lr {spec.base_lr:g}, "
          f"seeds {list(spec.seeds)}, {spec.epochs} epochs -> {out}", file=sys.stderr)
    results = run_grid(spec, out, workers=args.workers, progress=not args.no_progress, check=False,
                       threads=args.threads)
    print_summary(results, out)
    return 0
