"""The record of ``normlab-lab reproduce`` on a shared machine: the same runs, trained in an order that answers the
claims the demo could not test first, and the table of whatever has finished.

``python lab/scripts/record_reproduce.py train OUT``: plans exactly the grids and directories that
``normlab-lab reproduce --out OUT`` plans (:data:`~normlab_lab.reproduce.mnist1d.FULL_PROTOCOL`, seeds
300-302) and trains their cells in the stages of :data:`STAGES` (2 workers, one thread each), printing each stage's
wall time and the CPU time of its workers. ``normlab-lab reproduce --out OUT`` resumes the same directory (it skips
every finished run) and writes the report; CPU training is deterministic, so the order changes no number.

``python lab/scripts/record_reproduce.py partial OUT``: the finished runs of section (b) as a markdown table (test
accuracy in eval mode / train mode, mean ± sample std over the finished seeds, and each run's plateau check), for
a record that could not finish (lab/docs/reproduction.md, "The recorded full run"); ``verdicts OUT``: claims 3, 3a and
Batch Renorm's from those runs, by the report's own code and criteria.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from normlab.runner.grid.execute import run_cells
from normlab_lab.demo.claims import PLATEAU_Z, batch_rows, plateau_check
from normlab_lab.demo.experiment import plan_demo
from normlab_lab.reproduce.mnist1d import FULL_PROTOCOL

CLAIM_NORMS_A = {"none", "bn", "wn", "pws", "pws:gamma=0.01"}
STAGES = [  # (label, section, which cells): claims 3 and 3a first, then 3's plateau condition, BRN, ...
    ("(b) BN PWS at 128 and 2", "batch_size", lambda c: c.name in ("bn", "pws") and c.batch_size in (128, 2)),
    ("(b) GN; BN PWS at 4", "batch_size", lambda c: c.name == "gn" or (c.name in ("bn", "pws") and c.batch_size == 4)),
    ("(b) BRN", "batch_size", lambda c: c.name == "brn"),
    ("(b) SN", "batch_size", lambda c: c.name == "sn"),
    ("(a) none BN WN PWS", "lr_sweep", lambda c: c.name in CLAIM_NORMS_A),
    ("(c)", "collapse", lambda c: True),
    ("(c) guard", "guard", lambda c: True),
    ("(c) guard_dead", "guard_dead", lambda c: True),
    ("(a) the rest", "lr_sweep", lambda c: c.name not in CLAIM_NORMS_A),
]


def train(out: Path) -> None:
    grids = plan_demo(out, FULL_PROTOCOL, workers=2)
    for g in grids.values():
        g.start()
    for label, key, pick in STAGES:
        g = grids[key]
        g.wanted = frozenset(c.cell_id for c in g.cells if pick(c))
        t, w = time.time(), os.times()
        run_cells([g], workers=2, threads=1, progress=True, label=f"record {label}")
        w2 = os.times()
        cpu = w2.children_user + w2.children_system - w.children_user - w.children_system
        print(f"STAGE {label}: wall {time.time() - t:.0f} s, cpu of finished workers {cpu:.0f} s", flush=True)
        g.finish(render=False)


def _ms(xs: list[float]) -> str:
    if not xs:
        return "n/a"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{100 * statistics.mean(xs):.1f} ± {100 * sd:.1f}"


def partial(out: Path) -> None:
    runs = sorted((out / "batch_size" / "runs").glob("*/summary.json"))
    groups: dict[tuple[str, int], list[dict]] = {}
    for path in runs:
        s = json.loads(path.read_text())
        cfg = s["config"]
        name = path.parent.name.split("_lr")[0]  # the cell's norm name (PWS is a conv: its config's norm is none)
        groups.setdefault((name, int(cfg["batch_size"])), []).append({**s, "dir": path.parent})
    print("| norm | batch | seeds | eval mode % | train mode % | plateau: fall % / nats vs 2 se (per seed) | steps |")
    print("|---|---|---|---|---|---|---|")
    for (norm, bs), ss in sorted(groups.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        checks = [plateau_check(s["dir"]) for s in ss]
        falls = ", ".join(
            f"{100 * c['fall']:.1f} / {c['fall_nats']:.4f} vs {PLATEAU_Z * c['noise_nats']:.4f}"
            f" {'yes' if c['plateau'] else '**no**'}"
            for c in checks
        )
        seeds = ",".join(str(s["config"]["seed"]) for s in ss)
        ev = _ms([s["final_test_acc"] for s in ss])
        tm = _ms([s["final_test_acc_train_mode"] for s in ss])
        print(f"| {norm} | {bs} | {seeds} | {ev} | {tm} | {falls} | {checks[0]['steps']} |")


def verdicts(out: Path) -> None:
    """Claims 3, 3a and Batch Renorm's, by the report's own code and criteria, from section (b)'s finished runs
    alone (``results.json``, rewritten after each run): a group without runs counts as missing, as in the report."""
    b = json.loads((out / "batch_size" / "results.json").read_text())
    plateau = {c["cell"]: plateau_check(out / "batch_size" / "runs" / c["cell"]) for c in b["cells"]}
    runs = {(g["name"], int(g["batch_size"])): g["n_seeds"] for g in b["groups"]}
    print(f"section (b): {len(b['cells'])} finished runs; seeds per group: {runs}")
    for r in batch_rows(b, {"plateau": plateau}):
        print(f"- **{r['id']}**: **{r['verdict']}**: {r['numbers']}")


def main(argv: list[str]) -> int:
    modes = {"train": train, "partial": partial, "verdicts": verdicts}
    if len(argv) != 2 or argv[0] not in modes:
        print("usage: python lab/scripts/record_reproduce.py train|partial|verdicts OUT", file=sys.stderr)
        return 2
    modes[argv[0]](Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
