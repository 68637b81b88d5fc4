"""A comparison's figures, drawn to be read at a glance on a slide: the metric against the learning rate (one panel
per norm), the training loss per step (one panel per norm), the metric against the batch size. Each seed is a faint
line or point around a bold mean (its bar the range of the seeds, so it stays within the seeds' values), an axis is
logarithmic where its values span a decade or more, the legend sits outside the data and every mark is explained in
the figure; no text is smaller than :data:`FONT` points. A norm has the same colour in every figure
(:func:`~normlab.runner.grid.palette.norm_color`), and the norms come in one fixed order.

Every figure is computed from a ``results.json`` (:mod:`normlab.runner.grid.results`) and, for the loss curves, the
runs' ``loss_trace.json`` files, so ``normlab report DIR`` draws them again without training.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from normlab.monitor import CollapseCriteria
from normlab.monitor.plotting import spans_decades
from normlab.runner.grid.palette import norm_color, norm_order
from normlab.runner.grid.results import chance_accuracy, metric_name
from normlab.runner.io import atomic_savefig

__all__ = [
    "FONT",
    "TITLE",
    "agg_pyplot",
    "seed_range_bar",
    "metric_lr_plot",
    "loss_curves_plot",
    "metric_batch_plot",
    "smoothed",
    "lr_shade",
    "spans_decades",
    "save_figure",
    "finish_grid",
    "seeds_and_mean",
    "marks_legend",
    "mean_curve",
    "end_mark",
    "style_figure",
]

#: The smallest type of every figure in points (ticks, legends, notes), readable on a slide.
FONT = 10
#: The type of a figure's title in points.
TITLE = 12
#: The loss axis ends at this many times the reference (chance, else where the runs started): the failure taxonomy's
#: explosion (:class:`~normlab.monitor.CollapseCriteria`); a run above it is marked as exploded.
EXPLODED = CollapseCriteria().exploded


def agg_pyplot():
    """``matplotlib.pyplot`` on the Agg backend: figures are drawn to files, no display is needed."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as pyplot

    return pyplot


def seed_range_bar(mean: float, values: Sequence[float]) -> tuple[float, float]:
    """An error bar from ``mean`` down to the lowest and up to the highest of ``values`` (the seeds' results), as
    matplotlib's ``yerr`` takes it: two lengths, never negative (the mean of equal values can round past them)."""
    if not values:
        return 0.0, 0.0
    return max(0.0, mean - min(values)), max(0.0, max(values) - mean)


def style_figure(fig) -> None:
    """Every text of ``fig`` at least :data:`FONT` points (tick labels included)."""
    for ax in fig.axes:
        ax.tick_params(labelsize=FONT)
        for text in (ax.title, ax.xaxis.label, ax.yaxis.label):
            text.set_fontsize(max(text.get_fontsize(), FONT + 1))


def save_figure(fig, path: Path, handles=None, legend_title: str | None = None, note: str | None = None) -> Path:
    """Save ``fig`` (``layout="constrained"``) with the legend outside the panels on the right and ``note`` under
    them."""
    style_figure(fig)
    if handles:
        kw = {"fontsize": FONT, "frameon": False, "title": legend_title, "title_fontsize": FONT}
        fig.legend(handles=handles, loc="outside right center", **kw)
    if note:
        fig.supxlabel(note, fontsize=FONT, color="0.15")
    atomic_savefig(fig, path, dpi=100)
    agg_pyplot().close(fig)
    return path


def finish_grid(axes, used: int, xlabel: str, ylabel: str) -> None:
    """Hide the panels of a grid of axes past the first ``used``; label the bottom row's x and the left column's y."""
    for ax in axes.flat[used:]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel(xlabel)
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel)


class _Metric:
    """How a figure shows the results' metric: accuracy in percent on 0-100, any other metric as it is."""

    def __init__(self, results: dict[str, Any]) -> None:
        self.percent = (results.get("metric") or "accuracy") == "accuracy"
        self.scale = 100.0 if self.percent else 1.0
        self.label = "test accuracy (%)" if self.percent else f"test {metric_name(results)}"
        chance = chance_accuracy(results)
        self.chance = None if chance is None else 100 * chance

    def limits(self, ax) -> None:
        if self.percent:
            ax.set_ylim(0, 100)

    def chance_line(self, ax) -> None:
        if self.chance is not None:
            ax.axhline(self.chance, color="0.4", linestyle=":", linewidth=1)


def _seed_values(results: dict, name: str, key: str, x_key: str, scale: float) -> dict[float, list[tuple]]:
    """x -> [(value, collapsed)] over the seeds of ``name``."""
    out: dict[float, list[tuple]] = {}
    for c in results["cells"]:
        if c["name"] == name and c.get(key) is not None:
            out.setdefault(float(c[x_key]), []).append((scale * c[key], bool(c.get("collapsed"))))
    return dict(sorted(out.items()))


