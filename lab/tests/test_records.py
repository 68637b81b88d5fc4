"""The research record's tables: the README quotes the table of claims of the recorded full run
(``lab/docs/reproduce_record.json``), ``lab/docs/reproduction.md`` the one of the recorded demo
(``lab/docs/demo_record.json``); each is exactly what the lab makes of its record."""

import json

import pytest

from normlab_lab.demo.claims import claims_record, claims_table
from normlab_lab.demo.terminal import claims_terminal

from .labtest import LAB, ROOT

README = ROOT / "README.md"
DOCS = LAB / "docs"
QUOTED_TABLES = [  # (the text that quotes a record's table, its markers, the record, the command that makes both)
    (README, "reproduce-claims", DOCS / "reproduce_record.json", "runs/reproduce lab/docs/reproduce_record.json"),
    (DOCS / "reproduction.md", "demo-claims", DOCS / "demo_record.json", "runs/demo lab/docs/demo_record.json"),
]


@pytest.mark.parametrize("text_path, marker, record, command", QUOTED_TABLES, ids=["readme", "reproduction.md"])
def test_quoted_claims_table_is_the_reports_table_of_its_record(text_path, marker, record, command):
    """The README quotes the table of claims `normlab-lab reproduce` printed at the end of the recorded full run, and
    lab/docs/reproduction.md the one of the recorded demo (the terminal's rendering of the report's first table).
    Each must be exactly what the lab makes of its record (saved from the run's directory): a hand-edited number, a
    changed criterion or wording in the builder, or a new record without the text updated all fail here."""
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    text = text_path.read_text()
    assert text.count(begin) == 1 and text.count(end) == 1, f"{text_path.name} lacks the {marker} markers"
    quoted = text.split(begin)[1].split(end)[0].strip()
    built = "\n".join(["```text", *claims_terminal(json.loads(record.read_text())), "```"]).strip()
    assert quoted == built, (
        f"{text_path.name}'s claims table differs from its record's: refresh both with `python -m "
        f"normlab_lab.demo.terminal {command}` and paste its output between the markers"
    )


def test_demo_record_keeps_every_verdict():
    """lab/docs/demo_record.json drops the runs' histories only: the table built from it is the demo's own."""
    from .test_demo_report import _demo

    demo = _demo()
    for sec in demo["sections"].values():
        for c in sec["cells"]:
            c["history"] = [{"test_acc": 0.5}]
    assert claims_table(claims_record(demo)) == claims_table(demo)
