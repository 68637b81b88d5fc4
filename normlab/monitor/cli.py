"""`normlab monitor LOG.jsonl --out DIR`: render the monitor plots of a VarianceMonitor JSONL log.

normlab/cli.py wires it with ``add_parser(subparsers)`` and ``run(args)``; ``python -m normlab.monitor.cli``
runs it standalone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_parser", "run", "main"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``monitor`` subcommand to an argparse subparsers object and return its parser."""
    p = subparsers.add_parser(
        "monitor",
        help="render variance-transmission plots from a monitor JSONL log",
        description="Render PNG plots (PWS paper Figs. 1a, 1b, 2, 6, output variance, SPP) from a JSONL log "
        "written by VarianceMonitor.to_jsonl.",
    )
    p.add_argument("log", type=Path, help="monitor log (JSON lines)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: LOG's folder / monitor_plots)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Render the plots; print the alarm (if any) and the written paths. Returns the exit code."""
    from normlab.monitor.plots import load_log, render_monitor_plots

    log = Path(args.log)
    out = Path(args.out) if args.out is not None else log.parent / "monitor_plots"
    try:
        paths = render_monitor_plots(log, out)
        _, alarm, _ = load_log(log)
    except (FileNotFoundError, ValueError) as e:
        print(f"normlab monitor: {e}", file=sys.stderr)
        return 2
    if alarm is not None:
        print(f"collapse warning: layer '{alarm.get('layer')}' {alarm.get('quantity')} at step {alarm.get('step')}"
              f" (value {alarm.get('value')}, initial {alarm.get('initial')})")
    for p in paths:
        print(p)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="normlab")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
