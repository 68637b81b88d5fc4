"""The collapse benchmark's offline evaluation (``normlab-lab collapse-bench evaluate``): labels, replay, table.

Every detector is replayed over the same recorded runs. Definitions (fixed before any alarm was read):

- a run's collapse label comes from its training losses alone (:func:`normlab.monitor.collapse.label_collapse`);
- a collapse is *warnable* when it has a step and that step is >= ``LEAD`` (5) steps after the first recorded step;
- a detector *warned* when its first alarm came at a step <= collapse step - ``LEAD``; its *lead* is collapse step -
  alarm step;
- a *false alarm* is a healthy run with any alarm.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from normlab.monitor import rules as R
from normlab.monitor.collapse import label_collapse, window_mean
from normlab.monitor.rules import StepContext, replay
from normlab.monitor.rules import transformer as T
from normlab_lab.collapse_bench.protocol import LEAD, WINDOW, configs, criteria, load_run, run_path
from normlab_lab.collapse_bench.setups import ALL_SETUPS, SETUPS

__all__ = [
    "SETUPS",
    "detectors",
    "contexts",
    "first_events",
    "first_alarm",
    "adaptive_run",
    "label",
    "score",
    "evaluate_runs",
    "markdown",
    "final_loss",
    "degraded",
    "evaluate_dir",
]


# ---------------------------------------------------------------------------------------------- detectors
def detectors() -> dict[str, Callable[[], list]]:
    """Name -> factory of fresh rule lists: each default rule alone, the default set, the transformer rules, and
    the practitioners' detectors (each alone)."""
    defaults = R.DEFAULT_RULES
    out: dict[str, Callable[[], list]] = {"default": defaults}
    for i, rule in enumerate(defaults()):
        out[f"default:{rule.name}"] = lambda i=i: [defaults()[i]]
    for cls in T.TRANSFORMER_RULES:
        out[f"transformer:{cls.name}"] = lambda cls=cls: [cls()]
    default_names = {r.name for r in defaults()}
    if not all(cls.name in default_names for cls in T.TRANSFORMER_RULES):
        out["default+transformer"] = lambda: [*defaults(), *(c() for c in T.TRANSFORMER_RULES)]
    for cls in (R.LossSpikeRule, R.GradNormZScoreRule, R.NonFiniteRule):
        out[f"practitioner:{cls.name}"] = lambda cls=cls: [cls()]
    return out


# ---------------------------------------------------------------------------------------------- replay
def _ordering(records: Sequence[dict]) -> tuple[tuple[str, ...], frozenset[str]]:
    """Forward order of the recorded layers, and the conv/linear layers whose next layer is a normalization."""
    ordered = sorted(records, key=lambda r: r.get("index", 0))
    feeds = {a["layer"] for a, b in zip(ordered, ordered[1:]) if a.get("kind") != "norm" and b.get("kind") == "norm"}
    return tuple(r["layer"] for r in ordered), frozenset(feeds)


def _light(records: Sequence[dict]) -> list[dict]:
    """A step's records as the monitor's light step keeps them (layer, order, kind, output_var)."""
    keep = ("step", "layer", "index", "kind", "output_var")
    return [{k: r[k] for k in keep if k in r} for r in records if r.get("kind") != "norm"]


def contexts(steps: Sequence[dict], every: int, adaptive: bool = False) -> Iterable[tuple]:
    """``(StepContext, records)`` per step of a run, as the monitor at ``every`` would have produced them: full
    records and probes on steps ``s % every == 0``, light records (output variances) and the scalars (loss,
    gradient norm, lrs) on every step; ``adaptive``: the run's optimizer is adaptive (``StepContext.adaptive``)."""
    order, feeds, output = (), frozenset(), None
    for line in steps:
        recorded = line["step"] % every == 0
        if recorded and line["records"]:
            order, feeds = _ordering(line["records"])
            maps = [r["layer"] for r in sorted(line["records"], key=lambda r: r.get("index", 0))
                    if r.get("kind") in ("conv", "linear")]  # fmt: skip
            output = maps[-1] if maps else None
        ctx = StepContext(
            step=line["step"],
            loss=line["loss"],
            grad_norm=line["grad_norm"],
            lrs=tuple(line["lrs"]),
            skipped=False,
            layer_order=order,
            feeds_norm=feeds,
            probes=line["probes"] if recorded else {},
            recorded=recorded,
            output_layer=output,
            layer_lrs={name: line["lrs"][0] for name in order},
            adaptive=adaptive,
        )
        yield ctx, (line["records"] if recorded else _light(line["records"]))


