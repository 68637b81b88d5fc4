"""The paper's headline effects (normlab_lab.verdicts), judged from a grid's numbers, and normlab's grid report with
them (``PAPER_EFFECTS``): what the CIFAR-10 reproduction and ``normlab-lab report`` show."""

from __future__ import annotations

from normlab.runner.grid.report import markdown_report
from normlab.runner.grid.spec import GridSpec
from normlab_lab.verdicts import PAPER_COMPARE, PAPER_EFFECTS, headline_effects, render_paper_report


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


def test_effects_appear_when_numbers_show_them():
    e = headline_effects(_results(_base_groups()))
    assert e[0]["appeared"] is True and "0.5" in e[0]["text"]
    assert e[1]["appeared"] is True and "batch size 2" in e[1]["text"]


def test_effects_do_not_appear_when_numbers_do_not_show_them():
    # the unnormalized net trains at the high lr: effect 1 absent
    e = headline_effects(_results(_base_groups(none_hi=0.9, none_collapsed=0)))
    assert e[0]["appeared"] is False and "did not fail" in e[0]["text"]
    # the unnormalized net fails but BN does not train either
    e = headline_effects(_results(_base_groups(bn_hi=0.3)))
    assert e[0]["appeared"] is False
    # the unnormalized net fails at every lr: not a learning-rate effect
    groups = [g for g in _base_groups() if g["name"] != "none" or g["batch_size"] != 64]
    groups += [_group("none", 0.05, 64, 0.1), _group("none", 0.5, 64, 0.1, collapsed=3)]
    e = headline_effects(_results(groups))
    assert e[0]["appeared"] is False and "every learning rate" in e[0]["text"]
    # the unnormalized net learns (slowly, 40 %) at the low lr and fails at the high one: a learning-rate effect
    groups = [g for g in _base_groups() if g["name"] != "none" or g["batch_size"] != 64]
    groups += [_group("none", 0.05, 64, 0.4), _group("none", 0.5, 64, 0.15)]
    e = headline_effects(_results(groups))
    assert e[0]["appeared"] is True and "learns at lr 0.05 and fails at 0.5" in e[0]["text"]
    # ... but fails at the low lr and learns at the high one: not this effect
    groups = [g for g in _base_groups() if g["name"] != "none" or g["batch_size"] != 64]
    groups += [_group("none", 0.05, 64, 0.1), _group("none", 0.5, 64, 0.6)]
    e = headline_effects(_results(groups))
    assert e[0]["appeared"] is False and "lowest learning rates" in e[0]["text"]
    # BN holds at batch size 2: effect 2 absent
    e = headline_effects(_results(_base_groups(bn_small=0.95)))
    assert e[1]["appeared"] is False and "BN did not degrade" in e[1]["text"]
    # BN degrades but so does GN: only partly
    e = headline_effects(_results(_base_groups(gn_small=0.5)))
    assert e[1]["appeared"] is False and "GN" in e[1]["text"].split("also degraded:")[1]


def test_effects_not_testable_without_the_norms():
    groups = [g for g in _base_groups() if g["name"] in ("bn", "gn")]
    e = headline_effects(_results(groups, norms=("bn", "gn")))
    assert e[0]["appeared"] is None and e[1]["appeared"] is None


def test_identical_norms_reported():
    def cell(name, accs, seed=0):
        return {"name": name, "lr": 0.05, "batch_size": 64, "seed": seed, "history": [{"test_acc": a} for a in accs]}

    res = _results(_base_groups())
    res["cells"] = [
        cell("bn", [0.5, 0.9]),
        cell("brn", [0.5, 0.9]),
        cell("gn", [0.5, 0.8]),
        cell("none", [0.1, 0.1]),
        cell("pws", [0.1, 0.1]),
    ]
    text = [e["text"] for e in headline_effects(res) if e["effect"].startswith("Norms with identical")]
    assert len(text) == 1 and text[0].startswith("bn = brn (")  # none/pws both stuck at chance: not listed
    res["cells"][1] = cell("brn", [0.5, 0.91])
    assert not [e for e in headline_effects(res) if e["effect"].startswith("Norms with identical")]


def _with_cells(res):
    """``res`` with one cell per seed of each group (its final accuracy the group's mean): the runs the plots draw."""
    res["cells"] = [
        {"name": g["name"], "lr": g["lr"], "batch_size": g["batch_size"], "seed": s, "cell": f"{g['name']}{s}",
         "final_test_acc": g["final_mean"], "collapsed": s < g["collapsed_count"], "history": []}
        for g in res["groups"] for s in range(g["n_seeds"])
    ]  # fmt: skip
    return res


def test_the_paper_report_judges_the_headline_effects(tmp_path):
    res = _with_cells(_results(_base_groups()))
    paths = render_paper_report(res, tmp_path)
    assert {"results.md", "metric_vs_lr.png", "metric_vs_batch_size.png"} <= {p.name for p in paths}
    md = (tmp_path / "results.md").read_text()
    assert md.count("**yes**") >= 2 and "## Headline effects (computed from the table below)" in md
    assert "A setting *failed* if most seeds collapsed" in md  # the criteria are printed under the verdicts
    assert md == markdown_report(res, [p.name for p in paths[1:]], PAPER_EFFECTS)
    assert PAPER_COMPARE.render is render_paper_report and PAPER_COMPARE.train.__module__.startswith("normlab.")


def test_the_criteria_quote_the_failure_taxonomy_the_runs_were_labelled_by():
    """A run's *collapsed* is normlab.monitor.collapse's: the criteria quote its own sentence (the trainer's window
    over examples), so they cannot drift from the label they explain."""
    from normlab.monitor.collapse import WINDOW_EXAMPLES, CollapseCriteria
    from normlab_lab.verdicts import CRITERIA

    assert CollapseCriteria().describe(examples=WINDOW_EXAMPLES) in CRITERIA
    assert CRITERIA in PAPER_EFFECTS.criteria
