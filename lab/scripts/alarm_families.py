"""Round 4 of the collapse benchmark: calibrate the default rules on some families, judge them on others.

Reads runs recorded by ``normlab-lab collapse-bench collect`` and replays rule sets over them exactly as
``collapse-bench evaluate`` does (``--every 10``; labels from the losses alone, :func:`normlab.monitor.label_collapse`).
The protocol, the candidates and the criteria are in lab/docs/monitor_calibration.md ("Round 4"), written before the
report seeds were collected.

    # calibration: every candidate on the calibration families (seeds 400-405), pooled and leave-one-family-out
    python lab/scripts/alarm_families.py calibrate runs/alarms_cal
    # report: the shipped defaults beside the round-3 defaults on any recorded runs, by family
    python lab/scripts/alarm_families.py report runs/alarms_report

``calibrate`` never reads a run of a held-out family (:data:`normlab_lab.collapse_bench.setups.HELD_OUT`) or a seed
outside :data:`CAL_SEEDS`; ``report`` chooses nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from normlab.monitor.rules import DEFAULT_RULES, CountdownRule, FactorRule, RegimeRule, replay
from normlab_lab.collapse_bench.evaluate import adaptive_run, contexts, label, score
from normlab_lab.collapse_bench.protocol import LEAD, load_run
from normlab_lab.collapse_bench.setups import FAMILY, HELD_OUT

CAL_SEEDS = range(400, 406)  # calibration seeds of round 4; report seeds are 410-414


ROUND3 = dict(
    factor=dict(watch=("output_var", "shift"), explode_factor={"output_var": 1e3, "shift": 100.0},
                implode_factor={"input_sq": 1e4}, min_initial={"output_var": 1.0, "shift": 1e-6}),
    regime=dict(window=2, min_ratio=10.0),
    countdown=dict(growth=1.0, new_high=False),
)  # fmt: skip  # the default rules of round 3 (the shipped defaults before round 4), spelled out

# each candidate changes one thing of a rule set (lab/docs/monitor_calibration.md, round 4); None removes the rule
CANDIDATES: dict[str, tuple[str, dict | None]] = {
    "K1 countdown new_high": ("countdown", dict(new_high=True)),
    "K2 shift scale-free": ("factor", dict(watch=("output_var", "shift_scale_free"),
                            explode_factor={"output_var": 1e3, "shift_scale_free": 100.0},
                            min_initial={"output_var": 1.0, "shift_scale_free": 1e-6})),
    "K3 no implosion": ("factor", dict(implode_factor={})),
    "K4 countdown spread 3": ("countdown", dict(spread=3.0)),
    "K5 countdown confirm 2": ("countdown", dict(confirm=2)),
}  # fmt: skip


def with_change(config: dict, change: tuple[str, dict | None]) -> dict:
    """``config`` with one candidate's change applied."""
    rule, kwargs = change
    out = dict(config)
    if kwargs is None:
        out.pop(rule, None)
    elif rule in out:
        out[rule] = {**out[rule], **kwargs}
    return out


def make(config: dict) -> Callable[[], list]:
    """A factory of fresh rules for ``config`` (order: factor, regime, countdown, as DEFAULT_RULES)."""
    classes = dict(factor=FactorRule, regime=RegimeRule, countdown=CountdownRule)
    return lambda: [classes[k](**config[k]) for k in ("factor", "regime", "countdown") if k in config]


def round3_rules() -> list:
    """The default rules of round 3."""
    return make(ROUND3)()


def load(dirs: list[str], calibration: bool) -> list[dict]:
    """Every run of ``dirs`` (calibration: only calibration families and seeds), labelled."""
    out = []
    for d in dirs:
        for path in sorted(Path(d).glob("*.jsonl")):
            header, steps = load_run(path)
            family = FAMILY[header["setup"]]
            if calibration and (family in HELD_OUT or header["seed"] not in CAL_SEEDS):
                continue
            lab = label(header, steps)
            out.append(dict(name=path.stem, setup=header["setup"], family=family, lr=header["lr"],
                            seed=header["seed"], collapsed=lab.collapsed, step=lab.step, kind=lab.kind,
                            header=header, steps=steps))  # fmt: skip
    return out


