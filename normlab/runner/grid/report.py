"""Render a comparison's ``results.json`` as a markdown report (``results.md``) and PNG plots.

The report opens with one row per normalization (:func:`~normlab.runner.grid.results.per_norm`): the highest
learning rate that trained, the setting of the lowest test loss with its loss and metric, the cost of a step, how
many runs collapsed or stopped early, and the monitor's view (its alarms and the layer they named, the regime
warning); then every (norm, lr, batch size) over seeds; then the plots (:mod:`normlab.runner.grid.plots`). A caller
that judges claims from the numbers (the lab's paper verdicts) passes them as :class:`Effects`, shown after the
per-norm table. Everything is computed from the results dict and the runs' files, so ``normlab report DIR``
renders the same report without training.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from normlab.runner.grid.plots import agg_pyplot, loss_curves_plot, metric_batch_plot, metric_lr_plot, seed_range_bar
from normlab.runner.grid.results import chance_accuracy, metric_name
from normlab.runner.io import atomic_write_text

__all__ = [
    "Effects",
    "lr_used",
    "norm_table",
    "markdown_table",
    "markdown_report",
    "status_lines",
    "render_plots",
    "write_report",
    "render_report",
    "summary_lines",
    "print_summary",
    "agg_pyplot",
    "seed_range_bar",
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


def _effect_mark(e: dict[str, Any], marks: dict) -> str:
    return marks["tie"] if e.get("mark") == "tie" else marks[e["appeared"]]


def _is_accuracy(results: dict[str, Any]) -> bool:
    return (results.get("metric") or "accuracy") == "accuracy"


def _value(results: dict[str, Any], m: float | None, s: float | None = None, n: int = 1) -> str:
    """A metric value as the report writes it: accuracy in percent with one decimal, others with 4 digits."""
    if m is None:
        return "n/a"
    acc = _is_accuracy(results)
    text = f"{100 * m:.1f}" if acc else f"{m:.4g}"
    if n > 1 and s is not None:
        text += f" ± {100 * s:.1f}" if acc else f" ± {s:.2g}"
    return text


def _metric_header(results: dict[str, Any], prefix: str) -> str:
    return f"{prefix} acc %" if _is_accuracy(results) else f"{prefix} {metric_name(results)}"


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


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _monitor_text(n: dict[str, Any]) -> tuple[str, str]:
    """The alarm and regime-warning cells of a norm's row."""
    if not n["monitored"]:
        return "not monitored", "-"
    alarms = f"{n['alarms']}/{n['runs']}"
    if n["alarm_layers"]:
        alarms += " (" + ", ".join(f"`{layer}` {k}" for layer, k in n["alarm_layers"][:2]) + ")"
    if not n.get("regime_watched"):
        return alarms, "off"
    regime = f"{n['regime_warnings']}/{n['regime_watched']}"
    if n["regime"]:
        regime += f": {n['regime'].get('case') or ''} at `{n['regime'].get('layer')}`".rstrip()
    return alarms, regime


def norm_table(results: dict[str, Any]) -> str:
    """One row per normalization (the module docstring)."""
    head = [
        "norm",
        "highest lr that trained",
        "lowest test loss at (lr, batch)",
        "test loss",
        _metric_header(results, "test"),
        "step ms",
        "collapsed",
        "stopped early",
        "monitor alarms (layer)",
        "regime warnings",
    ]
    rows = [_row(head), "|" + "---|" * len(head)]
    for n in results.get("norms") or []:
        tried = len(n["lrs_at_base"])
        highest = "none" if n["highest_lr_trained"] is None else f"{n['highest_lr_trained']:g}"
        best = n["best"]
        where = "-" if best is None else f"{_lr_text(results, best['lr'], best['batch_size'])}, {best['batch_size']}"
        loss = "n/a" if n["best_test_loss"] is None else f"{n['best_test_loss']:.4g}"
        seeds = best["n_seeds"] if best else 1
        step = f"{1000 * n['step_time_s']:.1f}" if n["step_time_s"] else "n/a"
        alarms, regime = _monitor_text(n)
        rows.append(
            _row(
                [
                    n["name"],
                    f"{highest} (of {tried})",
                    where,
                    loss,
                    _value(results, n["best_metric_mean"], n["best_metric_std"], seeds),
                    step,
                    f"{n['collapsed']}/{n['runs']}",
                    f"{n['stopped_early']}/{n['runs']}",
                    alarms,
                    regime,
                ]
            )
        )
    return "\n".join(rows)


def markdown_table(results: dict[str, Any]) -> str:
    """One row per (norm, lr, batch size): the metric as mean ± std over seeds, the test loss, collapses."""
    spec = results["spec"]
    order = {n: i for i, n in enumerate(spec["norms"])}
    target = spec.get("target_acc")
    tgt = f"epochs to {_value(results, target)}" if target else "epochs to target"
    head = ["norm", "lr used", "batch", "seeds", _metric_header(results, "final test")]
    head += [_metric_header(results, "best test"), "test loss", "collapsed", tgt, "step time ms"]
    rows = [_row(head), "|" + "---|" * len(head)]
    groups = sorted(results["groups"], key=lambda g: (order.get(g["name"], 99), g["batch_size"], g["lr"]))
    for g in groups:
        n = g["n_seeds"]
        if not target:
            ett = "-"
        elif g["target_reached"]:
            ett = f"{g['epochs_to_target_mean']:.1f} ({g['target_reached']}/{n})"
        else:
            ett = f"not reached (0/{n})"
        loss = g.get("test_loss_mean")
        cells = [g["name"], _lr_text(results, g["lr"], g["batch_size"]), str(g["batch_size"]), str(n)]
        cells += [
            _value(results, g["final_mean"], g["final_std"], n),
            _value(results, g["best_mean"], g["best_std"], n),
        ]
        cells += ["n/a" if loss is None else f"{loss:.4g}"]
        cells += [f"{'yes' if g['collapsed_count'] else 'no'} ({g['collapsed_count']}/{n})", ett]
        cells += [f"{1000 * g['step_time_s']:.1f}" if g["step_time_s"] else "n/a"]
        rows.append(_row(cells))
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


