"""The demo's report: first the table of claims and verdicts (:mod:`.claims`), then the four sections' numbers.

``render_demo_report(demo, out)`` writes ``report.md`` and its plots into ``out`` from the dict
:func:`~normlab_lab.demo.experiment.run_demo` returns (also saved as ``demo.json``, so
``normlab-lab report`` can re-render it) and the runs' files under ``out/<section>/runs``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from normlab.monitor.rules import RegimeRule
from normlab.runner.grid.results import format_acc
from normlab.runner.io import atomic_write_text
from normlab_lab.demo.claims import (
    PLATEAU_FALL,
    PLATEAU_FLOOR,
    PLATEAU_Z,
    SECTION_LETTERS,
    claims_markdown,
    collect_evidence,
    criteria_markdown,
    timing_verdict,
)
from normlab_lab.demo.diagnosis import GUARDED, GUARDED_DEAD, alarm_audit, audited_runs, plot_diagnosis
from normlab_lab.demo.plots import batch_plot, loss_curves_plot, lr_plot
from normlab_lab.demo.twins import ENDED, FIGURES, plot_twins, twin_pairs, twins_markdown
from normlab_lab.verdicts import CRITERIA

__all__ = ["render_demo_report", "first_table", "risk_sentence", "alarm_sentence"]


PROTOCOL_NAMES = {  # the report names the protocol its runs used (by the run's mode)
    "demo": "normlab_lab.demo.experiment.PROTOCOL",
    "quick": "normlab_lab.demo.experiment.QUICK_PROTOCOL",
    "full": "normlab_lab.reproduce.mnist1d.FULL_PROTOCOL",
    "smoke": "normlab_lab.reproduce.mnist1d.SMOKE_PROTOCOL",
}


def _groups(results: dict) -> dict[tuple[str, float, int], dict]:
    return {(g["name"], float(g["lr"]), int(g["batch_size"])): g for g in results["groups"]}


def _pts(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f} points"


# ------------------------------------------------------------------------------------------- (a) learning rate
def _acc_kinds(grp: dict | None) -> str:
    """Accuracy with the kinds of collapse: ``35.5 ± 44.0 % (collapsed 2/3: 1 non-finite, 1 dead)``."""
    text = format_acc(grp)
    kinds = (grp or {}).get("collapse_kinds") or {}
    if kinds:
        text = text[:-1] + ": " + ", ".join(f"{n} {ENDED.get(k, k)}" for k, n in sorted(kinds.items())) + ")"
    return text


def _lr_table(results: dict) -> list[str]:
    spec, g = results["spec"], _groups(results)
    lrs, bs = sorted(spec["lrs"]), int(spec["base_batch_size"])
    rows = ["| norm | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |", "|---|" + "---|" * len(lrs)]
    for name in spec["norms"]:
        rows.append(f"| {name} | " + " | ".join(_acc_kinds(g.get((name, lr, bs))) for lr in lrs) + " |")
    return rows


# ------------------------------------------------------------------------------------------------ (b) batch size
def _used(results: dict, bs: int) -> tuple[float | None, int | None]:
    """The learning rate actually used at batch ``bs`` (scaled from the base) and the steps its runs took."""
    cells = [c for c in results["cells"] if int(c["batch_size"]) == bs]
    if not cells:
        return None, None
    return float(cells[0].get("train_lr") or cells[0]["lr"]), cells[0].get("steps_run")


def _batch_table(results: dict) -> list[str]:
    spec, g = results["spec"], _groups(results)
    bss = sorted(spec["batch_sizes"], reverse=True)
    head = []
    for b in bss:
        lr, steps = _used(results, b)
        head.append(f"batch {b} (lr {lr:g}, {steps} steps): eval / train mode" if lr else f"batch {b}")
    rows = [f"| norm | {' | '.join(head)} |", "|---|" + "---|" * len(bss)]
    for name in spec["norms"]:
        cells = []
        for b in bss:
            grp = g.get((name, spec["base_lr"], b))
            tm = grp and grp["train_mode_mean"]
            cells.append(f"{format_acc(grp)} / {'n/a' if tm is None else f'{100 * tm:.1f} %'}")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def _fall_text(x: dict) -> str:
    """One run's plateau check in a few characters: the relative fall, with the fall in nats and its noise (two
    standard errors) where the check records them."""
    rel = f"{round(100 * x['fall']) + 0:d} %"
    if x.get("noise_nats") is None:
        return rel
    return f"{rel} ({x['fall_nats']:.3f} vs {PLATEAU_Z:g}x{x['noise_nats']:.3f} nats)"


def _plateau_table(results: dict, evidence: dict) -> list[str]:
    """Per norm and batch size: how much the training loss still fell over the last fifth of the run's steps."""
    spec, plateau = results["spec"], evidence.get("plateau") or {}
    bss = sorted(spec["batch_sizes"], reverse=True)
    rows = ["| norm | " + " | ".join(f"batch {b}" for b in bss) + " |", "|---|" + "---|" * len(bss)]
    for name in spec["norms"]:
        cells = []
        for b in bss:
            checks = [
                plateau.get(c["cell"]) for c in results["cells"] if c["name"] == name and int(c["batch_size"]) == b
            ]
            falls = [_fall_text(x) for x in checks if x and x["fall"] is not None]
            at = sum(1 for x in checks if x and x["plateau"])
            cells.append(f"{', '.join(falls) or 'n/a'} ({at}/{len(checks)} at plateau)")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