_MEMO: dict[tuple[str, str], list] = {}


def events(runs: list[dict], rules: Callable[[], list]) -> list[list]:
    """The events (first of each rule) of ``rules()`` replayed over each run at ``--every 10`` (memoized per rule
    set, by the rules' repr, and run)."""
    key = repr(rules())
    out = []
    for r in runs:
        if (key, r["name"]) not in _MEMO:
            _MEMO[key, r["name"]] = replay(rules(), contexts(r["steps"], 10, adaptive_run(r["header"])))
        out.append(_MEMO[key, r["name"]])
    return out


def alarm_steps(evs: list[list], severity: str = "alarm") -> list:
    """Per run: the step of the first event of ``severity``, or None."""
    return [next((e.step for e in ev if e.severity == severity), None) for ev in evs]


def by_family(runs: list[dict], steps: list, families: list[str] | None = None) -> dict[str, dict]:
    """``score`` per family and pooled (``"all"``)."""
    families = families or sorted({r["family"] for r in runs})
    out = {}
    for f in [*families, "all"]:
        idx = [i for i, r in enumerate(runs) if f == "all" or r["family"] == f]
        out[f] = score([runs[i] for i in idx], {"d": [steps[i] for i in idx]})["d"]
    return out


def cell(s: dict) -> str:
    """``FA/healthy, warned/warnable``."""
    return f"{s['false_alarms']}/{s['healthy']}, {s['warned']}/{s['warnable']}"


def table(runs: list[dict], rows: dict[str, list]) -> str:
    """Markdown: per candidate and family, false alarms / healthy runs and warned / warnable collapses."""
    families = sorted({r["family"] for r in runs})
    lines = ["| rules | " + " | ".join(families) + " | all |", "|---" * (len(families) + 2) + "|"]
    for name, steps in rows.items():
        fam = by_family(runs, steps, families)
        lines.append(f"| {name} | " + " | ".join(cell(fam[f]) for f in [*families, "all"]) + " |")
    return "\n".join(lines)


def adopted(base: dict, cand: dict) -> bool:
    """The round-4 adoption criterion on pooled calibration scores: false alarms do not rise, warned collapses do
    not fall, and one of the two improves."""
    no_worse = cand["false_alarms"] <= base["false_alarms"] and cand["warned"] >= base["warned"]
    better = cand["false_alarms"] < base["false_alarms"] or cand["warned"] > base["warned"]
    return no_worse and better


def greedy(runs: list[dict], log=print) -> tuple[dict, list[str]]:
    """Forward selection from round 3: each pass applies every candidate not yet adopted to the current set and
    adopts the one the criterion accepts with the fewest false alarms (then the most warned, then the candidate's
    order); it stops when none is accepted. Returns the set and the adopted candidates in order."""
    config, chosen = dict(ROUND3), []
    base = by_family(runs, alarm_steps(events(runs, make(config))))["all"]
    while True:
        best = None
        for name, change in CANDIDATES.items():
            if name in chosen:
                continue
            cand = by_family(runs, alarm_steps(events(runs, make(with_change(config, change)))))["all"]
            log(f"  on top of {chosen or ['round 3']}: {name}: {cell(cand)} (now {cell(base)})")
            if adopted(base, cand) and (best is None or (cand["false_alarms"], -cand["warned"]) < best[0]):
                best = ((cand["false_alarms"], -cand["warned"]), name, cand)
        if best is None:
            return config, chosen
        config, base = with_change(config, CANDIDATES[best[1]]), best[2]
        chosen.append(best[1])


def alone(runs: list[dict], config: dict) -> dict[str, list]:
    """Alarm (warning, for the regime rule) steps of each rule of ``config`` alone."""
    out = {}
    for rule in ("factor", "regime", "countdown"):
        if rule in config:
            ev = events(runs, make({rule: config[rule]}))
            out[f"{rule} alone"] = alarm_steps(ev, "warning" if rule == "regime" else "alarm")
    return out


