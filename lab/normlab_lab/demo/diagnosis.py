"""Collapse diagnosis from the files a monitored run leaves: alarm, regime warning, collapse, lead, decomposition.

For each run (``<cell dir>/summary.json``, ``monitor.jsonl``, ``loss_trace.json``) :func:`diagnose_run` says how it
ended (:mod:`normlab.monitor.collapse`), when and where the monitor's countdown alarm fired and its regime
warning (the regime rule's, ``summary.json``'s ``monitor_risk``) was raised, the lead of each in steps
(collapse step - its step; positive: it came first), for the alarmed layer the two terms of
``Var[Y] = n E[W^2] Var[X] + E^2[X] Var_o[n E[W_o]]`` at the first record and at the alarm, and for a run with
``guard=True`` what its :class:`~normlab.monitor.CollapseGuard` did.
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

from normlab.monitor.log import load_log
from normlab.monitor.plotting import layer_series, log_scale, mark_alarm, spans_decades
from normlab.monitor.records import layer_keys
from normlab.monitor.rules import RegimeRule
from normlab.runner.io import atomic_savefig

__all__ = [
    "load_records",
    "diagnose_run",
    "alarm_audit",
    "audited_runs",
    "plot_diagnosis",
    "GUARDED",
    "GUARDED_DEAD",
    "GUARDED_SECTIONS",
]

GUARDED = "guard"  # the demo's section of guarded twins: their alarms were acted on, so no audit counts them
GUARDED_DEAD = "guard_dead"  # the twins with --guard-dead (the guard also measures against chance)
GUARDED_SECTIONS = (GUARDED, GUARDED_DEAD)


def load_records(run_dir: Path) -> tuple[list[dict], dict | None]:
    """(layer records, alarm event or None) of ``run_dir/monitor.jsonl`` read by the validated
    :func:`~normlab.monitor.log.load_log` (ValueError naming file:line for a bad line); empty when the run had no
    monitor."""
    path = Path(run_dir) / "monitor.jsonl"
    if not path.is_file():
        return [], None
    log = load_log(path)
    return log.records, log.alarm


def _terms(records: list[dict], layer: str, step: int | None) -> dict[str, float | None]:
    """variance_term and shift_term of ``layer`` at ``step`` (None: the first record of the layer)."""
    rows = [r for r in records if r["layer"] == layer and "variance_term" in r]
    if step is not None:
        rows = [r for r in rows if r["step"] <= step]
    row = (rows[0] if step is None else rows[-1]) if rows else {}
    return {"variance_term": row.get("variance_term"), "shift_term": row.get("shift_term"), "step": row.get("step")}


def _lead(collapse_step: int | None, event: dict | None) -> int | None:
    """collapse step - the event's step (None without either)."""
    if collapse_step is None or not event or event.get("step") is None:
        return None
    return collapse_step - event["step"]