# ---------------------------------------------------------------------------------------- (c) collapse diagnosis
def _terms_text(d: dict) -> str:
    a, b = d.get("terms_initial") or {}, d.get("terms_at_alarm") or {}
    if a.get("variance_term") is None or b.get("variance_term") is None:
        return "n/a"
    return (
        f"variance {a['variance_term']:.3g} -> {b['variance_term']:.3g}, shift {a['shift_term']:.3g} -> "
        f"{b['shift_term']:.3g}"
    )


def _outcome(d: dict) -> str:
    """How a run ended, in words."""
    if not d["collapsed"]:
        return "did not collapse"
    return {
        "non_finite_loss": f"non-finite loss at step {d['collapse_step']}",
        "exploded": f"exploded from step {d['collapse_step']}",
        "returned_to_chance": f"back to chance at step {d['collapse_step']}",
        "never_left_chance": "dead (never learned)",
    }.get(d["collapse_reason"], str(d["collapse_reason"]))


def _risk_cell(d: dict) -> str:
    r = d.get("risk")
    return "none" if not r else f"{r['layer']}, {r['step']}, {r['ratio']:.3g}"


def risk_sentence(d: dict) -> str:
    """The regime warning of a run in one or two sentences (the regime rule's warning: step, layer, the two terms,
    their ratio, the suggestion and ``suggested_lr``)."""
    r = d.get("risk")
    if not r:
        return "*Regime warning*: none."
    if r["case"] == "pws":
        what = (
            f"the variance term n E[W^2] Var[X] of this standardized conv grew to {r['variance_term']:.3g}, "
            f"{r['ratio']:.3g}x its first value"
        )
    else:
        what = (
            f"its shift term E^2[X] Var_o[n E[W_o]] = {r['shift_term']:.3g} exceeded its variance term "
            f"n E[W^2] Var[X] = {r['variance_term']:.3g} (ratio {r['ratio']:.3g})"
        )
    lead = d.get("risk_lead_steps")
    when = "" if lead is None else f", {lead} steps before the collapse" if lead >= 0 else f", {-lead} steps after it"
    lr = r.get("suggested_lr")
    return (
        f"*Regime warning* at step {r['step']} in `{r['layer']}`: {what}, sustained over the monitor's window{when}. "
        f'Its suggestion: "{r["suggestion"]}"' + ("." if lr is None else f" (`suggested_lr` {lr:.3g}).")
    )


