"""Render a grid's ``results.json`` as a markdown report and PNG plots.

Everything is computed from the results dict (:mod:`normlab.runner.grid.results`), so ``normlab report DIR`` re-renders
the same report without training. The report is the grid's table (mean ± std over seeds per norm, learning rate and
batch size) and its plots; a caller that judges claims from the numbers passes them as :class:`Effects`, shown
above the table.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from normlab.runner.grid.palette import norm_color, norm_order
from normlab.runner.grid.results import chance_level
from normlab.runner.io import atomic_savefig, atomic_write_text

__all__ = [
    "Effects",
    "lr_used",
    "markdown_table",
    "status_lines",
    "markdown_report",
    "agg_pyplot",
    "plot_sweep",
    "plot_curves",
    "seed_range_bar",
    "render_plots",
    "write_report",
    "render_report",
    "summary_lines",
    "print_summary",
]


@dataclass(frozen=True)
class Effects:
    """Claims that a grid's report judges from its numbers; the report shows none without them.

    Attributes:
        judge: ``judge(results)`` returns one dict per claim: ``effect`` (the claim in words), ``appeared``
            (True, False, or None when it is not testable or only information), ``text`` (the numbers behind the
            verdict) and, optionally, ``mark`` (``"tie"``).
        criteria: how the verdicts are reached, printed under them.
        title: the heading of the report's section.

    Example:
        >>> effects = Effects(lambda results: [{"effect": "two seeds", "appeared": None, "text": "2 seeds"}], "")
        >>> effects.judge({})[0]["effect"]
        'two seeds'
    """

    judge: Callable[[dict[str, Any]], list[dict[str, Any]]]
    criteria: str
    title: str = "Headline effects (computed from the table below)"


# --------------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------------


def _pm(m: float | None, s: float | None, n: int, scale: float = 100.0, fmt: str = ".1f") -> str:
    if m is None:
        return "n/a"
    if n > 1 and s is not None:
        return f"{scale * m:{fmt}} ± {scale * s:{fmt}}"
    return f"{scale * m:{fmt}}"


def lr_used(results: dict[str, Any], lr: float, bs: int) -> float:
    """The learning rate the runs of base lr ``lr`` at batch ``bs`` trained with (the grid scales it with the batch
    size under ``lr_scaling``), read from the runs themselves."""
    for c in results.get("cells", []):
        if float(c["lr"]) == float(lr) and int(c["batch_size"]) == int(bs) and c.get("train_lr") is not None:
            return float(c["train_lr"])
    spec = results["spec"]
    if spec.get("lr_scaling") == "linear":
        return float(lr) * int(bs) / int(spec["base_batch_size"])
    return float(lr)


def _lr_text(results: dict[str, Any], lr: float, bs: int) -> str:
    used = lr_used(results, lr, bs)
    return f"{used:g}" if used == float(lr) else f"{used:g} (base {lr:g})"


def markdown_table(results: dict[str, Any]) -> str:
    """One row per (norm, lr, batch size): accuracies as mean ± std over seeds (percent)."""
    spec = results["spec"]
    order = {n: i for i, n in enumerate(spec["norms"])}
    target = spec.get("target_acc")
    tgt = f"epochs to {100 * target:.0f} %" if target else "epochs to target"
    head = [
        "norm",
        "lr used",
        "batch",
        "seeds",
        "final test acc %",
        "best test acc %",
        "collapsed",
        tgt,
        "step time ms",
    ]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    groups = sorted(results["groups"], key=lambda g: (order.get(g["name"], 99), g["batch_size"], g["lr"]))
    for g in groups:
        n = g["n_seeds"]
        coll = f"{'yes' if g['collapsed_count'] else 'no'} ({g['collapsed_count']}/{n})"
        if not target:
            ett = "-"
        elif g["target_reached"]:
            ett = f"{g['epochs_to_target_mean']:.1f} ({g['target_reached']}/{n})"
        else:
            ett = f"not reached (0/{n})"
        step = f"{1000 * g['step_time_s']:.1f}" if g["step_time_s"] else "n/a"
        rows.append(
            "| "
            + " | ".join(
                [
                    g["name"],
                    _lr_text(results, g["lr"], g["batch_size"]),
                    str(g["batch_size"]),
                    str(n),
                    _pm(g["final_mean"], g["final_std"], n),
                    _pm(g["best_mean"], g["best_std"], n),
                    coll,
                    ett,
                    step,
                ]
            )
            + " |"
        )
    return "\n".join(rows)


def status_lines(results: dict[str, Any]) -> list[str]:
    """The report's lines for a grid that is still running and for its failed cells (none when neither)."""
    lines = []
    if not results.get("complete", True):
        lines += [
            "",
            f"**Partial results**: {len(results['cells'])} runs finished so far; rerun the same command to "
            f"complete the grid.",
        ]
    if results.get("failed"):
        lines += [
            "",
            "**Failed runs** (rerun the same command to retry them): "
            + "; ".join(f"`{f['cell']}`: {f['error']}" for f in results["failed"]),
        ]
    return lines


