"""Collapse diagnosis from the files a monitored run leaves: alarm, collapse, lead time, variance decomposition.

For each run (``<cell dir>/summary.json``, ``monitor.jsonl``, ``loss_trace.json``) :func:`diagnose_run` says how it
ended (:mod:`normlab.runner.training.collapse`), when and where the monitor's alarm fired,
the lead of the alarm in steps
(collapse step - alarm step; positive: the alarm came first) and, for the alarmed layer, the two terms of
``Var[Y] = n E[W^2] Var[X] + E^2[X] Var_o[n E[W_o]]`` at the first record and at the alarm.
:func:`alarm_audit` counts, over many runs, the alarms before a collapse and the false alarms (runs that did not
collapse but alarmed). :func:`plot_diagnosis` draws the paper's Figures 1(a), 1(b) and the per-layer output
variance next to the loss, with the alarm marked.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from normlab.runner.io import atomic_savefig

__all__ = ["load_records", "diagnose_run", "alarm_audit", "plot_diagnosis"]


def load_records(run_dir: Path) -> tuple[list[dict], dict | None]:
    """(layer records, alarm event or None) of ``run_dir/monitor.jsonl``; empty when the run had no monitor."""
    path = Path(run_dir) / "monitor.jsonl"
    if not path.is_file():
        return [], None
    records, alarm = [], None
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        obj = json.loads(line)
        if obj.get("event") == "alarm":
            alarm = obj
        elif "layer" in obj and "step" in obj:
            records.append(obj)
    return records, alarm


def _terms(records: list[dict], layer: str, step: int | None) -> dict[str, float | None]:
    """variance_term and shift_term of ``layer`` at ``step`` (None: the first record of the layer)."""
    rows = [r for r in records if r["layer"] == layer and "variance_term" in r]
    if step is not None:
        rows = [r for r in rows if r["step"] <= step]
    row = (rows[0] if step is None else rows[-1]) if rows else {}
    return {"variance_term": row.get("variance_term"), "shift_term": row.get("shift_term"), "step": row.get("step")}


def diagnose_run(run_dir: Path) -> dict[str, Any]:
    """How one run ended and what its monitor said, with the decomposition terms at the alarm."""
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    records, event = load_records(run_dir)
    alarm = summary.get("monitor_alarm") or (event and {k: event.get(k) for k in ("layer", "step", "quantity")})
    out = {
        "collapsed": bool(summary.get("collapsed")) and summary.get("collapse_reason") != "monitor_alarm",
        "collapse_reason": summary.get("collapse_reason"),
        "collapse_step": summary.get("collapse_step"),
        "final_test_acc": summary.get("final_test_acc"),
        "alarm": alarm or None,
        "lead_steps": None,
        "monitored": bool(records),
    }
    if alarm and out["collapse_step"] is not None and alarm.get("step") is not None:
        out["lead_steps"] = out["collapse_step"] - alarm["step"]
    if alarm and records:
        out["terms_initial"] = _terms(records, alarm["layer"], None)
        out["terms_at_alarm"] = _terms(records, alarm["layer"], alarm.get("step"))
    return out


def alarm_audit(diagnoses: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Over monitored runs: collapses warned in time (alarm before the collapse step), collapses without a timely
    alarm, and false alarms (an alarm in a run that did not collapse)."""
    monitored = [d for d in diagnoses if d["monitored"]]
    collapsed = [d for d in monitored if d["collapsed"]]
    datable = [d for d in collapsed if d["collapse_step"] is not None]
    in_time = [d for d in datable if d["lead_steps"] is not None and d["lead_steps"] > 0]
    healthy = [d for d in monitored if not d["collapsed"]]
    false_alarms = [d for d in healthy if d["alarm"]]
    return {"monitored_runs": len(monitored), "collapsed_runs": len(collapsed), "datable_collapses": len(datable),
            "warned_in_time": len(in_time), "leads": sorted(d["lead_steps"] for d in in_time),
            "healthy_runs": len(healthy), "false_alarms": len(false_alarms),
            "dead_runs_alarmed": sum(1 for d in collapsed if d["collapse_step"] is None and d["alarm"])}


def _loss_trace(run_dir: Path) -> list[float | None]:
    path = Path(run_dir) / "loss_trace.json"
    return json.loads(path.read_text())["losses"] if path.is_file() else []


def _series(records: list[dict], key: str, max_step: int | None) -> dict[str, tuple[list, list]]:
    out: dict[str, tuple[list, list]] = {}
    for r in records:
        if r.get(key) is None or r.get("kind") == "norm" or (max_step is not None and r["step"] > max_step):
            continue
        steps, vals = out.setdefault(r["layer"], ([], []))
        steps.append(r["step"])
        vals.append(r[key])
    return out


def _panel(ax, series: dict, title: str, ylabel: str, log: bool, alarm: dict | None) -> None:
    for layer, (steps, vals) in series.items():
        ax.plot(steps, vals, linewidth=1.0, label=layer)
    if log and any(v > 0 for _, vals in series.values() for v in vals if v is not None and math.isfinite(v)):
        ax.set_yscale("log", nonpositive="mask")
    if alarm and alarm.get("step") is not None:
        ax.axvline(alarm["step"], color="r", linestyle="--", linewidth=1)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel, fontsize=8)
    ax.grid(alpha=0.3)


def plot_diagnosis(runs: Sequence[tuple[str, Path]], path: Path, max_step: int | None = 100) -> Path | None:
    """One row per (label, run dir): loss, Fig. 1(a) update ratio, Fig. 1(b) spread of the per-filter mean update,
    the shift of the average and the output variance per layer over the first ``max_step`` steps; the red dashed
    line is the alarm."""
    runs = [(label, Path(d)) for label, d in runs if (Path(d) / "monitor.jsonl").is_file()]
    if not runs:
        return None
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 5, figsize=(22, 3.2 * len(runs)), squeeze=False)
    for row, (label, run_dir) in zip(axes, runs):
        records, _ = load_records(run_dir)
        alarm = diagnose_run(run_dir)["alarm"]
        losses = _loss_trace(run_dir)[: (max_step or 10**9) + 1]
        row[0].plot(range(len(losses)), [math.nan if v is None else v for v in losses], color="k", linewidth=1)
        row[0].axhline(math.log(10), color="0.5", linestyle=":", linewidth=1)
        _panel(row[0], {}, f"{label}: training loss (dotted: ln 10)", "loss", False, alarm)
        _panel(row[1], _series(records, "update_ratio_mean", max_step), "Fig. 1(a): Var[W - dW] / Var[W]", "ratio",
               False, alarm)
        _panel(row[2], _series(records, "mean_update_std", max_step), "Fig. 1(b): spread of mean(dW_o) over filters",
               "std", True, alarm)
        _panel(row[3], _series(records, "shift", max_step), "shift of the average: Var_o[n mean(W_o)]", "shift", True,
               alarm)
        _panel(row[4], _series(records, "output_var", max_step), "output variance per layer", "Var[Y]", True, alarm)
    handles, labels = axes[0][4].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=7, title="layer")
    fig.tight_layout(rect=(0, 0, 0.92, 1))
    atomic_savefig(fig, path, dpi=90)
    plt.close(fig)
    return path
