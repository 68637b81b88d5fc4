"""The demo's section (c) from constructed run directories: the regime warning and the countdown alarm of each
collapsed run in words and on the diagnosis plot, the guarded twins beside their unguarded runs (table, counts,
figure) and the guard's clause in the claims table's monitor row; records without the new fields still build."""

import copy
import dataclasses
import json
from pathlib import Path

from normlab.monitor import write_monitor_log  # noqa: E402
from normlab_lab.demo.claims import claims_markdown, claims_record, claims_table  # noqa: E402
from normlab_lab.demo.diagnosis import (  # noqa: E402
    GUARDED_DEAD,
    alarm_audit,
    audited_runs,
    diagnose_run,
)
from normlab_lab.demo.experiment import PROTOCOL  # noqa: E402
from normlab_lab.demo.report import (  # noqa: E402
    _diagnosis_section,
    alarm_sentence,
    render_demo_report,
    risk_sentence,
)
from normlab_lab.demo.twins import (  # noqa: E402
    guard_clause,
    plot_twins,
    twin_pairs,
    twin_summary,
    twins_markdown,
)

from .test_demo_report import _demo  # noqa: E402

RISK = {
    "step": 24,
    "layer": "features.1.conv",
    "shift_term": 8.46,
    "variance_term": 1.71,
    "ratio": 4.95,
    "case": "shift",
    "suggestion": "lower the learning rate to 0.0435 (from 0.1)",
    "suggested_lr": 0.0435,
}
ALARM = {"layer": "features.6.conv", "step": 30, "quantity": "output_var_growth", "value": 13.6, "initial": 3.1}
RESCUE = {  # a rescue of a guard acting on the alarm at once (confirm=None)
    "step": 31,
    "kind": "alarm",
    "reason": "monitor alarm: collapse warning at step 30: layer 'features.6.conv' output_var_growth = 13.65 "
    "(baseline 3.121, output variance growing at 1.01/step > growth 1)",
    "onset": 30,
    "restored_step": 0,
    "steps_lost": 31,
    "lr_before": 0.1,
    "lr_after": 0.05,
}


def _records(steps: int) -> list[dict]:
    return [
        {
            "step": s,
            "layer": layer,
            "index": i,
            "type": "Conv1d",
            "kind": "conv",
            "output_var": 1.0 + s,
            "shift": 0.5 * (1 + s),
            "shift_scale_free": 0.3,
            "weight_var": 0.5,
            "mean_update_std": 1e-2,
            "update_ratio_mean": 1.01,
            "variance_term": 1.0,
            "shift_term": 0.2 * (1 + s),
        }
        for s in range(steps)
        for i, layer in enumerate(("features.1.conv", "features.6.conv"))
    ]


def _run(path: Path, steps: int = 40, monitored: bool = True, **summary) -> Path:
    """A run directory as the trainer leaves it: summary.json, loss_trace.json and (monitored) monitor.jsonl."""
    path.mkdir(parents=True)
    base = {"collapsed": False, "collapse_reason": None, "collapse_step": None, "final_test_acc": 0.5}
    base.update(monitor_alarm=None, monitor_risk=None, steps_run=steps, rescues=[], steps_lost=0, guard_gave_up=None)
    (path / "summary.json").write_text(json.dumps({**base, **summary}))
    losses = [2.3 - 0.01 * s for s in range(steps)]
    (path / "loss_trace.json").write_text(json.dumps({"window": 10, "losses": losses}))
    if monitored:
        write_monitor_log(path / "monitor.jsonl", _records(steps), summary.get("monitor_alarm"))
    return path


