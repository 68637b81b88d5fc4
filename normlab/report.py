"""Render a comparison grid's ``results.json`` as a markdown report and PNG plots.

Everything here is computed from the results dict written by :func:`normlab.experiments.run_grid`, so
``normlab report DIR`` re-renders the same report without training. The headline effects of the PWS
paper are judged by the explicit criteria in :data:`CRITERIA`, never hard-coded.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Criteria for the headline effects (absolute accuracy, fractions in [0, 1]).
FAIL_MARGIN = 0.10      # "failed": collapsed in most seeds, or final accuracy <= chance + FAIL_MARGIN
TRAIN_FRACTION = 0.80   # "trains": no seed collapsed and final acc >= chance + 0.8 * (best acc in grid - chance)
DEGRADE_DROP = 0.05     # "degrades": final acc at the small batch is >= 5 points below the base batch size
CRITERIA = (
    f"A setting *failed* if most seeds collapsed (non-finite loss) or its mean final test accuracy is at most "
    f"chance + {FAIL_MARGIN:.2f}; otherwise it *learns*. It *trains* if no seed collapsed and its mean final "
    f"accuracy is at least "
    f"chance + {TRAIN_FRACTION:.2f} x (best mean final accuracy in the grid - chance). A norm *degrades* at a "
    f"small batch if it failed there or its mean final accuracy is >= {DEGRADE_DROP * 100:.0f} points below its "
    f"accuracy at the base batch size (same learning rate); otherwise it *holds*."
)


# --------------------------------------------------------------------------------------------------
# Lookups
# --------------------------------------------------------------------------------------------------

def _groups(results: dict[str, Any]) -> dict[tuple[str, float, int], dict[str, Any]]:
    return {(g["name"], float(g["lr"]), int(g["batch_size"])): g for g in results["groups"]}


def _chance(results: dict[str, Any]) -> float:
    n = results.get("num_classes")
    return 1.0 / n if n else 0.0


def _best_final(results: dict[str, Any]) -> float:
    vals = [g["final_mean"] for g in results["groups"] if g["final_mean"] is not None]
    return max(vals) if vals else 0.0


def failed(g: dict[str, Any] | None, chance: float) -> bool:
    """Most seeds collapsed, or mean final accuracy at most chance + FAIL_MARGIN."""
    if g is None:
        return False
    if 2 * g["collapsed_count"] > g["n_seeds"]:
        return True
    return g["final_mean"] is None or g["final_mean"] <= chance + FAIL_MARGIN


def trains(g: dict[str, Any] | None, chance: float, best: float) -> bool:
    """No seed collapsed and mean final accuracy close to the best of the grid (see CRITERIA)."""
    if g is None or g["collapsed_count"] > 0 or g["final_mean"] is None:
        return False
    return g["final_mean"] >= chance + TRAIN_FRACTION * (best - chance)


def _acc(g: dict[str, Any] | None) -> str:
    if g is None or g["final_mean"] is None:
        return "n/a"
    s = f"{100 * g['final_mean']:.1f}"
    if g["n_seeds"] > 1:
        s += f" ± {100 * g['final_std']:.1f}"
    s += " %"
    if g["collapsed_count"]:
        s += f" (collapsed {g['collapsed_count']}/{g['n_seeds']})"
    return s


# --------------------------------------------------------------------------------------------------
# Headline effects
# --------------------------------------------------------------------------------------------------

def headline_effects(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Judge the PWS paper's headline effects from the numbers.

    Returns a list of ``{"effect", "appeared": True | False | None (not testable), "text"}``.
    """
    spec = results["spec"]
    G = _groups(results)
    chance, best = _chance(results), _best_final(results)
    names = list(spec["norms"])
    base_lr, base_bs = float(spec["base_lr"]), int(spec["base_batch_size"])
    effects = []

    # (1) high learning rate: plain net without normalization collapses, BN and PWS still train.
    e1 = "At a learning rate where the plain net without normalization collapses, BN and PWS still train"
    need = [n for n in ("none", "bn", "pws") if n not in names]
    lrs = sorted({lr for (n, lr, bs) in G if n == "none" and bs == base_bs})
    if need or not lrs:
        effects.append({"effect": e1, "appeared": None,
                        "text": f"not testable: the grid lacks {', '.join(need) or 'a learning-rate sweep'}"})
    else:
        bad = [lr for lr in lrs if failed(G.get(("none", lr, base_bs)), chance)]
        learns = [lr for lr in lrs if lr not in bad]
        # a learning-rate effect: the net learns at some lr and fails at a higher one
        bad_above = [lr for lr in bad if any(x < lr for x in learns)]
        where = ", ".join(f"{x:g}: {_acc(G.get(('none', x, base_bs)))}" for x in lrs)
        if not bad:
            effects.append({"effect": e1, "appeared": False, "text": (
                f"did not appear: without normalization the plain net did not fail at any learning rate in "
                f"the grid (batch size {base_bs}; lr {where})")})
        elif not bad_above:
            effects.append({"effect": e1, "appeared": False, "text": (
                f"did not appear: without normalization the plain net "
                f"{'failed at every learning rate' if not learns else 'failed already at the lowest learning rates'}"
                f" in the grid (batch size {base_bs}; lr {where}), so there is no learning rate at which it learns "
                f"and a higher one at which it fails")})
        else:
            bad = bad_above
            parts, ok_lrs = [f"without normalization the plain net learns at lr {', '.join(f'{x:g}' for x in learns)}"
                             f" and fails at {', '.join(f'{x:g}' for x in bad)} (lr {where})"], []
            for lr in bad:
                gb, gp = G.get(("bn", lr, base_bs)), G.get(("pws", lr, base_bs))
                tb, tp = trains(gb, chance, best), trains(gp, chance, best)
                if tb and tp:
                    ok_lrs.append(lr)
                parts.append(
                    f"lr {lr:g}: none {_acc(G.get(('none', lr, base_bs)))} (failed); "
                    f"BN {_acc(gb)} ({'trains' if tb else 'does not train'}); "
                    f"PWS {_acc(gp)} ({'trains' if tp else 'does not train'})"
                )
            if ok_lrs:
                head = f"appeared at lr {', '.join(f'{x:g}' for x in ok_lrs)}"
            else:
                lr = bad[0]
                miss = [n.upper() for n in ("bn", "pws") if not trains(G.get((n, lr, base_bs)), chance, best)]
                head = (f"did not appear: at lr {lr:g}{' (and above)' if len(bad) > 1 else ''} the unnormalized net "
                        f"fails, but {' and '.join(miss)} {'does' if len(miss) == 1 else 'do'} not train there either")
            effects.append({"effect": e1, "appeared": bool(ok_lrs), "text": head + ". " + "; ".join(parts)})

    # (2) small batch: BN degrades while GN, BRN and PWS hold.
    holders = ("gn", "brn", "pws")
    bss = sorted({bs for (n, lr, bs) in G if n == "bn" and lr == base_lr})
    need = [n for n in ("bn",) + holders if n not in names]
    small = bss[0] if bss else None
    shown = small if small is not None and small < base_bs else 2
    e2 = f"At batch size {shown}, BN degrades while GN, BRN and PWS hold"
    if need or small is None or small >= base_bs:
        effects.append({"effect": e2, "appeared": None,
                        "text": f"not testable: the grid lacks {', '.join(need) or 'a batch size below the base'}"})
    else:
        status, parts = {}, []
        for n in ("bn",) + holders:
            g0, g1 = G.get((n, base_lr, base_bs)), G.get((n, base_lr, small))
            if g0 is None or g1 is None or g0["final_mean"] is None:
                status[n] = None
                parts.append(f"{n.upper()} n/a")
                continue
            drop = g0["final_mean"] - (g1["final_mean"] if g1["final_mean"] is not None else 0.0)
            deg = failed(g1, chance) or drop >= DEGRADE_DROP
            status[n] = deg
            parts.append(f"{n.upper()} {_acc(g0)} -> {_acc(g1)} ({'degrades' if deg else 'holds'})")
        appeared = status["bn"] is True and all(status[h] is False for h in holders)
        if appeared:
            head = f"appeared at batch size {small}"
        elif status["bn"] is False:
            head = f"did not appear: BN did not degrade at batch size {small}"
        else:
            held = [h.upper() for h in holders if status[h] is False]
            fell = [h.upper() for h in holders if status[h] is not False]
            head = (f"partly: BN degraded at batch size {small}; held: {', '.join(held) or 'none'}; "
                    f"also degraded: {', '.join(fell)}")
        effects.append({"effect": e2, "appeared": appeared,
                        "text": head + f" (lr {base_lr:g}, base batch size {base_bs}). " + "; ".join(parts)})

    # (3) highest learning rate: which weight reparametrizations suffer (paper: PWS and WN at lr 0.1).
    lrs_all = sorted({lr for (n, lr, bs) in G if bs == base_bs})
    if len(lrs_all) > 1:
        top = lrs_all[-1]
        bad = [n for n in names if (n, top, base_bs) in G and not trains(G[(n, top, base_bs)], chance, best)]
        effects.append({"effect": f"Norms that do not train at the highest learning rate ({top:g})",
                        "appeared": None,
                        "text": ", ".join(bad) if bad else "every norm in the grid trains there"})

    # Norms that behaved identically in every cell (e.g. BRN still in its rmax = 1, dmax = 0 warm-up = BN).
    same = _identical_norms(results)
    if same:
        effects.append({"effect": "Norms with identical results in every cell", "appeared": None,
                        "text": "; ".join(" = ".join(grp) for grp in same)
                        + " (same test accuracy every epoch of every run: these settings did not differ in this grid,"
                          " e.g. Batch Renorm before its rmax/dmax schedule leaves warm-up is exactly BN)"})

    # (4) cost: step time of PWS vs output normalizations at the base point.
    st = {n: G[(n, base_lr, base_bs)]["step_time_s"] for n in names
          if (n, base_lr, base_bs) in G and G[(n, base_lr, base_bs)]["step_time_s"]}
    if "pws" in st and any(n in st for n in ("bn", "gn", "sn", "brn")):
        ratios = ", ".join(f"{n.upper()} {st[n] / st['pws']:.2f}x" for n in ("bn", "brn", "gn", "sn") if n in st)
        cheaper = all(st[n] >= st["pws"] for n in ("bn", "brn", "gn", "sn") if n in st)
        effects.append({"effect": "PWS step is cheaper than output normalization (CPU, this model)",
                        "appeared": cheaper,
                        "text": f"step time relative to PWS ({1000 * st['pws']:.1f} ms): {ratios} (mean step times of "
                                f"runs made at different moments, noisy on a shared machine; `normlab bench "
                                f"--steps` times them side by side)"})
    return effects