def calibrate(dirs: list[str]) -> None:
    runs = load(dirs, calibration=True)
    print(f"{len(runs)} calibration runs ({sum(not r['collapsed'] for r in runs)} healthy, "
          f"{sum(r['collapsed'] and r['step'] is not None and r['step'] >= LEAD for r in runs)} warnable)")  # fmt: skip
    print("\nEach candidate alone on round 3, each rule alone (false alarms / healthy, warned / warnable):\n")
    rows = {"round 3": alarm_steps(events(runs, make(ROUND3)))}
    rows.update({f"round 3, {k}": v for k, v in alone(runs, ROUND3).items()})
    for name, change in CANDIDATES.items():
        config = with_change(ROUND3, change)
        rows[name] = alarm_steps(events(runs, make(config)))
        rule = change[0]
        if rule in config:
            rows[f"{name}, {rule} alone"] = alone(runs, {rule: config[rule]})[f"{rule} alone"]
    print(table(runs, rows))
    regime = alone(runs, ROUND3)["regime alone"]
    fam = by_family(runs, regime)
    keep = fam["all"]["warned"] >= 1 and all(10 * v["false_alarms"] <= 2 * v["healthy"] for v in fam.values())
    print(
        f"\nRegime warning: {'kept on' if keep else 'off'} by default (criterion: it warns >= 1 warnable collapse "
        ">= 5 steps ahead and flags <= 2 per 10 healthy runs of every calibration family)"
    )
    print("\nForward selection on every calibration family:\n")
    config, chosen = greedy(runs)
    if not keep:
        config = with_change(config, ("regime", None))
    print(f"adopted: {chosen}; regime {'on' if keep else 'off'}\n")
    final = {"adopted set": alarm_steps(events(runs, make(config)))}
    final.update(alone(runs, config))
    print(table(runs, final))
    families = sorted({r["family"] for r in runs})
    print("\nLeave one family out (selection without the family, scored on it):\n")
    for f in families:
        rest = [r for r in runs if r["family"] != f]
        held = [r for r in runs if r["family"] == f]
        cfg, picked = greedy(rest, log=lambda s: None)
        s_new = by_family(held, alarm_steps(events(held, make(cfg))))["all"]
        s_old = by_family(held, alarm_steps(events(held, make(ROUND3))))["all"]
        print(f"- without {f}: adopted {picked}; on {f}: {cell(s_new)} (round 3: {cell(s_old)})")
    print()
    evs = events(runs, make(config))
    for r, ev in zip(runs, evs):
        first = next((e for e in ev if e.severity == "alarm"), None)
        if first is not None and not r["collapsed"]:
            print(
                f"false alarm (adopted set): {r['name']} step {first.step} {first.rule} {first.layer} {first.quantity}"
            )


def report(dirs: list[str]) -> None:
    runs = load(dirs, calibration=False)
    print(f"{len(runs)} runs ({sum(not r['collapsed'] for r in runs)} healthy, "
          f"{sum(r['collapsed'] and r['step'] is not None and r['step'] >= LEAD for r in runs)} warnable)")  # fmt: skip
    evs = {"round 4 (DEFAULT_RULES)": events(runs, DEFAULT_RULES), "round 3": events(runs, round3_rules)}
    rows = {name: alarm_steps(ev) for name, ev in evs.items()}
    rows["round 3 regime warning (flags)"] = [next((e.step for e in ev if e.rule == "regime"), None)
                                              for ev in evs["round 3"]]  # fmt: skip
    print(table(runs, rows))
    for name, ev in evs.items():
        for r, e in zip(runs, ev):
            first = next((x for x in e if x.severity == "alarm"), None)
            if first is not None and (not r["collapsed"] or r["step"] is not None):
                what = "false alarm" if not r["collapsed"] else f"collapse {r['kind']} at {r['step']}"
                print(f"{name}: {r['name']} ({what}): {first.rule} at {first.step}, {first.layer} {first.quantity}")


if __name__ == "__main__":
    stage, *dirs = sys.argv[1:]
    {"calibrate": calibrate, "report": report}[stage](dirs)
