"""The demo's plots, drawn to be read at a glance: each seed a faint line or point around a bold mean, log axes
where the data span decades, the legend outside the data and every mark explained in the figure."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from normlab.runner.grid.report import plt
from normlab.runner.grid.verdicts import chance_level
from normlab.runner.io import atomic_savefig

__all__ = ["lr_plot", "loss_curves_plot", "batch_plot", "smoothed"]

_LABELS = {"pws": "pws (gamma 1e-3)", "pws:gamma=0.01": "pws (gamma 1e-2)"}


def _label(name: str) -> str:
    return _LABELS.get(name, name)


def _save(fig, path: Path, legend_handles=None, legend_title: str | None = None, right: float = 0.84) -> Path:
    """Lay out the panels left of ``right`` (a fraction of the width), the legend in the space to their right."""
    fig.tight_layout(rect=(0, 0, right, 1 - 0.45 / fig.get_figheight()))
    if legend_handles:
        fig.legend(
            handles=legend_handles,
            loc="center left",
            bbox_to_anchor=(right, 0.5),
            fontsize=8,
            frameon=False,
            title=legend_title,
            title_fontsize=8,
        )
    atomic_savefig(fig, path, dpi=100)
    plt().close(fig)
    return path


def _seed_values(results: dict, name: str, key: str, x_key: str) -> dict[float, list[tuple[float, bool]]]:
    """x -> [(value, collapsed)] over the seeds of ``name``."""
    out: dict[float, list[tuple[float, bool]]] = {}
    for c in results["cells"]:
        if c["name"] == name and c.get(key) is not None:
            out.setdefault(float(c[x_key]), []).append((100 * c[key], bool(c.get("collapsed"))))
    return dict(sorted(out.items()))


def _seeds_and_mean(ax, xs_vals: dict[float, list[tuple[float, bool]]], color: str, dodge: float = 1.0, **line) -> Any:
    """Faint point per seed (x where it collapsed), bold mean line with its std as error bars; ``dodge`` multiplies
    the x values (a log axis), so norms at the same x stand side by side instead of on top of each other."""
    xs_vals = {x * dodge: v for x, v in xs_vals.items()}
    xs = list(xs_vals)
    for x, vals in xs_vals.items():
        ok = [v for v, col in vals if not col]
        bad = [v for v, col in vals if col]
        ax.plot([x] * len(ok), ok, "o", color=color, alpha=0.3, markersize=4)
        ax.plot([x] * len(bad), bad, "x", color=color, alpha=0.6, markersize=6)
    means = [sum(v for v, _ in vals) / len(vals) for vals in xs_vals.values()]
    stds = [_std([v for v, _ in vals]) for vals in xs_vals.values()]
    return ax.errorbar(xs, means, yerr=stds, color=color, linewidth=2.2, capsize=3, **line)


def _std(vals: list[float]) -> float:
    if len(vals) < 2:
        return 0.0
    m = sum(vals) / len(vals)
    return math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))


def _marks_legend(extra: list | None = None) -> list:
    from matplotlib.lines import Line2D

    return [
        Line2D([], [], color="0.3", linewidth=2.2, label="mean over seeds (bar: ± std)"),
        Line2D([], [], color="0.3", marker="o", alpha=0.4, linestyle="", label="one seed"),
        Line2D([], [], color="0.3", marker="x", linestyle="", label="one seed, collapsed"),
        *(extra or []),
    ]


def lr_plot(results: dict, path: Path) -> Path | None:
    """Final test accuracy against the learning rate (log axis), one colour per norm."""
    lrs = sorted(results["spec"]["lrs"])
    if len(lrs) < 2:
        return None
    from matplotlib.lines import Line2D

    fig, ax = plt().subplots(figsize=(8.5, 4.6))
    handles = []
    for i, name in enumerate(results["spec"]["norms"]):
        color = f"C{i % 10}"
        dodge = 10 ** (0.025 * (i - (len(results["spec"]["norms"]) - 1) / 2))
        _seeds_and_mean(ax, _seed_values(results, name, "final_test_acc", "lr"), color, dodge)
        handles.append(Line2D([], [], color=color, linewidth=2.2, label=_label(name)))
    chance = chance_level(results)
    if chance:
        ax.axhline(100 * chance, color="0.4", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_xticks(lrs)
    ax.set_xticklabels([f"{x:g}" for x in lrs])
    ax.minorticks_off()
    ax.set(
        xlabel="learning rate (log scale; norms side by side at each rate)",
        ylabel="final test accuracy (%)",
        ylim=(0, 100),
    )
    ax.grid(alpha=0.3)
    fig.suptitle(f"(a) accuracy vs learning rate, batch {results['spec']['base_batch_size']}", fontsize=10)
    dotted = Line2D([], [], color="0.4", linestyle=":", label="chance (10 %)")
    return _save(fig, path, handles + _marks_legend([dotted]), "norm", right=0.72)


def smoothed(losses: list, window: int) -> list[float]:
    """Running mean over ``window`` steps (non-finite losses are NaN and end the curve)."""
    out, recent = [], []
    for v in losses:
        recent = (recent + [math.nan if v is None else v])[-window:]
        out.append(sum(recent) / len(recent))
    return out


def _traces(results: dict, grid_dir: Path) -> dict[tuple[str, float], list[list[float]]]:
    out: dict[tuple[str, float], list[list[float]]] = {}
    for c in results["cells"]:
        trace = grid_dir / "runs" / c["cell"] / "loss_trace.json"
        if trace.is_file():
            t = json.loads(trace.read_text())
            out.setdefault((c["name"], float(c["lr"])), []).append(smoothed(t["losses"], t["window"]))
    return out


def _mean_curve(curves: list[list[float]]) -> list[float]:
    n = max(len(c) for c in curves)
    cols = [[c[i] for c in curves if i < len(c) and math.isfinite(c[i])] for i in range(n)]
    return [sum(v) / len(v) if len(v) == len(curves) else math.nan for v in cols]


LOSS_TOP = 20.0  # the loss axis ends here (about 9 x ln 10); a run above it diverged and is marked at the edge


def _end_mark(ax, curve: list[float], color: str) -> None:
    """A run whose loss left the axis (diverged): a triangle at the top edge where it crossed; one whose loss became
    non-finite: an X where its last finite value was (at the edge if above it)."""
    up = next((i for i, v in enumerate(curve) if math.isfinite(v) and v > LOSS_TOP), None)
    if up is not None:
        ax.plot([up], [LOSS_TOP], "^", color=color, markersize=7, markeredgecolor="k", clip_on=False, zorder=5)
    finite = [i for i, v in enumerate(curve) if math.isfinite(v)]
    if finite and finite[-1] < len(curve) - 1:
        ax.plot(
            [finite[-1]],
            [min(curve[finite[-1]], LOSS_TOP)],
            "X",
            color=color,
            markersize=8,
            markeredgecolor="k",
            clip_on=False,
            zorder=6,
        )


def loss_curves_plot(results: dict, grid_dir: Path, path: Path) -> Path | None:
    """Smoothed training loss per step: one panel per norm, one colour per learning rate, each seed a faint line
    around the bold mean (where every seed is finite), log loss axis shared by all panels."""
    traces = _traces(results, grid_dir)
    if not traces:
        return None
    from matplotlib.lines import Line2D

    names, lrs = list(results["spec"]["norms"]), sorted(results["spec"]["lrs"])
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt().subplots(
        rows, cols, figsize=(4.2 * cols + 2.4, 2.9 * rows), squeeze=False, sharex=True, sharey=True
    )
    colors = {lr: f"C{i}" for i, lr in enumerate(lrs)}
    for ax, name in zip(axes.flat, names):
        for lr in lrs:
            curves = traces.get((name, lr), [])
            for c in curves:
                ax.plot(c, color=colors[lr], linewidth=0.7, alpha=0.35)
                _end_mark(ax, c, colors[lr])
            if curves:
                ax.plot(_mean_curve(curves), color=colors[lr], linewidth=2.0)
        ax.axhline(math.log(10), color="0.3", linestyle=":", linewidth=1)
        ax.set_title(_label(name), fontsize=9)
        ax.set_yscale("log")
        ax.set_ylim(0.05, LOSS_TOP)
        ax.grid(alpha=0.3, which="both")
    for ax in axes.flat[len(names) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    for ax in axes[:, 0]:
        ax.set_ylabel("training loss")
    handles = [Line2D([], [], color=colors[lr], linewidth=2.0, label=f"lr {lr:g}") for lr in lrs] + [
        Line2D([], [], color="0.3", linewidth=2.0, label="mean over seeds"),
        Line2D([], [], color="0.3", linewidth=0.7, alpha=0.5, label="one seed"),
        Line2D(
            [],
            [],
            color="0.5",
            marker="^",
            markeredgecolor="k",
            linestyle="",
            label=f"loss above {LOSS_TOP:g}: diverged",
        ),
        Line2D([], [], color="0.5", marker="X", markeredgecolor="k", linestyle="", label="loss became non-finite"),
        Line2D([], [], color="0.3", linestyle=":", label="ln 10 (chance)"),
    ]
    fig.suptitle("(a) training loss per norm (running mean of 10 steps; log scale)", fontsize=10)
    return _save(fig, path, handles, "learning rate", right=1 - 2.3 / fig.get_figwidth())


def batch_plot(results: dict, path: Path) -> Path | None:
    """Test accuracy against the batch size (log axis): eval mode (running statistics) and train mode (batch
    statistics) side by side, one colour per norm, seeds faint around the bold mean."""
    bss = sorted(results["spec"]["batch_sizes"])
    if len(bss) < 2:
        return None
    from matplotlib.lines import Line2D

    fig, axes = plt().subplots(1, 2, figsize=(12, 4.4), sharey=True)
    handles = []
    for i, name in enumerate(results["spec"]["norms"]):
        color = f"C{i % 10}"
        for ax, key in zip(axes, ("final_test_acc", "final_test_acc_train_mode")):
            vals = _seed_values(results, name, key, "batch_size")
            if vals:
                _seeds_and_mean(ax, vals, color, 2 ** (0.04 * (i - (len(results["spec"]["norms"]) - 1) / 2)))
        handles.append(Line2D([], [], color=color, linewidth=2.2, label=name))
    chance = chance_level(results)
    steps = {int(c["batch_size"]): c.get("steps_run") for c in results["cells"]}
    for ax, title in zip(axes, ("eval mode: running statistics", "train mode: statistics of each test batch")):
        if chance:
            ax.axhline(100 * chance, color="0.4", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(bss)
        ax.set_xticklabels([f"{b}\n({steps.get(b)})" for b in bss], fontsize=8)
        ax.minorticks_off()
        ax.set(
            xlabel="batch size, log scale (steps per run)",
            title=title,
            ylim=(0, 100),
            xlim=(bss[0] / 1.5, bss[-1] * 1.5),
        )
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy (%)")
    fig.suptitle("(b) accuracy vs batch size (lr scaled linearly with the batch size, equal epochs)", fontsize=10)
    dotted = Line2D([], [], color="0.4", linestyle=":", label="chance (10 %)")
    return _save(fig, path, handles + _marks_legend([dotted]), "norm", right=0.8)