def markdown_report(results: dict[str, Any], plots: Sequence[str] = (), effects: Effects | None = None) -> str:
    """The report's markdown: the grid's settings, ``effects`` judged (if any), the table and the ``plots`` (file
    names beside results.md)."""
    spec = results["spec"]
    chance = chance_level(results)
    lines = [
        "# normlab comparison report",
        "",
        f"Dataset `{spec['dataset']}`, model `{spec['model']}` (width {spec['width']:g}), {spec['epochs']} epochs, "
        f"seeds {', '.join(str(s) for s in spec['seeds'])}, layout `{spec['layout']}` "
        f"(base lr {spec['base_lr']:g}, base batch size {spec['base_batch_size']}, "
        f"lr scaling `{spec.get('lr_scaling', 'none')}`)"
        + (f", at most {spec['max_steps_per_epoch']} steps per epoch" if spec.get("max_steps_per_epoch") else "")
        + (f"; chance level {100 * chance:.0f} %." if chance else "."),
        "Accuracies are percent, mean ± sample std over seeds. A run *collapsed* if its loss became non-finite.",
        *status_lines(results),
        "",
    ]
    if effects is not None:
        lines += [f"## {effects.title}", ""]
        for e in effects.judge(results):
            mark = (
                "**tie**" if e.get("mark") == "tie" else {True: "**yes**", False: "**no**", None: "info"}[e["appeared"]]
            )
            lines.append(f"- {e['effect']}: {mark}. {e['text']}")
        lines += ["", f"Criteria: {effects.criteria}", ""]
    lines += [
        "## Results",
        "",
        markdown_table(results),
        "",
    ]
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
_STYLES = ("-", "--", "-.", ":")


def _style(i: int, name: str) -> dict[str, Any]:
    """The ``i``-th norm's look: its colour (the same in every figure, :func:`~normlab.runner.grid.palette.norm_color`)
    and a distinct marker and line style, so curves that coincide (e.g. BN and BRN) stay visible."""
    return {
        "color": norm_color(name),
        "marker": _MARKERS[i % len(_MARKERS)],
        "linestyle": _STYLES[i % len(_STYLES)],
        "markersize": 5,
        "markerfacecolor": "none" if i % 2 else None,
    }