def first_events(rules: list, steps: Sequence[dict], every: int, adaptive: bool = False):
    """``(first alarm, first event of any severity)`` when ``rules`` are replayed over a run (None when none)."""
    events = replay(rules, contexts(steps, every, adaptive))
    return next((e for e in events if e.severity == "alarm"), None), (events[0] if events else None)


def first_alarm(rules: list, steps: Sequence[dict], every: int, adaptive: bool = False):
    """The first Event of severity "alarm" when ``rules`` are replayed over a run, or None."""
    return first_events(rules, steps, every, adaptive)[0]


def adaptive_run(header: dict) -> bool:
    """The run's optimizer was adaptive: the header's ``adaptive`` (written by collect), else from its set-up's
    optimizer (runs recorded before the header had it: every optimizer of the set-ups but SGD is AdamW)."""
    if header.get("adaptive") is not None:
        return bool(header["adaptive"])
    return ALL_SETUPS[header["setup"]]["opt"] != "sgd"


# ---------------------------------------------------------------------------------------------- scoring
def label(header: dict, steps: Sequence[dict]):
    """The run's collapse label from its losses alone (the library's definition)."""
    return label_collapse([s["loss"] for s in steps], criteria(header["chance_loss"]))


def score(runs: list[dict], alarms: dict[str, list]) -> dict:
    """Per detector: warned/warnable, median lead, false alarms on healthy runs. ``runs`` carry their label."""
    healthy = [i for i, r in enumerate(runs) if not r["collapsed"]]
    warnable = [i for i, r in enumerate(runs) if r["collapsed"] and r["step"] is not None and r["step"] >= LEAD]
    out = {}
    for name, per_run in alarms.items():
        leads = [runs[i]["step"] - per_run[i] for i in warnable if per_run[i] is not None]
        warned = [d for d in leads if d >= LEAD]
        false = sum(per_run[i] is not None for i in healthy)
        out[name] = dict(
            warned=len(warned),
            warnable=len(warnable),
            median_lead=statistics.median(warned) if warned else None,
            false_alarms=false,
            healthy=len(healthy),
            fa_per_10=10 * false / len(healthy) if healthy else None,
        )
    return out


def evaluate_runs(paths: list[Path], every: int = 10, log=print) -> tuple[list[dict], dict[str, list]]:
    """Label every run and replay every detector on it: ``(runs, {detector: [alarm step or None per run]})``; each
    run also gets ``events``: {detector: step of its first event of any severity (warnings included) or None}."""
    dets = detectors()
    runs, alarms = [], {name: [] for name in dets}
    for k, path in enumerate(paths):
        header, steps = load_run(path)
        lab = label(header, steps)
        runs.append(dict(name=path.stem, setup=header["setup"], lr=header["lr"], seed=header["seed"],
                         collapsed=lab.collapsed, step=lab.step, kind=lab.kind))  # fmt: skip
        runs[-1]["final_loss"] = final_loss(steps)
        runs[-1]["events"] = {}
        for name, make in dets.items():
            alarm, event = first_events(make(), steps, every, adaptive_run(header))
            alarms[name].append(None if alarm is None else alarm.step)
            runs[-1]["events"][name] = None if event is None else event.step
        if log is not None and (k + 1) % 10 == 0:
            log(f"evaluated {k + 1}/{len(paths)}")
    return runs, alarms


def final_loss(steps: Sequence[dict]) -> float | None:
    """The mean of the last ``WINDOW`` finite training losses of a run (None when none is finite)."""
    finite = [s["loss"] for s in steps if s["loss"] is not None and math.isfinite(s["loss"])]
    return window_mean(finite[-WINDOW:]) if finite else None


DEGRADED = 1.1  # informational: a healthy run that ended >= 10 % above the best healthy run of its set-up and seed


def degraded(runs: Sequence[dict]) -> list[bool]:
    """Per run: healthy by the label, yet its final loss is >= ``DEGRADED`` x the lowest final loss among the healthy
    runs of the same set-up and seed (a run that trained on, worse; the label does not count it, and neither do the
    scores: this only splits the false alarms in the table)."""
    best: dict[tuple, float] = {}
    for r in runs:
        if not r["collapsed"] and r.get("final_loss") is not None:
            key = (r["setup"], r["seed"])
            best[key] = min(best.get(key, float("inf")), r["final_loss"])
    return [
        not r["collapsed"]
        and r.get("final_loss") is not None
        and r["final_loss"] >= DEGRADED * best[(r["setup"], r["seed"])]
        for r in runs
    ]