def alarm_sentence(d: dict) -> str:
    """The countdown alarm of a run in one sentence: step, layer, quantity, the lead before the collapse."""
    a = d.get("alarm")
    if not a:
        return "*Countdown alarm*: none."
    lead = d.get("lead_steps")
    if d.get("collapse_reason") == "never_left_chance":
        when = "the network never learned (dead), so there is no moment of collapse for it to precede"
    elif lead is None:
        when = "the run did not collapse"
    elif lead >= 0:
        when = f"{lead} step{'' if lead == 1 else 's'} before the collapse at step {d['collapse_step']}"
    else:
        when = f"{-lead} step{'' if lead == -1 else 's'} after the collapse at step {d['collapse_step']} (too late)"
    return f"*Countdown alarm* at step {a['step']} in `{a['layer']}` ({a.get('quantity')}): {when}."


def _no_regime_note(cells: list[dict], diag: dict) -> list[str]:
    """When no run of section (c) raised the regime warning, a line on why (the measured reason), else nothing."""
    runs = [diag.get("collapse", {}).get(c["cell"]) for c in cells]
    if any(d and d.get("risk") for d in runs) or not any(d and d["collapsed"] for d in runs):
        return []
    return [
        "",
        "No run here raised the regime warning. Its rule (a layer whose output is not normalized downstream, with "
        f"its shift term above {RegimeRule().min_ratio:g}x its variance term for {RegimeRule().window} steps) "
        "was chosen at width 1.0; at width 0.5 it rarely fires (1 of 11 collapsing plain runs on held-out seeds, "
        "lab/docs/monitor_calibration.md, round 5).",
    ]


def _diagnosis_section(out: Path, demo: dict, evidence: dict) -> tuple[list[str], list[tuple[str, Path]]]:
    lr = float(demo["protocol"]["collapse_lr"])
    diag = evidence.get("diagnoses") or {}
    cells = [c for c in demo["sections"]["collapse"]["cells"] if float(c["lr"]) == lr]
    lines = [
        "| norm | seed | outcome | regime warning (layer, step, shift / variance) | alarm (layer, step, quantity) "
        "| lead (steps) | terms of Var[Y] at the alarmed layer, step 0 -> alarm |",
        "|---|---|---|---|---|---|---|",
    ]
    told = []
    for c in cells:
        d = diag.get("collapse", {}).get(c["cell"])
        if not d:
            continue
        a = d["alarm"]
        alarm = "none" if not a else f"{a['layer']}, {a['step']}, {a['quantity']}"
        lead = "-" if d["lead_steps"] is None else d["lead_steps"]
        lines.append(
            f"| {c['name']} | {c['seed']} | {_outcome(d)} | {_risk_cell(d)} | {alarm} | {lead} | {_terms_text(d)} |"
        )
        if d["collapsed"]:
            told.append(f"- **{c['name']} seed {c['seed']}** ({_outcome(d)}): {risk_sentence(d)} {alarm_sentence(d)}")
    audit = alarm_audit(audited_runs(diag))
    lines += [
        "",
        "What the monitor said of each run that collapsed:",
        "",
        *(told or ["- no run of this section collapsed."]),
        *_no_regime_note(cells, diag),
        "",
        f"Over all {audit['monitored_runs']} monitored runs of the demo (the guarded twins below not counted): "
        f"{audit['collapsed_runs']} collapsed "
        f"({audit['datable_collapses']} with a collapse step, {audit['warned_in_time']} warned before it, leads "
        f"{audit['leads']} steps; {audit['dead_runs_alarmed']} of the dead ones alarmed), "
        f"{audit['healthy_runs']} did not collapse, **{audit['false_alarms']} false "
        f"alarm{'' if audit['false_alarms'] == 1 else 's'}** (an alarm in a run that did not collapse).",
    ]
    return lines, diagnosis_picks(out, cells, diag.get("collapse", {}))


