"""``normlab bench``: how to run the layer benchmarks; ``--steps`` times one training step per normalization."""

from __future__ import annotations

import argparse
from pathlib import Path

from normlab.runner.bench import step_times
from normlab.runner.data.datasets import DATASETS
from normlab.runner.grid.spec import DEFAULT_NORMS
from normlab.runner.models import MODELS
from normlab.runner.training.config import resolve_name

from .args import check_name, names, options_named, positive_int, threads_int, width_float

NAME = "bench"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        NAME,
        help="how to run the benchmarks in benchmarks/; --steps times training steps",
        description="Without options: print how to run the side-by-side layer benchmarks. With "
        "--steps: time one SGD step of the model with each normalization, interleaved "
        "(median over repeats).",
    )
    p.add_argument("--steps", action="store_true", help="time a training step per normalization")
    p.add_argument(
        "--norms", type=names, default=list(DEFAULT_NORMS), help=f"comparison names (default {','.join(DEFAULT_NORMS)})"
    )
    p.add_argument("--dataset", default="digits", help="data set (default digits)")
    p.add_argument("--model", default="plain", help="model (default plain)")
    p.add_argument("--width", type=width_float, default=0.25, help="width multiplier (default 0.25)")
    p.add_argument("--batch-size", type=positive_int, default=64, help="batch size (default 64)")
    p.add_argument("--repeats", type=positive_int, default=7, help="interleaved repeats (default 7)")
    p.add_argument("--iters", type=positive_int, default=5, help="steps per timing (default 5)")
    p.add_argument("--threads", type=threads_int, default=1, help="torch threads (default 1)")
    p.set_defaults(run=run)
    return p


def _print_steps(args: argparse.Namespace, res: dict) -> None:
    print(
        f"training step, {args.model} (width {args.width:g}) on {args.dataset}, batch {args.batch_size}, "
        f"{args.threads} thread(s); median of {args.repeats} interleaved repeats x {args.iters} steps"
    )
    print("| norm | ms / step (median) | ms / step (min) | relative to PWS |")
    print("|---|---|---|---|")
    for n, v in res.items():
        rel = f"{v['ratio_to_pws']:.2f}x" if "ratio_to_pws" in v else "-"
        print(f"| {n} | {1000 * v['median_s']:.2f} | {1000 * v['min_s']:.2f} | {rel} |")


def run(args: argparse.Namespace) -> int:
    if args.steps:
        with options_named():
            for n in args.norms:
                resolve_name(n, "norms", "bench")
        check_name(args.dataset, DATASETS, "--dataset", "data set")
        check_name(args.model, MODELS, "--model", "model")
        res = step_times(
            args.norms,
            dataset=args.dataset,
            model=args.model,
            width=args.width,
            batch_size=args.batch_size,
            repeats=args.repeats,
            iters=args.iters,
            threads=args.threads,
        )
        _print_steps(args, res)
        return 0
    here = Path(__file__).resolve().parents[2] / "benchmarks"
    scripts = sorted(p.name for p in here.glob("*.py")) if here.is_dir() else []
    print("Benchmarks time the normlab layer and its reference side by side and write a table.")
    print("From a source checkout run:  make bench   (or: python benchmarks/run_all.py)")
    if scripts:
        print("Individual scripts: " + ", ".join(f"python benchmarks/{s}" for s in scripts))
    return 0
