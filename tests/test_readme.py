"""The Python examples of the README and of docs/integrations.md run as written (in a temporary directory: some
write runs/...); the README's table of claims is the terminal's rendering of the recorded full run (and
docs/reproduction.md's of the recorded demo); no README line is longer than 120 characters."""

import os
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
INTEGRATIONS = README.parent / "docs" / "integrations.md"  # the integrations' examples, moved out of the README
EXTRAS = ("lightning", "tensorboard", "ray", "onnx", "onnxruntime", "onnxscript", "timm")


def test_readme_python_examples_run(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    blocks += re.findall(r"```python\n(.*?)```", INTEGRATIONS.read_text(), flags=re.S)
    for code in blocks:
        try:
            exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
        except ModuleNotFoundError as e:  # an integration's example without its extra (make test has them all)
            if (e.name or "").split(".")[0] not in EXTRAS or os.environ.get("NORMLAB_REQUIRE_EXTRAS") == "1":
                raise
    assert "None" in capsys.readouterr().out  # the examples print mon.alarm, None on a healthy step
    if (tmp_path / "runs" / "tb").is_dir():  # the TensorBoard example wrote its event file
        assert list((tmp_path / "runs" / "tb").glob("events.out.tfevents.*"))


DOCS = README.parent / "docs"
QUOTED_TABLES = [  # (the text that quotes a record's table, its markers, the record, the command that makes both)
    (README, "reproduce-claims", DOCS / "reproduce_record.json", "runs/reproduce docs/reproduce_record.json"),
    (DOCS / "reproduction.md", "demo-claims", DOCS / "demo_record.json", "runs/demo docs/demo_record.json"),
]


@pytest.mark.parametrize("text_path, marker, record, command", QUOTED_TABLES, ids=["readme", "reproduction.md"])
def test_quoted_claims_table_is_the_reports_table_of_its_record(text_path, marker, record, command):
    """The README quotes the table of claims `normlab reproduce` printed at the end of the recorded full run, and
    docs/reproduction.md the one of the recorded demo (the terminal's rendering of the report's first table). Each
    must be exactly what normlab makes of its record (saved from the run's directory): a hand-edited number, a
    changed criterion or wording in the builder, or a new record without the text updated all fail here."""
    import json

    from normlab.runner.experiments.demo.terminal import claims_terminal

    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    text = text_path.read_text()
    assert text.count(begin) == 1 and text.count(end) == 1, f"{text_path.name} lacks the {marker} markers"
    quoted = text.split(begin)[1].split(end)[0].strip()
    built = "\n".join(["```text", *claims_terminal(json.loads(record.read_text())), "```"]).strip()
    assert quoted == built, (
        f"{text_path.name}'s claims table differs from its record's: refresh both with `python -m "
        f"normlab.runner.experiments.demo.terminal {command}` and paste its output between the markers"
    )


def test_demo_record_keeps_every_verdict():
    """docs/demo_record.json drops the runs' histories only: the table built from it is the demo's own."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_demo_report import _demo

    from normlab.runner.experiments.demo.claims import claims_record, claims_table

    demo = _demo()
    for sec in demo["sections"].values():
        for c in sec["cells"]:
            c["history"] = [{"test_acc": 0.5}]
    assert claims_table(claims_record(demo)) == claims_table(demo)


def test_readme_lines_fit_120_columns_and_its_first_screen_says_how_to_start():
    lines = README.read_text().splitlines()
    assert all(len(line) <= 120 for line in lines), [i + 1 for i, line in enumerate(lines) if len(line) > 120]
    first = "\n".join(lines[:45])
    for needed in ("pip install normlab", "--index-url", "make demo", "make test", "minutes"):
        assert needed in first, needed
    text = "\n".join(lines)
    assert text.count("How to read its report") + text.count("Reading the demo's report") == 0
