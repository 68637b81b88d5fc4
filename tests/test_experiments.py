"""Comparison grids: expansion, running, resuming, results files, report re-rendering, judged effects."""

from __future__ import annotations

import json
import math

import pytest
from conftest import claimed

from normlab.nn import resolve_comparison as resolve_norm
from normlab.runner.experiments.compare import run_grid
from normlab.runner.grid.report import Effects, markdown_report, markdown_table, render_report, summary_lines
from normlab.runner.grid.results import chance_level, format_acc, load_results
from normlab.runner.grid.spec import GridSpec, expand_grid

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ names and grid expansion


@pytest.mark.parametrize(
    "name, expected",
    [
        ("none", ("none", "conv")),
        ("bn", ("bn", "conv")),
        ("brn", ("brn", "conv")),
        ("gn", ("gn", "conv")),
        ("sn", ("sn", "conv")),
        ("wn", ("none", "wn")),
        ("ws", ("none", "ws")),
        ("pws", ("none", "pws")),
        ("ws+gn", ("gn", "ws")),
        ("gn+ws", ("gn", "ws")),
        ("PWS", ("none", "pws")),
    ],
)
def test_resolve_norm(name, expected):
    assert resolve_norm(name) == expected


@pytest.mark.parametrize("bad", ["batchnorm", "ws+pws", "bn+gn", "", "ws+gn+bn"])
def test_resolve_norm_unknown_lists_valid_names(bad):
    with pytest.raises(ValueError) as e:
        resolve_norm(bad)
    msg = str(e.value)
    for valid in ("none", "bn", "brn", "gn", "sn", "wn", "ws", "pws"):
        assert valid in msg


def test_expand_grid_product():
    spec = GridSpec(norms=("none", "pws", "ws+gn"), lrs=(0.01, 0.1), batch_sizes=(2, 64), seeds=(0, 1, 2), epochs=3)
    cells = expand_grid(spec)
    assert len(cells) == 3 * 2 * 2 * 3
    assert len({c.cell_id for c in cells}) == len(cells)
    got = {(c.name, c.lr, c.batch_size, c.seed) for c in cells}
    assert got == {(n, lr, b, s) for n in spec.norms for lr in spec.lrs for b in spec.batch_sizes for s in spec.seeds}
    for c in cells:
        assert (c.config.norm, c.config.conv) == resolve_norm(c.name)
        assert c.config.lr == c.lr and c.config.batch_size == c.batch_size and c.config.seed == c.seed
        assert c.config.epochs == 3 and c.config.dataset == "digits"


def test_expand_grid_cross_and_lr_scaling():
    spec = GridSpec(
        norms=("bn",),
        lrs=(0.01, 0.1, 1.0),
        batch_sizes=(64, 8, 2),
        seeds=(0,),
        layout="cross",
        base_lr=0.1,
        lr_scaling="linear",
    )
    pts = {(c.lr, c.batch_size) for c in expand_grid(spec)}
    # lr sweep at the base batch size (first in the list) + batch-size sweep at the base lr, no duplicates
    assert pts == {(0.01, 64), (0.1, 64), (1.0, 64), (0.1, 8), (0.1, 2)}
    by_pt = {(c.lr, c.batch_size): c.config.lr for c in expand_grid(spec)}
    assert math.isclose(by_pt[(0.1, 2)], 0.1 * 2 / 64)
    assert math.isclose(by_pt[(1.0, 64)], 1.0)


@pytest.mark.parametrize(
    "kw",
    [
        dict(norms=()),
        dict(lrs=(0.1, 0.1)),
        dict(lrs=(-1.0,)),
        dict(batch_sizes=(0,)),
        dict(layout="diagonal"),
        dict(layout="cross", base_lr=0.3),
        dict(epochs=0),
        dict(norms=("bn", "xyz")),
    ],
)
def test_gridspec_rejects_bad_input(kw):
    with pytest.raises(ValueError, match="GridSpec|resolve_comparison"):
        GridSpec(**kw)