def _twin_demo(tmp_path: Path) -> tuple[dict, Path]:
    """A demo record with section (c)'s plain runs (seed 0 collapses back to chance at step 40 with a regime warning
    at 24 and an alarm at 30; seed 1 is healthy) and their guarded twins (seed 0 rescued, ends healthy; seed 1
    untouched), the run directories under ``tmp_path``."""
    dead = {"collapsed": True, "collapse_reason": "returned_to_chance", "collapse_step": 40, "final_test_acc": 0.1}
    _run(tmp_path / "collapse/runs/none_s0", monitor_alarm=ALARM, monitor_risk=RISK, **dead)
    _run(tmp_path / "collapse/runs/none_s1", final_test_acc=0.9)
    _run(tmp_path / "guard/runs/none_s0", steps=69, rescues=[RESCUE], steps_lost=31, final_test_acc=0.8)
    _run(tmp_path / "guard/runs/none_s1", final_test_acc=0.9)
    demo = _demo()
    cells = [{"cell": f"none_s{s}", "name": "none", "lr": 0.1, "batch_size": 128, "seed": s} for s in (0, 1)]
    demo["sections"]["collapse"] = {"spec": {"norms": ["none"]}, "groups": [], "cells": cells}
    demo["sections"]["guard"] = {"spec": {"norms": ["none"]}, "groups": [], "cells": copy.deepcopy(cells)}
    demo["protocol"] = {**dataclasses.asdict(PROTOCOL), "seeds": [0, 1], "guard_seeds": [0, 1]}
    demo["evidence"]["diagnoses"] = {
        k: {c["cell"]: diagnose_run(tmp_path / k / "runs" / c["cell"]) for c in cells} for k in ("collapse", "guard")
    }
    return demo, tmp_path


def test_diagnosis_reads_the_regime_warning_and_the_guards_rescues(tmp_path):
    demo, out = _twin_demo(tmp_path)
    d = demo["evidence"]["diagnoses"]["collapse"]["none_s0"]
    assert d["risk"] == RISK and d["risk_lead_steps"] == 16 and d["lead_steps"] == 10
    g = demo["evidence"]["diagnoses"]["guard"]["none_s0"]
    assert g["rescues"] == [RESCUE] and g["steps_lost"] == 31 and g["steps_run"] == 69
    old = _run(tmp_path / "old", monitored=False)  # a summary of an earlier version: no monitor_risk, no rescues
    summary = json.loads((old / "summary.json").read_text())
    for key in ("monitor_risk", "rescues", "steps_lost", "guard_gave_up"):
        del summary[key]
    (old / "summary.json").write_text(json.dumps(summary))
    d = diagnose_run(old)
    assert d["risk"] is None and d["risk_lead_steps"] is None and d["rescues"] == [] and d["steps_lost"] == 0


def test_section_c_states_the_regime_warning_and_the_countdown_of_a_collapsed_run(tmp_path):
    demo, out = _twin_demo(tmp_path)
    lines, picks = _diagnosis_section(out, demo, demo["evidence"])
    text = "\n".join(lines)
    told = [x for x in lines if x.startswith("- **none seed 0**")]
    assert len(told) == 1 and "none seed 1" not in text.split("What the monitor said")[1].split("Over all")[0]
    said = told[0]
    assert "*Regime warning* at step 24 in `features.1.conv`" in said
    assert "8.46" in said and "1.71" in said and "ratio 4.95" in said and "16 steps before the collapse" in said
    assert '"lower the learning rate to 0.0435 (from 0.1)"' in said and "`suggested_lr` 0.0435" in said
    assert "*Countdown alarm* at step 30 in `features.6.conv` (output_var_growth): 10 steps before the collapse" in said
    assert "| none | 0 | back to chance at step 40 | features.1.conv, 24, 4.95 |" in text
    assert "| none | 1 | did not collapse | none | none |" in text
    assert [p for _, p in picks] == [out / "collapse/runs/none_s0"]


def test_risk_and_alarm_sentences_without_a_warning_a_dead_net_and_the_pws_case():
    assert risk_sentence({"risk": None}) == "*Regime warning*: none."
    assert alarm_sentence({"alarm": None}) == "*Countdown alarm*: none."
    dead = {"alarm": ALARM, "lead_steps": None, "collapse_reason": "never_left_chance"}
    assert "never learned (dead), so there is no moment of collapse" in alarm_sentence(dead)
    late = {"alarm": ALARM, "lead_steps": -2, "collapse_reason": "non_finite_loss", "collapse_step": 28}
    assert "2 steps after the collapse at step 28 (too late)" in alarm_sentence(late)
    pws = {**RISK, "case": "pws", "ratio": 12.0, "suggested_lr": None, "suggestion": "use gamma 1e-2"}
    said = risk_sentence({"risk": pws, "risk_lead_steps": None})
    assert "standardized conv grew to 1.71, 12x its first value" in said and "suggested_lr" not in said


