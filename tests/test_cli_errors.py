"""Every user error of the ``normlab`` command is one line naming the option, exit code 2, no traceback, and
leaves ``--out`` (and every other path it names) as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from normlab.cli import main

NO_CUDA = not torch.cuda.is_available()


def _unwritable(tmp: Path) -> str:
    """A directory path this process cannot create (root ignores permission bits: use sysfs)."""
    if os.geteuid() == 0:
        return "/sys/normlab-test-out/run"
    ro = tmp / "ro"
    ro.mkdir(exist_ok=True)
    ro.chmod(0o500)
    return str(ro / "run")


def _report_dir(tmp: Path, results) -> str:
    d = tmp / "rep"
    d.mkdir(exist_ok=True)
    (d / "results.json").write_text(json.dumps(results))
    return str(d)


def _log(tmp: Path, lines: list[str]) -> str:
    p = tmp / "mon.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return str(p)


_RECORD = json.dumps({"layer": "conv", "step": 0, "output_var": 1.0})
_SPEC = {
    "norms": ["bn"],
    "lrs": [0.1],
    "batch_sizes": [8],
    "seeds": [0],
    "epochs": 1,
    "dataset": "digits",
    "model": "plain",
    "width": 0.25,
    "layout": "product",
    "base_lr": 0.1,
    "base_batch_size": 8,
}

# (id, argv with {out}/{file}/{unwritable} placeholders, words the message must contain, setup(tmp) -> extra
# placeholders). {out} does not exist; {file} is a file.
BAD = [
    ("lr-zero", ["train", "--lr", "0"], ["--lr", "> 0"], None),
    ("lr-negative", ["train", "--lr", "-0.1"], ["--lr"], None),
    ("lr-nan", ["train", "--lr", "nan"], ["--lr"], None),
    ("lr-inf", ["train", "--lr", "inf"], ["--lr"], None),
    ("momentum-nan", ["train", "--momentum", "nan"], ["--momentum", "[0, 1)"], None),
    ("momentum-one", ["train", "--momentum", "1"], ["--momentum"], None),
    ("weight-decay-negative", ["train", "--weight-decay", "-0.001"], ["--weight-decay", ">= 0"], None),
    ("lr-gamma-zero", ["train", "--lr-gamma", "0"], ["--lr-gamma"], None),
    ("device-foo", ["train", "--device", "foo"], ["--device"], None),
    ("width-absurd", ["train", "--width", "1e9"], ["--width", "(0, 16]"], None),
    ("width-zero", ["train", "--width", "0"], ["--width"], None),
    ("threads-absurd", ["train", "--threads", "100000"], ["--threads", "1024"], None),
    ("threads-zero", ["train", "--threads", "0"], ["--threads"], None),
    ("seed-negative", ["train", "--seed", "-1"], ["--seed"], None),
    ("epochs-zero", ["train", "--epochs", "0"], ["--epochs"], None),
    ("batch-size-zero", ["train", "--batch-size", "0"], ["--batch-size"], None),
    ("milestones-decreasing", ["train", "--milestones", "5,3"], ["--milestones", "increasing"], None),
    ("monitor-every-negative", ["train", "--monitor-every", "-1"], ["--monitor-every"], None),
    ("target-acc-absurd", ["train", "--target-acc", "2000"], ["--target-acc"], None),
    ("num-samples-digits", ["train", "--num-samples", "100"], ["--num-samples", "mnist1d"], None),
    ("num-train-too-large", ["train", "--num-train", "999999"], ["--num-train", "1437"], None),
    ("batch-size-too-large", ["train", "--batch-size", "5000"], ["--batch-size", "5000"], None),
    ("norm-unknown", ["train", "--norm", "batchnorm"], ["--norm", "pws"], None),
    ("dataset-unknown", ["train", "--dataset", "imagenet"], ["--dataset", "mnist1d"], None),
    ("model-unknown", ["train", "--model", "vgg"], ["--model", "resnet"], None),
    ("unknown-option", ["train", "--bogus", "1"], ["unrecognized", "--bogus"], None),
    ("out-empty", ["train", "--out", ""], ["--out", "empty"], None),
    ("out-is-file", ["train", "--out", "{file}"], ["--out", "is a file"], None),
    ("out-under-file", ["train", "--out", "{file}/sub"], ["--out", "which is a file"], None),
    ("out-unwritable", ["train", "--out", "{unwritable}"], ["--out"], None),
    ("data-dir-is-file", ["train", "--data-dir", "{file}"], ["--data-dir", "is a file"], None),
    ("compare-momentum-negative", ["compare", "--momentum", "-1"], ["--momentum"], None),
    ("compare-seeds-negative", ["compare", "--seeds", "-1"], ["--seeds", "seed"], None),
    ("compare-seeds-duplicate", ["compare", "--seeds", "0,0"], ["--seeds", "distinct"], None),
    ("compare-lrs-word", ["compare", "--lrs", "0.1,fast"], ["--lrs", "learning rate"], None),
    ("compare-lrs-zero", ["compare", "--lrs", "0"], ["--lrs"], None),
    ("compare-base-batch-size-zero", ["compare", "--base-batch-size", "0"], ["--base-batch-size"], None),
    (
        "compare-base-lr-not-in-lrs",
        ["compare", "--layout", "cross", "--lrs", "0.1", "--base-lr", "0.3"],
        ["--base-lr", "--lrs"],
        None,
    ),
    ("compare-workers-negative", ["compare", "--workers", "-1"], ["--workers"], None),
    ("compare-workers-absurd", ["compare", "--workers", "100000"], ["--workers", "256"], None),
    ("compare-variant-bad", ["compare", "--norms", "pws:gamma=abc"], ["--norms", "gamma"], None),
    ("compare-norm-unknown", ["compare", "--norms", "bn,layernorm2"], ["--norms", "valid names"], None),
    ("compare-batch-too-large", ["compare", "--batch-sizes", "64,99999"], ["--batch-sizes", "99999"], None),
    ("compare-lr-scaling-bad", ["compare", "--lr-scaling", "cubic"], ["--lr-scaling", "invalid choice"], None),
    ("compare-out-is-file", ["compare", "--out", "{file}"], ["--out", "is a file"], None),
    ("train-tensorboard-is-file", ["train", "--tensorboard", "{file}"], ["--tensorboard", "is a file"], None),
    ("train-tensorboard-empty", ["train", "--tensorboard", ""], ["--tensorboard", "empty"], None),
    ("compare-backend-bad", ["compare", "--backend", "dask"], ["--backend", "invalid choice"], None),
    ("compare-address-without-ray", ["compare", "--address", "auto"], ["--address", "--backend ray"], None),
    (
        "compare-address-with-workers",
        ["compare", "--backend", "ray", "--address", "auto", "--workers", "2"],
        ["--workers", "--address"],
        None,
    ),
    ("compare-out-empty", ["compare", "--out", ""], ["--out", "empty"], None),
    ("compare-lrs-empty-item", ["compare", "--lrs", "0.1,,0.2"], ["--lrs", "empty item"], None),
    ("compare-norms-trailing-comma", ["compare", "--norms", "bn,"], ["--norms", "empty item"], None),
    ("compare-seeds-empty", ["compare", "--seeds", ""], ["--seeds", "empty list"], None),
    ("train-milestones-empty-item", ["train", "--milestones", "2,,4"], ["--milestones", "empty item"], None),
    (
        "compare-long-grid-without-yes",
        ["compare", "--norms", "bn", "--seeds", "0", "--epochs", "5000"],
        ["--yes", "1 run to train", "min"],
        None,
    ),
    ("report-list", ["report", "{rep}"], ["results.json", "JSON object"], lambda t: {"rep": _report_dir(t, [])}),
    (
        "report-group-not-object",
        ["report", "{rep}"],
        ["groups[0]"],
        lambda t: {"rep": _report_dir(t, {"spec": _SPEC, "groups": [1], "cells": []})},
    ),
    (
        "report-spec-wrong-type",
        ["report", "{rep}"],
        ["spec.norms"],
        lambda t: {"rep": _report_dir(t, {"spec": {**_SPEC, "norms": "bn"}, "groups": [], "cells": []})},
    ),
    ("report-on-file", ["report", "{file}"], ["DIR", "file"], None),
    (
        "report-of-a-demo",  # the demo's record is the lab's (normlab-lab report); normlab reads grids
        ["report", "{rep}"],
        ["no results.json"],
        lambda t: {"rep": str(_demo_dir(t))},
    ),
    (
        "monitor-non-object-line",
        ["monitor", "{log}", "--out", "{out}"],
        ["LOG", "not a JSON object"],
        lambda t: {"log": _log(t, [_RECORD, "[1, 2]"])},
    ),
    (
        "monitor-bad-step",
        ["monitor", "{log}", "--out", "{out}"],
        ["LOG", "'step'"],
        lambda t: {"log": _log(t, [json.dumps({"layer": "conv", "step": "x"})])},
    ),
    ("monitor-missing-log", ["monitor", "{out}/none.jsonl", "--out", "{out}"], ["LOG", "does not exist"], None),
    (
        "monitor-empty-log",
        ["monitor", "{log}", "--out", "{out}"],
        ["LOG", "holds no monitor records (nothing to plot)"],
        lambda t: {"log": _log(t, [])},
    ),
    (
        "monitor-out-is-file",
        ["monitor", "{log}", "--out", "{file}"],
        ["--out", "is a file"],
        lambda t: {"log": _log(t, [_RECORD])},
    ),
    ("bench-width-absurd", ["bench", "--steps", "--width", "1e9"], ["--width"], None),
    # a user's factories (tests/user_factories.py), refused before anything is written
    ("model-not-importable", ["compare", "--model", "no_such_pkg.models:net"], ["--model", "cannot import"], None),
    ("model-no-function", ["compare", "--model", "user_factories:nope"], ["--model", "has no 'nope'"], None),
    ("model-not-callable", ["compare", "--model", "user_factories:STEPS"], ["--model", "expected a function"], None),
    ("model-not-a-module", ["compare", "--model", "user_factories:not_a_model"], ["--model", "nn.Module"], None),
    ("model-raises", ["train", "--model", "user_factories:raises"], ["--model", "the factory broke"], None),
    ("model-wrong-classes", ["train", "--model", "user_factories:three_classes"], ["--model", "10 classes"], None),
    ("model-timm-unknown", ["compare", "--model", "timm:no_such_net"], ["--model", "timm has no model"], None),
    (
        "model-no-batchnorm",
        ["compare", "--model", "user_factories:no_norm_cnn", "--norms", "gn"],
        ["--model", "no BatchNorm"],
        None,
    ),
    ("model-width", ["compare", "--model", "user_factories:bn_cnn", "--width", "0.5"], ["--width", "built-in"], None),
    (
        "dataset-not-pairs",
        ["compare", "--dataset", "user_factories:one_tensor"],
        ["--dataset", "(input, target)"],
        None,
    ),
    ("dataset-returns-model", ["train", "--dataset", "user_factories:bn_cnn"], ["--dataset", "factory raised"], None),
    ("loss-unknown", ["compare", "--loss", "hinge"], ["--loss", "unknown loss"], None),
    ("loss-does-not-fit", ["compare", "--loss", "mse"], ["--loss", "targets of its own shape"], None),
    (
        "loss-user-does-not-fit",
        ["compare", "--norms", "bn", "--loss", "torch.nn.functional:l1_loss"],
        ["--loss", "does not take the output", "(2, 10)"],
        None,
    ),
    ("metric-not-importable", ["train", "--metric", "nowhere:f1"], ["--metric", "cannot import"], None),
    ("compare-ddp-workers", ["compare", "--workers", "2"], ["--workers", "torchrun"], lambda t: _torchrun()),
    ("unknown-command", ["frobnicate"], ["invalid choice", "frobnicate"], None),
]
if NO_CUDA:
    BAD.append(("device-cuda-without-cuda", ["train", "--device", "cuda"], ["--device", "CUDA"], None))


def _torchrun() -> dict:
    """As under torchrun (2 processes): the variables torchrun sets (the test's monkeypatch takes them away)."""
    os.environ.update(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0")
    return {}


def _demo_dir(tmp: Path) -> Path:
    d = tmp / "demo"
    d.mkdir(exist_ok=True)
    (d / "demo.json").write_text(json.dumps({"protocol": 1, "sections": []}))
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


def _invoke(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse refusals
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_invocation_is_one_line_exit_2_and_writes_nothing(case, tmp_path, capsys, monkeypatch):
    _, argv, words, setup = case
    monkeypatch.chdir(tmp_path)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):  # restored after the test (a case may set them)
        monkeypatch.setenv(name, os.environ.get(name, "1" if name == "WORLD_SIZE" else "0"))
    work = tmp_path / "w"
    work.mkdir()
    (work / "a_file").write_text("keep")
    subs = {"out": str(work / "out"), "file": str(work / "a_file"), "unwritable": _unwritable(tmp_path)}
    subs.update(setup(work) if setup else {})
    argv = [a.format(**subs) for a in argv]
    if argv[0] in ("train", "compare") and "--out" not in argv:
        argv += ["--out", subs["out"]]
    before = _snapshot([work, tmp_path])
    rc, err = _invoke(argv, capsys)
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("normlab"), err
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert _snapshot([work, tmp_path]) == before  # nothing created, changed or removed


def test_console_entry_point_refusal_is_one_line(tmp_path):
    # through the real entry point (sys.exit): a run-time refusal after a parse-time check passed
    (tmp_path / "f").write_text("x")
    r = subprocess.run(
        [sys.executable, "-m", "normlab", "compare", "--lrs", "0.1", "--out", str(tmp_path / "f")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--out" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_help_is_unchanged(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: normlab train") and "--lr" in out
