"""``normlab-lab report DIR``: re-render the report of the demo or the full reproduction (``DIR/demo.json``) or of a
grid judged by the paper's headline effects (``DIR/results.json``: ``normlab-lab reproduce --preset cifar10-pws``'s
grids, or any ``normlab compare`` grid)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from normlab.runner.errors import UsageError, error_line
from normlab.runner.grid.report import summary_lines
from normlab.runner.grid.results import load_results
from normlab.runner.lock import out_lock
from normlab_lab.demo.report import render_demo_report
from normlab_lab.verdicts import PAPER_EFFECTS, render_paper_report

__all__ = ["add_parser", "run"]

NAME = "report"
# what rendering a record of the wrong shape raises: the record is the user's input, so it is a usage error
_SHAPE_ERRORS = (KeyError, TypeError, ValueError, IndexError, AttributeError, ZeroDivisionError)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        NAME,
        help="re-render the report and plots of DIR (a demo, reproduce or compare output directory)",
        description="Re-render the markdown report and PNG plots of the demo or the full reproduction "
        "(DIR/demo.json), or of a grid with the paper's headline effects judged (DIR/results.json).",
    )
    p.add_argument("dir", help="output directory of `normlab-lab demo`, `normlab-lab reproduce` or `normlab compare`")
    p.set_defaults(run=run)
    return p


class _NotADemo(ValueError):
    pass


def _check_demo_shape(demo) -> None:
    """The top level of demo.json as `normlab-lab demo` writes it: protocol, sections (lr_sweep, batch_size,
    collapse) and cost as JSON objects."""
    if not isinstance(demo, dict):
        raise _NotADemo(f"expected a JSON object, got {type(demo).__name__}")
    for key in ("protocol", "sections", "cost"):
        if not isinstance(demo.get(key), dict):
            raise _NotADemo(f"'{key}' is missing or not an object (got {type(demo.get(key)).__name__})")
    for key in ("lr_sweep", "batch_size", "collapse"):
        if not isinstance(demo["sections"].get(key), dict):
            raise _NotADemo(f"sections.{key} is missing or not an object")


def _render_demo(path: Path) -> list[Path]:
    try:
        demo = json.loads(path.read_text())
        _check_demo_shape(demo)
        return render_demo_report(demo, path.parent)
    except _NotADemo as e:
        raise UsageError(f"{path} is not a normlab-lab demo record: {e}") from None
    except (OSError, UnicodeDecodeError, *_SHAPE_ERRORS) as e:
        raise UsageError(f"{path} is not a normlab-lab demo record ({error_line(e, with_type=True)})") from None


def _render_grid(d: Path) -> tuple[dict, list[Path]]:
    results = load_results(d)
    try:
        return results, render_paper_report(results, d)
    except _SHAPE_ERRORS as e:
        raise UsageError(
            f"{d / 'results.json'} is not a normlab results file ({error_line(e, with_type=True)})"
        ) from None


def run(args: argparse.Namespace) -> int:
    d = Path(args.dir)
    if not d.is_dir():
        raise UsageError(
            f"DIR {args.dir!r}: expected the output directory of `normlab-lab demo`, `normlab-lab reproduce` or "
            f"`normlab compare`{', got a file' if d.exists() else ' (it does not exist)'}"
        )
    with out_lock(d, NAME, option="DIR"):
        if (d / "demo.json").is_file():
            paths = _render_demo(d / "demo.json")
        else:
            results, paths = _render_grid(d)
            for line in summary_lines(results, PAPER_EFFECTS):
                print(line)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