def _degraded_table(runs: list[dict], alarms: dict[str, list]) -> list[str]:
    """False alarms split into healthy runs that ended degraded (``degraded``) and the others."""
    bad = degraded(runs)
    healthy = [i for i, r in enumerate(runs) if not r["collapsed"]]
    n_bad = sum(bad[i] for i in healthy)
    out = ["", f"**False alarms by how the healthy run ended** (informational; degraded: final loss >= {DEGRADED:g}x "
           "the best healthy run of its set-up and seed)", "",
           f"| detector | on degraded healthy runs (of {n_bad}) | on the others (of {len(healthy) - n_bad}) |",
           "|---|---|---|"]  # fmt: skip
    for name, per_run in alarms.items():
        on_bad = sum(per_run[i] is not None for i in healthy if bad[i])
        on_good = sum(per_run[i] is not None for i in healthy if not bad[i])
        out.append(f"| {name} | {on_bad} | {on_good} |")
    return out


def _fmt(s: dict) -> str:
    pct = f"{100 * s['warned'] / s['warnable']:.0f} %" if s["warnable"] else "-"
    lead = "-" if s["median_lead"] is None else f"{s['median_lead']:g}"
    fa = "-" if s["fa_per_10"] is None else f"{s['fa_per_10']:.1f} ({s['false_alarms']}/{s['healthy']})"
    return f"{s['warned']}/{s['warnable']} ({pct}) | {lead} | {fa}"


def markdown(runs: list[dict], alarms: dict[str, list], setups: Sequence[str]) -> str:
    """The benchmark's tables: runs per set-up, then per detector over all set-ups and per set-up."""
    lines = [
        "| set-up | runs | healthy | collapsed | warnable | no step (never learned) |",
        "|---|---|---|---|---|---|",
    ]
    for s in setups:
        rs = [r for r in runs if r["setup"] == s]
        col = [r for r in rs if r["collapsed"]]
        lines.append(
            f"| {s} | {len(rs)} | {len(rs) - len(col)} | {len(col)} | "
            f"{sum(r['step'] is not None and r['step'] >= LEAD for r in col)} | {sum(r['step'] is None for r in col)} |"
        )
    lines += _warnings_table(runs, alarms)
    lines += _degraded_table(runs, alarms)
    for title, idx in [("all set-ups", range(len(runs)))] + [
        (s, [i for i, r in enumerate(runs) if r["setup"] == s]) for s in setups
    ]:
        idx = list(idx)
        sub = score([runs[i] for i in idx], {n: [a[i] for i in idx] for n, a in alarms.items()})
        head = f"| detector | warned >= {LEAD} ahead | median lead | false alarms / 10 healthy |"
        lines += ["", f"**{title}**", "", head, "|---|---|---|---|"]
        lines += [f"| {name} | {_fmt(s)} |" for name, s in sub.items()]
    return "\n".join(lines)


def _warnings_table(runs: list[dict], alarms: dict[str, list]) -> list[str]:
    """Detectors whose events include warnings: healthy runs with any event, by set-up and learning rate."""
    names = [n for n in alarms if any(r.get("events", {}).get(n) != a for r, a in zip(runs, alarms[n]))]
    if not names:
        return []
    out = ["", "**Warnings (informational events; not alarms)**: healthy runs with any event, per set-up and lr", "",
           "| detector | set-up | lr | healthy runs with an event |", "|---|---|---|---|"]  # fmt: skip
    for n in names:
        keys = sorted({(r["setup"], r["lr"]) for r in runs if not r["collapsed"]})
        for setup, lr in keys:
            hs = [r for r in runs if not r["collapsed"] and (r["setup"], r["lr"]) == (setup, lr)]
            k = sum(r["events"].get(n) is not None for r in hs)
            if k:
                out.append(f"| {n} | {setup} | {lr:g} | {k}/{len(hs)} |")
    return out


def evaluate_dir(out: Path, seeds, setups, every: int = 10) -> dict:
    """Evaluate every run of ``setups`` x seeds found in ``out``."""
    paths = [run_path(out, c) for c in configs(seeds, setups)]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        print(f"normlab-lab collapse-bench evaluate: {len(missing)} runs missing (not collected), e.g. {missing[0]}")
    paths = [p for p in paths if p.exists()]
    runs, alarms = evaluate_runs(paths, every)
    return dict(runs=runs, alarms=alarms, every=every, setups=list(setups), markdown=markdown(runs, alarms, setups),
                summary=score(runs, alarms), missing=missing)  # fmt: skip
