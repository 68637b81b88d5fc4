"""``normlab report DIR``: re-render the report of a grid (results.json) or of the demo (demo.json)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from normlab.runner.demo_report import render_demo_report
from normlab.runner.errors import UsageError
from normlab.runner.report import render_report, summary_lines
from normlab.runner.results import load_results

NAME = "report"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(NAME, help="re-render the report and plots of DIR (a compare or demo output directory)",
                       description="Re-render the markdown report and PNG plots of a finished or partial grid "
                                   "(DIR/results.json) or of the demo (DIR/demo.json).")
    p.add_argument("dir", help="output directory of `normlab compare` or `normlab demo`")
    p.set_defaults(run=run)
    return p


def _render_demo(path: Path) -> list[Path]:
    try:
        demo = json.loads(path.read_text())
        return render_demo_report(demo, path.parent)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise UsageError(f"{path} is not a normlab demo record ({type(e).__name__}: {e})") from None


def run(args: argparse.Namespace) -> int:
    demo = Path(args.dir) / "demo.json"
    if demo.is_file():
        paths = _render_demo(demo)
    else:
        results = load_results(args.dir)
        paths = render_report(results, args.dir)
        for line in summary_lines(results):
            print(line)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