def seeds_and_mean(ax, xs_vals: dict[float, list[tuple]], color: str, dodge: float = 1.0, **line) -> Any:
    """A faint point per seed (an x where it collapsed), the bold mean with the range of the seeds as its bar;
    ``dodge`` multiplies the x values (a log axis) to set groups side by side (1: at their true x)."""
    xs_vals = {x * dodge: v for x, v in xs_vals.items()}
    for x, vals in xs_vals.items():
        ok, bad = [v[0] for v in vals if not v[1]], [v[0] for v in vals if v[1]]
        ax.plot([x] * len(ok), ok, "o", color=color, alpha=0.35, markersize=5)
        ax.plot([x] * len(bad), bad, "x", color=color, alpha=0.8, markersize=7, markeredgewidth=1.5)
    means = [sum(v[0] for v in vals) / len(vals) for vals in xs_vals.values()]
    bars = [seed_range_bar(m, [v[0] for v in vals]) for m, vals in zip(means, xs_vals.values())]
    yerr = [[b[0] for b in bars], [b[1] for b in bars]]
    return ax.errorbar(list(xs_vals), means, yerr=yerr, color=color, linewidth=2.2, capsize=3, **line)


def marks_legend(results: dict, extra: list | None = None) -> list:
    """The marks' legend: only those the figure draws (a collapsed seed's x only where a seed collapsed)."""
    from matplotlib.lines import Line2D

    marks = [
        Line2D([], [], color="0.3", linewidth=2.2, label="mean over seeds\n(bar: lowest to highest seed)"),
        Line2D([], [], color="0.3", marker="o", alpha=0.4, linestyle="", label="one seed"),
    ]
    if any(c.get("collapsed") for c in results["cells"]):
        marks.append(
            Line2D([], [], color="0.3", marker="x", markeredgewidth=1.5, linestyle="", label="one seed, collapsed")
        )
    return marks + (extra or [])


def _log_x(ax, xs: Sequence[float], base: float = 10) -> None:
    """A logarithmic x axis (when ``xs`` span a decade, or always for ``base`` 2: batch sizes) ticked at ``xs``."""
    if base == 2 or spans_decades(xs):
        ax.set_xscale("log", base=base)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{x:g}" for x in xs])
    ax.minorticks_off()
    pad = 1.4 if ax.get_xscale() == "log" else 0
    if pad:
        ax.set_xlim(min(xs) / pad, max(xs) * pad)


def metric_lr_plot(results: dict, path: Path) -> Path | None:
    """The final test metric against the learning rate: one panel per norm (small multiples on the same axes, so
    each norm's slope is its own), the other norms' means faint behind it; None with fewer than two learning rates
    at the base batch size."""
    spec = results["spec"]
    base_bs = spec.get("base_batch_size") or spec["batch_sizes"][0]
    cells = [c for c in results["cells"] if int(c["batch_size"]) == int(base_bs)]
    lrs = sorted({float(c["lr"]) for c in cells})
    if len(lrs) < 2:
        return None
    from matplotlib.lines import Line2D

    m, sub = _Metric(results), {**results, "cells": cells}
    names = norm_order(spec["norms"])
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig, axes = agg_pyplot().subplots(
        rows, cols, figsize=(3.6 * cols + 2.6, 2.7 * rows + 0.6), squeeze=False, sharex=True, layout="constrained"
    )
    values = {n: _seed_values(sub, n, "final_test_acc", "lr", m.scale) for n in names}
    means = {n: {x: sum(v[0] for v in vals) / len(vals) for x, vals in values[n].items()} for n in names}
    for ax, name in zip(axes.flat, names):
        for other in names:
            if other != name and means[other]:
                ax.plot(list(means[other]), list(means[other].values()), color="0.8", linewidth=1, zorder=1)
        if values[name]:
            seeds_and_mean(ax, values[name], norm_color(name))
        m.chance_line(ax)
        _log_x(ax, lrs)
        m.limits(ax)
        ax.set_title(name, color=norm_color(name), fontweight="bold")
        ax.grid(alpha=0.3)
    finish_grid(axes, len(names), "learning rate", m.label)
    fig.suptitle(f"final {m.label} vs learning rate, batch {base_bs}", fontsize=TITLE)
    extra = [Line2D([], [], color="0.8", linewidth=1, label="the other norms' means")]
    if m.chance is not None:
        extra.append(Line2D([], [], color="0.4", linestyle=":", label=f"chance ({m.chance:.0f} %)"))
    return save_figure(fig, path, marks_legend(sub, extra))