def diagnose_run(run_dir: Path) -> dict[str, Any]:
    """How one run ended and what its monitor said, with the decomposition terms at the alarm.

    Keys: ``collapsed`` (an alarm that stopped the run is not a collapse), ``collapse_reason``, ``collapse_step``,
    ``final_test_acc``, ``alarm`` and ``lead_steps``, ``risk`` (the regime warning, None for runs of earlier
    versions) and ``risk_lead_steps``, ``monitored``, ``steps_run``, ``rescues`` (the guard's, one dict each),
    ``steps_lost``, ``guard_gave_up``, ``alarms_dismissed`` (the guard's, one dict each), and ``terms_initial`` /
    ``terms_at_alarm`` for an alarmed run with records.
    """
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    records, event = load_records(run_dir)
    alarm = summary.get("monitor_alarm") or (event and {k: event.get(k) for k in ("layer", "step", "quantity")})
    out = {
        "collapsed": bool(summary.get("collapsed")) and summary.get("collapse_reason") != "monitor_alarm",
        "collapse_reason": summary.get("collapse_reason"),
        "collapse_step": summary.get("collapse_step"),
        "final_test_acc": summary.get("final_test_acc"),
        "alarm": alarm or None,
        "lead_steps": _lead(summary.get("collapse_step"), alarm),
        "risk": summary.get("monitor_risk"),
        "risk_lead_steps": _lead(summary.get("collapse_step"), summary.get("monitor_risk")),
        "monitored": bool(records),
        "steps_run": summary.get("steps_run"),
        "rescues": list(summary.get("rescues") or []),
        "steps_lost": summary.get("steps_lost") or 0,
        "guard_gave_up": summary.get("guard_gave_up"),
        "alarms_dismissed": list(summary.get("alarms_dismissed") or []),
    }
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
    return {
        "monitored_runs": len(monitored),
        "collapsed_runs": len(collapsed),
        "datable_collapses": len(datable),
        "warned_in_time": len(in_time),
        "leads": sorted(d["lead_steps"] for d in in_time),
        "healthy_runs": len(healthy),
        "false_alarms": len(false_alarms),
        "dead_runs_alarmed": sum(1 for d in collapsed if d["collapse_step"] is None and d["alarm"]),
    }


def audited_runs(diagnoses: dict[str, dict[str, dict]]) -> list[dict[str, Any]]:
    """The diagnoses (section -> cell -> diagnosis) that :func:`alarm_audit` counts: every section's but the guarded
    twins' (:data:`GUARDED_SECTIONS`), whose alarms rolled the run back instead of being observed."""
    return [d for key, sec in diagnoses.items() if key not in GUARDED_SECTIONS for d in sec.values()]


def _loss_trace(run_dir: Path) -> list[float | None]:
    path = Path(run_dir) / "loss_trace.json"
    return json.loads(path.read_text())["losses"] if path.is_file() else []


# Values at float32 rounding level are no signal: the shift of a net with zero-mean filters (PWS, WS: ~1e-14 of
# n Var[W]) and the spread of their mean updates (~1e-7 of the weights' std). Below these floors a point is not drawn.
NOISE_FLOORS = {
    "shift": ("shift_scale_free", 1e-6, "of n Var[W]"),
    "mean_update_std": ("_mean_update_rel", 1e-5, "of the weights' std"),
}


def _relative(r: dict, key: str) -> float | None:
    if key == "_mean_update_rel":
        wv = r.get("weight_var")
        return None if not wv or r.get("mean_update_std") is None else r["mean_update_std"] / math.sqrt(wv)
    return r.get(key)


def _drawn(key: str):
    """The records of conv and linear layers with a value of ``key`` above its noise floor (:data:`NOISE_FLOORS`)."""
    floor = NOISE_FLOORS.get(key)

    def keep(r: dict) -> bool:
        if r.get(key) is None or r.get("kind") == "norm":
            return False
        rel = _relative(r, floor[0]) if floor else None
        return rel is None or abs(rel) >= floor[1]

    return keep


def _series(records: list[dict], key: str, max_step: int | None) -> tuple[dict[str, tuple[list, list]], int]:
    """layer -> (steps, values) of ``key`` (conv and linear layers), and how many values were at rounding level
    (:data:`NOISE_FLOORS`) and left out."""
    shown = layer_series(records, key, max_step, keep=_drawn(key))
    values = layer_series(records, key, max_step, keep=lambda r: r.get(key) is not None and r.get("kind") != "norm")
    return shown, sum(len(v) for _, v in values.values()) - sum(len(v) for _, v in shown.values())


RISK_STYLE = {"color": "darkorange", "linestyle": "-.", "linewidth": 1.5}  # the regime warning's mark
FONT = 12  # points: the body type of the figure (notes one point smaller), readable on a slide (ROW_INCHES tall rows)
ROW_INCHES = 4.6  # the height of one run's row: a one-run figure is no strip (at 21 inches wide)


