"""normlab_lab.demo: the first table of the demo's report says, claim by claim and in the paper's
order, reproduced / not reproduced / not testable here with the numbers; its words and signs read as they should."""

import json
from pathlib import Path

import pytest

from normlab.runner.grid.report import markdown_table, summary_lines
from normlab_lab.demo.claims import claims_markdown, claims_table, plateau_check, timing_verdict
from normlab_lab.demo.diagnosis import _series
from normlab_lab.demo.report import _cost_section
from normlab_lab.verdicts import PAPER_EFFECTS

LR_NORMS = ("none", "bn", "brn", "gn", "sn", "wn", "ws+gn", "pws", "pws:gamma=0.01")


def _group(name, lr, bs, acc, collapsed=0, train_mode=None):
    return {
        "name": name,
        "lr": lr,
        "batch_size": bs,
        "n_seeds": 3,
        "final_mean": acc,
        "final_std": 0.01,
        "collapsed_count": collapsed,
        "collapse_kinds": {"never_left_chance": collapsed} if collapsed else {},
        "train_mode_mean": train_mode,
        "step_time_s": 0.01,
    }


def _cells(groups, base_bs=128):
    return [
        {
            "cell": f"{g['name']}_lr{g['lr']}_bs{g['batch_size']}_s{s}",
            "name": g["name"],
            "lr": g["lr"],
            "batch_size": g["batch_size"],
            "seed": s,
            "train_lr": g["lr"] * g["batch_size"] / base_bs,
            "steps_run": 2000 // g["batch_size"],
            "final_test_acc": g["final_mean"],
            "collapsed": False,
            "final_test_acc_train_mode": g["train_mode_mean"],
            "step_time_s": 0.01,
        }
        for g in groups
        for s in (0, 1, 2)
    ]


def _demo(lr_acc=None, batch_acc=None, plateau=True, cost_ms=None):
    """A demo record: in (a) the plain net collapses at lr 0.2 where BN trains and PWS collapses too."""
    lr_acc = lr_acc or {}
    acc = {n: {0.02: 0.9, 0.1: 0.9, 0.2: 0.9} for n in LR_NORMS}
    acc.update(
        {
            "none": {0.02: 0.5, 0.1: 0.3, 0.2: 0.1},
            "pws": {0.02: 0.9, 0.1: 0.3, 0.2: 0.1},
            "wn": {0.02: 0.6, 0.1: 0.3, 0.2: 0.15},
            "pws:gamma=0.01": {0.02: 0.5, 0.1: 0.5, 0.2: 0.11},
        }
    )
    acc.update(lr_acc)
    a_groups = [_group(n, lr, 128, v, collapsed=2 if v <= 0.2 else 0) for n, d in acc.items() for lr, v in d.items()]
    bacc = {"bn": (0.26, 0.5), "brn": (0.46, 0.48), "gn": (0.16, 0.43), "sn": (0.22, 0.48), "pws": (0.23, 0.58)}
    bacc.update(batch_acc or {})
    b_groups = [
        _group(n, 0.05, bs, v, train_mode=v - (0.16 if n == "bn" and bs == 2 else 0.0))
        for n, (v128, v2) in bacc.items()
        for bs, v in ((128, v128), (2, v2))
    ]
    a = {
        "spec": {"norms": list(acc), "lrs": [0.02, 0.1, 0.2], "base_batch_size": 128, "base_lr": 0.02},
        "num_classes": 10,
        "groups": a_groups,
        "cells": _cells(a_groups),
    }
    b = {
        "spec": {
            "norms": list(bacc),
            "batch_sizes": [128, 2],
            "base_batch_size": 128,
            "base_lr": 0.05,
            "lr_scaling": "linear",
            "lrs": [0.05],
        },
        "num_classes": 10,
        "groups": b_groups,
        "cells": _cells(b_groups),
    }
    plateaus = {
        c["cell"]: {
            "steps": c["steps_run"],
            "fall": 0.01 if plateau or c["batch_size"] < 128 else 0.4,
            "plateau": plateau or c["batch_size"] < 128,
        }
        for c in b["cells"]
    }
    collapse = {
        "spec": {"norms": ["none"]},
        "groups": [],
        "cells": [{"cell": f"none_s{s}", "name": "none", "lr": 0.1, "batch_size": 128, "seed": s} for s in (0, 1, 2)],
    }
    diag = {
        f"none_s{s}": {
            "monitored": True,
            "collapsed": s < 2,
            "collapse_reason": "never_left_chance" if s < 2 else None,
            "collapse_step": None,
            "alarm": {"layer": "head", "step": 70} if s < 2 else None,
            "lead_steps": None,
        }
        for s in (0, 1, 2)
    }
    cost_ms = cost_ms or {"bn": 17.3, "gn": 15.6, "sn": 22.8, "pws": 16.4}
    cost = {
        "width": 0.25,
        "repeats": 3,
        "iters": 6,
        "by_batch": {
            "128": {
                n: {"median_s": v / 1000, "min_s": v / 1000 * 0.99, "ratio_to_pws": v / cost_ms["pws"]}
                for n, v in cost_ms.items()
            }
        },
    }
    return {
        "protocol": {"collapse_lr": 0.1, "seeds": [0, 1, 2]},
        "quick": False,
        "cost": cost,
        "sections": {"lr_sweep": a, "batch_size": b, "collapse": collapse},
        "evidence": {"plateau": plateaus, "diagnoses": {"collapse": diag}},
    }