def test_guarded_twins_table_counts_and_figure(tmp_path):
    demo, out = _twin_demo(tmp_path)
    pairs = twin_pairs(demo, demo["evidence"])
    assert [(p["cell"], p["unguarded"]["collapsed"], bool(p["guarded"]["rescues"])) for p in pairs] == [
        ("none_s0", True, True),
        ("none_s1", False, False),
    ]
    assert twin_summary(pairs) == {"pairs": 2, "collapsing": 1, "saved": 1, "healthy": 1, "changed": 0}
    lines = twins_markdown(pairs, "c_guarded_twins.png")
    row = next(x for x in lines if x.startswith("| none seed 0"))
    assert "| back to chance, 10.0 % | did not collapse, 80.0 % |" in row
    assert (
        "step 31 (monitor alarm: collapse warning at step 30: layer 'features.6.conv' output_var_growth = 13.65)" in row
    )
    assert "back to step 0, lr 0.1 -> 0.05, 31 steps lost | 69 |" in row
    assert "| none seed 1 | did not collapse, 90.0 % | did not collapse, 90.0 % | none | 40 |" in lines
    assert any("**1 ended healthy with the guard**" in x and "the guard rescued 0 anyway" in x for x in lines)
    path = plot_twins(pairs, out, out / "c_guarded_twins.png")
    assert path == out / "c_guarded_twins.png" and path.stat().st_size > 10_000
    assert plot_twins(pairs, out / "elsewhere", out / "none.png") is None  # no run directories: no figure


def test_a_rescue_on_a_healthy_twin_and_a_guard_that_gave_up_are_reported(tmp_path):
    demo, out = _twin_demo(tmp_path)
    diag = demo["evidence"]["diagnoses"]["guard"]
    diag["none_s1"] = {**diag["none_s1"], "rescues": [RESCUE]}
    diag["none_s0"] = {**diag["none_s0"], "guard_gave_up": "CollapseGuard: gave up after 3 rescue(s): ..."}
    pairs = twin_pairs(demo, demo["evidence"])
    assert twin_summary(pairs) == {"pairs": 2, "collapsing": 1, "saved": 0, "healthy": 1, "changed": 1}
    text = "\n".join(twins_markdown(pairs, None))
    assert "guard gave up, 80.0 %" in text and "; gave up: CollapseGuard: gave up after 3" in text
    assert "**0 ended healthy with the guard**" in text and "the guard rescued 1 anyway" in text
    assert "![]" not in text
    assert guard_clause(pairs) == (
        "guard (the same runs with --guard): 0 of 1 collapsing runs ended healthy (acc 80.0 % vs 10.0 % unguarded); "
        "1 of 1 healthy run rescued anyway"
    )


def test_a_dismissed_alarm_is_named_beside_the_rescues(tmp_path):
    demo, _ = _twin_demo(tmp_path)
    diag = demo["evidence"]["diagnoses"]["guard"]
    diag["none_s1"] = {**diag["none_s1"], "alarms_dismissed": [{"step": 9, "reason": "...", "dismissed_at": 20}]}
    lines = twins_markdown(twin_pairs(demo, demo["evidence"]), None)
    row = next(x for x in lines if x.startswith("| none seed 1"))
    assert "| none; alarm at step 9 dismissed at step 20 (no trouble followed) | 40 |" in row
    assert any("else it is dismissed" in x for x in lines)