def diagnosis_picks(out: Path, cells: list[dict], diagnoses: dict[str, dict]) -> list[tuple[str, Path]]:
    """The runs the collapse figure shows: for each norm its first seed that collapsed, then one run that did not
    (the first norm without a collapse, its first seed) as the healthy reference; (label, run dir) each."""
    picks, reference = [], None
    for name in dict.fromkeys(c["name"] for c in cells):
        runs = [(c, diagnoses.get(c["cell"])) for c in sorted(cells, key=lambda c: c["seed"]) if c["name"] == name]
        collapsed = [(c, d) for c, d in runs if d and d["collapsed"]]
        if collapsed:
            c, d = collapsed[0]
            picks.append((f"{name} seed {c['seed']}: {_outcome(d)}", out / "collapse" / "runs" / c["cell"]))
        elif reference is None and runs and runs[0][1]:
            c = runs[0][0]
            reference = (f"{name} seed {c['seed']}: did not collapse", out / "collapse" / "runs" / c["cell"])
    return picks + ([reference] if reference else [])


# ------------------------------------------------------------------------------------------------------ (d) cost
def _cost_section(cost: dict) -> list[str]:
    lines = [
        f"Width {cost['width']:g}, 1 thread, median of {cost['repeats']} interleaved repeats of {cost['iters']} "
        f"steps (forward, backward, SGD step), every norm timed in the same run. Spread: median - fastest "
        f"repeat. PWS is *cheaper* or *dearer* than a norm when the medians differ by more than the larger of "
        f"the two spreads (and at least 3 % of PWS's step); otherwise it is a *tie*.",
        "",
    ]
    for bs, t in cost["by_batch"].items():
        lines += [
            f"Batch {bs}:",
            "",
            "| norm | ms / step | spread (ms) | relative to PWS | PWS's step is |",
            "|---|---|---|---|---|",
        ]
        for n, v in t.items():
            said = timing_verdict(t, n)[0] if "pws" in t and n != "pws" else "-"
            said = {"cheaper": "cheaper", "dearer": "dearer", "tie": "a tie"}.get(said, said)
            spread = v["median_s"] - v.get("min_s", v["median_s"])
            lines.append(
                f"| {n} | {1000 * v['median_s']:.2f} | {1000 * spread:.2f} "
                f"| {v.get('ratio_to_pws', float('nan')):.2f}x | {said} |"
            )
        lines.append("")
    return lines


# ------------------------------------------------------------------------------------------------------ assembly
def first_table(demo: dict[str, Any]) -> list[str]:
    """The report's first table (claims, verdicts, numbers); also what ``normlab-lab demo`` prints last."""
    return claims_markdown(demo)


FULL_RUN_NOTE = (
    "Only the full run (`normlab-lab reproduce`, lab/docs/reproduction.md) trains every run to its plateau: a verdict "
    "*not testable here* (claim 3, and Batch Renorm's 'close to large-batch BN', whenever a run of (b) is short of "
    "its plateau) is one only it can give, and its runs of (a) and (c) finish training where the demo's stop after "
    "the first steps."
)


def _budget(p: dict, section: str) -> str:
    """A section's training budget in words: steps (the demo) or epochs with the lr schedule (the full run)."""
    epochs = p.get(f"{section}_epochs", 1)
    if epochs <= 1:
        return f"{p[f'{section}_steps']} steps"
    decay = f", lr x{p['lr_decay']:g} after {' and '.join(f'{100 * f:g} %' for f in p['milestones'])} of them"
    return f"{epochs} epochs{decay if p.get('milestones') else ''}"


