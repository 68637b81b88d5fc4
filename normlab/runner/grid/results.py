"""A grid's results: per-cell summaries aggregated over seeds and per normalization, written as ``results.json``.

``cells``: one record per run; ``groups``: one per (norm, lr, batch size), over seeds; ``norms``: one per norm
(:func:`per_norm`): the highest learning rate that trained, the point of the lowest test loss and its loss and
metric, the cost of a step, and the monitor's view (alarms and the layer they named, the regime warning). A
setting *trained* when no seed collapsed and every seed's loss went below ``LEARNED`` (0.8) x its reference (chance
for cross-entropy over known classes, else the loss it started from): the collapse module's words for a net that
learned something.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from normlab._checks import is_int, is_number
from normlab.runner.data.datasets import DATASET_CLASSES
from normlab.runner.errors import UsageError

__all__ = [
    "collect_results",
    "load_results",
    "read_summary",
    "mean_std",
    "per_norm",
    "chance_level",
    "chance_accuracy",
    "format_acc",
    "metric_name",
    "RESULTS_VERSION",
]

#: The version of the ``results.json`` layout (``version`` in the file).
RESULTS_VERSION = 1
_HISTORY_KEYS = ("epoch", "step", "train_loss", "train_acc", "test_loss", "test_acc", "test_acc_train_mode")


def mean_std(xs: Sequence[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation of the finite values (std 0 for one value; None, None for none)."""
    xs = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    if len(xs) == 1:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def chance_level(results: dict[str, Any]) -> float:
    """The accuracy of a constant guess, ``1 / C`` for the ``num_classes`` C of a results dict (0.0 when unknown).

    Example:
        >>> chance_level({"num_classes": 10})
        0.1
    """
    n = results.get("num_classes")
    return 1.0 / n if n else 0.0


def format_acc(group: dict[str, Any] | None) -> str:
    """A group's mean final test accuracy in percent, ``± std`` over seeds when it has several, and how many of
    its seeds collapsed; ``n/a`` without a group or an accuracy.

    Example:
        >>> format_acc({"final_mean": 0.912, "final_std": 0.004, "n_seeds": 3, "collapsed_count": 1})
        '91.2 ± 0.4 % (collapsed 1/3)'
    """
    if group is None or group["final_mean"] is None:
        return "n/a"
    s = f"{100 * group['final_mean']:.1f}"
    if group["n_seeds"] > 1:
        s += f" ± {100 * group['final_std']:.1f}"
    s += " %"
    if group["collapsed_count"]:
        s += f" (collapsed {group['collapsed_count']}/{group['n_seeds']})"
    return s


def _cell_record(cell, summary: dict[str, Any]) -> dict[str, Any]:
    return {
        "cell": cell.cell_id,
        "name": cell.name,
        "lr": cell.lr,
        "batch_size": cell.batch_size,
        "seed": cell.seed,
        "norm": cell.config.norm,
        "conv": cell.config.conv,
        "train_lr": cell.config.lr,
        "final_test_acc": summary.get("final_test_acc"),
        "best_test_acc": summary.get("best_test_acc"),
        "final_test_loss": summary.get("final_test_loss"),
        "final_train_loss": summary.get("final_train_loss"),
        "stopped_early": summary.get("stopped_early"),
        "risk": summary.get("monitor_risk"),
        "collapsed": bool(summary.get("collapsed")),
        "learned": summary.get("learned"),
        "collapse_epoch": summary.get("collapse_epoch"),
        "collapse_reason": summary.get("collapse_reason"),
        "collapse_step": summary.get("collapse_step"),
        "alarm": summary.get("monitor_alarm"),
        "monitored": bool(cell.config.monitor_every),
        "regime_watched": bool(cell.config.monitor_every) and cell.config.regime,
        "final_test_acc_train_mode": summary.get("final_test_acc_train_mode"),
        "epochs_to_target": summary.get("epochs_to_target"),
        "step_time_s": summary.get("step_time_s"),
        "epochs_run": summary.get("epochs_run"),
        "steps_run": summary.get("steps_run"),
        "rescues": len(summary.get("rescues") or []),
        "steps_lost": summary.get("steps_lost", 0),
        "guard_gave_up": summary.get("guard_gave_up"),
        "history": [{k: h.get(k) for k in _HISTORY_KEYS if k in h} for h in summary.get("history", [])],
    }


