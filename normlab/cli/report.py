"""``normlab report DIR``: re-render results.md and the plots from DIR/results.json."""

from __future__ import annotations

import argparse

from normlab.runner.report import render_report, summary_lines
from normlab.runner.results import load_results

NAME = "report"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(NAME, help="re-render results.md and plots from DIR/results.json",
                       description="Re-render the markdown report and PNG plots of a finished or partial grid.")
    p.add_argument("dir", help="output directory of `normlab compare` or `normlab demo`")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    results = load_results(args.dir)
    paths = render_report(results, args.dir)
    for line in summary_lines(results):
        print(line)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
