"""The ``normlab-lab`` command line: help, the quick demo end to end, bad input refused in one line with exit code 2
and nothing written."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from normlab_lab.cli import build_parser, main


def test_python_m_normlab_lab_help():
    r = subprocess.run([sys.executable, "-m", "normlab_lab", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: normlab-lab")
    for cmd in ("demo", "reproduce", "capsules", "report", "collapse-bench"):
        assert cmd in r.stdout


@pytest.mark.parametrize("cmd", ["demo", "reproduce", "capsules", "report", "collapse-bench"])
def test_subcommand_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    assert "usage: normlab-lab " + cmd in capsys.readouterr().out


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_demo_quick_writes_report(tmp_path, capsys):
    rc = main(["demo", "--quick", "--out", str(tmp_path), "--workers", "1", "--threads", "1", "--no-progress"])
    assert rc == 0
    out, err = capsys.readouterr()
    # the estimate comes before the first run (as compare's); --no-progress prints no progress line
    assert "normlab-lab demo: 14 runs to train: about" in err and "min with 1 worker(s) here" in err
    assert err.index("runs to train") < err.index("training runs on MNIST-1D") and "remaining" not in err
    report = (tmp_path / "report.md").read_text()
    for section in ("## (a) Learning rate", "## (b) Batch size", "## (c) Collapse diagnosis", "## (d) Cost"):
        assert section in report and section not in out  # the terminal shows the first table, not the report
    # the report opens with the claims table; the terminal ends with the same table and the report's path
    table = report.split("\n\n")[1]
    assert table.startswith("| # | claim (as its source states it) | verdict | the numbers |")
    assert [row.split(" | ")[0] for row in table.splitlines()[2:]] == [
        "| 1",
        "| 2",
        "| 3",
        "| 3a",
        "| 4",
        "| 5",
        "| BRN",
        "| mon",
    ]
    # the terminal's rendering: every claim's id starts a line, no line over 100 columns (report.md has the text)
    assert table not in out and all(len(line) <= 100 for line in out.splitlines() if not line.startswith("report: "))
    ids = [line.split()[0] for line in out.splitlines() if line[:1].strip() and not line.startswith(("report", "Q"))]
    assert [i for i in ids if i != "claim" and not i.startswith("normlab")] == [
        "1",
        "2",
        "3",
        "3a",
        "4",
        "5",
        "BRN",
        "mon",
    ]
    assert out.rstrip().splitlines()[-1].startswith(f"report: {tmp_path / 'report.md'}")
    assert "false alarm" in report and "at plateau" in report
    demo = json.loads((tmp_path / "demo.json").read_text())
    assert set(demo["sections"]) == {"lr_sweep", "collapse", "guard", "guard_dead", "batch_size"}
    # the guarded twins: section (c)'s unnormalized runs again, the same config but guard=True (and guard_dead=True),
    # beside their twins
    twins = {c["cell"]: c for c in demo["sections"]["collapse"]["cells"]}
    for section, dead in (("guard", False), ("guard_dead", True)):
        for c in demo["sections"][section]["cells"]:
            assert c["name"] == "none" and c["cell"] in twins and c["seed"] == twins[c["cell"]]["seed"]
            summary = json.loads((tmp_path / section / "runs" / c["cell"] / "summary.json").read_text())
            assert summary["config"]["guard"] is True and summary["config"]["guard_dead"] is dead
            assert "monitor_risk" in summary
    assert "### Guarded twins" in report and "| none seed 0 |" in report
    assert "### Guarded twins with --guard-dead" in report
    assert {c["name"] for c in demo["sections"]["lr_sweep"]["cells"]} == {"none", "bn", "pws"}
    pngs = ("a_acc_vs_lr.png", "a_loss_curves.png", "b_acc_vs_batch_size.png", "c_collapse_diagnosis.png")
    for png in (*pngs, "c_guarded_twins.png", "c_guarded_dead_twins.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the batch-size section reports train-mode accuracy; every run of the demo is monitored
    assert all(c["final_test_acc_train_mode"] is not None for c in demo["sections"]["batch_size"]["cells"])
    assert all(c["monitored"] for sec in demo["sections"].values() for c in sec["cells"])
    (tmp_path / "report.md").unlink()
    assert main(["report", str(tmp_path)]) == 0 and (tmp_path / "report.md").is_file()
    # the README's order, quick demo then demo, in one directory: refused in one line naming the quick demo's run
    capsys.readouterr()
    assert main(["demo", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds a `normlab-lab demo --quick` run (demo.json)" in err[0], err


def _parse_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "argv, typo, suggested",
    [
        (["demo", "--quik"], "--quik", "--quick"),
        (["capsules", "--iteration", "1"], "--iteration", "--iterations"),
        (["collapse-bench", "collect", "--seed", "300"], "--seed", "--seeds"),
    ],
)
def test_options_are_never_abbreviated_and_a_typo_gets_the_closest_option(argv, typo, suggested, capsys, tmp_path):
    err = _parse_error(argv + ["--out", str(tmp_path / "o")], capsys)
    assert err.startswith("normlab-lab ") and f"unrecognized arguments: {typo}" in err, err
    assert f"did you mean {suggested}" in err, err
    assert not (tmp_path / "o").exists()


def test_every_command_refuses_abbreviations():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # argparse keeps its subparsers here
    assert parser.allow_abbrev is False and commands
    assert all(p.allow_abbrev is False for p in commands.values()), [n for n, p in commands.items() if p.allow_abbrev]


def _demo_dir(tmp: Path) -> Path:
    d = tmp / "demo"
    d.mkdir(exist_ok=True)
    (d / "demo.json").write_text(json.dumps({"protocol": 1, "sections": []}))
    return d


BAD = [  # (id, argv, words the one line must hold, setup(work dir) -> extra substitutions)
    ("demo-out-is-file", ["demo", "--out", "{file}"], ["--out", "is a file"], None),
    ("demo-threads-zero", ["demo", "--threads", "0"], ["--threads"], None),
    ("reproduce-seeds-without-cifar", ["reproduce", "--seeds", "300"], ["--seeds", "cifar10-pws"], None),
    ("reproduce-download-without-dir", ["reproduce", "--preset", "cifar10-pws", "--download"], ["--data-dir"], None),
    ("capsules-iterations-word", ["capsules", "--iterations", "1,x"], ["--iterations", "integers"], None),
    ("report-on-file", ["report", "{file}"], ["DIR", "file"], None),
    (
        "report-demo-wrong-shape",
        ["report", "{rep}"],
        ["demo.json", "demo record", "'protocol' is missing"],
        lambda t: {"rep": str(_demo_dir(t))},
    ),
    ("report-without-results", ["report", "{out}"], ["results.json"], lambda t: {"out": str(_empty(t))}),
    ("collapse-bench-reserved-seeds", ["collapse-bench", "collect", "--seeds", "3-5"], ["--seeds", "reserved"], None),
    ("collapse-bench-unknown-setup", ["collapse-bench", "evaluate", "--setups", "vgg"], ["--setups", "vgg"], None),
    ("collapse-bench-stage", ["collapse-bench", "train"], ["invalid choice", "collect"], None),
    ("unknown-command", ["frobnicate"], ["invalid choice", "frobnicate"], None),
]


def _empty(tmp: Path) -> Path:
    d = tmp / "empty"
    d.mkdir(exist_ok=True)
    return d


def _snapshot(paths: list[Path]) -> dict:
    """Every file under ``paths`` (or the path itself) with its bytes; absent paths as None."""
    snap = {}
    for p in paths:
        if not os.path.lexists(p):
            snap[str(p)] = None
        elif p.is_dir():
            snap.update({str(q): q.read_bytes() if q.is_file() else "dir" for q in sorted(p.rglob("*"))})
            snap[str(p)] = "dir"
        else:
            snap[str(p)] = p.read_bytes()
    return snap


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_invocation_is_one_line_exit_2_and_writes_nothing(case, tmp_path, capsys, monkeypatch):
    _, argv, words, setup = case
    monkeypatch.chdir(tmp_path)
    work = tmp_path / "w"
    work.mkdir()
    (work / "a_file").write_text("keep")
    subs = {"out": str(work / "out"), "file": str(work / "a_file")}
    subs.update(setup(work) if setup else {})
    argv = [a.format(**subs) for a in argv]
    if argv[0] in ("demo", "reproduce", "capsules", "collapse-bench") and "--out" not in argv:
        argv += ["--out", subs["out"]]
    before = _snapshot([work, tmp_path])
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse refusals
        rc = e.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("normlab-lab"), err
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert _snapshot([work, tmp_path]) == before  # nothing created, changed or removed


# ------------------------------------------------------------------- one command per output directory (the claim)
CLAIMING = [  # (argv, the command line that claims its directory, its default directory)
    (["demo"], "normlab-lab demo", "runs/demo"),
    (["demo", "--quick"], "normlab-lab demo --quick", "runs/demo-quick"),
    (["capsules"], "normlab-lab capsules", "runs/capsules"),
    (["capsules", "--quick"], "normlab-lab capsules --quick", "runs/capsules-quick"),
    (["reproduce"], "normlab-lab reproduce", "runs/reproduce"),
    (["reproduce", "--smoke"], "normlab-lab reproduce --smoke", "runs/reproduce-smoke"),
    (
        ["reproduce", "--preset", "cifar10-pws", "--smoke"],
        "normlab-lab reproduce --preset cifar10-pws --smoke",
        "runs/cifar10_pws-smoke",
    ),
]


@pytest.mark.parametrize("argv, claim, default", CLAIMING, ids=[" ".join(c[0]) for c in CLAIMING])
def test_each_command_refuses_another_commands_directory_and_the_users_files(
    argv, claim, default, tmp_path, capsys, monkeypatch
):
    from normlab.runner.lock import CLAIM_NAME

    other = "normlab-lab demo" if claim == "normlab-lab demo --quick" else "normlab-lab demo --quick"
    theirs, mine = tmp_path / "theirs", tmp_path / "mine"
    theirs.mkdir()
    (theirs / CLAIM_NAME).write_text(json.dumps({"run": other, "record": "demo.json"}))
    (theirs / "demo.json").write_text("{}")
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    before = _snapshot([tmp_path])
    for d, words in ((theirs, f"holds a `{other}` run (demo.json)"), (mine, "holds files no normlab run wrote")):
        assert main([*argv, "--out", str(d), "--workers", "1", "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--out {d} {words}" in err[0], err
    assert _snapshot([tmp_path]) == before
    # without --out, each mode writes a directory of its own (the quick demo and the demo never collide)
    monkeypatch.chdir(tmp_path)
    (tmp_path / default).mkdir(parents=True)
    (tmp_path / default / "notes.txt").write_text("mine")
    assert main([*argv, "--workers", "1", "--no-progress"]) == 2
    assert f"--out {default} holds files" in capsys.readouterr().err
    assert len({c[2] for c in CLAIMING}) == len(CLAIMING)


# ------------------------------------------------------------------------------ one time estimate of the demo
_MINUTES = re.compile(r"(\d+(?:\.\d+)?|one|two|three|four|five|six)\**[- ](?:minutes?\b|min\b)", re.I)


def test_the_demos_time_is_the_same_everywhere():
    """README, the lab's README, the help texts and the demo's docstring say DEMO_MINUTES wherever they say how long
    the demo takes (they said 3.5, 4.5 and five minutes)."""
    from normlab_lab import DEMO_MINUTES
    from normlab_lab.demo import experiment

    parser = build_parser()
    demo = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["demo"]
    root = Path(__file__).resolve().parents[2]
    texts = {
        "README.md": (root / "README.md").read_text(),
        "lab/README.md": (root / "lab" / "README.md").read_text(),
        "normlab-lab --help": parser.description,
        "normlab-lab demo --help": demo.description,
        "normlab_lab.demo.experiment": experiment.__doc__,
    }
    for where, text in texts.items():
        said = [m.group(1) for line in text.splitlines() if "demo" in line for m in _MINUTES.finditer(line)]
        assert said and set(said) == {f"{DEMO_MINUTES:g}"}, (where, said)