def layer_colors(records: list[dict]) -> dict[str, Any]:
    """One colour per conv and linear layer, in forward order along a colormap (shallow: dark blue, deep: red), so
    that a dozen layers stay apart and a layer has the same colour in every panel and row."""
    import matplotlib

    names = list(dict.fromkeys(r["layer"] for r in records if r.get("kind") != "norm"))
    cmap = matplotlib.colormaps["turbo"]
    return {n: cmap(0.05 + 0.9 * i / max(1, len(names) - 1)) for i, n in enumerate(names)}


def _panel(
    ax,
    series: tuple[dict, int],
    title: str,
    ylabel: str,
    log: bool | str,
    marks: tuple[dict | None, dict | None],
    key: str | None = None,
    colors: dict | None = None,
) -> None:
    alarm, risk = marks
    layers, hidden = series
    for name, (steps, vals) in layers.items():
        ax.plot(steps, vals, label=name, linewidth=1.4, color=(colors or {}).get(name))
    ax.set_title(title, fontsize=FONT + 1)
    if hidden and key in NOISE_FLOORS and not layers:  # nothing to draw: a note in place of an empty panel
        _, level, of = NOISE_FLOORS[key]
        ax.axis("off")
        ax.text(
            0.5,
            0.5,
            f"not drawn: every value\n< {level:g} {of}\n(rounding noise of\nzero-mean filters)",
            ha="center",
            va="center",
            fontsize=FONT,
            color="0.3",
            transform=ax.transAxes,
        )
        return
    values = [v for _, vals in layers.values() for v in vals]
    log = log is True or (log == "decades" and spans_decades(values))
    if log:
        log_scale(ax, values)
    if hidden and key in NOISE_FLOORS:
        _, level, of = NOISE_FLOORS[key]
        ax.text(
            0.5,
            0.04,
            f"{hidden} values < {level:g} {of} not drawn",
            ha="center",
            va="bottom",
            fontsize=FONT - 1,
            color="0.3",
            transform=ax.transAxes,
        )
    if not log:
        ax.ticklabel_format(axis="y", useOffset=False)
    mark_alarm(ax, alarm)
    if risk and risk.get("step") is not None:
        ax.axvline(risk["step"], **RISK_STYLE)
    ax.set_xlabel("step", fontsize=FONT)
    ax.set_ylabel(ylabel, fontsize=FONT)
    ax.tick_params(labelsize=FONT)
    ax.grid(alpha=0.3)


# (record key, title, y label, log: True, or "decades" where the values span a factor of 10 or more)
_COLUMNS = (
    ("update_ratio_mean", "Fig. 1(a): update ratio\nVar[W - dW] / Var[W]", "ratio", "decades"),
    ("mean_update_std", "Fig. 1(b): spread of\nmean(dW_o) over filters", "std (log)", True),
    ("shift", "shift of the average\nVar_o[n mean(W_o)]", "shift (log)", True),
    ("output_var", "output variance\nper layer", "Var[Y] (log)", True),
)
layer_keys(*NOISE_FLOORS, "shift_scale_free", "weight_var", *(column[0] for column in _COLUMNS))  # record keys


def _share_log_limits(axes, col: int) -> None:
    """One y scale for a column in every row (log if any row's is: a collapse's decades beside a healthy run) and,
    when log, the same range, so rows compare at a glance."""
    if any(ax.get_yscale() == "log" for ax in axes[:, col]):
        for ax in axes[:, col]:
            if ax.axison and ax.get_yscale() != "log":
                ax.set_yscale("log", nonpositive="mask")
    lims = [ax.get_ylim() for ax in axes[:, col] if ax.get_yscale() == "log" and ax.lines]
    if lims:
        lo, hi = min(a for a, _ in lims), max(b for _, b in lims)
        for ax in axes[:, col]:
            if ax.get_yscale() == "log":
                ax.set_ylim(lo, hi)


