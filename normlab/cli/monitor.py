"""``normlab monitor LOG.jsonl --out DIR``: render the plots of a variance-monitor log."""

from __future__ import annotations

import argparse
from pathlib import Path

from normlab.monitor import load_log, render_monitor_plots
from normlab.runner.errors import UsageError
from normlab.runner.io import check_dir_option

NAME = "monitor"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        NAME,
        help="render variance-transmission plots from a monitor JSONL log",
        description="Render PNG plots (PWS paper Figs. 1a, 1b, 2, 6, output variance, signal "
        "propagation) from a JSONL log written by VarianceMonitor.to_jsonl or by "
        "`normlab train --monitor-every N`.",
    )
    p.add_argument("log", type=Path, help="monitor log (JSON lines)")
    p.add_argument("--out", default=None, help="output folder (default: LOG's folder / monitor_plots)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    out = check_dir_option(args.out if args.out is not None else args.log.parent / "monitor_plots", "--out")
    try:
        log = load_log(args.log)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UsageError(f"LOG: {e}") from None
    if not log.records and log.spp is None:
        raise UsageError(f"LOG: {args.log} holds no monitor records (nothing to plot)")
    paths = render_monitor_plots(log, out)  # the log read once
    for event in log.events:  # every rule's first event; an older log's one alarm
        print(event)
    for p in paths:
        print(p)
    return 0
