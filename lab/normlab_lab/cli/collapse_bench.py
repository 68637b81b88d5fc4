"""``normlab-lab collapse-bench all|collect|evaluate|guard``: the collapse benchmark
(:mod:`normlab_lab.collapse_bench`).

``collect`` trains every run of the protocol not on disk yet, ``evaluate`` replays every detector over the recorded
runs and prints the tables, ``guard`` trains runs again under the default guard; ``all`` does the three in order.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from normlab.cli.args import integer, positive_int
from normlab.runner.errors import UsageError
from normlab.runner.io import check_dir_option
from normlab_lab.collapse_bench.collect import collect
from normlab_lab.collapse_bench.evaluate import evaluate_dir
from normlab_lab.collapse_bench.guard import guard_all, guard_table, runs_to_guard
from normlab_lab.collapse_bench.protocol import parse_seeds, parse_setups
from normlab_lab.collapse_bench.setups import SETUPS

__all__ = ["add_parser", "run", "STAGES"]

NAME = "collapse-bench"
STAGES = ("all", "collect", "evaluate", "guard")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        NAME,
        help="the collapse benchmark: does a detector warn before a run collapses, and how often does it cry wolf",
        description="collect: train every run of the protocol (set-up x learning rate x seed) not on disk yet, one "
        "JSONL per run; evaluate: label each run from its losses and replay every detector over the recorded runs; "
        "guard: train runs again under the default CollapseGuard; all: the three in order. Record: "
        "lab/docs/monitor_benchmark.md.",
    )
    p.add_argument("stage", choices=STAGES, help="what to run")
    p.add_argument("--out", default="runs/collapse_bench", help="the runs' directory (default runs/collapse_bench)")
    p.add_argument("--seeds", default="300-302", help="e.g. 300-302 or 300,310 (>= 100; default 300-302)")
    p.add_argument("--setups", default=",".join(SETUPS), help="comma-separated set-ups (default: the report's)")
    p.add_argument("--workers", type=positive_int, default=2, help="worker processes (default 2)")
    p.add_argument("--steps", type=positive_int, default=None, help="override every set-up's step count (tests)")
    p.add_argument(
        "--lrs",
        default=None,
        help="collect: these learning rates instead of each set-up's grid, e.g. 0.01,0.1 (a pilot's candidates)",
    )
    p.add_argument(
        "--every",
        type=positive_int,
        default=10,
        help="evaluate: the monitor's recording interval replayed (default 10)",
    )
    p.add_argument("--json", default=None, help="evaluate/guard: also write the table as JSON here")
    p.add_argument(
        "--guard-healthy",
        type=integer(0),
        default=3,
        help="guard: at most this many healthy runs per set-up (default 3)",
    )
    p.set_defaults(run=run)
    return p


def _rates(text: str | None) -> list[float] | None:
    """ "0.01,0.1" -> [0.01, 0.1]: positive finite learning rates (None: each set-up's grid)."""
    if text is None:
        return None
    try:
        rates = [float(v) for v in text.split(",") if v]
    except ValueError:
        rates = []
    if not rates or not all(0 < r < float("inf") for r in rates):
        raise UsageError(f"--lrs: expected positive finite learning rates such as 0.01,0.1, got {text!r}")
    return rates


def _guard(args: argparse.Namespace, out: Path, seeds: list[int], setups: list[str], json_path: str | None) -> None:
    """Guard re-runs of every collapsing run and of up to ``--guard-healthy`` healthy runs per set-up."""
    runs = runs_to_guard(out, seeds, setups, args.guard_healthy)
    guarded = guard_all(out, runs, args.workers, log=lambda s: print(s, flush=True), steps=args.steps)
    text = guard_table(runs, guarded, setups)
    print(text)
    if json_path:
        Path(json_path).write_text(json.dumps(dict(runs=runs, guarded=guarded, markdown=text), indent=1))


def run(args: argparse.Namespace) -> int:
    out = check_dir_option(args.out, "--out")
    seeds, setups, lrs = parse_seeds(args.seeds), parse_setups(args.setups), _rates(args.lrs)
    if args.stage in ("collect", "all"):
        collect(out, seeds, setups, args.workers, args.steps, lrs=lrs)
    if args.stage in ("evaluate", "all"):
        table = evaluate_dir(out, seeds, setups, every=args.every)
        print(table["markdown"])
        if args.json:
            Path(args.json).write_text(json.dumps(table, indent=1))
    if args.stage in ("guard", "all"):
        json_path = (
            args.json if args.stage == "guard" or args.json is None else str(Path(args.json).with_suffix(".guard.json"))
        )
        _guard(args, out, seeds, setups, json_path)
    return 0
