"""The demo's first table: each claim of the paper (then Batch Renorm's and the monitor's), its verdict and numbers.

Every verdict is computed from ``demo.json`` alone (:func:`claims_table`): the monitor's diagnoses and the plateau
check of the batch-size runs, which need the runs' files, are gathered once by :func:`collect_evidence` and stored in
``demo.json`` under ``"evidence"``. The criteria below were fixed before the demo's seeds ran; :data:`CLAIM_CRITERIA`
states each in numbers and the report prints them under the table.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from normlab.runner.grid.results import chance_level, format_acc
from normlab_lab.demo.diagnosis import GUARDED_SECTIONS, alarm_audit, audited_runs, diagnose_run
from normlab_lab.demo.twins import FLAGS, guard_clause, twin_pairs
from normlab_lab.verdicts import FAIL_MARGIN, TRAIN_FRACTION, failed, trains

__all__ = [
    "CLAIM_CRITERIA",
    "DROP",
    "GAP_VISIBLE",
    "BRN_GAIN",
    "ALARM_SEEDS",
    "PLATEAU_FALL",
    "PLATEAU_FLOOR",
    "PLATEAU_Z",
    "PLATEAU_BLOCKS",
    "TIME_FLOOR",
    "SECTION_LETTERS",
    "collect_evidence",
    "plateau_check",
    "claims_table",
    "batch_rows",
    "claims_markdown",
    "criteria_markdown",
    "timing_verdict",
]

DROP = 0.02  # a norm degrades at a small batch when its mean accuracy falls >= 2 points below batch 128
GAP_VISIBLE = 0.05  # BN's eval - train-mode gap at the smallest batch >= 5 points, and >= 5 points above batch 128's
BRN_GAIN = 0.01  # Batch Renorm recovers a small batch when its accuracy there is >= 1 point above BN's
ALARM_SEEDS = 2  # the monitor's target: an alarm before the collapse on >= 2 seeds of the unnormalized net
PLATEAU_FALL = 0.05  # a run is at its plateau when its loss over the last fifth is < 5 % below the fifth before
PLATEAU_FLOOR = 0.01  # ... or < 0.01 nats below it (the mean probability of the right class moves by < 1 %)
PLATEAU_Z = 2.0  # ... or less than 2 standard errors of the difference of the two means (within the trace's noise)
PLATEAU_BLOCKS = 10  # each fifth's standard error from the spread of the means of its 10 consecutive blocks
TIME_FLOOR = 0.03  # two step times closer than 3 % of PWS's (or than their spread) are a tie
PAPER_HIGH_LR = 0.1  # claim 5's learning rate in the paper (1e-1)

CLAIM_CRITERIA = {
    "1": f"reproduced if at some learning rate of the sweep the unnormalized net *fails* (most seeds collapsed, or "
    f"mean accuracy <= chance + {100 * FAIL_MARGIN:.0f} points) after learning at a lower one, while BN *trains* "
    f"(no seed collapsed, mean >= chance + {TRAIN_FRACTION:.1f} x (best mean of the sweep - chance))",
    "2": "reproduced if PWS (gamma 1e-3 or 1e-2) *trains* at a learning rate where claim 1 is reproduced; not "
    "testable where claim 1 is not",
    "3": f"testable only if every BN, GN and PWS run of section (b) reached its plateau (mean training loss over the "
    f"last fifth of its steps less than {100 * PLATEAU_FALL:.0f} %, or {PLATEAU_FLOOR:g} nats, or "
    f"{PLATEAU_Z:g} standard errors below the fifth before); then reproduced if "
    f"BN's mean accuracy at the smallest batch is >= {100 * DROP:.0f} points below its batch-128 accuracy while "
    f"PWS's is not",
    "3a": f"reproduced if BN's train-mode accuracy (batch statistics) at the smallest batch is >= "
    f"{100 * GAP_VISIBLE:.0f} points below its eval-mode accuracy (running statistics) and that gap is >= "
    f"{100 * GAP_VISIBLE:.0f} points larger than at batch 128",
    "4": f"at each batch size, reproduced if PWS's median step is shorter than BN's, GN's and SN's by more than the "
    f"timing spread (the larger of the two norms' median - fastest repeat, and at least {100 * TIME_FLOOR:.0f} % "
    f"of PWS's step); a difference within the spread is a *tie*",
    "5": f"reproduced if at lr {PAPER_HIGH_LR:g} (the paper's) PWS (gamma 1e-3) and WN do not *train* while BN does",
    "BRN": f"reproduced if at every small batch BRN's mean accuracy is >= {100 * BRN_GAIN:.0f} point above BN's "
    f"(same data, same steps); 'close to large-batch BN' is judged only where batch 128 reached its plateau "
    f"(then BRN at the smallest batch must be within {100 * DROP:.0f} points of BN at batch 128)",
    "mon": f"reproduced if the alarm comes before the collapse (a positive lead in steps; for a dead network, which "
    f"has no moment of collapse, any alarm) on >= {ALARM_SEEDS} of the 3 seeds of the unnormalized net of "
    f"section (c), and no monitored run of the demo that did not collapse raised an alarm",
}

_STATEMENTS = {
    "1": "A plain net without output normalization collapses at a high learning rate (paper: 1e-2) where BN trains",
    "2": "PWS trains at that learning rate without normalizing the outputs",
    "3": "PWS is robust to the mini-batch size; BN is not",
    "3a": "(the mechanism of 3) BN's batch statistics cost it accuracy at small batches",
    "4": "PWS costs less than output normalization (one training step)",
    "5": "The paper's limit of its own method: at lr 1e-1 PWS and WN suffer (their alpha / g gradients are too large)",
    "BRN": "Batch Renorm (Ioffe 2017) keeps small-batch accuracy close to large-batch BN, above BN at the same batch",
    "mon": "normlab's monitor warns before the collapse, without false alarms",
}

REPRODUCED, NOT_REPRODUCED, NOT_TESTABLE = "reproduced", "not reproduced", "not testable here"


# ------------------------------------------------------------------------------------------------- evidence
def _window_se(xs: list[float]) -> float:
    """The standard error of the mean of ``xs`` (consecutive steps' losses) by the method of batch means: the spread
    of the means of :data:`PLATEAU_BLOCKS` consecutive blocks, so that correlated steps are not counted as
    independent; 0 for fewer than 2 blocks."""
    b = min(PLATEAU_BLOCKS, len(xs))
    if b < 2:
        return 0.0
    n = len(xs) // b
    means = [sum(xs[i * n : (i + 1) * n]) / n for i in range(b)]
    m = sum(means) / b
    return math.sqrt(sum((x - m) ** 2 for x in means) / (b - 1) / b)


def plateau_check(run_dir: Path) -> dict[str, Any] | None:
    r"""Has the run's training loss levelled off? The mean :math:`\bar a` over the fifth before the last fifth of
    its steps against the mean :math:`\bar b` over the last fifth: a plateau when the fall
    :math:`\bar a - \bar b` is less than :data:`PLATEAU_FALL` of :math:`\bar a`, or less than
    :data:`PLATEAU_FLOOR` nats (a loss near zero, whose relative changes are noise), or less than
    :data:`PLATEAU_Z` standard errors of the difference,
    :math:`z \sqrt{\mathrm{se}_a^2 + \mathrm{se}_b^2}` (a fall the trace's own noise could make: at batch 2 a
    step's loss is the mean of two samples' losses). Each fifth's standard error is that of its mean by batch means
    (:data:`PLATEAU_BLOCKS` blocks).

    Returns:
        ``{"steps", "fall" (relative), "fall_nats", "noise_nats" (the standard error of the difference),
        "plateau"}``; None without a loss trace.
    """
    path = Path(run_dir) / "loss_trace.json"
    if not path.is_file():
        return None
    losses = json.loads(path.read_text())["losses"]
    k = len(losses) // 5
    if k < 1:
        return {"steps": len(losses), "fall": None, "plateau": False}
    last, prev = losses[-k:], losses[-2 * k : -k]
    if any(v is None or not math.isfinite(v) for v in last + prev):
        return {"steps": len(losses), "fall": None, "plateau": False}
    a, b = sum(prev) / k, sum(last) / k
    fall = (a - b) / a if a > 0 else 0.0
    noise = math.hypot(_window_se(prev), _window_se(last))
    return {
        "steps": len(losses),
        "fall": fall,
        "fall_nats": a - b,
        "noise_nats": noise,
        "plateau": fall < PLATEAU_FALL or a - b < PLATEAU_FLOOR or a - b < PLATEAU_Z * noise,
    }


def collect_evidence(out: Path, sections: dict[str, dict]) -> dict[str, Any]:
    """What the verdicts need from the runs' files: every run's diagnosis, the batch-size runs' plateau check
    (``"plateau"``) and every run's (``"plateau_all"``, by section)."""
    out = Path(out)
    diag = {
        key: {c["cell"]: diagnose_run(out / key / "runs" / c["cell"]) for c in sec["cells"]}
        for key, sec in sections.items()
    }
    every = {
        key: {c["cell"]: plateau_check(out / key / "runs" / c["cell"]) for c in sec["cells"]}
        for key, sec in sections.items()
    }
    return {"diagnoses": diag, "plateau": every["batch_size"], "plateau_all": every}


# ------------------------------------------------------------------------------------------------- helpers
def _groups(results: dict) -> dict[tuple[str, float, int], dict]:
    return {(g["name"], float(g["lr"]), int(g["batch_size"])): g for g in results["groups"]}


def _pts(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f} points"


def _acc(g: dict | None) -> str:
    return format_acc(g).replace(" %", "%")


def _mean(g: dict | None, key: str = "final_mean") -> float | None:
    return None if g is None else g.get(key)


def _row(cid: str, verdict: str, numbers: str, key: str | None = None) -> dict[str, str]:
    """One row; ``key``: its key number in a few words for the terminal (:mod:`.terminal`), default ``numbers``."""
    return {"id": cid, "claim": _STATEMENTS[cid], "verdict": verdict, "numbers": numbers, "key": key or numbers}


# ----------------------------------------------------------------------------------------- (a) claims 1, 2, 5
def _lr_rows(a: dict) -> list[dict[str, str]]:
    g = {(n, lr): v for (n, lr, _), v in _groups(a).items()}
    chance, lrs, names = chance_level(a), sorted(a["spec"]["lrs"]), list(a["spec"]["norms"])
    best = max((x["final_mean"] for x in a["groups"] if x["final_mean"] is not None), default=0.0)

    def ok(n: str, lr: float) -> bool:
        return trains(g.get((n, lr)), chance, best)

    bad = [
        lr
        for lr in lrs
        if failed(g.get(("none", lr)), chance) and any(not failed(g.get(("none", x)), chance) for x in lrs if x < lr)
    ]
    c1 = [lr for lr in bad if ok("bn", lr)]
    at = c1[-1] if c1 else (bad[-1] if bad else lrs[-1])
    nums1 = f"lr {at:g}: none {_acc(g.get(('none', at)))}, BN {_acc(g.get(('bn', at)))}"
    if c1:
        more = [x for x in c1 if x != at]
        rows = [
            _row("1", REPRODUCED, f"{nums1}" + (f" (also at lr {', '.join(f'{x:g}' for x in more)})" if more else ""))
        ]
    else:
        why = "the unnormalized net does not fail after learning at a lower rate" if not bad else "BN fails there too"
        rows = [_row("1", NOT_REPRODUCED, f"{why}; {nums1}", nums1)]
    pws = [n for n in names if n.startswith("pws")]
    if not c1:
        rows.append(_row("2", NOT_TESTABLE, "claim 1 did not appear, so there is no such learning rate"))
    elif not pws:
        rows.append(_row("2", NOT_TESTABLE, "no PWS in the sweep"))
    else:
        held = [(n, lr) for lr in c1 for n in pws if ok(n, lr)]
        nums = "; ".join(f"{_label(n)} {_acc(g.get((n, at)))}" for n in pws)
        rows.append(
            _row(
                "2",
                REPRODUCED if held else NOT_REPRODUCED,
                (
                    f"PWS trains where the plain net collapses: lr {at:g}: {nums}"
                    if held
                    else f"PWS collapses too where the plain net does and BN trains: lr {at:g}: {nums}"
                ),
                f"lr {at:g}: {nums}",
            )
        )
    rows.append(_claim5(g, lrs, names, ok))
    return rows


def _label(name: str) -> str:
    return {"pws": "PWS (gamma 1e-3)", "pws:gamma=0.01": "PWS (gamma 1e-2)"}.get(name, name.upper())


def _claim5(g: dict, lrs: list[float], names: list[str], ok) -> dict[str, str]:
    lr = min(lrs, key=lambda x: abs(math.log(x / PAPER_HIGH_LR)))
    if not {"pws", "wn", "bn"} <= set(names):
        return _row("5", NOT_TESTABLE, "the sweep lacks " + ", ".join(sorted({"pws", "wn", "bn"} - set(names))))
    suffer = not ok("pws", lr) and not ok("wn", lr)
    nums = f"lr {lr:g}: PWS {_acc(g.get(('pws', lr)))}, WN {_acc(g.get(('wn', lr)))}, BN {_acc(g.get(('bn', lr)))}"
    if suffer and ok("bn", lr):
        return _row("5", REPRODUCED, f"PWS and WN fall behind as the paper says; {nums}", nums)
    why = "BN does not train there either" if suffer else "PWS or WN trains there"
    return _row("5", NOT_REPRODUCED, f"{why}; {nums}", nums)


# ------------------------------------------------------------------------------------------ (b) claims 3, BRN
def _plateau_state(b: dict, evidence: dict, names: tuple[str, ...]) -> list[str]:
    """The (norm, batch) settings of ``names`` whose runs did not reach their plateau (most seeds), in words (a
    setting without a finished run, as in a record that did not finish: "not run")."""
    plateau = evidence.get("plateau") or {}
    out = []
    for bs in sorted(b["spec"]["batch_sizes"], reverse=True):
        for n in (x for x in names if x in b["spec"]["norms"]):
            checks = [plateau.get(c["cell"]) for c in b["cells"] if c["name"] == n and int(c["batch_size"]) == bs]
            if not checks or 2 * sum(1 for x in checks if x and x["plateau"]) <= len(checks):
                falls = [x["fall"] for x in checks if x and x["fall"] is not None]
                fall = f", loss still falling {100 * sum(falls) / len(falls):.0f} %" if falls else ""
                steps = next((x["steps"] for x in checks if x), None)
                out.append(f"{n.upper()} at batch {bs} ({f'{steps} steps{fall}' if steps is not None else 'not run'})")
    return out


def batch_rows(b: dict, evidence: dict) -> list[dict[str, str]]:
    """The claims table's rows of section (b) (claims 3, 3a and Batch Renorm's) from its results ``b`` and the
    runs' ``evidence`` (:func:`collect_evidence`); also what ``lab/scripts/record_reproduce.py`` judges a partial
    record by."""
    g, spec = _groups(b), b["spec"]
    base, lr = int(spec["base_batch_size"]), float(spec["base_lr"])
    small = sorted(x for x in spec["batch_sizes"] if x < base)
    if not small:
        return [_row(c, NOT_TESTABLE, "no batch size below the base") for c in ("3", "3a", "BRN")]
    s = small[0]
    bn0, bns, pws0, pwss = (g.get((n, lr, x)) for n in ("bn", "pws") for x in (base, s))
    nums = f"batch {base} -> {s}: BN {_acc(bn0)} -> {_acc(bns)}; PWS {_acc(pws0)} -> {_acc(pwss)}"
    unplateaued = _plateau_state(b, evidence, ("bn", "gn", "pws"))
    if unplateaued:
        rows = [
            _row(
                "3",
                NOT_TESTABLE,
                f"not at their plateau: {'; '.join(unplateaued[:3])}"
                f"{' ...' if len(unplateaued) > 3 else ''}; a drop from batch {base} cannot be measured. For "
                f"information, {nums}",
                f"not at plateau: {unplateaued[0]}"
                + (f" and {len(unplateaued) - 1} more" if len(unplateaued) > 1 else ""),
            )
        ]
    elif None in (_mean(bn0), _mean(bns), _mean(pws0), _mean(pwss)):
        rows = [_row("3", NOT_TESTABLE, f"a result is missing; {nums}")]
    else:
        bn_deg, pws_deg = bn0["final_mean"] - bns["final_mean"] >= DROP, pws0["final_mean"] - pwss["final_mean"] >= DROP
        rows = [_row("3", REPRODUCED if bn_deg and not pws_deg else NOT_REPRODUCED, nums)]
    rows.append(_mechanism_row(g, lr, base, s))
    rows.append(_brn_row(g, lr, base, small, bool(unplateaued)))
    return rows


def _gap(grp: dict | None) -> float | None:
    if grp is None or grp["final_mean"] is None or grp.get("train_mode_mean") is None:
        return None
    return grp["final_mean"] - grp["train_mode_mean"]


def _mechanism_row(g: dict, lr: float, base: int, s: int) -> dict[str, str]:
    gs, g0 = _gap(g.get(("bn", lr, s))), _gap(g.get(("bn", lr, base)))
    nums = f"BN eval - train-mode accuracy: batch {base} {_pts(g0)}, batch {s} {_pts(gs)}"
    if gs is None or g0 is None:
        return _row("3a", NOT_TESTABLE, nums)
    return _row("3a", REPRODUCED if gs >= GAP_VISIBLE and gs - g0 >= GAP_VISIBLE else NOT_REPRODUCED, nums)


def _brn_row(g: dict, lr: float, base: int, small: list[int], base_unplateaued: bool) -> dict[str, str]:
    gains = {
        s: (
            None
            if None in (_mean(g.get(("brn", lr, s))), _mean(g.get(("bn", lr, s))))
            else g[("brn", lr, s)]["final_mean"] - g[("bn", lr, s)]["final_mean"]
        )
        for s in small
    }
    nums = "BRN - BN: " + ", ".join(f"batch {s} {_pts(v)}" for s, v in gains.items())
    if any(v is None for v in gains.values()):
        return _row("BRN", NOT_TESTABLE, nums)
    above = all(v >= BRN_GAIN for v in gains.values())
    close = None
    if not base_unplateaued and _mean(g.get(("bn", lr, base))) is not None:
        diff = g[("brn", lr, small[0])]["final_mean"] - g[("bn", lr, base)]["final_mean"]
        close = -diff < DROP
        nums += f"; BRN at batch {small[0]} - BN at batch {base}: {_pts(diff)}"
    else:
        nums += f" ('close to batch-{base} BN' not testable: batch {base} not at its plateau)"
    key = nums.split(" (")[0]  # without the aside on batch 128's plateau
    return _row("BRN", REPRODUCED if above and close is not False else NOT_REPRODUCED, nums, key)


# ----------------------------------------------------------------------------------------------- (d) claim 4
def timing_verdict(t: dict[str, dict[str, float]], other: str) -> tuple[str, float]:
    """ "cheaper" / "dearer" / "tie" for PWS's step against ``other``'s, and the spread that decided it (seconds):
    the larger of the two norms' (median - fastest repeat), and at least TIME_FLOOR of PWS's median."""
    p, o = t["pws"], t[other]
    spread = max(
        p["median_s"] - p.get("min_s", p["median_s"]),
        o["median_s"] - o.get("min_s", o["median_s"]),
        TIME_FLOOR * p["median_s"],
    )
    diff = o["median_s"] - p["median_s"]
    return ("tie" if abs(diff) <= spread else "cheaper" if diff > 0 else "dearer"), spread


_SAID = {"cheaper": "PWS cheaper", "dearer": "PWS dearer", "tie": "a tie"}


def _cost_rows(cost: dict) -> list[dict[str, str]]:
    rows = []
    for bs, t in cost["by_batch"].items():
        others = [n for n in ("bn", "gn", "sn") if n in t]
        if "pws" not in t or not others:
            rows.append(_row("4", NOT_TESTABLE, f"batch {bs}: PWS or every output normalization missing"))
            continue
        said = {n: timing_verdict(t, n) for n in others}
        words = "; ".join(f"{n.upper()} {1000 * t[n]['median_s']:.2f} ms: {_SAID[v]}" for n, (v, _) in said.items())
        nums = (
            f"batch {bs}: PWS {1000 * t['pws']['median_s']:.2f} ms; {words}. A tie is a difference within the "
            f"timing spread (here up to {1000 * max(s for _, s in said.values()):.2f} ms)"
        )
        verdict = REPRODUCED if all(v == "cheaper" for v, _ in said.values()) else NOT_REPRODUCED
        key = f"batch {bs}: PWS {1000 * t['pws']['median_s']:.1f} ms; " + ", ".join(
            f"{n.upper()} {1000 * t[n]['median_s']:.1f} ({_SAID[v]})" for n, (v, _) in said.items()
        )
        rows.append(_row("4", verdict, nums, key))
    return rows


# ------------------------------------------------------------------------------------------------- (c) monitor
def _monitor_row(demo: dict, evidence: dict) -> dict[str, str]:
    diag = evidence.get("diagnoses") or {}
    c = demo["sections"]["collapse"]
    plain = [diag.get("collapse", {}).get(x["cell"]) for x in c["cells"] if x["name"] == "none"]
    plain = [d for d in plain if d]
    if not plain:
        return _row("mon", NOT_TESTABLE, "no monitored run of the unnormalized net in section (c)")
    dated = sum(1 for d in plain if d["lead_steps"] is not None and d["lead_steps"] > 0)
    dead = sum(1 for d in plain if d["collapse_reason"] == "never_left_chance" and d["alarm"])
    audit = alarm_audit(audited_runs(diag))
    met = dated + dead >= ALARM_SEEDS and audit["false_alarms"] == 0
    nums = (
        f"unnormalized net, lr {demo['protocol']['collapse_lr']:g}: warned before {dated} dated collapse"
        f"{'' if dated == 1 else 's'} and in {dead} dead network{'' if dead == 1 else 's'} of {len(plain)} seed"
        f"{'' if len(plain) == 1 else 's'}; "
        f"{audit['false_alarms']} false alarm{'' if audit['false_alarms'] == 1 else 's'} in "
        f"{audit['healthy_runs']} runs that did not collapse"
    )
    clauses = [guard_clause(twin_pairs(demo, evidence, s), FLAGS[s]) for s in FLAGS]  # as measured; no verdict
    key = (
        f"alarm on {dated + dead} of {len(plain)} seed{'' if len(plain) == 1 else 's'} ({dated} before a dated "
        f"collapse); "
        f"{audit['false_alarms']} false alarm{'' if audit['false_alarms'] == 1 else 's'} in {audit['healthy_runs']} "
        f"healthy runs"
    )
    if not met:
        nums += f". {_why_not(demo, diag, c, dated + dead)}"
    return _row("mon", REPRODUCED if met else NOT_REPRODUCED, "; ".join([nums, *(c for c in clauses if c)]), key)


SECTION_LETTERS = {"lr_sweep": "(a)", "batch_size": "(b)", "collapse": "(c)"}  # a section key as the report says it
# why a run with a collapse step collapsed (its collapse_reason), in words
_ENDED = {
    "non_finite_loss": "a non-finite loss",
    "exploded": "an exploded loss",
    "returned_to_chance": "a return to chance",
}
# the rule behind an alarm's quantity, for records made before summaries named the rule
_RULE_OF = {"output_var_growth": "countdown", "output_var_level": "countdown", "input_sq": "factor", "shift": "factor"}


def _run_name(demo: dict, key: str, cell: str) -> str:
    """A run in a few words: its section, norm, learning rate (and batch size in (b)) and seed."""
    c = next((x for x in demo["sections"].get(key, {}).get("cells", []) if x["cell"] == cell), None)
    if c is None:
        return f"{SECTION_LETTERS.get(key, key)} {cell}"
    batch = f" batch {c['batch_size']}" if key == "batch_size" else ""
    return f"{SECTION_LETTERS.get(key, key)} {c['name']} lr {float(c['lr']):g}{batch} seed {c['seed']}"


def _rule(alarm: dict) -> str:
    rule = alarm.get("rule") or _RULE_OF.get(alarm.get("quantity"))
    return f"the {rule} rule ({alarm.get('quantity')})" if rule else f"an alarm on {alarm.get('quantity')}"


def _span(values: list[float]) -> str:
    """``"24-55 %"``, or ``"28 %"`` when they round alike."""
    low, high = f"{min(values):.0f}", f"{max(values):.0f}"
    return f"{low} %" if low == high else f"{low}-{high} %"


def _why_not(demo: dict, diag: dict, collapse: dict, warned: int) -> str:
    """Why the monitor's claim is not met, in two sentences: the false alarms grouped by rule (which runs, what the
    collapse label says of them), then each seed of (c)'s unnormalized net without a timely alarm."""
    false = [
        (key, cell, d)
        for key, sec in diag.items()
        if key not in GUARDED_SECTIONS
        for cell, d in sec.items()
        if d and d["monitored"] and not d["collapsed"] and d["alarm"]
    ]
    out = []
    if false:
        by_rule: dict[str, list[str]] = {}
        for key, cell, d in false:
            by_rule.setdefault(_rule(d["alarm"]), []).append(_run_name(demo, key, cell))
        accs = [100 * d["final_test_acc"] for _, _, d in false if isinstance(d.get("final_test_acc"), (int, float))]
        ended = f"; they ended at {_span(accs)} test accuracy" if accs else ""
        groups = "; ".join(
            f"{len(runs)} by {rule} in {', '.join(runs)}"
            for rule, runs in sorted(by_rule.items(), key=lambda kv: -len(kv[1]))
        )
        n = len(false)
        out.append(
            f"Not met because of {n} false alarm{'' if n == 1 else 's'}: alarms in runs the collapse label "
            f"(normlab.monitor.collapse) calls healthy (no non-finite or exploded loss, no return to chance{ended}): "
            f"{groups}"
        )
    if warned < ALARM_SEEDS:
        seeds, plain = [], [x for x in collapse["cells"] if x["name"] == "none"]
        for x in plain:
            d = diag.get("collapse", {}).get(x["cell"])
            if not d or (d["lead_steps"] is not None and d["lead_steps"] > 0):
                continue
            if d["collapse_reason"] == "never_left_chance" and d["alarm"]:
                continue
            name = _run_name(demo, "collapse", x["cell"])
            if not d["collapsed"]:
                seeds.append(f"{name} did not collapse (nothing to warn of)")
            elif d["collapse_step"] is None:
                seeds.append(f"{name} never learned and raised no alarm")
            else:
                alarm = d["alarm"]
                when = "no alarm" if not alarm else f"{_rule(alarm)} alarmed at step {alarm.get('step')}, not before"
                why = _ENDED.get(d["collapse_reason"], d["collapse_reason"])
                seeds.append(f"{name} collapsed at step {d['collapse_step']} ({why}): {when}")
        out.append(
            f"{'Also' if false else 'Not met because'} only {warned} of {len(plain)} seeds "
            f"{'was' if warned == 1 else 'were'} warned ({ALARM_SEEDS} needed): " + "; ".join(seeds)
        )
    return ". ".join(out) if out else "Not met"


# ------------------------------------------------------------------------------------------------- the table
def claims_table(demo: dict[str, Any]) -> list[dict[str, str]]:
    """The rows of the first table, in the paper's order (1-5), then Batch Renorm's claim and the monitor's:
    ``[{"id", "claim", "verdict", "numbers", "key"}]`` (``key``: the key number in a few words, for the terminal).
    Needs ``demo["evidence"]`` (:func:`collect_evidence`)."""
    evidence = demo.get("evidence") or {}
    a, b = demo["sections"]["lr_sweep"], demo["sections"]["batch_size"]
    lr_rows, b_rows = _lr_rows(a), batch_rows(b, evidence)
    by_id: dict[str, list[dict[str, str]]] = {}
    for r in [*lr_rows, *b_rows, *_cost_rows(demo["cost"]), _monitor_row(demo, evidence)]:
        by_id.setdefault(r["id"], []).append(r)
    return [r for cid in _STATEMENTS for r in by_id.get(cid, [])]


def claims_markdown(demo: dict[str, Any]) -> list[str]:
    """The table as markdown lines, with the quick-mode warning when it applies."""
    lines = ["| # | claim (as its source states it) | verdict | the numbers |", "|---|---|---|---|"]
    lines += [f"| {r['id']} | {r['claim']} | **{r['verdict']}** | {r['numbers']} |" for r in claims_table(demo)]
    if demo.get("quick"):
        lines += ["", "Quick mode: a pipeline check on tiny runs; these verdicts mean nothing."]
    return lines


def criteria_markdown() -> list[str]:
    """What *reproduced* means for each claim, in numbers (printed under the table)."""
    return [f"- **{cid}**: {text}." for cid, text in CLAIM_CRITERIA.items()]


# ------------------------------------------------------------------------------------- the record in docs/
RECORD_KEYS = ("spec", "num_classes", "groups", "cells")


def claims_record(demo: dict[str, Any]) -> dict[str, Any]:
    """What :func:`claims_table` reads of a demo record, without the runs' histories: the record committed as
    ``lab/docs/demo_record.json``, from which the README's table of claims (the terminal's,
    :func:`~normlab_lab.demo.terminal.claims_terminal`) is checked (tests/test_readme.py)."""
    sections = {k: {key: sec[key] for key in RECORD_KEYS if key in sec} for k, sec in demo["sections"].items()}
    for sec in sections.values():
        sec["cells"] = [{k: v for k, v in c.items() if k != "history"} for c in sec.get("cells", [])]
    return {
        "protocol": demo["protocol"],
        "quick": demo.get("quick", False),
        "cost": demo["cost"],
        "evidence": demo["evidence"],
        "sections": sections,
    }
