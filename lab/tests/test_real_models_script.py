"""lab/scripts/real_models.py, the survey of normlab on real model definitions: the table and JSON have one row per
model and one cell per target + fold + monitor, and a wrong result shows as WRONG / MISS / MUTATED / crash."""

from __future__ import annotations

import copy
import json
import re
import warnings

import pytest
import torch
from torch import nn

from normlab.convert import convert_norm, fold_for_inference
from normlab.monitor import VarianceMonitor

from .labtest import load_script

CELL = re.compile(r"^(ok|noop|WRONG|caught|MUTATED|MISS|refused|crash|timeout|died)\b")


@pytest.fixture(scope="module")
def rm():
    return load_script("lab/scripts/real_models.py")


def _tiny(rm):
    """Conv-BN-ReLU-pool-Linear: a model every normlab function handles, so only the injected fault shows."""

    def build():
        return nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(4, 4),
        )

    return rm.ModelSpec(
        "tiny", "test", build, lambda: torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    )


def _cells(rm, targets=("bn",), **fns):
    [row] = rm.survey([_tiny(rm)], list(targets), isolate=False, progress=False, **fns)
    return row["cells"]


def test_two_real_models_in_subprocesses(rm, tmp_path, capsys):
    md, js = tmp_path / "t.md", tmp_path / "t.json"
    assert (
        rm.main(
            ["--models", "resnet10t,mobilenetv3_small_050", "--targets", "bn,pws", "--out", str(md), "--json", str(js)]
        )
        == 0
    )
    lines = md.read_text().splitlines()
    assert lines[0] == "| model | bn | pws | fold | fold pws | monitor |"
    rows = [line for line in lines[2:] if line.startswith("| `")]
    assert [r.split(" | ")[0] for r in rows] == ["| `resnet10t`", "| `mobilenetv3_small_050`"]
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")][1:]
        assert len(cells) == 5 and all(CELL.match(c) for c in cells), r
    doc = json.loads(js.read_text())
    assert doc["targets"] == ["bn", "pws"] and [r["model"] for r in doc["rows"]] == [
        "resnet10t",
        "mobilenetv3_small_050",
    ]
    for row in doc["rows"]:
        assert set(row["cells"]) == {"model", "bn", "pws", "fold", "fold_pws", "monitor"}
        assert row["cells"]["model"]["status"] == "ok" and row["cells"]["model"]["input"] == [2, 3, 64, 64]
        assert all("status" in c and "warnings" in c for k, c in row["cells"].items() if k != "model")
        assert row["cells"]["monitor"]["ran"] > 10  # the hooks saw the real model's layers
    err = capsys.readouterr().err
    assert "[1/2] resnet10t" in err and "[2/2] mobilenetv3_small_050" in err  # progress, one line per model


def test_broken_converter_shows_wrong(rm):
    def doubles_bn_weight(model, to):
        model = convert_norm(model, to=to)
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.data.mul_(2)
        return model

    cell = _cells(rm, convert=doubles_bn_weight)["bn"]
    assert cell["status"] == "WRONG" and cell["keep_diff"] > 0.1
    assert rm.cell_text("bn", cell).startswith("WRONG ")
    same = _cells(rm, convert=lambda model, to: model)["bn"]  # keeps the outputs, replaces nothing
    assert same["status"] == "noop" and same["keep_diff"] == 0 and rm.cell_text("bn", same) == "noop 0"


def test_refused_and_crash_are_told_apart(rm):
    refused = _cells(rm, targets=["no-such-norm"])["no-such-norm"]  # normlab's own ValueError
    assert refused["status"] == "refused" and refused["message"].startswith("convert_norm:")
    assert rm.cell_text("no-such-norm", refused) == "refused"

    def broken(model, to):
        return {}[to]

    crashed = _cells(rm, convert=broken)["bn"]
    assert crashed["status"] == "crash" and rm.cell_text("bn", crashed) == "crash: KeyError"

    def nan_after_step(model, to):
        model[0].weight.register_hook(lambda g: torch.full_like(g, float("nan")))
        return model

    assert rm.cell_text("pws", _cells(rm, ["pws"], convert=nan_after_step)["pws"]) == "noop; nan loss"


def test_broken_fold_and_monitor_show(rm):
    def off_fold(model, example_input):
        folded = fold_for_inference(model, example_input=example_input)
        folded[-1].bias.data.add_(1.0)
        return folded

    def mutating_fold(model, example_input):
        folded = copy.deepcopy(model)
        model[-1].bias.data.add_(1.0)
        return folded

    def warning_fold(model, example_input):
        warnings.warn("fold_for_inference: left unfolded: 0 -> 1 (test)", UserWarning, stacklevel=2)
        return fold_for_inference(model, example_input=example_input)

    assert _cells(rm, fold=off_fold)["fold"]["status"] == "WRONG"
    warned = _cells(rm, fold=warning_fold)["fold"]
    assert warned["warnings"] == ["UserWarning: fold_for_inference: left unfolded: 0 -> 1 (test)"]
    assert rm.cell_text("fold", warned).endswith(" 1/1 w1")
    assert rm.cell_text("fold", _cells(rm, fold=mutating_fold)["fold"]).startswith("MUTATED")
    cells = _cells(rm)
    assert re.match(r"ok \S+ 1/1$", rm.cell_text("fold", cells["fold"])), cells["fold"]  # conv+BN folded

    class DropsLinear(VarianceMonitor):
        def close(self):
            self.records = [r for r in self.records if r["kind"] != "linear"]
            super().close()

    cell = _cells(rm, monitor_cls=DropsLinear)["monitor"]
    assert rm.cell_text("monitor", cell) == "MISS 1/2" and cell["missing_types"] == {"Linear": 1}
    assert rm.cell_text("monitor", cells["monitor"]) == "ok 2/2"


def test_timeout_and_dead_worker_fill_the_row(rm):
    cells = {"model": {"status": "ok"}, "bn": {"status": "ok", "warnings": []}}
    rm._fill_missing(cells, ["bn", "pws"], None, 5, "")
    assert [cells[c]["status"] for c in ("pws", "fold", "fold_pws", "monitor")] == ["timeout"] * 4
    assert rm.cell_text("pws", cells["pws"]) == "timeout"
    died = {}
    rm._fill_missing(died, ["bn"], -11, 5, "Segmentation fault")
    assert rm.cell_text("monitor", died["monitor"]) == "died" and died["model"]["stderr_tail"]
    table = rm.markdown([{"model": "m", "cells": died}], ["bn"])
    assert "| `m` | died | died | died | died |" in table


def test_custom_models_need_isolate_false(rm):
    with pytest.raises(ValueError, match="isolate=False"):
        rm.survey([_tiny(rm)], ["bn"], progress=False)


def test_a_model_over_its_timeout_is_killed_and_the_next_gets_a_new_worker(rm):
    rows = rm.survey(["resnet10t", "regnetx_002"], ["bn"], timeout=0, progress=False)  # killed before any cell
    assert [r["model"] for r in rows] == ["resnet10t", "regnetx_002"]
    for row in rows:
        assert {c: cell["status"] for c, cell in row["cells"].items()} == dict.fromkeys(
            ["model", "bn", "fold", "fold_pws", "monitor"], "timeout"
        )
    assert "| `resnet10t` | timeout | timeout | timeout | timeout |" in rm.markdown(rows, ["bn"])