def _group_record(name: str, lr: float, bs: int, recs: list[dict[str, Any]]) -> dict[str, Any]:
    fm, fs = mean_std([r["final_test_acc"] for r in recs])
    bm, bsd = mean_std([r["best_test_acc"] for r in recs])
    ett = [r["epochs_to_target"] for r in recs if r["epochs_to_target"] is not None]
    tm, ts = mean_std([r["final_test_acc_train_mode"] for r in recs])
    kinds: dict[str, int] = {}
    for r in recs:
        if r["collapsed"]:
            kinds[r["collapse_reason"]] = kinds.get(r["collapse_reason"], 0) + 1
    return {
        "name": name,
        "lr": lr,
        "batch_size": bs,
        "n_seeds": len(recs),
        "final_mean": fm,
        "final_std": fs,
        "test_loss_mean": mean_std([r.get("final_test_loss") for r in recs])[0],
        "best_mean": bm,
        "best_std": bsd,
        "collapsed_count": sum(r["collapsed"] for r in recs),
        "learned_count": sum(bool(r.get("learned")) for r in recs),
        "stopped_count": sum(bool(r.get("stopped_early")) for r in recs),
        "collapse_kinds": kinds,
        "alarm_count": sum(r["alarm"] is not None for r in recs),
        "rescued_count": sum(bool(r.get("rescues")) for r in recs),
        "train_mode_mean": tm,
        "train_mode_std": ts,
        "target_reached": len(ett),
        "epochs_to_target_mean": mean_std(ett)[0],
        "step_time_s": mean_std([r["step_time_s"] for r in recs])[0],
    }


def collect_results(
    spec, pairs: Sequence[tuple[Any, dict[str, Any]]], complete: bool = True, failed: Sequence[tuple[Any, str]] = ()
) -> dict[str, Any]:
    """Aggregate ``(cell, summary)`` pairs over seeds into groups keyed by (name, lr, batch size).

    A collapsed run's final accuracy counts as recorded (usually chance level). ``complete=False`` marks a grid
    that is still running (results.json is rewritten after every finished cell). ``failed``: ``(cell, error line)``
    of the cells that raised, listed under ``failed``.
    """
    cells = [_cell_record(c, s) for c, s in pairs]
    groups: dict[tuple[str, float, int], list[dict[str, Any]]] = {}
    for rec in cells:
        groups.setdefault((rec["name"], rec["lr"], rec["batch_size"]), []).append(rec)
    classes = next((s["num_classes"] for _, s in pairs if s.get("num_classes")), DATASET_CLASSES.get(spec.dataset))
    results = {
        "version": RESULTS_VERSION,
        "spec": spec.to_dict(),
        "loss": spec.train_kwargs.get("loss", "cross_entropy"),
        "metric": spec.train_kwargs.get("metric", "accuracy"),
        "num_classes": classes,
        "complete": complete,
        "groups": [_group_record(*key, recs) for key, recs in groups.items()],
        "cells": cells,
        "failed": [
            {"cell": c.cell_id, "name": c.name, "lr": c.lr, "batch_size": c.batch_size, "seed": c.seed, "error": error}
            for c, error in failed
        ],
    }
    results["norms"] = per_norm(results)
    return results


def metric_name(results: dict[str, Any]) -> str:
    """The metric's short name: ``accuracy``, or the function's name of a ``pkg.module:function``."""
    return str(results.get("metric") or "accuracy").rsplit(":", 1)[-1].rsplit(".", 1)[-1]


def chance_accuracy(results: dict[str, Any]) -> float | None:
    """:func:`chance_level` where the metric is the accuracy over known classes (the line the plots draw), else
    None."""
    known = results.get("num_classes") and (results.get("metric") or "accuracy") == "accuracy"
    return chance_level(results) if known else None


def _alarm_layers(cells: list[dict[str, Any]]) -> list[list]:
    """[layer, runs] of the layers the monitor's alarms named, the most named first."""
    counts: dict[str, int] = {}
    for c in cells:
        layer = (c.get("alarm") or {}).get("layer")
        if layer is not None:
            counts[layer] = counts.get(layer, 0) + 1
    return [[k, v] for k, v in sorted(counts.items(), key=lambda kv: -kv[1])]


def _trained(group: dict[str, Any]) -> bool:
    """Every seed of a setting trained: none collapsed and each one's loss went below ``LEARNED`` x its reference
    (:mod:`normlab.monitor.collapse`: chance, else where it started)."""
    return not group["collapsed_count"] and group.get("learned_count", group["n_seeds"]) == group["n_seeds"]


def _norm_record(results: dict[str, Any], name: str) -> dict[str, Any]:
    spec = results["spec"]
    base_bs = spec.get("base_batch_size") or spec["batch_sizes"][0]
    groups = [g for g in results["groups"] if g["name"] == name]
    cells = [c for c in results["cells"] if c["name"] == name]
    trained = [g["lr"] for g in groups if g["batch_size"] == base_bs and _trained(g)]
    scored = [g for g in groups if g.get("test_loss_mean") is not None and not g["collapsed_count"]]
    best = min(scored, key=lambda g: g["test_loss_mean"], default=None)
    risks = [c["risk"] for c in cells if c.get("risk")]
    steps = [c["step_time_s"] for c in cells if c["batch_size"] == base_bs and c.get("step_time_s")]
    return {
        "name": name,
        "runs": len(cells),
        "highest_lr_trained": max(trained, default=None),
        "lrs_at_base": sorted({g["lr"] for g in groups if g["batch_size"] == base_bs}),
        "best": None if best is None else {k: best[k] for k in ("lr", "batch_size", "n_seeds")},
        "best_test_loss": None if best is None else best["test_loss_mean"],
        "best_metric_mean": None if best is None else best["final_mean"],
        "best_metric_std": None if best is None else best["final_std"],
        "step_time_s": mean_std(steps)[0],
        "step_batch_size": base_bs,
        "collapsed": sum(c["collapsed"] for c in cells),
        "stopped_early": sum(bool(c.get("stopped_early")) for c in cells),
        "monitored": sum(bool(c.get("monitored")) for c in cells),
        "alarms": sum(c.get("alarm") is not None for c in cells),
        "alarm_layers": _alarm_layers(cells),
        "regime_watched": sum(bool(c.get("regime_watched")) for c in cells),
        "regime_warnings": len(risks),
        "regime": None if not risks else {k: risks[0].get(k) for k in ("case", "suggestion", "layer", "step")},
    }