def _setting(results: dict[str, Any]) -> str:
    spec = results["spec"]
    width = f" (width {spec['width']:g})" if spec.get("width", 1.0) != 1.0 else ""
    chance = chance_accuracy(results)
    return (
        f"Model `{spec['model']}`{width} on data `{spec['dataset']}`, loss `{results.get('loss', 'cross_entropy')}`, "
        f"metric `{results.get('metric') or 'accuracy'}`; {spec['epochs']} epochs, seeds "
        f"{', '.join(str(s) for s in spec['seeds'])}, layout `{spec['layout']}` (base lr {spec['base_lr']:g}, base "
        f"batch size {spec['base_batch_size']}, lr scaling `{spec.get('lr_scaling', 'none')}`)"
        + (f", at most {spec['max_steps_per_epoch']} steps per epoch" if spec.get("max_steps_per_epoch") else "")
        + (f"; chance level {100 * chance:.0f} %." if chance else ".")
    )


def markdown_report(results: dict[str, Any], plots: Sequence[str] = (), effects: Effects | None = None) -> str:
    """The report's markdown (the module docstring): the settings, the per-norm table, ``effects`` judged (if any),
    every setting, the ``plots`` (file names beside results.md)."""
    lines = [
        "# normlab comparison report",
        "",
        _setting(results),
        "A run *collapsed* if its loss became non-finite, returned to chance (or to where it started) or never left "
        "it (normlab/monitor/collapse.py); *stopped early*: the run stopped there (a non-finite loss, or with "
        "`stop_on` confirmed, the monitor's alarm confirmed by a collapse). The *highest lr that trained* is the "
        "highest learning rate at the base batch size at which every seed trained: none collapsed and each one's "
        "loss went below 0.8 x its reference (chance, else where it started).",
        *status_lines(results),
        "",
        "## Per normalization",
        "",
        norm_table(results),
        "",
    ]
    if effects is not None:
        marks = {"tie": "**tie**", True: "**yes**", False: "**no**", None: "info"}
        lines += [f"## {effects.title}", ""]
        lines += [f"- {e['effect']}: {_effect_mark(e, marks)}. {e['text']}" for e in effects.judge(results)]
        lines += ["", f"Criteria: {effects.criteria}", ""]
    lines += [
        "## Every setting (mean ± sample std over seeds)",
        "",
        markdown_table(results),
        "",
    ]
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(lines)


def render_plots(results: dict[str, Any], out_dir: str | os.PathLike) -> list[Path]:
    """Write metric_vs_lr.png, loss_curves.png and metric_vs_batch_size.png (those the grid supports)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    made = [
        metric_lr_plot(results, out / "metric_vs_lr.png"),
        loss_curves_plot(results, out, out / "loss_curves.png"),
        metric_batch_plot(results, out / "metric_vs_batch_size.png"),
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


def _norm_line(results: dict[str, Any], n: dict[str, Any]) -> str:
    highest = "none" if n["highest_lr_trained"] is None else f"{n['highest_lr_trained']:g}"
    best, alarms = n["best"], f"; {n['alarms']} alarm(s)" if n["alarms"] else ""
    at = ""
    if best is not None:
        unit = "test acc %" if _is_accuracy(results) else f"test {metric_name(results)}"
        at = f"; best at lr {best['lr']:g}, batch {best['batch_size']}: test loss {n['best_test_loss']:.4g}, "
        at += f"{unit} {_value(results, n['best_metric_mean'])}"
    return f"{n['name']}: highest lr that trained {highest}{at}; collapsed {n['collapsed']}/{n['runs']}{alarms}"


def _effect_lines(results: dict[str, Any], effects: Effects | None) -> list[str]:
    marks = {"tie": "TIE", True: "YES", False: "NO", None: "info"}
    judged = effects.judge(results) if effects is not None else []
    return [f"[{_effect_mark(e, marks)}] {e['effect']}: {e['text']}" for e in judged]


def summary_lines(results: dict[str, Any], effects: Effects | None = None) -> list[str]:
    """A short console summary: one line per normalization, then each of ``effects`` judged (if given)."""
    return [_norm_line(results, n) for n in results.get("norms") or []] + _effect_lines(results, effects)


def print_summary(results: dict[str, Any], out_dir: str | os.PathLike, effects: Effects | None = None) -> None:
    """Print the per-norm table, ``effects`` judged (if given) and where the report and plots are."""
    out = Path(out_dir)
    print(norm_table(results))
    lines = _effect_lines(results, effects)
    if lines:
        print()
    for line in lines:
        print(line)
    print(f"\nreport: {out / 'results.md'}  plots: {', '.join(str(p) for p in sorted(out.glob('*.png')))}")
