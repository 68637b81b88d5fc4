"""``normlab-lab capsules``: the capsule routing experiment (routing iterations x gradient through the inner iterations
x reconstruction x seeds), with paired comparisons and verdicts on the paper's and the seed's claims."""

from __future__ import annotations

import argparse
import sys

from normlab.cli.args import MAX_WORKERS, add_out_arg, finite_float, integer, options_named, positive_int
from normlab.runner.errors import UsageError
from normlab.runner.io import check_dir_option
from normlab.runner.lock import check_claim
from normlab_lab import PROG
from normlab_lab.capsules.experiment import (
    DATASETS,
    CapsSpec,
    expand_cells,
    quick_spec,
    run_capsules,
)
from normlab_lab.capsules.report import summary_lines, variant_table

__all__ = ["add_parser", "run"]

NAME = "capsules"
OUT, QUICK_OUT = "runs/capsules", "runs/capsules-quick"


def _ints(option: str, text: str) -> list[int]:
    """A comma-separated list of integers (the spec judges their values); a one-line UsageError otherwise."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{option}: expected comma-separated integers, got {text!r}") from None


def _words(text: str) -> list[str]:
    return [x.strip().lower() for x in text.split(",") if x.strip()]


_RENAMES = {"recons": "--recon", "out_dir": "--out"}


def add_parser(sub) -> argparse.ArgumentParser:
    d = CapsSpec()
    p = sub.add_parser(
        NAME,
        help="capsule routing experiment: iterations x stop_gradient x reconstruction x seeds",
        description="Train CapsNets (dynamic routing) on bundled data for every routing variant and "
        "seed; write OUT/results.json, OUT/results.md (paired comparisons, verdicts) and "
        "PNG plots. Rerun the same command to resume. See lab/docs/capsules.md.",
    )
    p.add_argument(
        "--iterations",
        default=",".join(map(str, d.iterations)),
        help=f"comma-separated routing iteration counts >= 1 (default {','.join(map(str, d.iterations))})",
    )
    p.add_argument(
        "--grads",
        default=",".join(d.grads),
        help="gradient through the inner routing iterations: detached (naturomics' stop_gradient), "
        "full (the official code) (default detached,full)",
    )
    p.add_argument("--recon", default=",".join(d.recons), help="reconstruction loss: off, on (default off,on)")
    p.add_argument(
        "--seeds",
        default=",".join(map(str, d.seeds)),
        help=f"comma-separated seeds (default {','.join(map(str, d.seeds))})",
    )
    p.add_argument("--epochs", type=positive_int, default=d.epochs, help=f"epochs per run (default {d.epochs})")
    p.add_argument("--dataset", default=d.dataset, help=f"{', '.join(DATASETS)} (default {d.dataset})")
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size, help=f"batch size (default {d.batch_size})")
    p.add_argument("--lr", type=finite_float, default=d.lr, help=f"Adam learning rate (default {d.lr:g})")
    p.add_argument("--max-steps-per-epoch", type=positive_int, default=None, help="cap on steps per epoch")
    p.add_argument("--data-dir", default=None, help="cache directory for generated data (mnist1d)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny grid (iterations 1,3, 2 seeds, 2 short epochs; well under a minute): a pipeline check "
        "whose numbers mean nothing; ignores the grid options",
    )
    add_out_arg(p, OUT, quick=("--quick", QUICK_OUT))
    p.add_argument(
        "--workers",
        type=integer(0, MAX_WORKERS, what="a number of workers"),
        default=0,
        help="parallel worker processes, 1 torch thread each (default 0: one per usable core)",
    )
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per worker (default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)
    return p


def _spec(args: argparse.Namespace) -> CapsSpec:
    """The grid of the options (CapsSpec checks it)."""
    if args.quick:
        return quick_spec()
    return CapsSpec(
        iterations=_ints("--iterations", args.iterations),
        grads=_words(args.grads),
        recons=_words(args.recon),
        seeds=_ints("--seeds", args.seeds),
        epochs=args.epochs,
        dataset=args.dataset,
        batch_size=args.batch_size,
        lr=args.lr,
        max_steps_per_epoch=args.max_steps_per_epoch,
        data_dir=args.data_dir,
    )


def run(args: argparse.Namespace) -> int:
    out = check_dir_option(args.out or (QUICK_OUT if args.quick else OUT), "--out")
    claim = f"{PROG} {NAME}" + (" --quick" if args.quick else "")
    check_claim(out, claim)  # before the plan is printed (run_capsules claims it)
    with options_named(_RENAMES):
        spec = _spec(args)
        cells = expand_cells(spec)
        print(
            f"{PROG} {NAME}: {len(cells) // len(spec.seeds)} variants x {len(spec.seeds)} seeds = {len(cells)} "
            f"runs of {spec.epochs} epochs on {spec.dataset} -> {out}",
            file=sys.stderr,
        )
        results = run_capsules(
            spec,
            out,
            workers=args.workers,
            threads=args.threads,
            progress=not args.no_progress,
            option="--out",
            command=claim,
        )
    print(variant_table(results))
    print()
    for line in summary_lines(results):
        print(line)
    print(f"\nreport: {out / 'results.md'}  plots: {', '.join(str(p) for p in sorted(out.glob('*.png')))}")
    return 0