def agg_pyplot():
    """``matplotlib.pyplot`` on the Agg backend: figures are drawn to files, no display is needed."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(results: dict[str, Any], path: Path, axis: str) -> Path | None:
    """Final test accuracy vs ``axis`` ("lr" or "batch_size"), one line per norm, one panel per other value."""
    other = "batch_size" if axis == "lr" else "lr"
    spec = results["spec"]
    by_other: dict[float, dict[str, list[dict[str, Any]]]] = {}
    for g in results["groups"]:
        by_other.setdefault(g[other], {}).setdefault(g["name"], []).append(g)
    panels = {o: d for o, d in by_other.items() if any(len(v) > 1 for v in d.values())}
    if not panels:
        return None
    chance = chance_level(results)
    pyplot = agg_pyplot()
    keys = sorted(panels)
    fig, axes = pyplot.subplots(1, len(keys), figsize=(5.5 * len(keys) + 1.0, 4.2), squeeze=False)
    for ax, o in zip(axes[0], keys):
        for i, name in enumerate(norm_order(spec["norms"])):
            gs = sorted(panels[o].get(name, []), key=lambda g: g[axis])
            gs = [g for g in gs if g["final_mean"] is not None]
            if not gs:
                continue
            xs = [g[axis] for g in gs]
            ys = [100 * g["final_mean"] for g in gs]
            ax.errorbar(xs, ys, yerr=_seed_range(results, gs, axis, other), capsize=3, label=name, **_style(i, name))
            for g in gs:  # mark collapsed settings
                if g["collapsed_count"]:
                    ax.plot([g[axis]], [100 * g["final_mean"]], "kx", markersize=9)
        if chance:
            ax.axhline(100 * chance, color="0.5", linewidth=0.8, linestyle=":")
        ax.set_xscale("log", base=10 if axis == "lr" else 2)
        xs_all = sorted({g[axis] for d in (panels[o],) for v in d.values() for g in v})
        ax.set_xticks(xs_all)
        ax.set_xticklabels([f"{x:g}" for x in xs_all])
        ax.minorticks_off()
        ax.set_xlabel("learning rate" if axis == "lr" else "batch size")
        ax.set_ylabel("final test accuracy (%)")
        scaled = spec.get("lr_scaling") == "linear"
        ax.set_title(
            f"{other.replace('_', ' ')} = {o:g}"
            if axis == "lr"
            else f"base lr {o:g} at batch {spec['base_batch_size']}" + (", scaled linearly" if scaled else "")
        )
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    _legend(fig, axes)
    fig.suptitle(
        f"{spec['dataset']} / {spec['model']}: final test accuracy vs "
        f"{'learning rate' if axis == 'lr' else 'batch size'}\n(mean over seeds, bar: lowest to highest seed; "
        "x: a seed collapsed; "
        f"dotted: chance)",
        fontsize=10,
    )
    atomic_savefig(fig, path, dpi=100)
    pyplot.close(fig)
    return path


def _seed_range(results: dict[str, Any], groups: Sequence[dict[str, Any]], axis: str, other: str) -> list[list[float]]:
    """The error bars of ``groups`` (percent below and above each mean): from the mean to the lowest and the highest
    seed's final accuracy, so a bar stays within the seeds' values (a mean +- std can pass 0 % or 100 %)."""
    low, high = [], []
    for g in groups:
        accs = [
            100 * c["final_test_acc"]
            for c in results["cells"]
            if c["name"] == g["name"]
            and float(c[axis]) == float(g[axis])
            and float(c[other]) == float(g[other])
            and c.get("final_test_acc") is not None
        ]
        below, above = seed_range_bar(100 * g["final_mean"], accs)
        low.append(below)
        high.append(above)
    return [low, high]


def seed_range_bar(mean: float, values: Sequence[float]) -> tuple[float, float]:
    """An error bar from ``mean`` down to the lowest and up to the highest of ``values`` (the seeds' results), as
    matplotlib's ``yerr`` takes it: two lengths, never negative (the mean of equal values can round past them)."""
    if not values:
        return 0.0, 0.0
    return max(0.0, mean - min(values)), max(0.0, max(values) - mean)


def plot_curves(results: dict[str, Any], path: Path) -> Path | None:
    """Test accuracy per epoch (mean over seeds) per norm at the base point, highest lr and smallest batch."""
    spec = results["spec"]
    base_lr, base_bs = float(spec["base_lr"]), int(spec["base_batch_size"])
    pts = {(float(c["lr"]), int(c["batch_size"])) for c in results["cells"]}
    panels = [(base_lr, base_bs)] if (base_lr, base_bs) in pts else sorted(pts)[:1]
    hi = max((lr for lr, bs in pts if bs == base_bs), default=None)
    lo = min((bs for lr, bs in pts if lr == base_lr), default=None)
    if hi is not None and (hi, base_bs) not in panels:
        panels.append((hi, base_bs))
    if lo is not None and (base_lr, lo) not in panels:
        panels.append((base_lr, lo))
    if not panels:
        return None
    pyplot = agg_pyplot()
    fig, axes = pyplot.subplots(1, len(panels), figsize=(5.5 * len(panels) + 1.0, 4.2), squeeze=False)
    for ax, (lr, bs) in zip(axes[0], panels):
        for k, name in enumerate(norm_order(spec["norms"])):
            runs = [
                c
                for c in results["cells"]
                if c["name"] == name and float(c["lr"]) == lr and int(c["batch_size"]) == bs and c["history"]
            ]
            if not runs:
                continue
            n_ep = max(len(c["history"]) for c in runs)
            xs, ys = [], []
            for i in range(n_ep):
                vals = [
                    c["history"][i]["test_acc"]
                    for c in runs
                    if i < len(c["history"]) and c["history"][i].get("test_acc") is not None
                ]
                if vals:
                    xs.append(runs[0]["history"][min(i, len(runs[0]["history"]) - 1)]["epoch"] or i + 1)
                    ys.append(100 * sum(vals) / len(vals))
            ax.plot(xs, ys, label=name, **_style(k, name))
        if chance_level(results):
            ax.axhline(100 * chance_level(results), color="0.5", linewidth=0.8, linestyle=":")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("epoch")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"lr {_lr_text(results, lr, bs)}, batch size {bs}", fontsize=10)
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    _legend(fig, axes)
    fig.suptitle("test accuracy per epoch (mean over seeds; a collapsed run stops; dotted: chance)", fontsize=10)
    atomic_savefig(fig, path, dpi=100)
    pyplot.close(fig)
    return path