def _said(ax, alarm: dict | None, risk: dict | None) -> None:
    """The loss panel's note: where and when the countdown alarm fired and the regime warning was raised."""
    said = f"alarm: {alarm['layer']}, step {alarm['step']}" if alarm else "no alarm"
    said += "\n" + (f"regime warning: {risk['layer']}, step {risk['step']}" if risk else "no regime warning")
    ax.text(
        0.97,
        0.95,
        said,
        ha="right",
        va="top",
        fontsize=FONT - 1,
        color="r" if alarm else "0.3",
        transform=ax.transAxes,
        bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"},
    )


def plot_diagnosis(runs: Sequence[tuple[str, Path]], path: Path, max_step: int | None = 100) -> Path | None:
    """One row per (label, run dir): loss, Fig. 1(a) update ratio, Fig. 1(b) spread of the per-filter mean update,
    the shift of the average and the output variance per layer over the first ``max_step`` steps; the red dashed
    line is the monitor's countdown alarm, the orange dash-dotted line its regime warning (both named in the row's
    loss panel). Layers are coloured by depth, the same in every panel; values at rounding level are not drawn
    (a panel with nothing else says so in place of its axes); the legend lists only the marks drawn."""
    runs = [(label, Path(d)) for label, d in runs if (Path(d) / "monitor.jsonl").is_file()]
    if not runs:
        return None
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(
        len(runs), 5, figsize=(21, ROW_INCHES * len(runs) + 0.5), squeeze=False, layout="constrained"
    )
    colors: dict[str, Any] = {}
    drawn = {"alarm": False, "risk": False}
    for row, (label, run_dir) in zip(axes, runs):
        records, _ = load_records(run_dir)
        colors = {**layer_colors(records), **colors}
        diag = diagnose_run(run_dir)
        marks = (diag["alarm"], diag["risk"])
        drawn["alarm"] |= bool(diag["alarm"] and diag["alarm"].get("step") is not None)
        drawn["risk"] |= bool(diag["risk"] and diag["risk"].get("step") is not None)
        losses = _loss_trace(run_dir)[: (max_step or 10**9) + 1]
        row[0].plot(range(len(losses)), [math.nan if v is None else v for v in losses], color="k", linewidth=1.2)
        row[0].axhline(math.log(10), color="0.5", linestyle=":", linewidth=1)
        _said(row[0], *marks)
        _panel(row[0], ({}, 0), label, "training loss", False, marks)
        for ax, (key, title, ylabel, log) in zip(row[1:], _COLUMNS):
            _panel(ax, _series(records, key, max_step), title, ylabel, log, marks, key, colors)
    for col in range(1, 5):
        _share_log_limits(axes, col)
    handles = [Line2D([], [], color=c, linewidth=2) for c in colors.values()]
    labels = list(colors)
    if drawn["alarm"]:
        handles.append(Line2D([], [], color="r", linestyle="--"))
        labels.append(
            "countdown alarm (mon.alarm):\na layer's output variance\nor shift past its threshold,"
            "\nor its input collapsed"
        )
    if drawn["risk"]:
        handles.append(Line2D([], [], **RISK_STYLE))
        labels.append(
            f"regime warning (RegimeRule):\nshift term > {RegimeRule().min_ratio:g}x variance\n"
            f"term, {RegimeRule().window} steps in a row"
        )
    handles.append(Line2D([], [], color="0.5", linestyle=":"))
    labels.append("ln 10 (chance loss)")
    fig.legend(
        handles,
        labels,
        loc="outside right center",
        fontsize=FONT,
        title="layer (shallow to deep)",
        title_fontsize=FONT,
        frameon=False,
    )
    fig.suptitle(
        "(c) what the monitor saw in runs that collapsed (one run that did not, for reference)", fontsize=FONT + 3
    )
    try:
        return atomic_savefig(fig, path, dpi=100)
    finally:
        plt.close(fig)