def smoothed(losses: list, window: int) -> list[float]:
    """Running mean over ``window`` steps (a non-finite or missing loss is NaN and ends the curve)."""
    out, recent = [], []
    for v in losses:
        recent = (recent + [math.nan if v is None else v])[-window:]
        out.append(sum(recent) / len(recent))
    return out


def _traces(results: dict, grid_dir: Path) -> dict[tuple[str, float], list[list[float]]]:
    """(norm, lr) -> the smoothed loss curve of each seed at the base batch size (from its loss_trace.json)."""
    spec = results["spec"]
    base_bs = spec.get("base_batch_size") or spec["batch_sizes"][0]
    out: dict[tuple[str, float], list[list[float]]] = {}
    for c in results["cells"]:
        trace = Path(grid_dir) / "runs" / c["cell"] / "loss_trace.json"
        if int(c["batch_size"]) == int(base_bs) and trace.is_file():
            t = json.loads(trace.read_text())
            out.setdefault((c["name"], float(c["lr"])), []).append(smoothed(t["losses"], t["window"]))
    return out


def mean_curve(curves: list[list[float]]) -> list[float]:
    """The mean of the seeds' curves where every seed is finite (NaN elsewhere)."""
    n = max(len(c) for c in curves)
    cols = [[c[i] for c in curves if i < len(c) and math.isfinite(c[i])] for i in range(n)]
    return [sum(v) / len(v) if len(v) == len(curves) else math.nan for v in cols]


def end_mark(ax, curve: list[float], color: str, top: float) -> set[str]:
    """A run whose loss left the axis: a triangle at ``top`` where it crossed; one whose loss became non-finite:
    an X at its last finite value (at ``top`` if above). Returns the marks drawn."""
    drawn = set()
    up = next((i for i, v in enumerate(curve) if math.isfinite(v) and v > top), None)
    if up is not None:
        ax.plot([up], [top], "^", color=color, markersize=8, markeredgecolor="k", zorder=5)
        drawn.add("^")
    finite = [i for i, v in enumerate(curve) if math.isfinite(v)]
    if finite and finite[-1] < len(curve) - 1:
        ax.plot([finite[-1]], [min(curve[finite[-1]], top)], "X", color=color, markersize=9, markeredgecolor="k")
        drawn.add("X")
    return drawn


_LR_STYLES = ("-", "--", "-.", (0, (5, 1, 1, 1, 1, 1)))  # the mean line of the 1st, 2nd, ... learning rate


def lr_shade(color: str, i: int, n: int) -> tuple[float, float, float]:
    """``color`` for the ``i``-th of ``n`` learning rates: mixed with white, the more the lower the rate (the lowest
    55 % white, the highest the colour itself), so a norm keeps its colour in every panel."""
    from matplotlib.colors import to_rgb

    white = 0.55 * (n - 1 - i) / max(1, n - 1)
    return tuple(c + (1 - c) * white for c in to_rgb(color))


def _loss_reference(results: dict, traces: dict) -> tuple[float | None, float]:
    """(chance loss or None, the reference the loss axis is scaled to: chance, else the median starting loss)."""
    n = results.get("num_classes")
    chance = math.log(n) if n and n > 1 and results.get("loss", "cross_entropy") == "cross_entropy" else None
    starts = sorted(c[0] for curves in traces.values() for c in curves if c and math.isfinite(c[0]))
    return chance, chance or (starts[len(starts) // 2] if starts else 1.0)


def _loss_legend(lrs: list[float], drawn: set[str], top: float, chance: float | None) -> list:
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], color=lr_shade("0.15", i, len(lrs)), linewidth=2.0, linestyle=style, label=f"lr {lr:g}")
        for i, (lr, style) in enumerate(zip(lrs, _LR_STYLES * len(lrs)))
    ]
    handles += [
        Line2D([], [], color="0.3", linewidth=2.0, label="mean over seeds"),
        Line2D([], [], color="0.3", linewidth=0.7, alpha=0.5, label="one seed"),
    ]
    if "^" in drawn:
        label = f"loss above {top:.3g}: exploded"
        handles.append(Line2D([], [], color="0.5", marker="^", markeredgecolor="k", linestyle="", label=label))
    if "X" in drawn:
        handles.append(Line2D([], [], color="0.5", marker="X", markeredgecolor="k", linestyle="", label="non-finite"))
    if chance is not None:
        handles.append(Line2D([], [], color="0.3", linestyle=":", label=f"ln {round(math.exp(chance))} (chance)"))
    return handles