def per_norm(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per norm of the grid, in the grid's order (the module docstring): ``highest_lr_trained`` (at
    the base batch size, every seed trained; None when none did), ``best`` (the lr and batch size of the lowest
    mean final test loss among the settings where no seed collapsed) with ``best_test_loss`` and the metric's mean
    and std there, ``step_time_s`` (mean, at the base batch size), the counts of ``collapsed``, ``stopped_early``,
    ``alarms`` and ``regime_warnings`` runs, ``alarm_layers`` ([layer, runs], most named first) and the first
    ``regime`` warning's ``case``, ``suggestion``, ``layer`` and ``step``."""
    names = [n for n in results["spec"]["norms"] if any(c["name"] == n for c in results["cells"])]
    return [_norm_record(results, n) for n in names]


def read_summary(cell_dir: Path) -> dict[str, Any] | None:
    """A finished run's ``summary.json`` (None when it has none); a one-line error when it cannot be read."""
    path = Path(cell_dir) / "summary.json"
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{path} is unreadable ({e}); move the run directory away to rerun it") from None
    if not isinstance(summary, dict):
        raise UsageError(f"{path} is not a run summary (a JSON object); move the run directory away to rerun it")
    return summary


_num, _int = is_number, is_int


def _opt(check):
    return lambda v: v is None or check(v)


def _list(check):
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


def _str(v) -> bool:
    return isinstance(v, str)


def _history_entry(h) -> bool:
    return isinstance(h, dict) and _opt(_num)(h.get("epoch")) and _opt(_num)(h.get("test_acc"))


_SPEC_KEYS = {
    "norms": _list(_str),
    "lrs": _list(_num),
    "batch_sizes": _list(_int),
    "seeds": _list(_int),
    "epochs": _int,
    "dataset": _str,
    "model": _str,
    "width": _num,
    "layout": _str,
    "base_lr": _num,
    "base_batch_size": _int,
}
_GROUP_KEYS = {
    "name": _str,
    "lr": _num,
    "batch_size": _int,
    "n_seeds": _int,
    "final_mean": _opt(_num),
    "final_std": _opt(_num),
    "best_mean": _opt(_num),
    "best_std": _opt(_num),
    "collapsed_count": _int,
    "target_reached": _int,
    "epochs_to_target_mean": _opt(_num),
    "step_time_s": _opt(_num),
}
_CELL_KEYS = {"name": _str, "lr": _num, "batch_size": _int, "seed": _int, "history": _list(_history_entry)}
_FAILED_KEYS = {"cell": _str, "error": _str}


def _shape_error(results: Any) -> str | None:
    """What is wrong with the shape of a results dict (the keys and types the report reads), or None."""
    if not isinstance(results, dict):
        return f"expected a JSON object, got {type(results).__name__}"
    for key, kind in (("spec", dict), ("groups", list), ("cells", list)):
        if not isinstance(results.get(key), kind):
            return f"expected an object with spec, groups and cells; {key!r} is missing or not a {kind.__name__}"
    if not isinstance(results.get("failed", []), list):
        return "'failed' is not a list"
    tables = [
        ("spec", [results["spec"]], _SPEC_KEYS),
        ("groups", results["groups"], _GROUP_KEYS),
        ("cells", results["cells"], _CELL_KEYS),
        ("failed", results.get("failed", []), _FAILED_KEYS),
    ]
    for where, items, keys in tables:
        for i, item in enumerate(items):
            label = where if where == "spec" else f"{where}[{i}]"
            if not isinstance(item, dict):
                return f"{label} is not an object"
            bad = [k for k, check in keys.items() if not check(item.get(k))]
            if bad:
                return f"{label}.{bad[0]} is missing or of the wrong type ({item.get(bad[0])!r})"
    if not _opt(_int)(results.get("num_classes")):
        return f"num_classes is not an integer ({results.get('num_classes')!r})"
    return None


def load_results(out_dir: str | os.PathLike) -> dict[str, Any]:
    """Read ``results.json`` of a grid's output directory; a one-line error if missing or malformed
    (wrong JSON, or keys the report reads missing or of the wrong type)."""
    path = Path(out_dir) / "results.json"
    if not path.is_file():
        raise UsageError(f"no results.json in {Path(out_dir)} (run `normlab compare` first)")
    try:
        results = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{path} is not valid JSON: {e}") from None
    problem = _shape_error(results)
    if problem is not None:
        raise UsageError(f"{path} is not a normlab results file: {problem}")
    return results