def _md_header(demo: dict) -> list[str]:
    p = demo["protocol"]
    full = demo.get("mode") in ("full", "smoke")
    return [
        "# normlab-lab reproduce: the paper's claims on MNIST-1D, every run to its plateau"
        if full
        else "# normlab-lab demo: which of the paper's claims reproduce on MNIST-1D",
        "",
        *first_table(demo),
        "",
        *([] if full else [FULL_RUN_NOTE, ""]),
        "What *reproduced* means, per claim (fixed before the demo's seeds ran):",
        "",
        *criteria_markdown(),
        f"- Terms: {CRITERIA}",
        "",
        "## Protocol",
        "",
        ("**Quick mode**: a pipeline check, too small for any verdict.\n" if demo.get("quick") else "")
        + f"MNIST-1D generated locally ({p['num_samples']} samples, 80 % train), the paper's plain net in 1-D "
        f"(width {p['lr_width']:g} in (a), (b), (d); {p['collapse_width']:g} in (c)), SGD momentum 0.9, weight "
        f"decay 5e-4 (not on norm parameters, biases and PWS alpha), seeds {', '.join(map(str, p['seeds']))}. "
        f"Accuracies: test set, mean ± sample std over seeds. The protocol: `{PROTOCOL_NAMES[_mode(demo)]}`.",
        "",
        *(plateau_summary((demo.get("evidence") or {}).get("plateau_all") or {}, _cells(demo)) if full else []),
    ]


def _mode(demo: dict) -> str:
    """The run's mode (a record from before modes were recorded is the demo's, or its quick version's)."""
    return demo.get("mode") or ("quick" if demo.get("quick") else "demo")


def _cells(demo: dict) -> dict[str, dict]:
    return {c["cell"]: c for sec in demo["sections"].values() for c in sec.get("cells", [])}


def plateau_summary(plateau_all: dict[str, dict], cells: dict[str, dict]) -> list[str]:
    """The full run's plateau in one paragraph: how many runs met the criterion, per section, and each that did not
    (its relative fall, its fall in nats against two standard errors; a collapsed run by how it ended)."""
    total = sum(len(runs) for runs in plateau_all.values())
    misses = [(sec, cell, chk) for sec, runs in plateau_all.items() for cell, chk in runs.items() if not chk["plateau"]]
    if not misses:
        return [f"**Plateau**: all {total} runs reached their plateau (criterion in claim 3's row above).", ""]
    said = []
    for sec, cell, chk in misses:
        reason = (cells.get(cell) or {}).get("collapse_reason")
        if reason:
            said.append(f"{SECTION_LETTERS.get(sec, sec)} {cell} (collapsed: {reason.replace('_', ' ')})")
        elif chk.get("fall") is not None:
            noise = f" vs {PLATEAU_Z:g} x {chk['noise_nats']:.4f}" if chk.get("noise_nats") is not None else ""
            said.append(
                f"{SECTION_LETTERS.get(sec, sec)} {cell} (fell {100 * chk['fall']:.1f} %, "
                f"{chk['fall_nats']:.4f} nats{noise})"
            )
        else:
            said.append(f"{SECTION_LETTERS.get(sec, sec)} {cell} (too short to judge)")
    return [
        f"**Plateau**: {total - len(misses)} of {total} runs reached their plateau (criterion in claim 3's row "
        f"above); not: {'; '.join(said)}.",
        "",
    ]


def _sections_md(demo: dict, evidence: dict, diag_lines: list[str], twin_lines: list[str]) -> list[str]:
    a, b, p = demo["sections"]["lr_sweep"], demo["sections"]["batch_size"], demo["protocol"]
    md = [
        f"## (a) Learning rate (batch {a['spec']['base_batch_size']}, {_budget(p, 'lr')})",
        "",
        "Final test accuracy; claims 1, 2 and 5 of the first table are judged from it.",
        "",
        *_lr_table(a),
        "",
        "![](a_acc_vs_lr.png)",
        "",
        "![](a_loss_curves.png)",
        "",
    ]
    data = f"{p['batch_num_train']} training samples" if p.get("batch_num_train") else "every training sample"
    cap = f" of at most {p['batch_max_steps']} steps" if p.get("batch_max_steps") else ""
    scaling = "linearly" if p.get("batch_lr_scaling", "linear") == "linear" else "with the root of the batch size"
    md += [
        f"## (b) Batch size (lr scaled {scaling} from {b['spec']['base_lr']:g} at batch "
        f"{b['spec']['base_batch_size']}, {p.get('batch_epochs', 1)} epoch(s){cap} on {data})",
        "",
        "Test accuracy with running statistics (eval mode) / with batch statistics (train mode); claims 3, 3a and "
        "BRN are judged from it.",
        "",
        *_batch_table(b),
        "",
        f"Has each run reached its plateau? How much its mean training loss fell over the last fifth of its steps "
        f"(against the fifth before: relative, and in nats against {PLATEAU_Z:g} standard errors of the difference; "
        f"< {100 * PLATEAU_FALL:.0f} %, < {PLATEAU_FLOOR:g} nats or < {PLATEAU_Z:g} standard errors is a plateau), "
        "per seed:",
        "",
        *_plateau_table(b, evidence),
        "",
        "![](b_acc_vs_batch_size.png)",
        "",
    ]
    md += [
        f"## (c) Collapse diagnosis (width {p['collapse_width']:g}, lr {p['collapse_lr']:g}, "
        + (f"{_budget(p, 'collapse')}, " if p.get("collapse_epochs", 1) > 1 else "")
        + f"the monitor recording every step of the first {p['collapse_steps']})",
        "",
        *diag_lines,
        "",
        "The figure shows, for each norm, its first seed that collapsed, and one run that did not for reference.",
        "",
        "![](c_collapse_diagnosis.png)",
        "",
        *twin_lines,
    ]
    md += ["## (d) Cost of a training step", "", *_cost_section(demo["cost"])]
    return md