def _verdicts(demo):
    return {r["id"]: r for r in claims_table(demo)}


def test_first_table_lists_the_claims_in_the_papers_order_then_brn_and_the_monitor():
    assert [r["id"] for r in claims_table(_demo())] == ["1", "2", "3", "3a", "4", "5", "BRN", "mon"]
    lines = claims_markdown(_demo())
    assert lines[0] == "| # | claim (as its source states it) | verdict | the numbers |"
    assert all(line.count("|") >= 5 for line in lines[2:])


def test_headline_claim_2_says_plainly_that_pws_collapses_where_the_plain_net_does():
    v = _verdicts(_demo())
    assert v["1"]["verdict"] == "reproduced" and "lr 0.2" in v["1"]["numbers"]
    assert v["2"]["verdict"] == "not reproduced"
    assert "PWS collapses too" in v["2"]["numbers"] and "PWS (gamma 1e-3) 10.0" in v["2"]["numbers"]
    # PWS with gamma 1e-2 training there reproduces it
    v = _verdicts(_demo(lr_acc={"pws:gamma=0.01": {0.02: 0.9, 0.1: 0.9, 0.2: 0.9}}))
    assert v["2"]["verdict"] == "reproduced"
    # without claim 1 there is nothing to test claim 2 at
    v = _verdicts(_demo(lr_acc={"none": {0.02: 0.9, 0.1: 0.9, 0.2: 0.9}}))
    assert v["1"]["verdict"] == "not reproduced" and v["2"]["verdict"] == "not testable here"


def test_claim_5_is_the_papers_own_limit_judged_at_its_learning_rate():
    v = _verdicts(_demo())
    assert v["5"]["claim"].startswith("The paper's limit of its own method")
    assert v["5"]["verdict"] == "reproduced" and "lr 0.1:" in v["5"]["numbers"]
    v = _verdicts(_demo(lr_acc={"wn": {0.02: 0.9, 0.1: 0.9, 0.2: 0.9}}))
    assert v["5"]["verdict"] == "not reproduced"


def test_claim_3_is_not_testable_when_the_batch_128_runs_had_not_reached_their_plateau():
    v = _verdicts(_demo(plateau=False))
    assert v["3"]["verdict"] == "not testable here"
    assert "BN at batch 128 (15 steps, loss still falling 40 %)" in v["3"]["numbers"]
    assert "not testable: batch 128 not at its plateau" in v["BRN"]["numbers"]
    # every run at its plateau: BN 30 points down, PWS holds -> reproduced; PWS down too -> not reproduced
    v = _verdicts(_demo(batch_acc={"bn": (0.8, 0.5), "pws": (0.6, 0.6)}))
    assert v["3"]["verdict"] == "reproduced" and "BN 80.0 ± 1.0% -> 50.0 ± 1.0%" in v["3"]["numbers"]
    assert _verdicts(_demo(batch_acc={"bn": (0.8, 0.5), "pws": (0.8, 0.6)}))["3"]["verdict"] == "not reproduced"


def test_mechanism_and_brn_signs_read_as_differences():
    v = _verdicts(_demo())
    assert v["3a"]["verdict"] == "reproduced" and "batch 2 +16.0 points" in v["3a"]["numbers"]
    assert v["BRN"]["verdict"] == "not reproduced" and "BRN - BN: batch 2 -2.0 points" in v["BRN"]["numbers"]


def test_plateau_check_on_the_loss_trace(tmp_path):
    (tmp_path / "loss_trace.json").write_text(json.dumps({"window": 10, "losses": [2.3 - 0.1 * i for i in range(15)]}))
    falling = plateau_check(tmp_path)
    assert not falling["plateau"] and falling["fall"] > 0.05 and falling["steps"] == 15
    (tmp_path / "loss_trace.json").write_text(
        json.dumps({"window": 10, "losses": [0.5 + 0.01 * (i % 2) for i in range(100)]})
    )
    assert plateau_check(tmp_path)["plateau"]
    (tmp_path / "loss_trace.json").write_text(json.dumps({"window": 10, "losses": [0.5] * 90 + [None] * 10}))
    assert not plateau_check(tmp_path)["plateau"]  # a loss that became non-finite is no plateau