def _identical_norms(results: dict[str, Any]) -> list[list[str]]:
    """Groups of comparison names whose runs have exactly the same test-accuracy history in every cell."""
    runs: dict[str, dict[tuple, tuple]] = {}
    for c in results.get("cells", []):
        key = (float(c["lr"]), int(c["batch_size"]), int(c["seed"]))
        runs.setdefault(c["name"], {})[key] = tuple(h.get("test_acc") for h in c.get("history", []))
    chance = _chance(results)

    def learned(n: str) -> bool:  # two nets stuck at chance predict alike without being the same method
        return any(a is not None and a > chance + FAIL_MARGIN for h in runs[n].values() for a in h)

    names = [n for n in results["spec"]["norms"] if n in runs and runs[n] and learned(n)]
    groups: list[list[str]] = []
    for n in names:
        for grp in groups:
            if runs[grp[0]] == runs[n]:
                grp.append(n)
                break
        else:
            groups.append([n])
    return [g for g in groups if len(g) > 1]


# --------------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------------

def _pm(m: float | None, s: float | None, n: int, scale: float = 100.0, fmt: str = ".1f") -> str:
    if m is None:
        return "n/a"
    if n > 1 and s is not None:
        return f"{scale * m:{fmt}} ± {scale * s:{fmt}}"
    return f"{scale * m:{fmt}}"


