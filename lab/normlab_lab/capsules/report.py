"""The capsule grid's report: ``results.md`` (verdicts, per-variant table, paired comparisons, timing) and PNG
plots (test error per variant with every seed, training curves, time per step, coupling entropy per iteration).

Everything is computed from the results dict of :func:`normlab_lab.capsules.stats.collect`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from normlab.runner.grid.report import status_lines, write_report
from normlab.runner.io import atomic_write
from normlab_lab.capsules.stats import CRITERIA

__all__ = [
    "markdown_report",
    "variant_table",
    "comparison_table",
    "verdict_lines",
    "render_report",
    "render_plots",
    "summary_lines",
]

_VERDICT_MARK = {
    "reproduced": "**reproduced**",
    "consistent": "**consistent**",
    "contradicted": "**contradicted**",
    "not resolved": "**not resolved** (within seed noise)",
    "not run": "not run",
}


def _pm(m: float | None, s: float | None, scale: float = 100.0, fmt: str = ".2f") -> str:
    if m is None:
        return "n/a"
    return f"{scale * m:{fmt}} ± {scale * (s or 0.0):{fmt}}"


def _ci(p: dict[str, Any] | None, scale: float = 100.0) -> str:
    if p is None:
        return "n/a"
    return f"{scale * p['mean']:+.2f} [{scale * p['lo']:+.2f}, {scale * p['hi']:+.2f}]"


def _detach_cell(v: dict[str, Any]) -> str:
    if v["detach_rel_diff"] is None:
        return "-"
    ratio = "n/a" if v.get("detach_norm_ratio") is None else f"{v['detach_norm_ratio']:.3f}"
    return f"{v['detach_rel_diff']:.3f}, {v['detach_cosine']:.4f}, {ratio}"


def variant_table(results: dict[str, Any]) -> str:
    """One row per variant: test error and margin loss (mean ± std over seeds), entropy, time per step."""
    head = [
        "variant",
        "seeds",
        "test error %",
        "test margin loss x1e-3",
        "train loss x1e-3",
        "coupling entropy (nats)",
        "entropy after iteration 1..r",
        "detached vs full gradient: rel. diff, cosine, norm ratio",
        "recon / margin gradient on the encoder",
        "ms / step in training",
        "ms / step round-robin",
        "x r1",
    ]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in results["variants"]:
        ent = ", ".join(f"{e:.4f}" for e in v["entropy_by_iteration"]) or "n/a"
        rows.append(
            "| "
            + " | ".join(
                [
                    v["variant"],
                    str(v["n_seeds"]),
                    _pm(v["err_mean"], v["err_std"]),
                    _pm(v["margin_mean"], v["margin_std"], 1000.0, ".1f"),
                    "n/a" if v["train_loss_mean"] is None else f"{1000 * v['train_loss_mean']:.1f}",
                    "n/a" if v["entropy_mean"] is None else f"{v['entropy_mean']:.4f}",
                    ent,
                    _detach_cell(v),
                    "-" if v["recon_grad_ratio"] is None else f"{v['recon_grad_ratio']:.4f}",
                    "n/a" if not v["step_time_s"] else f"{1000 * v['step_time_s']:.1f}",
                    "n/a" if not v.get("bench_step_s") else f"{1000 * v['bench_step_s']:.1f}",
                    "n/a" if v["step_ratio"] is None else f"{v['step_ratio']:.2f}",
                ]
            )
            + " |"
        )
    return "\n".join(rows)


def comparison_table(results: dict[str, Any]) -> str:
    """The pre-declared paired comparisons: mean difference A - B with its 95 % interval."""
    head = [
        "family",
        "A",
        "B",
        "seeds",
        "error A - B, pp [95 % CI]",
        "error",
        "margin loss A - B x1e-3 [95 % CI]",
        "margin loss",
    ]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in results["comparisons"]:
        e, m = c["err"], c["margin"]
        rows.append(
            "| "
            + " | ".join(
                [
                    c["family"],
                    c["a"],
                    c["b"],
                    "n/a" if e is None else str(e["n"]),
                    _ci(e),
                    _label(e),
                    _ci(m, 1000.0),
                    _label(m),
                ]
            )
            + " |"
        )
    return "\n".join(rows)


def _identical(p: dict[str, Any] | None) -> bool:
    return p is not None and all(d == 0 for d in p["diffs"])


def _label(p: dict[str, Any] | None) -> str:
    if p is None:
        return "n/a"
    if _identical(p):
        return "identical in every seed"
    return "**real**" if p["real"] else "noise"


def _mark(v: dict[str, Any]) -> str:
    if v["verdict"] == "not resolved" and _identical(v["err"]):
        return "**not resolved** (the errors are identical in every seed: no effect)"
    return _VERDICT_MARK[v["verdict"]]


def verdict_lines(results: dict[str, Any]) -> list[str]:
    return [f"- {v['source']}: {v['claim']}: {_mark(v)}. {v['text']}." for v in results["verdicts"]]


def _timing_line(results: dict[str, Any]) -> str:
    tot = results.get("totals") or {}
    line = (
        f"Sum over the cells: {tot.get('cell_wall_s', 0.0):.0f} s wall, {tot.get('cell_cpu_s', 0.0):.0f} s CPU "
        f"(each cell in one process with 1 torch thread)."
    )
    for t in results.get("timings") or []:
        load = "" if t.get("load_avg") is None else f", load average {t['load_avg']:.1f} at the end"
        line += (
            f" An invocation ran {t['cells_run']} cells with {t['workers']} worker(s) in {t['wall_s']:.0f} s "
            f"wall, {t['cpu_s']:.0f} s CPU (all processes{load})."
        )
    return line


def _setup_line(results: dict[str, Any]) -> str:
    s, cells = results["spec"], results["cells"]
    params = sorted({c["num_parameters"] for c in cells if c.get("num_parameters")})
    size = (f"{cells[0].get('num_primary')} primary capsules, " if cells else "") + (
        f"{params[0]:,} parameters" + (f" ({params[-1]:,} with the decoder)" if len(params) > 1 else "")
        if params
        else ""
    )
    capped = s.get("max_steps_per_epoch") or s.get("test_subset")
    return (
        f"Dataset `{s['dataset']}`, CapsNet preset `{s['dataset']}` ({size}), Adam lr {s['lr']:g}, batch "
        f"{s['batch_size']}, {s['epochs']} epochs"
        + (f" of at most {s['max_steps_per_epoch']} steps" if s.get("max_steps_per_epoch") else "")
        + (f", first {s['test_subset']} test examples" if s.get("test_subset") else "")
        + f", seeds {', '.join(str(x) for x in s['seeds'])}. Test error is measured after the last epoch "
        f"(mean ± sample std over seeds)."
        + (
            " **Capped steps or test set: a pipeline check, not the documented protocol; its numbers mean nothing.**"
            if capped
            else ""
        )
    )


def markdown_report(results: dict[str, Any], plots: Sequence[str] = ()) -> str:
    lines = [
        "# normlab-lab capsules report",
        "",
        _setup_line(results),
        "",
        _timing_line(results),
        *status_lines(results),
    ]
    lines += [
        "",
        "## Verdicts",
        "",
        *verdict_lines(results),
        "",
        f"Criteria: {CRITERIA}",
        "",
        "## Variants",
        "",
        variant_table(results),
        "",
        "`detached`: naturomics' stop_gradient (`detach_inner=True`); `full`: the official code; r1 has no "
        "inner iteration, so both are the same computation there. Uniform coupling over 10 parents has "
        f"entropy ln 10 = {math.log(10):.4f} nats.",
        "",
        "## Paired comparisons (A - B per seed; negative: A has the lower error)",
        "",
        comparison_table(results),
        "",
    ]
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(lines)


def summary_lines(results: dict[str, Any]) -> list[str]:
    """One console line per verdict."""
    return [f"[{v['verdict']}] {v['claim']}: {v['text']}" for v in results["verdicts"]]


# --------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------

_COLORS = {"-": "0.35", "detached": "tab:blue", "full": "tab:orange"}
_LINES = {"-": "-", "detached": "--", "full": "-"}
_RCOLORS = ("0.2", "tab:green", "tab:purple", "tab:red", "tab:brown", "tab:cyan", "tab:olive")


def _line_style(results: dict[str, Any], v: dict[str, Any]) -> dict[str, Any]:
    """Curves: colour by iteration count, dashed for detached, solid for full (and r1)."""
    its = sorted(results["spec"]["iterations"])
    k = its.index(v["iterations"]) if v["iterations"] in its else 0
    return {"color": _RCOLORS[k % len(_RCOLORS)], "linestyle": _LINES[v["grad"]]}


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> Path:
    """Write the figure as PNG through normlab.runner.io (atomic, no link following) and close it."""
    try:
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=100))
    finally:
        plt.close(fig)
    return path


def _recons(results: dict[str, Any]) -> list[str]:
    return [r for r in results["spec"]["recons"] if any(v["recon"] == r for v in results["variants"])]


def _error_plot(results: dict[str, Any], path: Path) -> Path:
    """Test error per variant: every seed as a dot, mean ± std as a bar; one panel per reconstruction setting."""
    plt, recons = _plt(), _recons(results)
    fig, axes = plt.subplots(1, len(recons), figsize=(5.5 * len(recons), 4.2), squeeze=False, sharey=True)
    for ax, rec in zip(axes[0], recons):
        vs = [v for v in results["variants"] if v["recon"] == rec]
        for i, v in enumerate(vs):
            errs = [100 * c["final_test_err"] for c in results["cells"] if c["variant"] == v["variant"]]
            xs = [i + 0.08 * (k - (len(errs) - 1) / 2) for k in range(len(errs))]
            ax.plot(xs, errs, "o", color=_COLORS[v["grad"]], alpha=0.45, markersize=4)
            ax.errorbar(
                [i + 0.3],
                [100 * v["err_mean"]],
                yerr=[100 * (v["err_std"] or 0.0)],
                fmt="s",
                color=_COLORS[v["grad"]],
                capsize=3,
            )
        ax.set_xticks(range(len(vs)))
        ax.set_xticklabels([v["variant"].replace(" +rec", "") for v in vs], rotation=30, ha="right")
        ax.set_title(f"reconstruction {rec}")
        ax.set_ylabel("test error after the last epoch (%)")
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(
        "test error per variant (dots: seeds; square and bar: mean ± std)\ngrey: 1 iteration, blue: "
        "detached (stop_gradient), orange: full gradient",
        fontsize=9,
    )
    fig.tight_layout()
    return _save(plt, fig, path)


def _curve(results: dict[str, Any], variant: str, key: str) -> tuple[list[int], list[float]]:
    runs = [c["history"] for c in results["cells"] if c["variant"] == variant and c["history"]]
    xs, ys = [], []
    for i in range(min((len(h) for h in runs), default=0)):
        vals = [h[i][key] for h in runs if h[i].get(key) is not None]
        if vals:
            xs.append(runs[0][i]["epoch"])
            ys.append(sum(vals) / len(vals))
    return xs, ys


def _curves_plot(results: dict[str, Any], path: Path) -> Path:
    """Test error and test margin loss per epoch (mean over seeds), one column per reconstruction setting."""
    plt, recons = _plt(), _recons(results)
    fig, axes = plt.subplots(2, len(recons), figsize=(5.5 * len(recons) + 1.5, 7.0), squeeze=False)
    for col, rec in enumerate(recons):
        vs = [v for v in results["variants"] if v["recon"] == rec]
        for v in vs:
            for row, (key, scale) in enumerate((("test_err", 100.0), ("test_margin", 1.0))):
                xs, ys = _curve(results, v["variant"], key)
                axes[row][col].plot(
                    xs,
                    [scale * y for y in ys],
                    label=v["variant"].replace(" +rec", ""),
                    linewidth=1.2,
                    **_line_style(results, v),
                )
        axes[0][col].set_title(f"reconstruction {rec}")
        axes[0][col].set_ylabel("test error (%)")
        axes[1][col].set_ylabel("test margin loss")
        axes[0][col].set_yscale("log")
        axes[1][col].set_yscale("log")
        for row in range(2):
            axes[row][col].set_xlabel("epoch")
            axes[row][col].xaxis.get_major_locator().set_params(integer=True)
            axes[row][col].grid(alpha=0.3)
        axes[0][col].legend(fontsize=7, frameon=False)
    fig.suptitle("training curves (mean over seeds; colour: iterations; dashed: detached)", fontsize=10)
    fig.tight_layout()
    return _save(plt, fig, path)


def _step_plot(results: dict[str, Any], path: Path) -> Path:
    """Time per training step per variant: round-robin timing (bars) and the median during training (dots)."""
    plt = _plt()
    vs = results["variants"]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.55 * len(vs) + 2), 4.0))
    bench = [1000 * (v.get("bench_step_s") or 0.0) for v in vs]
    if any(bench):
        ax.bar(range(len(vs)), bench, color=[_COLORS[v["grad"]] for v in vs], label="round-robin, one batch")
    train = [(i, 1000 * v["step_time_s"]) for i, v in enumerate(vs) if v["step_time_s"]]
    ax.plot([i for i, _ in train], [t for _, t in train], "ko", markersize=4, label="median during training")
    ax.set_xticks(range(len(vs)))
    ax.set_xticklabels([v["variant"] for v in vs], rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("ms per training step (1 thread)")
    ax.set_title(f"time per step, batch {results['spec']['batch_size']}", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return _save(plt, fig, path)


def _entropy_plot(results: dict[str, Any], path: Path) -> Path:
    """Coupling entropy after each routing iteration of the trained models (mean over seeds and test examples)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for v in results["variants"]:
        e = v["entropy_by_iteration"]
        if e:
            ax.plot(
                range(1, len(e) + 1),
                e,
                marker="o" if v["recon"] == "on" else "x",
                label=v["variant"],
                markersize=4,
                alpha=0.8,
                **_line_style(results, v),
            )
    ax.axhline(math.log(10), color="0.5", linewidth=0.8, linestyle=":")
    ax.set_xlabel("routing iteration k (the coupling used by iteration k)")
    ax.set_ylabel("entropy of c over the parents (nats)")
    ax.set_title("coupling entropy of the trained models (dotted: uniform, ln 10)", fontsize=10)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, frameon=False, ncol=2)
    fig.tight_layout()
    return _save(plt, fig, path)


def render_plots(results: dict[str, Any], out_dir: str | os.PathLike) -> list[Path]:
    """Write error_by_variant.png, training_curves.png, step_time.png and coupling_entropy.png."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not results["variants"]:
        return []
    return [
        _error_plot(results, out / "error_by_variant.png"),
        _curves_plot(results, out / "training_curves.png"),
        _step_plot(results, out / "step_time.png"),
        _entropy_plot(results, out / "coupling_entropy.png"),
    ]


def render_report(results: dict[str, Any], out_dir: str | os.PathLike) -> list[Path]:
    """Write results.md and the PNG plots into ``out_dir``; returns the paths written."""
    return write_report(results, out_dir, render_plots, markdown_report)
