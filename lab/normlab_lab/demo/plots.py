"""The demo's plots, drawn to be read at a glance: each seed a faint line or point around a bold mean (its bar the
range of the seeds, so it stays within the seeds' values), log axes where the data span decades, the legend outside
the data and every mark explained in the figure. A norm has the same colour in every figure
(:func:`~normlab.runner.grid.palette.norm_color`), and the norms come in one fixed order."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from normlab.runner.grid.palette import norm_color, norm_order
from normlab.runner.grid.plots import FONT, TITLE, finish_grid, lr_shade, mean_curve, smoothed, style_figure
from normlab.runner.grid.report import agg_pyplot, seed_range_bar
from normlab.runner.grid.results import chance_level
from normlab.runner.io import atomic_savefig

__all__ = ["lr_plot", "loss_curves_plot", "batch_plot"]

_LABELS = {"pws": "pws (gamma 1e-3)", "pws:gamma=0.01": "pws (gamma 1e-2)"}


def _label(name: str) -> str:
    return _LABELS.get(name, name)


def _save(fig, path: Path, legend_handles=None, legend_title: str | None = None, note: str | None = None) -> Path:
    """Save ``fig`` (made with ``layout="constrained"``) with the legend outside the panels on the right and
    ``note`` as a caption under them."""
    style_figure(fig)
    if legend_handles:
        fig.legend(
            handles=legend_handles,
            loc="outside right center",
            fontsize=FONT,
            frameon=False,
            title=legend_title,
            title_fontsize=FONT,
        )
    if note:
        fig.supxlabel(note, fontsize=FONT, color="0.15")
    atomic_savefig(fig, path, dpi=100)
    agg_pyplot().close(fig)
    return path


def _seed_values(results: dict, name: str, key: str, x_key: str) -> dict[float, list[tuple[float, bool, str]]]:
    """x -> [(value, collapsed, cell id)] over the seeds of ``name``."""
    out: dict[float, list[tuple[float, bool, str]]] = {}
    for c in results["cells"]:
        if c["name"] == name and c.get(key) is not None:
            out.setdefault(float(c[x_key]), []).append((100 * c[key], bool(c.get("collapsed")), c.get("cell", "")))
    return dict(sorted(out.items()))


def _seeds_and_mean(ax, xs_vals: dict[float, list[tuple]], color: str, dodge: float = 1.0, **line) -> Any:
    """Faint point per seed (x where it collapsed), bold mean line with the range of the seeds (lowest to highest) as
    its bar, so the bar never leaves the seeds' values (a mean +- std of two clusters of seeds can pass 0 % or 100 %);
    ``dodge`` multiplies the x values (a log axis) to set groups side by side (1: at their true x)."""
    xs_vals = {x * dodge: v for x, v in xs_vals.items()}
    xs = list(xs_vals)
    for x, vals in xs_vals.items():
        ok = [v[0] for v in vals if not v[1]]
        bad = [v[0] for v in vals if v[1]]
        ax.plot([x] * len(ok), ok, "o", color=color, alpha=0.35, markersize=5)
        ax.plot([x] * len(bad), bad, "x", color=color, alpha=0.8, markersize=7, markeredgewidth=1.5)
    means = [sum(v[0] for v in vals) / len(vals) for vals in xs_vals.values()]
    bars = [seed_range_bar(m, [v[0] for v in vals]) for m, vals in zip(means, xs_vals.values())]
    yerr = [[b[0] for b in bars], [b[1] for b in bars]]
    return ax.errorbar(xs, means, yerr=yerr, color=color, linewidth=2.2, capsize=3, **line)


def _any_collapsed(results: dict) -> bool:
    return any(c.get("collapsed") for c in results["cells"])


def _marks_legend(results: dict, extra: list | None = None) -> list:
    """The marks' legend: only those the figure draws (a collapsed seed's x only where a seed collapsed)."""
    from matplotlib.lines import Line2D

    marks = [
        Line2D([], [], color="0.3", linewidth=2.2, label="mean over seeds\n(bar: lowest to highest seed)"),
        Line2D([], [], color="0.3", marker="o", alpha=0.4, linestyle="", label="one seed"),
    ]
    if _any_collapsed(results):
        marks.append(
            Line2D([], [], color="0.3", marker="x", markeredgewidth=1.5, linestyle="", label="one seed, collapsed")
        )
    return marks + (extra or [])


def lr_plot(results: dict, path: Path) -> Path | None:
    """Final test accuracy against the learning rate (log axis): one panel per norm (small multiples on the same
    axes, so each norm's slope is its own and norms at similar accuracy stay apart), the other norms' means faint
    behind it for reference."""
    lrs = sorted(results["spec"]["lrs"])
    if len(lrs) < 2:
        return None
    from matplotlib.lines import Line2D

    names = norm_order(results["spec"]["norms"])
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig, axes = agg_pyplot().subplots(
        rows, cols, figsize=(3.6 * cols + 2.6, 2.7 * rows + 0.6), squeeze=False, sharex=True, layout="constrained"
    )
    values = {n: _seed_values(results, n, "final_test_acc", "lr") for n in names}
    means = {n: {x: sum(v[0] for v in vals) / len(vals) for x, vals in values[n].items()} for n in names}
    chance = chance_level(results)
    for ax, name in zip(axes.flat, names):
        for other in names:
            if other != name and means[other]:
                ax.plot(list(means[other]), list(means[other].values()), color="0.8", linewidth=1, zorder=1)
        _seeds_and_mean(ax, values[name], norm_color(name))
        if chance:
            ax.axhline(100 * chance, color="0.4", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_xticks(lrs)
        ax.set_xticklabels([f"{x:g}" for x in lrs])
        ax.minorticks_off()
        ax.set(ylim=(0, 100), xlim=(lrs[0] / 1.4, lrs[-1] * 1.4))
        ax.set_title(_label(name), color=norm_color(name), fontweight="bold")
        ax.grid(alpha=0.3)
    finish_grid(axes, len(names), "learning rate", "test acc. (%)")
    fig.suptitle(
        f"(a) final test accuracy vs learning rate (log scale), batch {results['spec']['base_batch_size']}",
        fontsize=TITLE,
    )
    extra = [Line2D([], [], color="0.8", linewidth=1, label="the other norms' means")]
    if chance:
        extra.append(Line2D([], [], color="0.4", linestyle=":", label=f"chance ({100 * chance:.0f} %)"))
    return _save(fig, path, _marks_legend(results, extra))


def _traces(results: dict, grid_dir: Path) -> dict[tuple[str, float], list[list[float]]]:
    out: dict[tuple[str, float], list[list[float]]] = {}
    for c in results["cells"]:
        trace = grid_dir / "runs" / c["cell"] / "loss_trace.json"
        if trace.is_file():
            t = json.loads(trace.read_text())
            out.setdefault((c["name"], float(c["lr"])), []).append(smoothed(t["losses"], t["window"]))
    return out


LOSS_TOP = 20.0  # the loss axis shows the loss up to here (about 9 x ln 10); a run above it diverged
AXIS_TOP = 45.0  # the axis itself ends higher, so the marks at LOSS_TOP stay inside the panel, clear of its title


def _end_mark(ax, curve: list[float], color: str) -> set[str]:
    """A run whose loss left the axis (diverged): a triangle at LOSS_TOP where it crossed; one whose loss became
    non-finite: an X where its last finite value was (at LOSS_TOP if above it). Returns the marks drawn."""
    drawn = set()
    up = next((i for i, v in enumerate(curve) if math.isfinite(v) and v > LOSS_TOP), None)
    if up is not None:
        ax.plot([up], [LOSS_TOP], "^", color=color, markersize=8, markeredgecolor="k", zorder=5)
        drawn.add("^")
    finite = [i for i, v in enumerate(curve) if math.isfinite(v)]
    if finite and finite[-1] < len(curve) - 1:
        x, y = finite[-1], min(curve[finite[-1]], LOSS_TOP)
        ax.plot([x], [y], "X", color=color, markersize=9, markeredgecolor="k", zorder=6)
        drawn.add("X")
    return drawn


_LR_STYLES = ("-", "--", "-.", (0, (5, 1, 1, 1, 1, 1)))  # the mean line of the 1st, 2nd, ... learning rate


def _loss_marks_legend(drawn: set[str]) -> list:
    from matplotlib.lines import Line2D

    marks = {
        "^": Line2D(
            [],
            [],
            color="0.5",
            marker="^",
            markeredgecolor="k",
            linestyle="",
            label=f"loss above {LOSS_TOP:g}: diverged",
        ),
        "X": Line2D([], [], color="0.5", marker="X", markeredgecolor="k", linestyle="", label="loss became non-finite"),
    }
    return [marks[m] for m in ("^", "X") if m in drawn]


def loss_curves_plot(results: dict, grid_dir: Path, path: Path) -> Path | None:
    """Smoothed training loss per step: one panel per norm in the norm's colour, the learning rate by shade and line
    style (light and solid: the lowest; dark and dash-dotted: the highest), each seed a faint line around the bold
    mean (where every seed is finite), log loss axis shared by all panels; the legend names only the marks drawn."""
    traces = _traces(results, grid_dir)
    if not traces:
        return None
    from matplotlib.lines import Line2D

    names, lrs = norm_order(results["spec"]["norms"]), sorted(results["spec"]["lrs"])
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig, axes = agg_pyplot().subplots(
        rows,
        cols,
        figsize=(4.2 * cols + 2.8, 2.9 * rows + 0.4),
        squeeze=False,
        sharex=True,
        sharey=True,
        layout="constrained",
    )
    drawn: set[str] = set()
    for ax, name in zip(axes.flat, names):
        for i, lr in enumerate(lrs):
            color, dashes = lr_shade(norm_color(name), i, len(lrs)), _LR_STYLES[i % len(_LR_STYLES)]
            curves = traces.get((name, lr), [])
            for c in curves:
                ax.plot(c, color=color, linewidth=0.7, alpha=0.35)
                drawn |= _end_mark(ax, c, color)
            if curves:
                ax.plot(mean_curve(curves), color=color, linewidth=2.0, linestyle=dashes)
        ax.axhline(math.log(10), color="0.3", linestyle=":", linewidth=1)
        ax.set_title(_label(name), color=norm_color(name), fontweight="bold")
        ax.set_yscale("log")
        ax.set_ylim(0.05, AXIS_TOP)
        ax.grid(alpha=0.3, which="both")
    finish_grid(axes, len(names), "step", "training loss")
    handles = [
        Line2D(
            [],
            [],
            color=lr_shade("0.15", i, len(lrs)),
            linewidth=2.0,
            linestyle=_LR_STYLES[i % len(_LR_STYLES)],
            label=f"lr {lr:g}",
        )
        for i, lr in enumerate(lrs)
    ] + [
        Line2D([], [], color="0.3", linewidth=2.0, label="mean over seeds"),
        Line2D([], [], color="0.3", linewidth=0.7, alpha=0.5, label="one seed"),
        *_loss_marks_legend(drawn),
        Line2D([], [], color="0.3", linestyle=":", label="ln 10 (chance)"),
    ]
    fig.suptitle("(a) training loss per norm (running mean of 10 steps; log scale)", fontsize=TITLE)
    return _save(fig, path, handles, "learning rate")


def _unplateaued(vals: list[tuple], plateau: dict) -> bool:
    """Most seeds of one (norm, batch size) did not reach their plateau (a seed without a check counts as not)."""
    checks = [plateau.get(v[2]) for v in vals]
    return 2 * sum(1 for x in checks if x and x.get("plateau")) <= len(checks)


def _ring_unplateaued(ax, vals_by_x: dict[float, list[tuple]], plateau: dict, dodge: float) -> set[int]:
    """An open ring around each mean whose seeds mostly did not reach their plateau; the batch sizes ringed."""
    ringed = set()
    for x, vals in vals_by_x.items():
        if _unplateaued(vals, plateau):
            mean = sum(v[0] for v in vals) / len(vals)
            ax.plot([x * dodge], [mean], "o", markersize=15, markerfacecolor="none", markeredgecolor="k")
            ringed.add(int(x))
    return ringed


def batch_plot(results: dict, path: Path, plateau: dict | None = None) -> Path | None:
    """Test accuracy against the batch size (log axis): eval mode (running statistics) and train mode (batch
    statistics) side by side, one colour per norm, seeds faint around the bold mean.

    ``plateau`` (cell id -> :func:`~normlab_lab.demo.claims.plateau_check`): a mean whose seeds
    mostly did not reach their plateau is ringed, and the figure says under it that those points are not
    comparable (equal epochs are fewer steps at a larger batch)."""
    bss = sorted(results["spec"]["batch_sizes"])
    if len(bss) < 2:
        return None
    from matplotlib.lines import Line2D

    fig, axes = agg_pyplot().subplots(1, 2, figsize=(13, 5.2), sharey=True, layout="constrained")
    handles, ringed = [], set()
    names = norm_order(results["spec"]["norms"])
    for i, name in enumerate(names):
        color = norm_color(name)
        for ax, key in zip(axes, ("final_test_acc", "final_test_acc_train_mode")):
            vals = _seed_values(results, name, key, "batch_size")
            if vals:
                dodge = 2 ** (0.04 * (i - (len(names) - 1) / 2))
                _seeds_and_mean(ax, vals, color, dodge)
                if plateau is not None:
                    ringed |= _ring_unplateaued(ax, vals, plateau, dodge)
        handles.append(Line2D([], [], color=color, linewidth=2.2, label=name))
    chance = chance_level(results)
    steps = {int(c["batch_size"]): c.get("steps_run") for c in results["cells"]}
    for ax, title in zip(axes, ("eval mode: running statistics", "train mode: statistics of each test batch")):
        if chance:
            ax.axhline(100 * chance, color="0.4", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(bss)
        ax.set_xticklabels([f"{b}\n({steps.get(b)})" for b in bss])
        ax.minorticks_off()
        ax.set(
            xlabel="batch size, log scale (training steps)",
            title=title,
            ylim=(0, 100),
            xlim=(bss[0] / 1.5, bss[-1] * 1.5),
        )
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy (%)")
    fig.suptitle("(b) accuracy vs batch size (lr scaled linearly with the batch size, equal epochs)", fontsize=TITLE)
    extra = []
    if ringed:
        extra.append(
            Line2D(
                [],
                [],
                marker="o",
                markersize=12,
                markerfacecolor="none",
                markeredgecolor="k",
                linestyle="",
                label="not at its plateau\n(loss still falling)",
            )
        )
    if chance:
        extra.append(Line2D([], [], color="0.4", linestyle=":", label=f"chance ({100 * chance:.0f} %)"))
    notes = []
    few, many = bss[-1], bss[0]
    if steps.get(few) and steps.get(many) and steps[many] > 2 * steps[few]:
        notes.append(
            f"Equal epochs: batch {few} trains {steps[few]} steps, batch {many} {steps[many]}; accuracy here mixes "
            "the batch size with the number of steps."
        )
    if ringed:
        where = ", ".join(str(b) for b in sorted(ringed, reverse=True))
        notes.append(
            f"Ringed means did not reach their plateau (batch {where}): under-trained, so they do not show the "
            "effect of the batch size itself."
        )
    note = "\n".join(notes) or None
    return _save(fig, path, handles + _marks_legend(results, extra), "norm", note)
