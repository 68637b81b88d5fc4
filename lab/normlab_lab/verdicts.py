"""The PWS paper's headline effects, judged from a grid's results by the explicit criteria in :data:`CRITERIA`.

Nothing here is hard-coded: every verdict is computed from ``results.json`` (``normlab-lab report DIR`` re-judges
it). :data:`PAPER_EFFECTS` hands them to normlab's grid report (:class:`normlab.runner.grid.report.Effects`), and
:data:`PAPER_COMPARE` is normlab's comparison with that report (the CIFAR-10 reproduction, ``normlab-lab report``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from normlab.monitor.collapse import WINDOW_EXAMPLES, CollapseCriteria
from normlab.runner.experiments.compare import COMPARE
from normlab.runner.grid.report import Effects, render_report
from normlab.runner.grid.results import chance_level, format_acc

__all__ = [
    "FAIL_MARGIN",
    "TRAIN_FRACTION",
    "DEGRADE_DROP",
    "TIME_TIE",
    "CRITERIA",
    "DEGRADE_CRITERION",
    "COST_CRITERION",
    "failed",
    "trains",
    "headline_effects",
    "cost_comparison",
    "PAPER_EFFECTS",
    "PAPER_COMPARE",
    "render_paper_report",
]

# Criteria for the headline effects (absolute accuracy, fractions in [0, 1]).
FAIL_MARGIN = 0.10  # "failed": collapsed in most seeds, or final accuracy <= chance + FAIL_MARGIN
TRAIN_FRACTION = 0.80  # "trains": no seed collapsed and final acc >= chance + 0.8 * (best acc in grid - chance)
DEGRADE_DROP = 0.05  # "degrades": final acc at the small batch is >= 5 points below the base batch size
CRITERIA = (
    f"A setting *failed* if most seeds collapsed or its mean final test accuracy is at most chance + "
    f"{FAIL_MARGIN:.2f}; otherwise it *learns*. It *trains* if no seed collapsed and its mean final accuracy is at "
    f"least chance + {TRAIN_FRACTION:.2f} x (best mean final accuracy in the grid - chance). A run has *collapsed* "
    f"by normlab.monitor.collapse's failure taxonomy, chance being ln(C): "
    f"{CollapseCriteria().describe(examples=WINDOW_EXAMPLES)}."
)
DEGRADE_CRITERION = (
    f"A norm *degrades* at a small batch if it failed there or its mean final accuracy is >= "
    f"{DEGRADE_DROP * 100:.0f} points below its accuracy at the base batch size (same learning rate); otherwise it "
    f"*holds*."
)


# --------------------------------------------------------------------------------------------------
# Lookups
# --------------------------------------------------------------------------------------------------


def _groups(results: dict[str, Any]) -> dict[tuple[str, float, int], dict[str, Any]]:
    return {(g["name"], float(g["lr"]), int(g["batch_size"])): g for g in results["groups"]}


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


# --------------------------------------------------------------------------------------------------
# Headline effects
# --------------------------------------------------------------------------------------------------


def headline_effects(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Judge the PWS paper's headline effects from the numbers.

    Returns ``[{"effect", "appeared": True | False | None (not testable / information), "text"}, ...]``.
    """
    spec = results["spec"]
    ctx = _Context(
        results,
        _groups(results),
        chance_level(results),
        _best_final(results),
        list(spec["norms"]),
        float(spec["base_lr"]),
        int(spec["base_batch_size"]),
    )
    effects = [
        _effect_high_lr(ctx),
        _effect_small_batch(ctx),
        _effect_top_lr(ctx),
        _effect_identical(ctx),
        _effect_cost(ctx),
    ]
    return [e for e in effects if e is not None]


@dataclass
class _Context:
    results: dict[str, Any]
    groups: dict[tuple[str, float, int], dict[str, Any]]
    chance: float
    best: float
    names: list[str]
    base_lr: float
    base_bs: int

    def get(self, name: str, lr: float, bs: int | None = None) -> dict[str, Any] | None:
        return self.groups.get((name, lr, self.base_bs if bs is None else bs))

    def trains(self, name: str, lr: float, bs: int | None = None) -> bool:
        return trains(self.get(name, lr, bs), self.chance, self.best)


def _lrs(xs) -> str:
    return ", ".join(f"{x:g}" for x in xs)


