"""The demo's report: four sections, each claim judged from the numbers by criteria fixed in this file.

``render_demo_report(demo, out)`` writes ``report.md`` and its plots into ``out`` from the dict
:func:`~normlab.runner.experiments.demo.experiment.run_demo` returns (also saved as ``demo.json``, so
``normlab report`` can re-render it) and the runs' files under ``out/<section>/runs``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from normlab.runner.experiments.demo.diagnosis import alarm_audit, diagnose_run, plot_diagnosis
from normlab.runner.grid.report import plot_curves, plot_sweep, plt
from normlab.runner.grid.verdicts import CRITERIA, chance_level, failed, format_acc, trains
from normlab.runner.io import atomic_savefig, atomic_write_text

__all__ = ["render_demo_report", "DEMO_CRITERIA", "DROP", "GAP_VISIBLE", "BRN_GAIN"]

DROP = 0.02  # a norm degrades at a small batch when its mean accuracy falls >= 2 points below batch 128
GAP_VISIBLE = 0.05  # BN's eval - train-mode gap at the smallest batch >= 5 points, and >= 5 points above its gap at
# batch 128 (where, early in training, train mode can even be ahead: the running statistics lag the weights)
BRN_GAIN = 0.01  # Batch Renorm recovers a small batch when its accuracy there is >= 1 point above BN's
ALARM_SEEDS = 2  # the monitor's target: an alarm before the collapse on >= 2 seeds of the unnormalized net
DEMO_CRITERIA = (
    f"{CRITERIA} At a small batch a norm *degrades* if its mean accuracy is >= {100 * DROP:.0f} points below its "
    f"accuracy at batch 128 (else it *holds*). BN's train/test discrepancy is *visible* if its train-mode accuracy "
    f"at the smallest batch is >= {100 * GAP_VISIBLE:.0f} points below its eval-mode accuracy and that gap exceeds "
    f"the gap at batch 128 by >= {100 * GAP_VISIBLE:.0f} points. BRN *recovers* a small batch if its accuracy there "
    f"is >= {100 * BRN_GAIN:.0f} point above BN's. The monitor's target: its alarm comes before the collapse (a "
    f"positive lead in steps; for a dead network, which has no moment of collapse, any alarm during the run) on >= "
    f"{ALARM_SEEDS} of 3 seeds of the unnormalized net at the collapsing learning rate, and it raises no alarm in "
    f"any monitored run that did not collapse."
)


def _groups(results: dict) -> dict[tuple[str, float, int], dict]:
    return {(g["name"], float(g["lr"]), int(g["batch_size"])): g for g in results["groups"]}


def _mark(appeared: bool | None) -> str:
    return {True: "**yes**", False: "**no**", None: "n/a"}[appeared]


# ------------------------------------------------------------------------------------------- (a) learning rate
def _lr_table(results: dict) -> list[str]:
    spec, g = results["spec"], _groups(results)
    lrs, bs = sorted(spec["lrs"]), int(spec["base_batch_size"])
    rows = ["| norm | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |", "|---|" + "---|" * len(lrs)]
    for name in spec["norms"]:
        rows.append(f"| {name} | " + " | ".join(_acc_kinds(g.get((name, lr, bs))) for lr in lrs) + " |")
    return rows


_KIND_WORDS = {"non_finite_loss": "non-finite", "returned_to_chance": "back to chance", "never_left_chance": "dead"}


def _acc_kinds(grp: dict | None) -> str:
    """Accuracy with the kinds of collapse: ``35.5 ± 44.0 % (collapsed 2/3: 1 non-finite, 1 dead)``."""
    text = format_acc(grp)
    kinds = (grp or {}).get("collapse_kinds") or {}
    if kinds:
        text = text[:-1] + ": " + ", ".join(f"{n} {_KIND_WORDS.get(k, k)}" for k, n in sorted(kinds.items())) + ")"
    return text


def _lr_claims(results: dict) -> list[str]:
    spec, g0 = results["spec"], _groups(results)
    g = {(n, lr, 128): v for (n, lr, _), v in g0.items()}  # one batch size in this section
    chance, lrs = chance_level(results), sorted(spec["lrs"])
    best = max((x["final_mean"] for x in results["groups"] if x["final_mean"] is not None), default=0.0)
    ok = {n: {lr: trains(g.get((n, lr, 128)), chance, best) for lr in lrs} for n in spec["norms"]}
    bad = [lr for lr in lrs if failed(g.get(("none", lr, 128)), chance)
           and any(not failed(g.get(("none", x, 128)), chance) for x in lrs if x < lr)]
    c1 = [lr for lr in bad if ok.get("bn", {}).get(lr)]
    lines = [f"- Claim 1 (the plain net without normalization collapses at a learning rate where BN trains): "
             f"{_mark(bool(c1))}" + (f" at lr {', '.join(f'{x:g}' for x in c1)}." if c1 else
                                     f". Learning rates where it fails after learning at a lower one: "
                                     f"{', '.join(f'{x:g}' for x in bad) or 'none'}.")]
    for name in (n for n in spec["norms"] if n.startswith("pws")):
        held = [lr for lr in c1 if ok[name][lr]]
        lines.append(f"- Claim 2 (PWS trains there without normalizing outputs), `{name}`: "
                     f"{_mark(bool(held)) if c1 else 'n/a (claim 1 did not appear)'}"
                     + (f": {', '.join(f'lr {lr:g}: {format_acc(g.get((name, lr, 128)))}' for lr in c1)}." if c1
                        else "."))
    top = lrs[-1]
    suffer = [n for n in ("pws", "wn") if n in ok and not ok[n][top]]
    lines.append(f"- Claim 5 (at the highest learning rate, {top:g}, PWS and WN suffer): {_mark(len(suffer) == 2)}; "
                 f"do not train there: {', '.join(n for n in spec['norms'] if not ok[n][top]) or 'none'}.")
    return lines


def _smoothed(losses: list, window: int) -> list[float]:
    out, recent = [], []
    for v in losses:
        recent = (recent + [math.nan if v is None else v])[-window:]
        out.append(sum(recent) / len(recent))
    return out


def _loss_curves_plot(results: dict, grid_dir: Path, path: Path) -> Path | None:
    """Smoothed training loss per step, one panel per learning rate, one colour per norm (a line per seed)."""
    lrs = sorted(results["spec"]["lrs"])
    fig, axes = plt().subplots(1, len(lrs), figsize=(6.5 * len(lrs), 4.2), squeeze=False)
    colors = {n: f"C{i % 10}" for i, n in enumerate(results["spec"]["norms"])}
    for ax, lr in zip(axes[0], lrs):
        for c in (c for c in results["cells"] if float(c["lr"]) == lr):
            trace = grid_dir / "runs" / c["cell"] / "loss_trace.json"
            if trace.is_file():
                t = json.loads(trace.read_text())
                ax.plot(_smoothed(t["losses"], t["window"]), color=colors[c["name"]], linewidth=0.9,
                        label=c["name"] if c["seed"] == min(results["spec"]["seeds"]) else None)
        ax.axhline(math.log(10), color="0.4", linestyle=":", linewidth=1)
        ax.set_ylim(0, 3.5)
        ax.set(xlabel="step", ylabel="training loss (smoothed)", title=f"lr {lr:g} (dotted: ln 10, chance)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=100)
    plt().close(fig)
    return path


# ------------------------------------------------------------------------------------------------ (b) batch size
def _gap(grp: dict | None) -> float | None:
    if grp is None or grp["final_mean"] is None or grp["train_mode_mean"] is None:
        return None
    return grp["final_mean"] - grp["train_mode_mean"]


def _batch_table(results: dict) -> list[str]:
    spec, g = results["spec"], _groups(results)
    bss = sorted(spec["batch_sizes"], reverse=True)
    head = " | ".join(f"batch {b}: eval / train mode" for b in bss)
    rows = [f"| norm | {head} |", "|---|" + "---|" * len(bss)]
    for name in spec["norms"]:
        cells = []
        for b in bss:
            grp = g.get((name, spec["base_lr"], b))
            tm = grp and grp["train_mode_mean"]
            cells.append(f"{format_acc(grp)} / {'n/a' if tm is None else f'{100 * tm:.1f} %'}")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def _batch_claims(results: dict) -> list[str]:
    spec, g = results["spec"], _groups(results)
    base, lr = int(spec["base_batch_size"]), float(spec["base_lr"])
    small = sorted(b for b in spec["batch_sizes"] if b < base)
    if not small:
        return ["- no batch size below the base: nothing to judge"]
    drop = {n: {b: _drop(g.get((n, lr, base)), g.get((n, lr, b))) for b in small} for n in spec["norms"]}
    lines = []
    for b in small:
        deg = {n: drop[n][b] is not None and drop[n][b] >= DROP for n in spec["norms"]}
        holds = [n for n in ("gn", "pws") if n in deg and not deg[n]]
        appeared = deg.get("bn", False) and len(holds) == 2
        lines.append(f"- Claim 3 at batch {b} (BN degrades while GN and PWS hold): {_mark(appeared)}; drop from "
                     f"batch {base}: " + ", ".join(f"{n} {_pts(drop[n][b])}" for n in spec["norms"]) + ".")
    gaps = {b: _gap(g.get(("bn", lr, b))) for b in spec["batch_sizes"]}
    s, visible = small[0], None
    if gaps.get(s) is not None and gaps.get(base) is not None:
        visible = gaps[s] >= GAP_VISIBLE and gaps[s] - gaps[base] >= GAP_VISIBLE
    lines.append(f"- Mechanism (BN's train-mode accuracy, with batch statistics, falls below its eval-mode accuracy "
                 f"at small batches): {_mark(visible)}; eval - train mode: "
                 + ", ".join(f"batch {b} {_pts(gaps[b])}" for b in sorted(gaps, reverse=True)) + ".")
    for b in small:
        bn, brn = g.get(("bn", lr, b)), g.get(("brn", lr, b))
        gain = None if not bn or not brn or None in (bn["final_mean"], brn["final_mean"]) else \
            brn["final_mean"] - bn["final_mean"]
        lines.append(f"- BRN's claim at batch {b} (Batch Renorm recovers small-batch accuracy): "
                     f"{_mark(None if gain is None else gain >= BRN_GAIN)}; BRN - BN: {_pts(gain)}.")
    return lines


def _drop(g0: dict | None, g1: dict | None) -> float | None:
    if not g0 or not g1 or g0["final_mean"] is None or g1["final_mean"] is None:
        return None
    return g0["final_mean"] - g1["final_mean"]


def _pts(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f} points"


def _batch_plot(results: dict, path: Path) -> Path | None:
    spec, g = results["spec"], _groups(results)
    bss = sorted(spec["batch_sizes"])
    if len(bss) < 2:
        return None
    fig, ax = plt().subplots(figsize=(7.5, 4.5))
    for name in spec["norms"]:
        rows = [(b, g.get((name, spec["base_lr"], b))) for b in bss]
        rows = [(b, x) for b, x in rows if x and x["final_mean"] is not None]
        line = ax.plot([b for b, _ in rows], [100 * x["final_mean"] for _, x in rows], marker="o", label=f"{name}")
        tm = [(b, x["train_mode_mean"]) for b, x in rows if x["train_mode_mean"] is not None]
        if tm:
            ax.plot([b for b, _ in tm], [100 * v for _, v in tm], marker="x", linestyle="--",
                    color=line[0].get_color(), label=f"{name} (train mode)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(bss)
    ax.set_xticklabels([str(b) for b in bss])
    ax.set_xlabel("batch size (lr scaled linearly)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("accuracy vs batch size: eval mode (solid) and train mode, batch statistics (dashed)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=100)
    plt().close(fig)
    return path


# ---------------------------------------------------------------------------------------- (c) collapse diagnosis
def _terms_text(d: dict) -> str:
    a, b = d.get("terms_initial") or {}, d.get("terms_at_alarm") or {}
    if a.get("variance_term") is None or b.get("variance_term") is None:
        return "n/a"
    return (f"variance {a['variance_term']:.3g} -> {b['variance_term']:.3g}, shift {a['shift_term']:.3g} -> "
            f"{b['shift_term']:.3g}")


def _outcome(d: dict) -> str:
    """How a run ended, in words."""
    if not d["collapsed"]:
        return "did not collapse"
    return {"non_finite_loss": f"non-finite loss at step {d['collapse_step']}",
            "returned_to_chance": f"back to chance at step {d['collapse_step']}",
            "never_left_chance": "dead (never learned)"}.get(d["collapse_reason"], str(d["collapse_reason"]))


def _diagnosis_rows(out: Path, results: dict, lr: float) -> list[tuple[dict, dict]]:
    return [(c, diagnose_run(out / "runs" / c["cell"])) for c in results["cells"] if float(c["lr"]) == lr]


def _diagnosis_section(out: Path, demo: dict) -> tuple[list[str], list[tuple[str, Path]]]:
    lr = float(demo["protocol"]["collapse_lr"])
    grid_dir = out / "collapse"
    rows = _diagnosis_rows(grid_dir, demo["sections"]["collapse"], lr)
    lines = ["| norm | seed | outcome | alarm (layer, step, quantity) | lead (steps) | terms of Var[Y] at the alarmed "
             "layer, step 0 -> alarm |", "|---|---|---|---|---|---|"]
    for c, d in rows:
        outcome = _outcome(d)
        a = d["alarm"]
        alarm = "none" if not a else f"{a['layer']}, {a['step']}, {a['quantity']}"
        lead = "-" if d["lead_steps"] is None else d["lead_steps"]
        lines.append(f"| {c['name']} | {c['seed']} | {outcome} | {alarm} | {lead} | {_terms_text(d)} |")
    plain = [d for c, d in rows if c["name"] == "none"]
    dated = sum(1 for d in plain if d["lead_steps"] is not None and d["lead_steps"] > 0)
    dead = sum(1 for d in plain if d["collapse_reason"] == "never_left_chance" and d["alarm"])
    everything = [diagnose_run(out / key / "runs" / c["cell"]) for key in demo["sections"]
                  for c in demo["sections"][key]["cells"]]
    audit = alarm_audit(everything)
    met = dated + dead >= ALARM_SEEDS and audit["false_alarms"] == 0
    lines += ["", f"- Monitor target: {_mark(met)}. Unnormalized net at lr {lr:g}: alarm before a dated collapse on "
              f"{dated} of {len(plain)} seeds, alarm in a dead network (never learned; no collapse step) on {dead}. "
              f"Over all {audit['monitored_runs']} monitored runs of the demo: {audit['collapsed_runs']} collapsed "
              f"({audit['datable_collapses']} with a collapse step, {audit['warned_in_time']} warned before it, leads "
              f"{audit['leads']} steps; {audit['dead_runs_alarmed']} of the dead ones alarmed), "
              f"{audit['healthy_runs']} did not collapse, **{audit['false_alarms']} false "
              f"alarm{'' if audit['false_alarms'] == 1 else 's'}**."]
    picks = [(f"{c['name']} seed {c['seed']}", grid_dir / "runs" / c["cell"]) for c, _ in rows
             if c["seed"] == min(demo["protocol"]["seeds"])]
    return lines, picks


# ------------------------------------------------------------------------------------------------------ (d) cost
def _cost_section(cost: dict) -> list[str]:
    lines = [f"Width {cost['width']:g}, 1 thread, median of {cost['repeats']} interleaved repeats of {cost['iters']} "
             f"steps (forward, backward, SGD step), every norm timed in the same run.", ""]
    for bs, t in cost["by_batch"].items():
        lines += [f"Batch {bs}:", "", "| norm | ms / step | relative to PWS |", "|---|---|---|"]
        lines += [f"| {n} | {1000 * v['median_s']:.2f} | {v.get('ratio_to_pws', float('nan')):.2f}x |"
                  for n, v in t.items()]
        others = [n for n in ("bn", "gn", "sn") if n in t]
        if "pws" in t and others:
            cheaper = [n for n in others if t[n]["median_s"] >= t["pws"]["median_s"]]
            lines += ["", f"- Claim 4 at batch {bs} (PWS costs less than output normalization): "
                          f"{_mark(len(cheaper) == len(others))}; PWS's step is cheaper than "
                          f"{', '.join(cheaper) or 'none'} (of {', '.join(others)}).", ""]
    return lines


def _md_header(demo: dict) -> list[str]:
    p = demo["protocol"]
    return ["# normlab demo: normalization and collapse on MNIST-1D", "",
            ("**Quick mode**: a pipeline check, too small for any verdict.\n" if demo.get("quick") else "")
            + f"MNIST-1D generated locally ({p['num_samples']} samples, 80 % train), the paper's plain net in 1-D "
            f"(width {p['lr_width']:g} in (a), (b), (d); {p['collapse_width']:g} in (c)), SGD momentum 0.9, weight "
            f"decay 5e-4 (not on norm parameters, biases and PWS alpha), seeds {', '.join(map(str, p['seeds']))}. "
            f"Accuracies: test set, mean ± sample std over seeds. The protocol: "
            "`normlab.runner.experiments.demo.experiment.PROTOCOL`.",
            "", f"Criteria (fixed before the runs): {DEMO_CRITERIA}", ""]


def render_demo_report(demo: dict[str, Any], out_dir: str | os.PathLike) -> list[Path]:
    """Write ``report.md`` and the plots; returns the paths written."""
    out = Path(out_dir)
    a, b = demo["sections"]["lr_sweep"], demo["sections"]["batch_size"]
    plots = [plot_sweep(a, out / "a_acc_vs_lr.png", "lr"), plot_curves(a, out / "a_training_curves.png"),
             _loss_curves_plot(a, out / "lr_sweep", out / "a_loss_curves.png"),
             _batch_plot(b, out / "b_acc_vs_batch_size.png")]
    diag_lines, picks = _diagnosis_section(out, demo)
    plots.append(plot_diagnosis(picks, out / "c_collapse_diagnosis.png"))
    plots = [p for p in plots if p is not None]
    md = _md_header(demo)
    steps = demo["protocol"]["lr_steps"]
    md += [f"## (a) Learning rate (batch {a['spec']['base_batch_size']}, {steps} steps)", "", *_lr_table(a), "",
           *_lr_claims(a), "", "![](a_acc_vs_lr.png)", "", "![](a_loss_curves.png)", "",
           "![](a_training_curves.png)", ""]
    md += [f"## (b) Batch size (lr scaled linearly from batch {b['spec']['base_batch_size']}, equal epochs)",
           "", *_batch_table(b), "",
           *_batch_claims(b), "", "![](b_acc_vs_batch_size.png)", ""]
    p = demo["protocol"]
    md += [f"## (c) Collapse diagnosis (width {p['collapse_width']:g}, lr {p['collapse_lr']:g}, the monitor recording "
           f"every step of the first {p['collapse_steps']})", "", *diag_lines,
           "", "![](c_collapse_diagnosis.png)", ""]
    md += ["## (d) Cost of a training step", "", *_cost_section(demo["cost"]), ""]
    path = atomic_write_text(out / "report.md", "\n".join(md))
    return [path, *plots]
