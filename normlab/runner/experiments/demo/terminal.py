"""The demo's table of claims for a terminal: one block per claim that fits in 100 columns.

``report.md`` keeps the full table (:func:`~normlab.runner.experiments.demo.claims.claims_markdown`: each claim in
its source's words, the verdict and every number behind it); the terminal shows, per claim, a short title, the
verdict and its key number, wrapped to the width::

    claim                                    verdict            key number
    1    plain net collapses, BN trains      reproduced         lr 0.2: none 17.5 ± 12.9% (collapsed
                                                                2/3), BN 94.9 ± 1.6%
"""

from __future__ import annotations

import textwrap
from typing import Any

from normlab.runner.experiments.demo.claims import claims_table

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
        demo (dict): the demo's record (``demo.json`` with its evidence, or ``docs/demo_record.json``).
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