def _effect_high_lr(ctx: _Context) -> dict[str, Any]:
    """(1) At a learning rate where the unnormalized plain net fails, BN and PWS still train."""
    effect = "At a learning rate where the plain net without normalization collapses, BN and PWS still train"
    need = [n for n in ("none", "bn", "pws") if n not in ctx.names]
    lrs = sorted({lr for (n, lr, bs) in ctx.groups if n == "none" and bs == ctx.base_bs})
    if need or not lrs:
        return {
            "effect": effect,
            "appeared": None,
            "text": f"not testable: the grid lacks {', '.join(need) or 'a learning-rate sweep'}",
        }
    bad = [lr for lr in lrs if failed(ctx.get("none", lr), ctx.chance)]
    learns = [lr for lr in lrs if lr not in bad]
    bad_above = [lr for lr in bad if any(x < lr for x in learns)]  # learns at some lr, fails at a higher one
    where = ", ".join(f"{x:g}: {format_acc(ctx.get('none', x))}" for x in lrs)
    if not bad_above:
        why = (
            "did not fail at any learning rate"
            if not bad
            else "failed at every learning rate"
            if not learns
            else "failed already at the lowest learning rates"
        )
        return {
            "effect": effect,
            "appeared": False,
            "text": (
                f"did not appear: without normalization the plain net {why} in the grid (batch size {ctx.base_bs}; "
                f"lr {where}), so there is no learning rate at which it learns and a higher one at which it fails"
            ),
        }
    parts = [
        f"without normalization the plain net learns at lr {_lrs(learns)} and fails at {_lrs(bad_above)} (lr {where})"
    ]
    ok = [lr for lr in bad_above if ctx.trains("bn", lr) and ctx.trains("pws", lr)]
    for lr in bad_above:
        parts.append(
            f"lr {lr:g}: none {format_acc(ctx.get('none', lr))} (failed); "
            + "; ".join(
                f"{n.upper()} {format_acc(ctx.get(n, lr))} ({'trains' if ctx.trains(n, lr) else 'does not train'})"
                for n in ("bn", "pws")
            )
        )
    if ok:
        head = f"appeared at lr {_lrs(ok)}"
    else:
        lr = bad_above[0]
        miss = [n.upper() for n in ("bn", "pws") if not ctx.trains(n, lr)]
        head = (
            f"did not appear: at lr {lr:g}{' (and above)' if len(bad_above) > 1 else ''} the unnormalized net "
            f"fails, but {' and '.join(miss)} {'does' if len(miss) == 1 else 'do'} not train there either"
        )
    return {"effect": effect, "appeared": bool(ok), "text": head + ". " + "; ".join(parts)}


def _degrades(ctx: _Context, name: str, small: int) -> tuple[bool | None, str]:
    g0, g1 = ctx.get(name, ctx.base_lr), ctx.get(name, ctx.base_lr, small)
    if g0 is None or g1 is None or g0["final_mean"] is None:
        return None, f"{name.upper()} n/a"
    drop = g0["final_mean"] - (g1["final_mean"] if g1["final_mean"] is not None else 0.0)
    deg = failed(g1, ctx.chance) or drop >= DEGRADE_DROP
    return deg, f"{name.upper()} {format_acc(g0)} -> {format_acc(g1)} ({'degrades' if deg else 'holds'})"


def _effect_small_batch(ctx: _Context) -> dict[str, Any]:
    """(2) At a small batch, BN degrades while GN, BRN and PWS hold."""
    holders = ("gn", "brn", "pws")
    bss = sorted({bs for (n, lr, bs) in ctx.groups if n == "bn" and lr == ctx.base_lr})
    need = [n for n in ("bn",) + holders if n not in ctx.names]
    small = bss[0] if bss else None
    effect = (
        f"At batch size {small if small is not None and small < ctx.base_bs else 2}, BN degrades while GN, "
        f"BRN and PWS hold"
    )
    if need or small is None or small >= ctx.base_bs:
        return {
            "effect": effect,
            "appeared": None,
            "text": f"not testable: the grid lacks {', '.join(need) or 'a batch size below the base'}",
        }
    judged = {n: _degrades(ctx, n, small) for n in ("bn",) + holders}
    status = {n: v[0] for n, v in judged.items()}
    appeared = status["bn"] is True and all(status[h] is False for h in holders)
    if appeared:
        head = f"appeared at batch size {small}"
    elif status["bn"] is False:
        head = f"did not appear: BN did not degrade at batch size {small}"
    else:
        held = [h.upper() for h in holders if status[h] is False]
        fell = [h.upper() for h in holders if status[h] is not False]
        head = (
            f"partly: BN degraded at batch size {small}; held: {', '.join(held) or 'none'}; "
            f"also degraded: {', '.join(fell)}"
        )
    return {
        "effect": effect,
        "appeared": appeared,
        "text": head + f" (lr {ctx.base_lr:g}, base batch size "
        f"{ctx.base_bs}). " + "; ".join(v[1] for v in judged.values()),
    }