def loss_curves_plot(results: dict, grid_dir: Path, path: Path) -> Path | None:
    """The smoothed training loss per step at the base batch size: one panel per norm in the norm's colour, the
    learning rate by shade and line style (light and solid: the lowest), each seed a faint line around the bold
    mean; a log loss axis (shared) unless a loss is <= 0; a run that exploded or went non-finite is marked."""
    traces = _traces(results, grid_dir)
    if not traces:
        return None
    names = norm_order(results["spec"]["norms"])
    lrs = sorted({lr for _, lr in traces})
    chance, ref = _loss_reference(results, traces)
    top = EXPLODED * ref
    values = [v for curves in traces.values() for c in curves for v in c if math.isfinite(v)]
    log = bool(values) and min(values) > 0
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    size = (4.2 * cols + 2.8, 2.9 * rows + 0.4)
    fig, axes = agg_pyplot().subplots(
        rows, cols, figsize=size, squeeze=False, sharex=True, sharey=True, layout="constrained"
    )
    drawn: set[str] = set()
    for ax, name in zip(axes.flat, names):
        for i, lr in enumerate(lrs):
            color = lr_shade(norm_color(name), i, len(lrs))
            for c in traces.get((name, lr), []):
                ax.plot(c, color=color, linewidth=0.7, alpha=0.35)
                drawn |= end_mark(ax, c, color, top)
            if traces.get((name, lr)):
                ax.plot(mean_curve(traces[(name, lr)]), color=color, linewidth=2.0, linestyle=_LR_STYLES[i % 4])
        if chance is not None:
            ax.axhline(chance, color="0.3", linestyle=":", linewidth=1)
        ax.set_title(name, color=norm_color(name), fontweight="bold")
        if log:
            ax.set_yscale("log")
            ax.set_ylim(min(values) / 2, top * 2.2)
        ax.grid(alpha=0.3, which="both")
    finish_grid(axes, len(names), "step", "training loss")
    scale = "log scale" if log else "linear scale"
    fig.suptitle(f"training loss per norm (running mean; {scale})", fontsize=TITLE)
    return save_figure(fig, path, _loss_legend(lrs, drawn, top, chance), "learning rate")


def metric_batch_plot(results: dict, path: Path) -> Path | None:
    """The final test metric against the batch size (log axis) at the base learning rate, one colour per norm,
    seeds faint around the bold mean; with ``eval_train_mode`` a second panel with batch statistics (train mode).
    None with fewer than two batch sizes."""
    spec = results["spec"]
    base_lr = float(spec.get("base_lr") or spec["lrs"][0])
    cells = [c for c in results["cells"] if float(c["lr"]) == base_lr]
    bss = sorted({int(c["batch_size"]) for c in cells})
    if len(bss) < 2:
        return None
    from matplotlib.lines import Line2D

    m, sub = _Metric(results), {**results, "cells": cells}
    keys = ["final_test_acc"]
    if any(c.get("final_test_acc_train_mode") is not None for c in cells):
        keys.append("final_test_acc_train_mode")
    size = (6.5 * len(keys), 5.2)
    fig, axes = agg_pyplot().subplots(1, len(keys), figsize=size, sharey=True, squeeze=False, layout="constrained")
    names = norm_order(spec["norms"])
    for i, name in enumerate(names):
        for ax, key in zip(axes[0], keys):
            vals = _seed_values(sub, name, key, "batch_size", m.scale)
            if vals:
                seeds_and_mean(ax, vals, norm_color(name), 2 ** (0.04 * (i - (len(names) - 1) / 2)))
    steps = {int(c["batch_size"]): c.get("steps_run") for c in cells}
    titles = ("eval mode: running statistics", "train mode: statistics of each test batch")
    for ax, title in zip(axes[0], titles if len(keys) > 1 else ("",)):
        m.chance_line(ax)
        _log_x(ax, bss, base=2)
        ax.set_xticklabels([f"{b}\n({steps.get(b)})" for b in bss])
        ax.set(xlabel="batch size, log scale (training steps)", title=title)
        m.limits(ax)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(m.label)
    fig.suptitle(f"final {m.label} vs batch size (base lr {base_lr:g}, lr scaling {spec.get('lr_scaling', 'none')})")
    handles = [Line2D([], [], color=norm_color(n), linewidth=2.2, label=n) for n in names]
    if m.chance is not None:
        handles.append(Line2D([], [], color="0.4", linestyle=":", label=f"chance ({m.chance:.0f} %)"))
    few, many = bss[-1], bss[0]
    note = None
    if steps.get(few) and steps.get(many) and steps[many] > 2 * steps[few]:
        note = f"Equal epochs: batch {few} trains {steps[few]} steps, batch {many} {steps[many]}."
    return save_figure(fig, path, handles + marks_legend(sub), "norm", note)
