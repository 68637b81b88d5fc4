"""The demo's table of claims for a terminal: one block per claim that fits in 100 columns.

``report.md`` keeps the full table (:func:`~normlab_lab.demo.claims.claims_markdown`: each claim in
its source's words, the verdict and every number behind it); the terminal shows, per claim, a short title, the
verdict and its key number, wrapped to the width (the README quotes it for the recorded demo:
``python -m normlab_lab.demo.terminal runs/demo lab/docs/demo_record.json`` saves the record and prints
the table)::

    claim                                    verdict            key number
    1    plain net collapses, BN trains      reproduced         lr 0.2: none 17.5 ± 12.9% (collapsed
                                                                2/3), BN 94.9 ± 1.6%
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

from normlab.runner.io import atomic_write_json
from normlab_lab.demo.claims import claims_record, claims_table, collect_evidence

__all__ = ["TITLES", "WIDTH", "claims_terminal"]

WIDTH = 100  # the terminal's columns the table is made for
# Each claim in a few words (its source's words are in report.md's table).
TITLES = {
    "1": "plain net collapses, BN trains",
    "2": "PWS trains at that lr",
    "3": "PWS robust to batch size, BN not",
    "3a": "BN loses accuracy at small batches",
    "4": "PWS step cheaper than output norm",
    "5": "PWS and WN suffer at lr 1e-1",
    "BRN": "BRN recovers small batches",
    "mon": "monitor warns before collapse",
}
_ID, _TITLE, _VERDICT = 5, 36, 19  # column widths; the key number takes the rest
_KEEP = (" ± ", "collapsed ", "batch ")  # never broken across lines (a no-break space while wrapping)


def claims_terminal(demo: dict[str, Any], width: int = WIDTH) -> list[str]:
    """The claims table as plain-text lines of at most ``width`` characters (``width`` >= 80).

    Args:
        demo (dict): the demo's record (``demo.json`` with its evidence, or ``lab/docs/demo_record.json``).
        width (int, optional): the most characters a line may have. Default: 100.

    Returns:
        list of str: a header line, then each claim's lines: id, short title, verdict and the key number, which
        wraps onto the lines below in its own column; the quick-mode warning last when it applies.
    """
    key_width = width - _ID - _TITLE - _VERDICT
    lines = [f"{'claim':<{_ID + _TITLE}}{'verdict':<{_VERDICT}}key number"]
    for r in claims_table(demo):
        title = textwrap.wrap(TITLES.get(r["id"], r["claim"]), _TITLE - 2)
        key = r["key"]
        for words in _KEEP:
            key = key.replace(words, words.replace(" ", "\u00a0"))
        key = [k.replace("\u00a0", " ") for k in textwrap.wrap(key, key_width, break_on_hyphens=False)]
        for i in range(max(len(title), len(key))):
            left = f"{r['id'] if i == 0 else '':<{_ID}}{title[i] if i < len(title) else '':<{_TITLE}}"
            verdict = r["verdict"] if i == 0 else ""
            lines.append(f"{left}{verdict:<{_VERDICT}}{key[i] if i < len(key) else ''}".rstrip())
    if demo.get("quick"):
        lines += ["", "Quick mode: a pipeline check on tiny runs; these verdicts mean nothing."]
    return lines


USAGE = "usage: python -m normlab_lab.demo.terminal DEMO_DIR RECORD.json"


def _main(argv: list[str]) -> int:
    """``python -m normlab_lab.demo.terminal DEMO_DIR RECORD.json``: save DEMO_DIR's record (its
    evidence gathered again from its runs) and print the README's table (what ``normlab-lab demo`` prints); 2 with a
    one-line message on bad arguments."""

    if len(argv) != 2 or argv[0].startswith("-"):
        print(f"{USAGE} (save DEMO_DIR's record and print the README's claims table)", file=sys.stderr)
        return 2
    demo_dir, target = Path(argv[0]), Path(argv[1])
    if not (demo_dir / "demo.json").is_file():
        print(
            f"claims: {demo_dir / 'demo.json'} not found: DEMO_DIR must be a finished `normlab-lab demo --out` "
            "directory",
            file=sys.stderr,
        )
        return 2
    demo = json.loads((demo_dir / "demo.json").read_text())
    demo["evidence"] = collect_evidence(demo_dir, demo["sections"])
    atomic_write_json(target, claims_record(demo))
    print("\n".join(["```text", *claims_terminal(demo), "```"]))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
