"""The demo's guarded twins: section (c)'s unnormalized runs again with ``guard=True`` (section :data:`GUARDED`) and
with ``guard=True, guard_dead=True`` (section :data:`GUARDED_DEAD`), beside their unguarded runs.

A twin is the same configuration and seed (same width, learning rate, steps, monitor), trained through a
:class:`~normlab.monitor.CollapseGuard` (``normlab train --guard``, at the library's defaults): on a failure of the
failure taxonomy (:mod:`normlab.monitor.collapse`), or a countdown alarm that such a failure confirms, it restores a
snapshot from before the trouble and lowers the learning rate; with ``guard_dead`` (``--guard-dead``) the guard knows
chance (ln 10), and a waiting alarm on a net that has not learned is also confirmed once the net is judged never to
have learned. :func:`guard_rules` says it in words, from the library's own values. Both runs take the same batches;
the steps thrown away at a rollback are not taken again, so the guarded twin ends after ``steps - steps_lost`` kept
steps.

:func:`twin_pairs` pairs the runs from a demo record's diagnoses, :func:`twins_markdown` writes the report's lines,
:func:`guard_clause` the clause of the claims table's monitor row and :func:`plot_twins` the figure (loss curves of
both twins, rescues marked).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from normlab.monitor import RescueOptions, SnapshotOptions
from normlab.monitor.collapse import WINDOW_EXAMPLES, CollapseCriteria
from normlab.runner.grid.palette import norm_color
from normlab.runner.io import atomic_savefig
from normlab_lab.demo.diagnosis import GUARDED, GUARDED_DEAD

__all__ = [
    "FLAGS",
    "FIGURES",
    "ENDED",
    "twin_pairs",
    "ended_healthy",
    "twin_summary",
    "rescue_text",
    "twins_markdown",
    "guard_rules",
    "guard_clause",
    "step_axis",
    "plot_twins",
]


FLAGS = {GUARDED: "--guard", GUARDED_DEAD: "--guard-dead"}  # the option each guarded section ran with
FIGURES = {GUARDED: "c_guarded_twins.png", GUARDED_DEAD: "c_guarded_dead_twins.png"}  # the report's figure of each


def twin_pairs(demo: dict[str, Any], evidence: dict[str, Any], section: str = GUARDED) -> list[dict[str, Any]]:
    """The guarded runs of ``section`` (:data:`GUARDED` or :data:`GUARDED_DEAD`) and their unguarded twins in
    section (c): ``[{"cell", "name", "seed", "unguarded", "guarded"}]`` (the two runs' diagnoses), in the guarded
    section's order; empty for a record without that section (earlier versions)."""
    sec = demo["sections"].get(section)
    diag = evidence.get("diagnoses") or {}
    if not sec:
        return []
    guarded, plain = diag.get(section) or {}, diag.get("collapse") or {}
    return [
        {**{k: c[k] for k in ("cell", "name", "seed")}, "unguarded": plain[c["cell"]], "guarded": guarded[c["cell"]]}
        for c in sec["cells"]
        if c["cell"] in guarded and c["cell"] in plain
    ]


def ended_healthy(d: dict[str, Any]) -> bool:
    """A run ended healthy: it did not collapse (no failure of the collapse label: finite, not exploded, not back to
    chance, not dead), has a final accuracy, and its guard (if any) did not give up."""
    return not d["collapsed"] and not d.get("guard_gave_up") and d.get("final_test_acc") is not None


def twin_summary(pairs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counts over the pairs: ``collapsing`` (unguarded twin collapsed), ``saved`` (of those, the guarded twin ended
    healthy), ``healthy`` (unguarded twin did not collapse) and ``changed`` (of those, the guard rescued anyway)."""
    collapsing = [p for p in pairs if p["unguarded"]["collapsed"]]
    healthy = [p for p in pairs if not p["unguarded"]["collapsed"]]
    return {
        "pairs": len(pairs),
        "collapsing": len(collapsing),
        "saved": sum(ended_healthy(p["guarded"]) for p in collapsing),
        "healthy": len(healthy),
        "changed": sum(bool(p["guarded"]["rescues"]) for p in healthy),
    }


def rescue_text(r: dict[str, Any]) -> str:
    """One rescue in words: ``step 10 (monitor alarm: ...): back to step 0, lr 0.1 -> 0.05, 10 steps lost``."""
    why = str(r.get("reason", "?")).split(" (baseline")[0]
    return (
        f"step {r['step']} ({why}): back to step {r['restored_step']}, lr {r['lr_before']:g} -> {r['lr_after']:g}, "
        f"{r['steps_lost']} step{'' if r['steps_lost'] == 1 else 's'} lost"
    )


# how a collapsed run ended, in words, by its ``collapse_reason`` (the trainer's: the failure taxonomy's kind, with
# ``non_finite_loss`` for ``non_finite``)
ENDED = {
    "non_finite_loss": "non-finite",
    "exploded": "exploded",
    "returned_to_chance": "back to chance",
    "never_left_chance": "dead",
}


def _acc(d: dict[str, Any]) -> str:
    a = d.get("final_test_acc")
    return "n/a" if a is None else f"{100 * a:.1f} %"


def _ended(d: dict[str, Any]) -> str:
    if d.get("guard_gave_up"):
        return "guard gave up"
    if not d["collapsed"]:
        return "did not collapse"
    return ENDED.get(d["collapse_reason"], str(d["collapse_reason"]))


def guard_rules(dead: bool = False) -> str:
    """What the twins' guard does, in words, from the library's values (the guard's options and the failure
    taxonomy's :meth:`~normlab.monitor.collapse.CollapseCriteria.describe`, as ``normlab train --guard`` says it);
    ``dead``: the ``--guard-dead`` twins."""
    snaps, rescue = SnapshotOptions(), RescueOptions()
    margin = snaps.every if rescue.margin is None else rescue.margin
    text = (
        f"A rescue restores the newest snapshot (one every {snaps.every} steps) taken at least {margin} steps before "
        f"the trouble, or the first one (step 0), and multiplies the learning rate by {rescue.lr_factor:g}; the "
        "batches of the lost steps are not replayed. Trouble is a non-finite loss or gradient, an "
        "exploded loss or a return to chance, by normlab.monitor.collapse's failure taxonomy "
        f"({CollapseCriteria().describe(examples=WINDOW_EXAMPLES)}); a countdown alarm is acted on only when such a "
        f"failure follows within {rescue.confirm} steps (the rollback then goes back to before the alarm), else it is "
        "dismissed (lab/docs/monitor_calibration.md, round 3)."
    )
    if dead:
        text += (
            " With --guard-dead a waiting alarm on a net that has not learned keeps waiting, and is confirmed once the "
            "net is judged never to have learned; the guard knows chance (ln 10) instead of estimating it by the "
            "first loss (lab/docs/monitor_calibration.md, rounds 4 and 5)."
        )
    return text


def twins_markdown(pairs: Sequence[dict[str, Any]], figure: str | None, dead: bool = False) -> list[str]:
    """The report's lines on the guarded twins: a table (outcome and final accuracy of each twin, the guard's rescues),
    the counts of :func:`twin_summary` and the figure; ``dead``: the twins ran with ``--guard-dead``."""
    if not pairs:
        return ["No guarded twins in this record (a demo of an earlier version)."]
    lines = [
        "| run | unguarded: ended, final acc | guarded: ended, final acc | the guard's rescues | steps kept |",
        "|---|---|---|---|---|",
    ]
    for p in pairs:
        u, g = p["unguarded"], p["guarded"]
        rescues = "; ".join(rescue_text(r) for r in g["rescues"]) or "none"
        for d in g.get("alarms_dismissed") or []:
            rescues += f"; alarm at step {d['step']} dismissed at step {d['dismissed_at']} (no trouble followed)"
        if g.get("guard_gave_up"):
            rescues += f"; gave up: {g['guard_gave_up']}"
        lines.append(
            f"| {p['name']} seed {p['seed']} | {_ended(u)}, {_acc(u)} | {_ended(g)}, {_acc(g)} | {rescues} "
            f"| {g.get('steps_run')} |"
        )
    s = twin_summary(pairs)
    lines += [
        "",
        f"Of the {s['collapsing']} unguarded run{'' if s['collapsing'] == 1 else 's'} that collapsed, **{s['saved']} "
        f"ended healthy with the guard** (finite, not exploded, not back to chance, not dead); of the {s['healthy']} "
        f"that did not collapse, the guard rescued {s['changed']} anyway (a rescue on a healthy run changes it: it "
        f"counts against the guard). {guard_rules(dead)}",
    ]
    if figure:
        lines += ["", f"![]({figure})"]
    return lines


def guard_clause(pairs: Sequence[dict[str, Any]], flag: str = "--guard") -> str | None:
    """The clause of the claims table's monitor row, as measured: ``guard (...): 2 of 2 collapsing runs ended healthy
    (acc 36.6 %, 30.6 % vs 10.3 %, 9.6 % unguarded); 1 of 1 healthy run rescued anyway``; None without twins.
    ``flag``: the option the twins ran with (``--guard`` or ``--guard-dead``)."""
    if not pairs:
        return None
    s = twin_summary(pairs)
    coll = [p for p in pairs if p["unguarded"]["collapsed"]]
    name = flag.lstrip("-")
    text = f"{name} (the same runs with {flag}): {s['saved']} of {s['collapsing']} collapsing runs ended healthy"
    if coll:
        text += (
            f" (acc {', '.join(_acc(p['guarded']) for p in coll)} vs {', '.join(_acc(p['unguarded']) for p in coll)} "
            f"unguarded)"
        )
    if s["healthy"]:
        text += f"; {s['changed']} of {s['healthy']} healthy run{'' if s['healthy'] == 1 else 's'} rescued anyway"
    return text


def step_axis(kept: int, rescues: Sequence[dict[str, Any]]) -> tuple[list[int], list[tuple[int, int]]]:
    """Where a guarded run's steps lie on the axis of optimizer steps taken (the steps a rollback threw away
    included, so both twins are at the same batch at the same x: the batches of lost steps are not replayed).

    The run's loss trace holds its ``kept`` steps (trajectory steps 1, 2, ...); each rescue (in order) saw trouble
    after ``step`` steps of the trajectory it was on and went back to its step ``restored_step``. Returns the x of
    each kept step and, per rescue, the x of the trouble and of the step restored (0: the start).

    Example::

        >>> xs, marks = step_axis(5, [{"step": 4, "restored_step": 2}])
        >>> xs, marks  # steps 1 and 2 kept, 3 and 4 thrown away, then on from the 5th step taken
        ([1, 2, 5, 6, 7], [(4, 2)])
    """
    xs: list[int] = []  # x of each step of the trajectory the run is on
    taken = 0  # optimizer steps taken so far, thrown-away ones included
    marks = []
    for r in rescues:
        while len(xs) < r["step"]:
            taken += 1
            xs.append(taken)
        restored = int(r["restored_step"])
        marks.append((taken, xs[restored - 1] if restored > 0 else 0))
        del xs[restored:]
    while len(xs) < kept:
        taken += 1
        xs.append(taken)
    return xs[:kept], marks


def _loss(run_dir: Path) -> list[float]:
    """The run's loss of every kept step (NaN where it was not finite); empty without a loss trace."""
    path = run_dir / "loss_trace.json"
    return [math.nan if v is None else v for v in json.loads(path.read_text())["losses"]] if path.is_file() else []


FONT = 10  # points: the smallest type of the figure, readable on a slide
UNGUARDED = {"color": "0.72", "linewidth": 4.0, "solid_capstyle": "butt"}  # a wide grey band under ...
GUARDED_LINE = {"linewidth": 1.5}  # ... the guarded run in its norm's colour (norm_color): dark on grey where they meet


def _with_gaps(xs: list[int], ys: list[float]) -> tuple[list[float], list[float]]:
    """``xs``, ``ys`` with a NaN point where ``xs`` jumps, so the line breaks there instead of bridging the gap."""
    gx: list[float] = []
    gy: list[float] = []
    for i, (x, y) in enumerate(zip(xs, ys)):
        if i and x > xs[i - 1] + 1:
            gx.append(math.nan)
            gy.append(math.nan)
        gx.append(x)
        gy.append(y)
    return gx, gy


def _panel(ax, pair: dict[str, Any], out: Path, section: str) -> bool:
    """One pair: both loss curves (the unguarded a grey band under the guarded line, so coinciding curves stay
    visible), each rescue's trouble step and the step it went back to; the outcomes in the title. True when the
    panel has a rescue."""
    u, g = pair["unguarded"], pair["guarded"]
    plain = _loss(out / "collapse" / "runs" / pair["cell"])
    ax.plot(range(1, len(plain) + 1), plain, **UNGUARDED)
    guarded = _loss(out / section / "runs" / pair["cell"])
    xs, marks = step_axis(len(guarded), g["rescues"])
    ax.plot(*_with_gaps(xs, guarded), color=norm_color(pair["name"]), **GUARDED_LINE)  # broken over lost steps
    ax.axhline(math.log(10), color="0.5", linestyle=":", linewidth=1)
    notes = []
    for i, (r, (trouble, restored)) in enumerate(zip(g["rescues"], marks)):
        ax.axvline(trouble, color="r", linestyle=":", linewidth=1.4)
        ax.axvline(restored, color="tab:green", linestyle="--", linewidth=1.4)
        kept = f" (its step {r['step']} after the rollbacks before)" if trouble != r["step"] else ""
        notes.append(
            f"rescue {i + 1}: trouble at step {trouble}{kept}, back to {restored}, lr {r['lr_before']:g} -> "
            f"{r['lr_after']:g}"
        )
    if not notes:  # no rescue: the guard changed nothing, so the two runs are one curve; say so, and what it saw
        notes.append("no rescue: the guarded run is the unguarded one")
        notes += [f"alarm at step {d['step']} dismissed (no trouble followed)" for d in g.get("alarms_dismissed") or []]
    if notes:
        ax.text(  # top right: a loss curve starts high on the left and falls
            0.97,
            0.96,
            "\n".join(notes),
            ha="right",
            va="top",
            fontsize=FONT - 1,
            color="tab:green",
            transform=ax.transAxes,
            bbox={"facecolor": "white", "alpha": 0.6, "edgecolor": "none"},
        )
    ax.set_title(
        f"{pair['name']} seed {pair['seed']}\nunguarded: {_ended(u)}, {_acc(u)}\n{FLAGS[section]}: {_ended(g)}, "
        f"{_acc(g)}",
        fontsize=FONT,
        loc="left",
    )
    ax.set_xlabel("optimizer step (steps a rollback threw away included)", fontsize=FONT)
    ax.set_ylabel("training loss", fontsize=FONT)
    ax.tick_params(labelsize=FONT)
    ax.grid(alpha=0.3)
    return bool(g["rescues"])


def plot_twins(pairs: Sequence[dict[str, Any]], out: Path, path: Path, section: str = GUARDED) -> Path | None:
    """One panel per pair: the training loss of the unguarded (a grey band) and the guarded (a line on it in the norm's
    colour) run
    of ``section`` against the optimizer steps taken (:func:`step_axis`: both twins at the same batch at the same x,
    the guarded line broken over the steps a rollback threw away); for each rescue a red dotted line where the guard
    saw the trouble and a green dashed line at the step it restored (the guarded run goes on from that step's state
    at the lowered learning rate). The legend lists only
    the marks drawn. None without pairs that have loss traces."""
    pairs = [p for p in pairs if (Path(out) / section / "runs" / p["cell"] / "loss_trace.json").is_file()]
    if not pairs:
        return None
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(
        1, len(pairs), figsize=(4.6 * len(pairs) + 2.8, 4.4), squeeze=False, sharey=True, layout="constrained"
    )
    rescued = [_panel(ax, pair, Path(out), section) for ax, pair in zip(axes[0], pairs)]
    handles = [Line2D([], [], **UNGUARDED), Line2D([], [], color=norm_color(pairs[0]["name"]), **GUARDED_LINE)]
    labels = ["unguarded run", f"the same run with {FLAGS[section]}"]
    if any(rescued):
        trouble = "non-finite, exploded\nor back to chance" + (
            ",\nor never learned\nsince the alarm" if section == GUARDED_DEAD else ""
        )
        handles += [Line2D([], [], color="r", linestyle=":"), Line2D([], [], color="tab:green", linestyle="--")]
        labels += [f"guard saw trouble\n({trouble})", "rolled back to this step,\nlearning rate lowered"]
    handles.append(Line2D([], [], color="0.5", linestyle=":"))
    labels.append("ln 10 (chance loss)")
    fig.legend(handles, labels, loc="outside right center", fontsize=FONT, frameon=False)
    try:
        return atomic_savefig(fig, path, dpi=90)
    finally:
        plt.close(fig)