def test_the_monitor_row_carries_the_guards_outcome_from_the_record_and_old_records_build(tmp_path):
    demo, out = _twin_demo(tmp_path)
    row = {r["id"]: r for r in claims_table(claims_record(demo))}["mon"]
    assert row["numbers"].endswith(
        "; guard (the same runs with --guard): 1 of 1 collapsing runs ended healthy (acc 80.0 % vs 10.0 % "
        "unguarded); 0 of 1 healthy run rescued anyway"
    )
    old = _demo()  # a record without guarded twins: the row as before, no clause
    old_row = {r["id"]: r for r in claims_table(old)}["mon"]
    assert "guard" not in old_row["numbers"]
    assert twin_pairs(old, old["evidence"]) == [] and guard_clause([]) is None
    assert claims_markdown(old)  # builds


def test_the_guarded_twins_are_not_counted_by_the_alarm_audit(tmp_path):
    demo, _ = _twin_demo(tmp_path)
    diag = demo["evidence"]["diagnoses"]
    diag["guard"]["none_s1"]["alarm"] = ALARM  # an alarm the guard acted on (rolled back): not an observed one
    audit = alarm_audit(audited_runs(diag))
    assert audit["monitored_runs"] == 2 and audit["false_alarms"] == 0


def test_the_report_renders_section_c_with_both_figures(tmp_path):
    demo, out = _twin_demo(tmp_path)
    for key in ("lr_sweep", "batch_size"):  # the other sections' runs: summaries only
        for c in demo["sections"][key]["cells"]:
            _run(out / key / "runs" / c["cell"], monitored=False, final_test_acc=c["final_test_acc"])
    paths = render_demo_report(demo, out)
    assert out / "c_collapse_diagnosis.png" in paths and out / "c_guarded_twins.png" in paths
    md = (out / "report.md").read_text()
    c = md.split("## (c)")[1].split("## (d)")[0]
    assert "*Regime warning* at step 24" in c and "### Guarded twins" in c and "![](c_guarded_twins.png)" in c
    assert "1 of 1 collapsing runs ended healthy" in md.split("## Protocol")[0]  # the claims table's monitor row
    del demo["sections"]["guard"]  # a demo.json of an earlier version re-rendered (``normlab-lab report``)
    render_demo_report(demo, out)
    assert "No guarded twins in this record" in (out / "report.md").read_text()


DEAD_RESCUE = {  # --guard-dead: the alarm at step 30 confirmed by a net judged never to have learned
    **RESCUE,
    "step": 40,
    "kind": "never_left_chance",
    "reason": "never learned: its 10-step mean 2.3 is at chance (2.303), its best 2.3, after the monitor alarm: "
    "collapse warning at step 30: layer 'features.6.conv' output_var_growth = 13.65 (baseline 3.121, output variance "
    "growing at 1.01/step > growth 1)",
    "steps_lost": 40,
}


def _with_dead_twins(demo: dict, out: Path) -> dict:
    """``demo`` with the --guard-dead twins: seed 0 rolled back at step 40 (never learned since the alarm) and ending at
    60 %, seed 1 (healthy unguarded) rolled back too and ending at 70 %."""
    _run(out / "guard_dead/runs/none_s0", steps=60, rescues=[DEAD_RESCUE], steps_lost=40, final_test_acc=0.6)
    _run(out / "guard_dead/runs/none_s1", steps=60, rescues=[DEAD_RESCUE], steps_lost=40, final_test_acc=0.7)
    cells = copy.deepcopy(demo["sections"]["guard"]["cells"])
    demo["sections"][GUARDED_DEAD] = {"spec": {"norms": ["none"]}, "groups": [], "cells": cells}
    demo["evidence"]["diagnoses"][GUARDED_DEAD] = {
        c["cell"]: diagnose_run(out / GUARDED_DEAD / "runs" / c["cell"]) for c in cells
    }
    return demo