# ------------------------------------------------------------------ running a tiny grid (real training)


def _tiny_spec(**kw):
    base = dict(
        norms=("bn", "pws"),
        lrs=(0.05, 0.2),
        batch_sizes=(16,),
        seeds=(0,),
        epochs=1,
        width=0.125,
        max_steps_per_epoch=2,
        target_acc=0.5,
    )
    base.update(kw)
    return GridSpec(**base)


@pytest.fixture(scope="module")
def tiny_grid(tmp_path_factory):
    out = tmp_path_factory.mktemp("grid")
    results = run_grid(_tiny_spec(), out, workers=1, progress=False, threads=1)
    return out, results


def test_run_grid_writes_results_table_and_plots(tiny_grid):
    out, results = tiny_grid
    cells = expand_grid(_tiny_spec())
    for c in cells:
        assert (out / "runs" / c.cell_id / "summary.json").is_file()
    on_disk = load_results(out)
    assert on_disk["spec"]["norms"] == ["bn", "pws"]
    assert len(on_disk["cells"]) == len(cells) == 4
    assert len(on_disk["groups"]) == 4  # one seed per (norm, lr, batch size)
    # aggregated numbers are the per-cell summaries' numbers (one seed: mean = value, std = 0)
    for g in on_disk["groups"]:
        c = next(c for c in cells if (c.name, c.lr, c.batch_size) == (g["name"], g["lr"], g["batch_size"]))
        s = json.loads((out / "runs" / c.cell_id / "summary.json").read_text())
        assert g["final_mean"] == pytest.approx(s["final_test_acc"]) and g["final_std"] == 0.0
        assert g["best_mean"] == pytest.approx(s["best_test_acc"])
        assert g["collapsed_count"] == int(bool(s["collapsed"]))
        assert g["step_time_s"] == pytest.approx(s["step_time_s"])
    md = (out / "results.md").read_text()
    assert "| bn | 0.05 | 16 | 1 |" in md and "| pws | 0.2 | 16 | 1 |" in md
    assert "## Per normalization" in md and "Headline effects" not in md and "Criteria" not in md  # the lab's
    for png in ("metric_vs_lr.png", "loss_curves.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC
    # a single batch size: no batch-size plot to draw
    assert not (out / "metric_vs_batch_size.png").exists()


def test_resume_skips_finished_cells(tiny_grid, tmp_path):
    import shutil

    src, _ = tiny_grid
    out = tmp_path / "grid"
    shutil.copytree(src, out)
    cells = expand_grid(_tiny_spec())
    done, redo = cells[0], cells[1]
    # mark a finished cell with a sentinel value: if it were rerun, the sentinel would be overwritten
    p = out / "runs" / done.cell_id / "summary.json"
    s = json.loads(p.read_text())
    s["final_test_acc"] = 0.123456
    p.write_text(json.dumps(s))
    # a cell of the partial grid that never finished
    shutil.rmtree(out / "runs" / redo.cell_id)
    mtimes = {c.cell_id: (out / "runs" / c.cell_id / "summary.json").stat().st_mtime_ns for c in cells[2:]}

    results = run_grid(_tiny_spec(), out, workers=1, progress=False, threads=1)
    rec = {c["cell"]: c for c in results["cells"]}
    assert rec[done.cell_id]["final_test_acc"] == 0.123456
    assert (out / "runs" / redo.cell_id / "summary.json").is_file()
    for cid, t in mtimes.items():
        assert (out / "runs" / cid / "summary.json").stat().st_mtime_ns == t
    # the rerun cell is the same deterministic run as before
    old = json.loads((src / "runs" / redo.cell_id / "summary.json").read_text())
    assert rec[redo.cell_id]["final_test_acc"] == pytest.approx(old["final_test_acc"])


def test_cell_with_other_config_is_refused(tiny_grid, tmp_path):
    import shutil

    src, _ = tiny_grid
    out = tmp_path / "grid"
    shutil.copytree(src, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    spec = _tiny_spec(epochs=2)  # same cell ids, different config: never overwrite existing results
    with pytest.raises(ValueError, match="different config.*epochs: 1 -> 2"):
        run_grid(spec, out, workers=1, progress=False, threads=1)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_report_rerenders_from_results_json(tiny_grid, tmp_path):
    import shutil

    from normlab.cli import main

    src, _ = tiny_grid
    out = tmp_path / "grid"
    shutil.copytree(src, out)
    before = (out / "results.md").read_text()
    for f in ["results.md", "metric_vs_lr.png", "loss_curves.png"]:
        (out / f).unlink()
    assert main(["report", str(out)]) == 0
    assert (out / "results.md").read_text() == before
    assert (out / "metric_vs_lr.png").read_bytes()[:8] == PNG_MAGIC


def test_parallel_workers(tmp_path):
    spec = _tiny_spec(norms=("gn", "ws"), lrs=(0.05,), max_steps_per_epoch=1)
    results = run_grid(spec, tmp_path, workers=2, progress=False, render=False)
    assert sorted(c["name"] for c in results["cells"]) == ["gn", "ws"]
    for c in expand_grid(spec):
        assert (tmp_path / "runs" / c.cell_id / "summary.json").is_file()


# ------------------------------------------------------------------ judging the headline effects


def _group(name, lr, bs, final, n=3, collapsed=0, std=0.01, step=0.01):
    return {
        "name": name,
        "lr": lr,
        "batch_size": bs,
        "n_seeds": n,
        "final_mean": final,
        "final_std": std,
        "best_mean": final,
        "best_std": std,
        "collapsed_count": collapsed,
        "target_reached": 0,
        "epochs_to_target_mean": None,
        "step_time_s": step,
    }


def _results(groups, norms=("none", "bn", "brn", "gn", "pws")):
    spec = GridSpec(norms=norms, lrs=(0.05, 0.5), batch_sizes=(64, 2), seeds=(0, 1, 2), layout="cross").to_dict()
    return {"spec": spec, "num_classes": 10, "groups": groups, "cells": []}


def _base_groups(none_hi=0.10, none_collapsed=3, bn_hi=0.95, pws_hi=0.93, bn_small=0.60, gn_small=0.94):
    g = [_group("none", 0.05, 64, 0.90), _group("none", 0.5, 64, none_hi, collapsed=none_collapsed)]
    for n, hi in (("bn", bn_hi), ("brn", 0.94), ("gn", 0.95), ("pws", pws_hi)):
        g.append(_group(n, 0.05, 64, 0.96))
        g.append(_group(n, 0.5, 64, hi))
    for n, small in (("bn", bn_small), ("brn", 0.95), ("gn", gn_small), ("pws", 0.95), ("none", 0.9)):
        g.append(_group(n, 0.05, 2, small))
    return g


def test_markdown_table_mean_std_and_collapse_count():
    res = _results([_group("none", 0.5, 64, 0.1, collapsed=2, std=0.0234), _group("bn", 0.5, 64, 0.9512)])
    md = markdown_table(res)
    assert "| none | 0.5 | 64 | 3 | 10.0 ± 2.3 |" in md and "yes (2/3)" in md
    assert "| bn | 0.5 | 64 | 3 | 95.1 ± 1.0 |" in md and "no (0/3)" in md


def _with_cells(res):
    """``res`` with one cell per seed of each group (its final accuracy the group's mean) and the per-norm records."""
    from normlab.runner.grid.results import per_norm

    res["cells"] = [
        {"name": g["name"], "lr": g["lr"], "batch_size": g["batch_size"], "seed": s, "cell": f"{g['name']}{s}",
         "final_test_acc": g["final_mean"], "collapsed": s < g["collapsed_count"], "history": []}
        for g in res["groups"] for s in range(g["n_seeds"])
    ]  # fmt: skip
    res["norms"] = per_norm(res)
    return res


def test_render_report_on_synthetic_results(tmp_path):
    res = _with_cells(_results(_base_groups()))
    paths = render_report(res, tmp_path)
    names = {p.name for p in paths}
    assert {"results.md", "metric_vs_lr.png", "metric_vs_batch_size.png"} <= names
    md = (tmp_path / "results.md").read_text()
    assert "## Per normalization" in md and "**yes**" not in md  # no claims judged without effects


def test_a_report_judges_the_effects_it_is_given_and_none_by_default(tmp_path):
    res = _results(_base_groups())
    effects = Effects(
        lambda r: [{"effect": "BN at lr 0.5", "appeared": True, "text": format_acc(_find(r, "bn", 0.5, 64))}],
        criteria="BN trains above 90 %.",
        title="The claim",
    )
    md = markdown_report(res, effects=effects)
    assert "## The claim" in md and "- BN at lr 0.5: **yes**. 95.0 ± 1.0 %" in md and "Criteria: BN trains" in md
    assert md.index("## Per normalization") < md.index("## The claim") < md.index("## Every setting")
    assert summary_lines(res, effects) == ["[YES] BN at lr 0.5: 95.0 ± 1.0 %"]
    plain = markdown_report(res)
    assert "## The claim" not in plain and "Criteria" not in plain and summary_lines(res) == []
    render_report(res, tmp_path, effects)
    assert "## The claim" in (tmp_path / "results.md").read_text()


def _find(results, name, lr, bs):
    return next(g for g in results["groups"] if (g["name"], g["lr"], g["batch_size"]) == (name, lr, bs))


def test_chance_level_and_accuracy_text():
    assert chance_level({"num_classes": 10}) == 0.1 and chance_level({}) == 0.0
    assert format_acc(None) == "n/a" and format_acc(_group("bn", 0.5, 64, None)) == "n/a"
    assert format_acc(_group("bn", 0.5, 64, 0.9512, n=1)) == "95.1 %"
    assert format_acc(_group("none", 0.5, 64, 0.1, collapsed=2, std=0.0234)) == "10.0 ± 2.3 % (collapsed 2/3)"


def test_partial_results_written_after_each_cell(tmp_path, monkeypatch):
    # the grid dies in its second cell: results.json already holds the first one and renders as partial
    import normlab.runner.experiments.compare as ex
    from normlab.cli import main

    real = ex.train
    calls = []

    def dying(config, out_dir, **kw):
        calls.append(out_dir)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(config, out_dir, **kw)

    monkeypatch.setattr(ex, "train", dying)
    spec = _tiny_spec(norms=("bn",), lrs=(0.05, 0.2), max_steps_per_epoch=1)
    with pytest.raises(KeyboardInterrupt):
        run_grid(spec, tmp_path, workers=1, threads=1, progress=False)
    res = load_results(tmp_path)
    assert res["complete"] is False and len(res["cells"]) == 1
    assert main(["report", str(tmp_path)]) == 0
    assert "Partial results" in (tmp_path / "results.md").read_text()
    monkeypatch.setattr(ex, "train", real)
    res = run_grid(spec, tmp_path, workers=1, threads=1, progress=False)
    assert res["complete"] is True and len(res["cells"]) == 2


def test_a_cell_that_raises_is_recorded_as_failed_and_the_others_finish(tmp_path):
    from normlab.runner.grid.execute import CellsFailed

    spec = _tiny_spec(norms=("bn", "gn"), lrs=(0.05,), max_steps_per_epoch=1)
    bad, good = expand_grid(spec)
    (claimed(tmp_path) / "runs" / bad.cell_id).mkdir(parents=True)  # by the grid that wrote the checkpoint
    (tmp_path / "runs" / bad.cell_id / "checkpoint.pt").write_bytes(b"garbage")
    with pytest.raises(CellsFailed, match=f"first: {bad.cell_id}: RunError: train: checkpoint"):
        run_grid(spec, tmp_path, workers=1, threads=1, progress=False)
    res = load_results(tmp_path)
    assert [c["cell"] for c in res["cells"]] == [good.cell_id] and not res["complete"]
    assert res["failed"][0]["cell"] == bad.cell_id and "corrupt or unreadable" in res["failed"][0]["error"]
    assert f"`{bad.cell_id}`: RunError" in (tmp_path / "results.md").read_text()


# ------------------------------------------------------------------ one validator per fact (the compare path)


def test_compare_validates_and_builds_each_config_once_and_loads_the_data_once(tmp_path, monkeypatch):
    # the data path of `normlab compare` (CLI -> GridSpec -> cells -> checks -> workers -> results.json): each
    # cell's TrainConfig is built once and its names and numbers are checked once, the data set is read once in
    # this process: by the checks, and the estimate and each cell's trainer (workers=1 trains here) take it from there
    from normlab.cli import main
    from normlab.runner.data import datasets
    from normlab.runner.training import setup
    from normlab.runner.training.config import TrainConfig

    counts = {"built": 0, "checked": 0, "loaded": 0}
    init, check, digits = TrainConfig.__init__, TrainConfig._check_data, datasets._digits

    def counting(key, fn):
        def wrapper(*a, **kw):
            counts[key] += 1
            return fn(*a, **kw)

        return wrapper

    monkeypatch.setattr(TrainConfig, "__init__", counting("built", init))
    monkeypatch.setattr(TrainConfig, "_check_data", counting("checked", check))
    monkeypatch.setattr(datasets, "_digits", counting("loaded", digits))
    monkeypatch.setattr(setup, "_MEMORY", {})  # what earlier tests in this process loaded
    argv = [
        "compare",
        "--norms",
        "bn,gn",
        "--lrs",
        "0.05",
        "--batch-sizes",
        "16",
        "--seeds",
        "0",
        "--epochs",
        "1",
        "--width",
        "0.125",
        "--max-steps-per-epoch",
        "1",
        "--workers",
        "1",
        "--threads",
        "1",
        "--no-progress",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    assert len(json.loads((tmp_path / "results.json").read_text())["cells"]) == 2
    assert counts == {"built": 2, "checked": 2, "loaded": 1}


def test_records_refuse_unknown_keys_in_one_line():
    from normlab.runner.errors import UsageError
    from normlab.runner.training.config import TrainConfig
    from normlab.runner.training.train import TrainState

    for cls, d in (
        (GridSpec, {**GridSpec(norms=("bn",)).to_dict(), "bogus": 1, "extra": 2}),
        (TrainConfig, {**TrainConfig().to_dict(), "bogus": 1, "extra": 2}),
        (TrainState, {**TrainState().to_dict(), "bogus": 1, "extra": 2}),
    ):
        with pytest.raises(UsageError, match=r"unknown key\(s\) 'bogus', 'extra'") as e:
            cls.from_dict(d)
        assert len(str(e.value).splitlines()) == 1
        assert cls.from_dict({k: v for k, v in d.items() if k not in ("bogus", "extra")}) == cls.from_dict(
            {k: v for k, v in d.items() if k not in ("bogus", "extra")}
        )


def test_a_refused_field_names_the_field_in_the_library_and_the_option_on_the_command_line(capsys, tmp_path):
    from normlab.cli import main
    from normlab.runner.errors import FieldError

    with pytest.raises(FieldError, match=r"GridSpec base_lr: expected one of lrs \(0.1\) with layout cross") as e:
        GridSpec(norms=("bn",), lrs=(0.1,), layout="cross", base_lr=0.3)
    assert e.value.field == "base_lr"
    assert (
        main(
            [
                "compare",
                "--norms",
                "bn",
                "--lrs",
                "0.1",
                "--layout",
                "cross",
                "--base-lr",
                "0.3",
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 2
    )
    assert "--base-lr: expected one of --lrs (0.1) with --layout cross, got 0.3" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
