"""``normlab report DIR``: re-render the report of a grid (``DIR/results.json``) without training."""

from __future__ import annotations

import argparse
from pathlib import Path

from normlab.runner.errors import UsageError, error_line
from normlab.runner.grid.report import render_report
from normlab.runner.grid.results import load_results
from normlab.runner.lock import out_lock

NAME = "report"
# what rendering a record of the wrong shape raises: the record is the user's input, so it is a usage error
_SHAPE_ERRORS = (KeyError, TypeError, ValueError, IndexError, AttributeError, ZeroDivisionError)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        NAME,
        help="re-render the report and plots of DIR (a compare output directory)",
        description="Re-render the markdown report and PNG plots of a finished or partial grid (DIR/results.json).",
    )
    p.add_argument("dir", help="output directory of `normlab compare`")
    p.set_defaults(run=run)
    return p


def _render_grid(d: Path) -> list[Path]:
    results = load_results(d)
    try:
        return render_report(results, d)
    except _SHAPE_ERRORS as e:
        raise UsageError(
            f"{d / 'results.json'} is not a normlab results file ({error_line(e, with_type=True)})"
        ) from None


def run(args: argparse.Namespace) -> int:
    d = Path(args.dir)
    if not d.is_dir():
        raise UsageError(
            f"DIR {args.dir!r}: expected the output directory of `normlab compare`"
            f"{', got a file' if d.exists() else ' (it does not exist)'}"
        )
    with out_lock(d, NAME, option="DIR"):
        paths = _render_grid(d)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
