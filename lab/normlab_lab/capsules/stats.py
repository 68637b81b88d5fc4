"""Analysis of the capsule routing grid: per-variant mean ± std, paired per-seed differences with 95 % intervals,
and the verdicts on the paper's and the seed's claims, by the criteria in :data:`CRITERIA` (fixed before the grid
was run; lab/docs/capsules.md).

Everything is computed from the cells' summaries, so re-rendering a ``results.json`` gives the same verdicts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from normlab.runner.grid.results import mean_std

__all__ = [
    "collect",
    "paired",
    "t_quantile",
    "comparisons",
    "verdicts",
    "variant_name",
    "CRITERIA",
    "RESULTS_KIND",
    "RESULTS_VERSION",
]

RESULTS_KIND = "capsules"
RESULTS_VERSION = 1
_HISTORY_KEYS = ("epoch", "train_loss", "train_err", "test_err", "test_margin", "entropy")
_CELL_KEYS = (
    "final_test_err",
    "final_test_margin",
    "final_train_loss",
    "final_entropy",
    "entropy_by_iteration",
    "detach_effect",
    "recon_share",
    "step_time_s",
    "wall_s",
    "cpu_s",
    "diverged",
    "epochs_run",
    "num_parameters",
    "num_primary",
)

CRITERIA = (
    "The measured quantity is the test error (percent) after the last epoch. For two variants A and B the per-seed "
    "difference err(A) - err(B) is paired (same seed: same initial weights, same batches in the same order); its "
    "mean gets a two-sided 95 % Student-t interval over the seeds. A difference is *real* when that interval "
    "excludes 0, otherwise it is *within seed noise*. A claim that A is better than B is *reproduced* when the "
    "difference is real in the claimed direction, *contradicted* when it is real in the other direction, and "
    "*not resolved* otherwise; a claim of no difference is *consistent* when the interval includes 0 and "
    "*contradicted* when it does not. A claim that A is the best of a set needs A's mean to be the lowest and a "
    "real difference to the named alternative. The test margin loss is judged the same way as a second, more "
    "sensitive measurement and reported beside the error; it does not change a verdict. With about 25 comparisons "
    "at 95 %, one or two *real* differences are expected by chance alone."
)

# two-sided 95 % quantiles of Student's t for 1..30 degrees of freedom
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)


def variant_name(iterations: int, grad: str, recon: str) -> str:
    """``r3 detached +rec`` style label (``r1 +rec``: one iteration, where the gradient variant is irrelevant)."""
    return f"r{iterations}" + ("" if grad == "-" else f" {grad}") + (" +rec" if recon == "on" else "")


def t_quantile(df: int) -> float:
    """The 97.5 % quantile of Student's t with ``df`` >= 1 degrees of freedom (table; z + 2.37/df above 30)."""
    if df < 1:
        raise ValueError(f"t_quantile: df must be >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.95996 + 2.37 / df


# --------------------------------------------------------------------------------------------------
# Collecting
# --------------------------------------------------------------------------------------------------


def _cell_record(cell, s: dict[str, Any]) -> dict[str, Any]:
    return {
        "cell": cell.cell_id,
        "variant": cell.variant,
        "iterations": cell.iterations,
        "grad": cell.grad,
        "recon": cell.recon,
        "seed": cell.seed,
        **{k: s.get(k) for k in _CELL_KEYS},
        "history": [{k: h.get(k) for k in _HISTORY_KEYS} for h in s.get("history", [])],
    }


def _variant_record(recs: list[dict[str, Any]]) -> dict[str, Any]:
    r0 = recs[0]
    em, es = mean_std([r["final_test_err"] for r in recs])
    mm, ms = mean_std([r["final_test_margin"] for r in recs])
    step = mean_std([r["step_time_s"] for r in recs])[0]
    by_it = [r["entropy_by_iteration"] or [] for r in recs]
    effects = [r["detach_effect"] for r in recs if r.get("detach_effect")]
    shares = [r["recon_share"] for r in recs if r.get("recon_share")]
    depth = min((len(b) for b in by_it), default=0)
    return {
        "variant": r0["variant"],
        "iterations": r0["iterations"],
        "grad": r0["grad"],
        "recon": r0["recon"],
        "n_seeds": len(recs),
        "seeds": [r["seed"] for r in recs],
        "err_mean": em,
        "err_std": es,
        "margin_mean": mm,
        "margin_std": ms,
        "train_loss_mean": mean_std([r["final_train_loss"] for r in recs])[0],
        "entropy_mean": mean_std([r["final_entropy"] for r in recs])[0],
        "entropy_by_iteration": [mean_std([b[k] for b in by_it])[0] for k in range(depth)],
        "detach_rel_diff": mean_std([e["rel_diff"] for e in effects])[0],
        "detach_cosine": mean_std([e["cosine"] for e in effects])[0],
        "detach_norm_ratio": mean_std([e.get("norm_ratio") for e in effects])[0],
        "recon_grad_ratio": mean_std([e["norm_ratio"] for e in shares])[0],
        "recon_grad_cosine": mean_std([e["cosine"] for e in shares])[0],
        "step_time_s": step,
        "diverged": sum(bool(r["diverged"]) for r in recs),
    }


def _variants(cells: list[dict[str, Any]], bench: dict[str, float] | None) -> list[dict[str, Any]]:
    """Per-variant records; ``step_ratio`` is the step time relative to r1 with the same reconstruction setting,
    from the round-robin ``bench`` when there is one (else from the steps timed during training)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for rec in cells:
        groups.setdefault(rec["variant"], []).append(rec)
    out = [_variant_record(recs) for recs in groups.values()]
    for v in out:
        v["bench_step_s"] = (bench or {}).get(v["variant"])
    for v in out:
        key = "bench_step_s" if bench else "step_time_s"
        base = next((b[key] for b in out if b["iterations"] == 1 and b["recon"] == v["recon"]), None)
        v["step_ratio"] = v[key] / base if v[key] and base else None
    return out


def collect(
    spec,
    pairs: Sequence[tuple[Any, dict[str, Any]]],
    complete: bool = True,
    failed: Sequence[tuple[Any, str]] = (),
    timings: Sequence[dict[str, Any]] = (),
    step_bench: dict[str, float] | None = None,
) -> dict[str, Any]:
    """results.json of a capsule grid from ``(cell, summary)`` pairs (``complete=False`` while it still runs);
    ``failed``: ``(cell, error line)`` of the cells that raised; ``timings``: wall and CPU time of each invocation
    that ran cells; ``step_bench``: seconds per training step of each variant timed round-robin
    (:func:`normlab_lab.capsules.train.step_benchmark`)."""
    cells = [_cell_record(c, s) for c, s in pairs]
    results = {
        "kind": RESULTS_KIND,
        "version": RESULTS_VERSION,
        "spec": spec.to_dict(),
        "complete": complete,
        "timings": list(timings),
        "step_bench": step_bench,
        "cells": cells,
        "variants": _variants(cells, step_bench),
        "failed": [{"cell": c.cell_id, "variant": c.variant, "seed": c.seed, "error": e} for c, e in failed],
    }
    results["comparisons"] = comparisons(results)
    results["verdicts"] = verdicts(results)
    results["totals"] = {
        "cell_wall_s": sum(c["wall_s"] or 0.0 for c in cells),
        "cell_cpu_s": sum(c["cpu_s"] or 0.0 for c in cells),
    }
    return results


# --------------------------------------------------------------------------------------------------
# Paired differences
# --------------------------------------------------------------------------------------------------


def _by_seed(results: dict[str, Any], variant: str, key: str) -> dict[int, float]:
    out = {}
    for c in results["cells"]:
        v = c.get(key)
        if c["variant"] == variant and v is not None and math.isfinite(v):
            out[c["seed"]] = float(v)
    return out


def paired(results: dict[str, Any], a: str, b: str, key: str = "final_test_err") -> dict[str, Any] | None:
    """Mean of ``key(a) - key(b)`` over the seeds both variants finished, its sample std and 95 % t interval.

    Returns None with fewer than 2 common seeds. ``real`` is True when the interval excludes 0.
    """
    xa, xb = _by_seed(results, a, key), _by_seed(results, b, key)
    seeds = sorted(set(xa) & set(xb))
    if len(seeds) < 2:
        return None
    d = [xa[s] - xb[s] for s in seeds]
    m, sd = mean_std(d)
    half = t_quantile(len(d) - 1) * sd / math.sqrt(len(d))
    lo, hi = m - half, m + half
    return {
        "a": a,
        "b": b,
        "key": key,
        "n": len(d),
        "seeds": seeds,
        "diffs": d,
        "mean": m,
        "std": sd,
        "lo": lo,
        "hi": hi,
        "real": bool(lo > 0 or hi < 0),
    }


def _names(results: dict[str, Any]) -> set[str]:
    return {v["variant"] for v in results["variants"]}


def _comparison_pairs(spec: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(family, A, B) of the comparisons fixed in advance: more iterations vs 1, detached vs full, rec on vs off."""
    its, grads, recons = spec["iterations"], spec["grads"], spec["recons"]
    out = []
    for rec in recons:
        for g in grads:
            out += [("iterations", variant_name(r, g, rec), variant_name(1, "-", rec)) for r in its if r > 1]
        if "detached" in grads and "full" in grads:
            out += [("gradient", variant_name(r, "detached", rec), variant_name(r, "full", rec)) for r in its if r > 1]
    if "on" in recons and "off" in recons:
        for r in its:
            for g in ("-",) if r == 1 else grads:
                out.append(("reconstruction", variant_name(r, g, "on"), variant_name(r, g, "off")))
    return out


def comparisons(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every pre-declared comparison with the paired error and margin-loss differences (None where not run)."""
    names = _names(results)
    out = []
    for family, a, b in _comparison_pairs(results["spec"]):
        if a in names and b in names:
            out.append(
                {
                    "family": family,
                    "a": a,
                    "b": b,
                    "err": paired(results, a, b),
                    "margin": paired(results, a, b, "final_test_margin"),
                }
            )
    return out


# --------------------------------------------------------------------------------------------------
# Verdicts
# --------------------------------------------------------------------------------------------------


def _judge(p: dict[str, Any] | None, claim: str) -> str:
    """``claim``: ``less`` (A better than B) or ``equal``; see CRITERIA."""
    if p is None:
        return "not run"
    if claim == "equal":
        return "contradicted" if p["real"] else "consistent"
    if p["real"]:
        return "reproduced" if p["hi"] < 0 else "contradicted"
    return "not resolved"


def _interval(p: dict[str, Any] | None, scale: float = 100.0, unit: str = " pp") -> str:
    if p is None:
        return "n/a"
    kind = (
        "identical in every seed" if all(d == 0 for d in p["diffs"]) else "real" if p["real"] else "within seed noise"
    )
    return f"{scale * p['mean']:+.2f}{unit} [{scale * p['lo']:+.2f}, {scale * p['hi']:+.2f}] ({kind}, n={p['n']})"


def _verdict(results, claim_id: str, text: str, a: str, b: str, kind: str, source: str) -> dict[str, Any]:
    pe, pm = paired(results, a, b), paired(results, a, b, "final_test_margin")
    return {
        "id": claim_id,
        "source": source,
        "claim": text,
        "a": a,
        "b": b,
        "kind": kind,
        "verdict": _judge(pe, kind),
        "err": pe,
        "margin": pm,
        "text": f"err({a}) - err({b}) = {_interval(pe)}; margin loss difference {_interval(pm, 1000.0, ' x1e-3')}",
    }


def _best_verdict(results, claim_id: str, text: str, best: str, rival: str, pool: list[str]) -> dict[str, Any]:
    """``best`` is the best of ``pool``: lowest mean error and really better than ``rival`` (CRITERIA)."""
    v = _verdict(results, claim_id, text, best, rival, "less", "seed 001")
    means = {x["variant"]: x["err_mean"] for x in results["variants"] if x["variant"] in pool}
    if best not in means or len(means) < 2:
        return {**v, "verdict": "not run"}
    lowest = min(means, key=lambda k: means[k])
    beaten = [o for o in means if o != best and (p := paired(results, o, best)) and p["real"] and p["hi"] < 0]
    if beaten:
        v["verdict"] = "contradicted"
    elif v["verdict"] == "reproduced" and lowest != best:
        v["verdict"] = "not resolved"
    v["text"] += f"; lowest mean error of {', '.join(pool)}: {lowest}" + (
        f"; really better than {best}: {', '.join(beaten)}" if beaten else ""
    )
    return v


def verdicts(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The paper's claims (MNIST, full gradient) and the seed's (naturomics' stop_gradient), per reconstruction
    setting, judged on this grid by CRITERIA."""
    vn = variant_name
    spec, names, out = results["spec"], _names(results), []
    for rec in spec["recons"]:
        tag = " (reconstruction on)" if rec == "on" else " (reconstruction off)"
        paper = (
            "3 routing iterations beat 1 (MNIST 0.25 % vs 0.29 %)"
            if rec == "on"
            else "3 routing iterations do not beat 1 (MNIST 0.35 % vs 0.34 %)"
        )
        out.append(
            _verdict(
                results,
                f"paper-iterations-{rec}",
                paper + tag,
                vn(3, "full", rec),
                vn(1, "-", rec),
                "less" if rec == "on" else "equal",
                "paper",
            )
        )
        det = [
            n for n in (vn(1, "-", rec), *(vn(r, "detached", rec) for r in spec["iterations"] if r > 1)) if n in names
        ]
        full = [n for n in (vn(1, "-", rec), *(vn(r, "full", rec) for r in spec["iterations"] if r > 1)) if n in names]
        out.append(
            _best_verdict(
                results,
                f"seed-detached-3-best-{rec}",
                "with stop_gradient, 3 iterations are best" + tag,
                vn(3, "detached", rec),
                vn(1, "-", rec),
                det,
            )
        )
        out.append(
            _best_verdict(
                results,
                f"seed-full-1-best-{rec}",
                "without stop_gradient, 1 iteration is best" + tag,
                vn(1, "-", rec),
                vn(3, "full", rec),
                full,
            )
        )
        out.append(
            _verdict(
                results,
                f"seed-stop-gradient-right-{rec}",
                "stop_gradient (detached) beats the full gradient at 3 iterations" + tag,
                vn(3, "detached", rec),
                vn(3, "full", rec),
                "less",
                "seed 001",
            )
        )
    if "on" in spec["recons"] and "off" in spec["recons"]:
        for r, mnist in ((1, "0.29 % vs 0.34 %"), (3, "0.25 % vs 0.35 %")):
            g = "-" if r == 1 else "full"
            out.append(
                _verdict(
                    results,
                    f"paper-reconstruction-r{r}",
                    f"the reconstruction loss lowers the error at {r} iteration{'s' if r > 1 else ''} (MNIST {mnist})",
                    vn(r, g, "on"),
                    vn(r, g, "off"),
                    "less",
                    "paper",
                )
            )
    return [v for v in out if v["a"] in names and v["b"] in names]
