"""Calibrate ``adaptive_steps`` of the variance rules (FactorRule, CountdownRule) on the collapse benchmark's PILOT
runs only (seeds 200 and 201; never the report seeds): the steps, under an adaptive optimizer, whose records the
rules skip (the optimizer's first-step transient).

Criterion, fixed before the pilot runs were scored: among ``GRID``, the smallest value at which the default rules
raise <= 1 false alarm per 10 healthy runs on the pilot's adaptive-optimizer runs (all such set-ups pooled); if
none, the value with the fewest false alarms (ties: the smaller). SGD runs are untouched by construction
(``StepContext.adaptive`` is False there) and are not scored here.

    python lab/scripts/bench_adaptive_steps.py runs/bench_pilot runs/bench_pilot201 runs/bench_explore
"""

from __future__ import annotations

import sys
from pathlib import Path

from normlab.monitor.rules import DEFAULT_RULES, CountdownRule, FactorRule
from normlab_lab.collapse_bench.evaluate import adaptive_run, first_events, label, score
from normlab_lab.collapse_bench.protocol import load_run

GRID = (0, 5, 10, 20, 30, 50)
SEEDS = (200, 201)  # pilot seeds only


def pilot_paths(dirs: list[str]) -> list[Path]:
    """The pilot runs of ``dirs`` (one per name: the first directory holding it wins)."""
    seen: dict[str, Path] = {}
    for d in dirs:
        for p in sorted(Path(d).glob("*.jsonl")):
            if any(p.stem.endswith(f"_s{s}") for s in SEEDS):
                seen.setdefault(p.stem, p)
    return [seen[k] for k in sorted(seen)]


def main(dirs: list[str]) -> None:
    runs, loaded = [], []
    for path in pilot_paths(dirs):
        header, steps = load_run(path)
        if not adaptive_run(header):
            continue
        lab = label(header, steps)
        runs.append(dict(name=path.stem, collapsed=lab.collapsed, step=lab.step))
        loaded.append(steps)
    print(f"{len(runs)} adaptive pilot runs, {sum(not r['collapsed'] for r in runs)} healthy")
    for k in GRID:

        def rules(k=k):
            out = []
            for r in DEFAULT_RULES():
                if isinstance(r, FactorRule | CountdownRule):
                    r.adaptive_steps = k
                out.append(r)
            return out

        alarms = {"default": [], "countdown": [], "factor": []}
        for steps in loaded:
            for name in alarms:
                made = rules() if name == "default" else [r for r in rules() if r.name == name]
                alarm, _ = first_events(made, steps, 10, adaptive=True)
                alarms[name].append(None if alarm is None else alarm.step)
        s = score(runs, alarms)
        cells = "; ".join(
            f"{n}: warned {v['warned']}/{v['warnable']}, false {v['false_alarms']}/{v['healthy']}" for n, v in s.items()
        )
        fa = [r["name"] for r, a in zip(runs, alarms["default"]) if a is not None and not r["collapsed"]]
        print(f"adaptive_steps={k}: {cells}; false-alarm runs {fa}")


if __name__ == "__main__":
    main(sys.argv[1:])