_TWIN_HEADINGS = {
    GUARDED: "### Guarded twins: the {norm} runs above again with `guard=True` (`normlab train --guard`)",
    GUARDED_DEAD: "### Guarded twins with --guard-dead: the {norm} runs above again with `guard=True, guard_dead=True` "
    "(`normlab train --guard-dead`)",
}


def _twins_md(demo: dict, evidence: dict, out: Path, section: str, figure: str) -> tuple[list[str], Path | None]:
    """The report's lines on one section of guarded twins (none for a record without it, except the --guard section,
    which says so) and its figure."""
    if section != GUARDED and section not in demo["sections"]:
        return [], None
    pairs = twin_pairs(demo, evidence, section)
    plot = plot_twins(pairs, out, out / figure, section)
    heading = _TWIN_HEADINGS[section].format(norm=demo["protocol"].get("guard_norm", "none"))
    lines = twins_markdown(pairs, figure if plot is not None else None, dead=section == GUARDED_DEAD)
    return [heading, "", *lines, ""], plot


def render_demo_report(demo: dict[str, Any], out_dir: str | os.PathLike, fresh: bool = False) -> list[Path]:
    """Write ``report.md`` and the plots; returns the paths written. The evidence from the runs' files
    (:func:`~normlab_lab.demo.claims.collect_evidence`) is gathered again where the runs' files are
    in ``out_dir``, else taken from ``demo["evidence"]`` (a record copied without its runs); ``fresh=True``: the
    caller has just gathered it from these files (``run_demo``), so it is not read twice."""
    out = Path(out_dir)
    if not (fresh and demo.get("evidence")) and ((out / "collapse" / "runs").is_dir() or not demo.get("evidence")):
        demo = {**demo, "evidence": collect_evidence(out, demo["sections"])}
    evidence = demo["evidence"]
    a, b = demo["sections"]["lr_sweep"], demo["sections"]["batch_size"]
    plots = [
        lr_plot(a, out / "a_acc_vs_lr.png"),
        loss_curves_plot(a, out / "lr_sweep", out / "a_loss_curves.png"),
        batch_plot(b, out / "b_acc_vs_batch_size.png", (evidence or {}).get("plateau") or {}),
    ]
    diag_lines, picks = _diagnosis_section(out, demo, evidence)
    plots.append(plot_diagnosis(picks, out / "c_collapse_diagnosis.png"))
    twin_lines = []
    for section, figure in FIGURES.items():
        lines, plot = _twins_md(demo, evidence, out, section, figure)
        twin_lines += lines
        plots.append(plot)
    md = _md_header(demo) + _sections_md(demo, evidence, diag_lines, twin_lines)
    path = atomic_write_text(out / "report.md", "\n".join(md))
    return [path, *(p for p in plots if p is not None)]