def _effect_top_lr(ctx: _Context) -> dict[str, Any] | None:
    """(3) Which norms do not train at the highest learning rate (paper: PWS and WN at lr 0.1)."""
    lrs = sorted({lr for (n, lr, bs) in ctx.groups if bs == ctx.base_bs})
    if len(lrs) < 2:
        return None
    top = lrs[-1]
    bad = [n for n in ctx.names if ctx.get(n, top) is not None and not ctx.trains(n, top)]
    return {
        "effect": f"Norms that do not train at the highest learning rate ({top:g})",
        "appeared": None,
        "text": ", ".join(bad) if bad else "every norm in the grid trains there",
    }


def _effect_identical(ctx: _Context) -> dict[str, Any] | None:
    """Norms that behaved identically in every cell (e.g. BRN in its rmax = 1, dmax = 0 warm-up is BN)."""
    same = _identical_norms(ctx.results)
    if not same:
        return None
    return {
        "effect": "Norms with identical results in every cell",
        "appeared": None,
        "text": "; ".join(" = ".join(grp) for grp in same)
        + " (same test accuracy every epoch of every run: these settings did not differ in this grid, e.g. "
        "Batch Renorm before its rmax/dmax schedule leaves warm-up is exactly BN)",
    }


TIME_TIE = 0.03  # step times closer than 3 % of PWS's (or than the spread over seeds) are a tie
COST_CRITERION = (
    f"PWS's step is *cheaper* (or *dearer*) than a norm's when their mean step times at the base point differ by more "
    f"than the larger of the two norms' spread over seeds (max - min) and at least {100 * TIME_TIE:.0f} % of PWS's "
    f"step; otherwise it is a *tie*."
)


def _step_times(ctx: _Context, name: str) -> list[float]:
    """The step times of ``name``'s runs at the base point, one per seed (the group's mean without cells)."""
    ts = [
        c["step_time_s"]
        for c in ctx.results.get("cells", [])
        if c["name"] == name
        and c.get("step_time_s")
        and float(c["lr"]) == ctx.base_lr
        and int(c["batch_size"]) == ctx.base_bs
    ]
    g = ctx.get(name, ctx.base_lr)
    return ts or ([g["step_time_s"]] if g is not None and g.get("step_time_s") else [])


def cost_comparison(pws: list[float], other: list[float]) -> str:
    """ "cheaper" / "dearer" / "tie": PWS's step times (one per seed) against another norm's (COST_CRITERION)."""
    mp, mo = sum(pws) / len(pws), sum(other) / len(other)
    spread = max(max(pws) - min(pws), max(other) - min(other), TIME_TIE * mp)
    return "tie" if abs(mo - mp) <= spread else "cheaper" if mo > mp else "dearer"


def _effect_cost(ctx: _Context) -> dict[str, Any] | None:
    """(4) Step time of PWS against the output normalizations at the base point, a tie within the spread."""
    st = {n: ts for n in ctx.names if (ts := _step_times(ctx, n))}
    others = [n for n in ("bn", "brn", "gn", "sn") if n in st]
    if "pws" not in st or not others:
        return None
    said = {n: cost_comparison(st["pws"], st[n]) for n in others}
    mean = {n: sum(v) / len(v) for n, v in st.items()}
    ratios = ", ".join(
        f"{n.upper()} {mean[n] / mean['pws']:.2f}x ({'a tie' if said[n] == 'tie' else 'PWS ' + said[n]})"
        for n in others
    )
    appeared = (
        True
        if all(v == "cheaper" for v in said.values())
        else False
        if any(v == "dearer" for v in said.values())
        else None
    )
    return {
        "effect": "PWS step is cheaper than output normalization (CPU, this model)",
        "appeared": appeared,
        "mark": "tie" if appeared is None else None,
        "text": f"{'a tie within the timing spread: ' if appeared is None else ''}step time relative to PWS "
        f"({1000 * mean['pws']:.1f} ms): {ratios} (mean step times of runs made at different moments, "
        f"noisy on a shared machine; `normlab bench --steps` times them side by side)",
    }


def _identical_norms(results: dict[str, Any]) -> list[list[str]]:
    """Groups of comparison names whose runs have exactly the same test-accuracy history in every cell."""
    runs: dict[str, dict[tuple, tuple]] = {}
    for c in results.get("cells", []):
        key = (float(c["lr"]), int(c["batch_size"]), int(c["seed"]))
        runs.setdefault(c["name"], {})[key] = tuple(h.get("test_acc") for h in c.get("history", []))
    chance = chance_level(results)

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


PAPER_EFFECTS = Effects(headline_effects, f"{CRITERIA} {DEGRADE_CRITERION} {COST_CRITERION}")


def render_paper_report(results: dict[str, Any], out_dir: str | os.PathLike) -> list[Path]:
    """normlab's grid report with the paper's headline effects judged above the table."""
    return render_report(results, out_dir, PAPER_EFFECTS)


PAPER_COMPARE = dataclasses.replace(COMPARE, render=render_paper_report)