def markdown_table(results: dict[str, Any]) -> str:
    """One row per (norm, lr, batch size): accuracies as mean ± std over seeds (percent)."""
    spec = results["spec"]
    order = {n: i for i, n in enumerate(spec["norms"])}
    target = spec.get("target_acc")
    tgt = f"epochs to {100 * target:.0f} %" if target else "epochs to target"
    head = ["norm", "lr", "batch", "seeds", "final test acc %", "best test acc %", "collapsed", tgt,
            "step time ms"]
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
        rows.append("| " + " | ".join([
            g["name"], f"{g['lr']:g}", str(g["batch_size"]), str(n),
            _pm(g["final_mean"], g["final_std"], n), _pm(g["best_mean"], g["best_std"], n), coll, ett, step,
        ]) + " |")
    return "\n".join(rows)


def markdown_report(results: dict[str, Any], plots: Sequence[str] = ()) -> str:
    spec = results["spec"]
    chance = _chance(results)
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
        *([] if results.get("complete", True) else [
            "", f"**Partial results**: {len(results['cells'])} runs finished so far; rerun the same command to "
                f"complete the grid."]),
        "",
        "## Headline effects (computed from the table below)",
        "",
    ]
    for e in headline_effects(results):
        mark = {True: "**yes**", False: "**no**", None: "info"}[e["appeared"]]
        lines.append(f"- {e['effect']}: {mark}. {e['text']}")
    lines += ["", f"Criteria: {CRITERIA}", "", "## Results", "", markdown_table(results), ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
_STYLES = ("-", "--", "-.", ":")


def _style(i: int) -> dict[str, Any]:
    """Distinct marker and line style per norm, so curves that coincide (e.g. BN and BRN) stay visible."""
    return {"marker": _MARKERS[i % len(_MARKERS)], "linestyle": _STYLES[i % len(_STYLES)], "markersize": 5,
            "markerfacecolor": "none" if i % 2 else None}


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _sweep_plot(results: dict[str, Any], path: Path, axis: str) -> Path | None:
    """Final test accuracy vs ``axis`` ("lr" or "batch_size"), one line per norm, one panel per other value."""
    other = "batch_size" if axis == "lr" else "lr"
    spec = results["spec"]
    by_other: dict[float, dict[str, list[dict[str, Any]]]] = {}
    for g in results["groups"]:
        by_other.setdefault(g[other], {}).setdefault(g["name"], []).append(g)
    panels = {o: d for o, d in by_other.items() if any(len(v) > 1 for v in d.values())}
    if not panels:
        return None
    chance = _chance(results)
    plt = _plt()
    keys = sorted(panels)
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys) + 1.0, 4.2), squeeze=False)
    for ax, o in zip(axes[0], keys):
        for i, name in enumerate(spec["norms"]):
            gs = sorted(panels[o].get(name, []), key=lambda g: g[axis])
            gs = [g for g in gs if g["final_mean"] is not None]
            if not gs:
                continue
            xs = [g[axis] for g in gs]
            ys = [100 * g["final_mean"] for g in gs]
            es = [100 * (g["final_std"] or 0.0) for g in gs]
            ax.errorbar(xs, ys, yerr=es, capsize=3, label=name, **_style(i))
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
        ax.set_title(f"{other.replace('_', ' ')} = {o:g}" if axis == "lr" else f"lr = {o:g}")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    _legend(fig, axes)
    fig.suptitle(f"{spec['dataset']} / {spec['model']}: final test accuracy vs "
                 f"{'learning rate' if axis == 'lr' else 'batch size'}\n(mean ± std over seeds; x: a seed collapsed; "
                 f"dotted: chance)", fontsize=10)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _curves_plot(results: dict[str, Any], path: Path) -> Path | None:
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
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels) + 1.0, 4.2), squeeze=False)
    for ax, (lr, bs) in zip(axes[0], panels):
        for k, name in enumerate(spec["norms"]):
            runs = [c for c in results["cells"]
                    if c["name"] == name and float(c["lr"]) == lr and int(c["batch_size"]) == bs and c["history"]]
            if not runs:
                continue
            n_ep = max(len(c["history"]) for c in runs)
            xs, ys = [], []
            for i in range(n_ep):
                vals = [c["history"][i]["test_acc"] for c in runs
                        if i < len(c["history"]) and c["history"][i].get("test_acc") is not None]
                if vals:
                    xs.append(runs[0]["history"][min(i, len(runs[0]["history"]) - 1)]["epoch"] or i + 1)
                    ys.append(100 * sum(vals) / len(vals))
            ax.plot(xs, ys, label=name, **_style(k))
        if _chance(results):
            ax.axhline(100 * _chance(results), color="0.5", linewidth=0.8, linestyle=":")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("epoch")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"lr {lr:g}, batch size {bs}")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    _legend(fig, axes)
    fig.suptitle("test accuracy per epoch (mean over seeds; a collapsed run stops; dotted: chance)", fontsize=10)
    fig.savefig(path, dpi=100)
    plt.close(fig)
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
        _sweep_plot(results, out / "acc_vs_lr.png", "lr"),
        _sweep_plot(results, out / "acc_vs_batch_size.png", "batch_size"),
        _curves_plot(results, out / "training_curves.png"),
    ]
    return [p for p in made if p is not None]


def render_report(results: dict[str, Any], out_dir: str | os.PathLike) -> list[Path]:
    """Write results.md and the PNG plots into ``out_dir``; returns the paths written."""
    out = Path(out_dir)
    plots = render_plots(results, out)
    md = out / "results.md"
    md.write_text(markdown_report(results, [p.name for p in plots]))
    return [md, *plots]


def summary_lines(results: dict[str, Any]) -> list[str]:
    """Short console summary: the headline effects, one line each."""
    out = []
    for e in headline_effects(results):
        mark = {True: "YES", False: "NO", None: "info"}[e["appeared"]]
        out.append(f"[{mark}] {e['effect']}: {e['text']}")
    return out