def test_the_guard_dead_twins_are_paired_counted_and_named_in_the_monitor_row(tmp_path):
    demo, out = _twin_demo(tmp_path)
    demo = _with_dead_twins(demo, out)
    pairs = twin_pairs(demo, demo["evidence"], GUARDED_DEAD)
    assert [(p["cell"], p["guarded"]["final_test_acc"]) for p in pairs] == [("none_s0", 0.6), ("none_s1", 0.7)]
    assert twin_summary(pairs) == {"pairs": 2, "collapsing": 1, "saved": 1, "healthy": 1, "changed": 1}
    assert twin_pairs(demo, demo["evidence"])[0]["guarded"]["final_test_acc"] == 0.8  # the --guard twins unchanged
    text = "\n".join(twins_markdown(pairs, None, dead=True))
    assert (
        "step 40 (never learned: its 10-step mean 2.3 is at chance (2.303), its best 2.3, after the monitor alarm: "
        "collapse warning at step 30: layer 'features.6.conv' output_var_growth = 13.65): back to step 0" in text
    )
    assert "With --guard-dead a waiting alarm on a net that has not learned" in text
    assert "--guard-dead" not in "\n".join(twins_markdown(pairs, None))
    row = {r["id"]: r for r in claims_table(claims_record(demo))}["mon"]
    assert row["numbers"].endswith(
        "0 of 1 healthy run rescued anyway; guard-dead (the same runs with --guard-dead): 1 of 1 collapsing runs "
        "ended healthy (acc 60.0 % vs 10.0 % unguarded); 1 of 1 healthy run rescued anyway"
    )
    demo["evidence"]["diagnoses"][GUARDED_DEAD]["none_s1"]["alarm"] = ALARM  # acted on, not observed
    assert alarm_audit(audited_runs(demo["evidence"]["diagnoses"]))["false_alarms"] == 0


def test_the_report_renders_the_guard_dead_twins_after_the_guard_twins(tmp_path):
    demo, out = _twin_demo(tmp_path)
    demo = _with_dead_twins(demo, out)
    for key in ("lr_sweep", "batch_size"):
        for c in demo["sections"][key]["cells"]:
            _run(out / key / "runs" / c["cell"], monitored=False, final_test_acc=c["final_test_acc"])
    paths = render_demo_report(demo, out)
    assert out / "c_guarded_dead_twins.png" in paths and out / "c_guarded_twins.png" in paths
    c = (out / "report.md").read_text().split("## (c)")[1].split("## (d)")[0]
    plain, dead = c.split("### Guarded twins with --guard-dead")
    assert (
        "### Guarded twins: the none runs above again with `guard=True`" in plain
        and "![](c_guarded_twins.png)" in plain
    )
    assert "`normlab train --guard-dead`" in dead and "![](c_guarded_dead_twins.png)" in dead
    del demo["sections"][GUARDED_DEAD]  # an earlier record: no such section, no heading
    render_demo_report(demo, out)
    assert "--guard-dead" not in (out / "report.md").read_text().split("## (c)")[1]


def test_the_claims_tool_refuses_bad_arguments_in_one_line(tmp_path, capsys):
    from normlab_lab.demo.terminal import _main

    assert _main([]) == 2 and _main(["--help"]) == 2
    assert capsys.readouterr().err.count("usage: python -m normlab_lab.demo.terminal") == 2
    assert _main([str(tmp_path), str(tmp_path / "record.json")]) == 2
    err = capsys.readouterr().err
    assert "demo.json not found" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "record.json").exists()


def test_section_c_says_why_when_no_collapsed_run_raised_the_regime_warning(tmp_path):
    demo, out = _twin_demo(tmp_path)
    lines, _ = _diagnosis_section(out, demo, demo["evidence"])
    assert not any(x.startswith("No run here raised the regime warning") for x in lines)  # seed 0 has one
    demo["evidence"]["diagnoses"]["collapse"]["none_s0"]["risk"] = None
    lines, _ = _diagnosis_section(out, demo, demo["evidence"])
    (note,) = [x for x in lines if x.startswith("No run here raised the regime warning")]
    assert "10x its variance term for 2 steps" in note and "lab/docs/monitor_calibration.md, round 5" in note