def test_equal_step_times_are_a_tie_not_a_win():
    t = {n: {"median_s": v, "min_s": v * 0.98} for n, v in {"pws": 0.0164, "gn": 0.0164, "bn": 0.0173}.items()}
    assert timing_verdict(t, "gn")[0] == "tie" and timing_verdict(t, "bn")[0] == "cheaper"
    t["sn"] = {"median_s": 0.010, "min_s": 0.010}
    assert timing_verdict(t, "sn")[0] == "dearer"
    v = _verdicts(_demo(cost_ms={"bn": 17.3, "gn": 16.4, "pws": 16.4}))
    assert v["4"]["verdict"] == "not reproduced" and "GN 16.40 ms: a tie" in v["4"]["numbers"]
    assert _verdicts(_demo(cost_ms={"bn": 17.3, "gn": 18.0, "pws": 16.4}))["4"]["verdict"] == "reproduced"
    text = "\n".join(_cost_section(_demo(cost_ms={"bn": 2.8, "gn": 16.4, "sn": 8.5, "pws": 16.4})["cost"]))
    assert "| gn | 16.40 | 0.16 | 1.00x | a tie |" in text and "| bn | 2.80 | 0.03 | 0.17x | dearer |" in text


def test_grid_cost_effect_reports_a_tie_within_the_spread_over_seeds():
    demo = _demo()
    a = demo["sections"]["lr_sweep"]
    for c in a["cells"]:  # GN 1.01x PWS within its spread over seeds; BN 1.25x
        c["step_time_s"] = {"gn": 0.0100 + 0.0005 * c["seed"], "pws": 0.0100 + 0.0004 * c["seed"], "bn": 0.013}.get(
            c["name"], 0.02
        )
    line = next(x for x in summary_lines(a, PAPER_EFFECTS) if "PWS step is cheaper" in x)
    assert line.startswith("[TIE]") and "GN 1.01x (a tie)" in line and "BN 1.25x (PWS cheaper)" in line


def test_grid_table_shows_the_learning_rate_each_run_used():
    b = _demo()["sections"]["batch_size"]
    b["spec"].update(
        dataset="mnist1d", model="plain1d", width=0.25, epochs=1, seeds=[0, 1, 2], layout="cross", target_acc=None
    )
    for g in b["groups"]:
        g.update(best_mean=g["final_mean"], best_std=0.0, target_reached=0, epochs_to_target_mean=None)
    table = markdown_table(b)
    assert "| bn | 0.00078125 (base 0.05) | 2 |" in table and "| bn | 0.05 | 128 |" in table


def test_rounding_noise_of_zero_mean_filters_is_not_drawn_as_signal():
    recs = [
        {
            "layer": "c",
            "step": s,
            "kind": "conv",
            "shift": 2.7e-14,
            "shift_scale_free": 1.4e-14,
            "mean_update_std": 8e-8,
            "weight_var": 0.66,
        }
        for s in range(3)
    ]
    recs += [
        {
            "layer": "d",
            "step": s,
            "kind": "conv",
            "shift": 2.0,
            "shift_scale_free": 0.9,
            "mean_update_std": 1e-2,
            "weight_var": 0.66,
        }
        for s in range(3)
    ]
    for key in ("shift", "mean_update_std"):
        layers, hidden = _series(recs, key, None)
        assert set(layers) == {"d"} and hidden == 3


@pytest.mark.parametrize(
    "demo",
    [
        _demo(),
        _demo(lr_acc={"none": {0.02: 0.9, 0.1: 0.9, 0.2: 0.9}}),
        _demo(lr_acc={"pws:gamma=0.01": {0.02: 0.9, 0.1: 0.9, 0.2: 0.9}}),
        {**_demo(), "quick": True},
        json.loads((Path(__file__).parents[1] / "docs" / "demo_record.json").read_text()),
    ],
    ids=["record-like", "no-claim-1", "claim-2", "quick", "docs-record"],
)
def test_the_terminal_table_fits_100_columns_with_every_claim(demo):
    """What `normlab-lab demo` prints: every claim of the report's table with its verdict and key number, no line over
    100 characters (report.md keeps the full text)."""
    from normlab_lab.demo.terminal import WIDTH, claims_terminal

    lines = claims_terminal(demo)
    assert WIDTH == 100 and all(len(line) <= WIDTH for line in lines), max(lines, key=len)
    rows = claims_table(demo)
    starts = [line for line in lines[1:] if line[:1].strip()]  # each claim's first line starts at column 0
    assert [line.split()[0] for line in starts if not line.startswith("Quick")] == [r["id"] for r in rows]
    for line, r in zip(starts, rows):
        assert r["verdict"] in line
    text = " ".join(" ".join(line.split()) for line in lines)
    for r in rows:
        assert " ".join(r["key"].split()[:3]) in text  # the key number is shown, wrapped but whole
        assert len(r["key"]) < len(r["numbers"]) or r["key"] == r["numbers"]
    assert ("Quick mode" in lines[-1]) == bool(demo.get("quick"))