def _legend(fig, axes) -> None:
    """One legend for the figure, right of the panels (no curve hidden under it)."""
    handles, labels = [], []
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.tight_layout(rect=(0, 0, 1 - 0.9 / fig.get_figwidth(), 0.9))
    fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)


def render_plots(results: dict[str, Any], out_dir: str | os.PathLike) -> list[Path]:
    """Write acc_vs_lr.png, acc_vs_batch_size.png and training_curves.png (those the grid supports)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    made = [
        plot_sweep(results, out / "acc_vs_lr.png", "lr"),
        plot_sweep(results, out / "acc_vs_batch_size.png", "batch_size"),
        plot_curves(results, out / "training_curves.png"),
    ]
    return [p for p in made if p is not None]


def write_report(
    results: dict[str, Any],
    out_dir: str | os.PathLike,
    plots: Callable[[dict, Path], list[Path]],
    markdown: Callable[[dict, list[str]], str],
) -> list[Path]:
    """Draw ``plots(results, out)``, then write ``markdown(results, plot file names)`` to results.md; returns the
    paths written (shared by the grid's report and the capsule grid's)."""
    out = Path(out_dir)
    drawn = plots(results, out)
    md = out / "results.md"
    atomic_write_text(md, markdown(results, [p.name for p in drawn]))
    return [md, *drawn]


def render_report(results: dict[str, Any], out_dir: str | os.PathLike, effects: Effects | None = None) -> list[Path]:
    """Write results.md (with ``effects`` judged, if given) and the PNG plots into ``out_dir``; returns the paths
    written."""
    return write_report(results, out_dir, render_plots, lambda r, plots: markdown_report(r, plots, effects))


def summary_lines(results: dict[str, Any], effects: Effects | None = None) -> list[str]:
    """Short console summary: each of ``effects`` judged, one line each (none without them)."""
    out = []
    for e in effects.judge(results) if effects is not None else []:
        mark = "TIE" if e.get("mark") == "tie" else {True: "YES", False: "NO", None: "info"}[e["appeared"]]
        out.append(f"[{mark}] {e['effect']}: {e['text']}")
    return out


def print_summary(results: dict[str, Any], out_dir: str | os.PathLike, effects: Effects | None = None) -> None:
    """Print the table, ``effects`` judged (if given) and where the report and plots are."""
    out = Path(out_dir)
    print(markdown_table(results))
    lines = summary_lines(results, effects)
    if lines:
        print()
    for line in lines:
        print(line)
    print(f"\nreport: {out / 'results.md'}  plots: {', '.join(str(p) for p in sorted(out.glob('*.png')))}")