def test_a_monitor_row_that_is_not_met_says_which_runs_which_rule_and_what_the_label_says(tmp_path):
    demo, out = _twin_demo(tmp_path)
    # (c) seed 1 did not collapse; a seed 2 collapses at step 50 and its alarm comes at 55, after it
    late = {**ALARM, "rule": "countdown", "step": 55}
    _run(out / "collapse/runs/none_s2", monitor_alarm=late, collapsed=True, collapse_reason="non_finite_loss",
         collapse_step=50, final_test_acc=0.1)  # fmt: skip
    demo["sections"]["collapse"]["cells"].append({"cell": "none_s2", "name": "none", "lr": 0.1, "seed": 2})
    demo["evidence"]["diagnoses"]["collapse"]["none_s2"] = diagnose_run(out / "collapse/runs/none_s2")
    # a false alarm in section (a): the factor rule fires in a run the collapse label calls healthy
    cell = next(c for c in demo["sections"]["lr_sweep"]["cells"] if c["name"] == "none" and c["lr"] == 0.1)
    implosion = {"rule": "factor", "layer": "head", "step": 60, "quantity": "input_sq", "value": 1e-4, "initial": 1.0}
    _run(out / "lr_sweep/runs" / cell["cell"], monitor_alarm=implosion, final_test_acc=0.28)
    demo["evidence"]["diagnoses"]["lr_sweep"] = {cell["cell"]: diagnose_run(out / "lr_sweep/runs" / cell["cell"])}
    row = {r["id"]: r for r in claims_table(claims_record(demo))}["mon"]
    assert row["verdict"] == "not reproduced"
    why = row["numbers"].split(". ", 1)[1].split("; guard (")[0]
    assert why == (
        "Not met because of 1 false alarm: alarms in runs the collapse label (normlab.monitor.collapse) calls healthy "
        "(no non-finite or exploded loss, no return to chance; they ended at 28 % test accuracy): 1 by the factor rule "
        f"(input_sq) in (a) none lr 0.1 seed {cell['seed']}. Also only 1 of 3 seeds was warned (2 needed): "
        "(c) none lr 0.1 seed 1 did not collapse (nothing to warn of); (c) none lr 0.1 seed 2 collapsed at step 50 "
        "(a non-finite loss): the countdown rule (output_var_growth) alarmed at step 55, not before"
    )
    # met: a timely alarm on two seeds and no false alarm -> no explanation
    del demo["evidence"]["diagnoses"]["lr_sweep"]
    demo["evidence"]["diagnoses"]["collapse"]["none_s2"]["lead_steps"] = 5
    row = {r["id"]: r for r in claims_table(claims_record(demo))}["mon"]
    assert row["verdict"] == "reproduced" and "Not met" not in row["numbers"]


def test_the_twins_text_says_the_guard_by_the_librarys_own_values(tmp_path):
    """The guard's rules in the report come from the library (the snapshot interval, the margin, the factor, the
    confirmation wait, the taxonomy's own sentence): nothing restated that could drift from what the guard does."""
    from normlab.monitor import CollapseCriteria, RescueOptions, SnapshotOptions
    from normlab.monitor.collapse import WINDOW_EXAMPLES

    demo, _ = _twin_demo(tmp_path)
    text = "\n".join(twins_markdown(twin_pairs(demo, demo["evidence"]), None))
    every, rescue = SnapshotOptions().every, RescueOptions()
    assert f"(one every {every} steps) taken at least {every} steps before the trouble" in text
    assert f"multiplies the learning rate by {rescue.lr_factor:g}" in text
    assert f"follows within {rescue.confirm} steps" in text
    assert f"({CollapseCriteria().describe(examples=WINDOW_EXAMPLES)})" in text


def test_every_failure_kind_of_the_trainer_has_its_words_in_the_demo():
    """A collapsed run's ``collapse_reason`` is the taxonomy's kind (``non_finite_loss`` for ``non_finite``): the
    report's tables and the claims' explanations name each one in words (not the key, the fallback)."""
    from normlab.monitor.collapse import LOSS_KINDS
    from normlab_lab.demo import claims, report, twins

    for kind in LOSS_KINDS:
        reason = "non_finite_loss" if kind == "non_finite" else kind
        run = {"collapsed": True, "collapse_reason": reason, "collapse_step": 7}
        assert reason in twins.ENDED  # the twins' table and the report's (a) table (collapse kinds)
        assert report._outcome(run) != reason  # section (c)'s table
        if kind != "never_left_chance":  # the claims explain runs with a collapse step
            assert reason in claims._ENDED
