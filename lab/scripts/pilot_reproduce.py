"""The pilot that fixed ``normlab-lab reproduce``'s protocol: its slowest cells on pilot seeds, with the plateau check.

``python lab/scripts/pilot_reproduce.py OUT [SEED] [small|batch2 [MAX_STEPS]]``: trains, with FULL_PROTOCOL's
settings, the unnormalized net, WN, GN and BN at section (a)'s lowest learning rate, and BN / GN / PWS at section
(b)'s batch sizes (PWS at 4 and 2, BN at 128 and 2, GN at 2); ``small``: only the cells of the second pilot
(:data:`SMALL`); ``batch2``: BN and PWS at batch 2, with MAX_STEPS as the cap on an epoch of (b); ``smallb``: every
norm of (b) at batches 4 and 2; ``b2``: every norm of (b) at batch 2 (the fourth pilot, of the noise-aware
criterion, seeds 203 and 204); ``a5``: every norm of (a) at learning rates 0.02 and 0.1 with 5 epochs instead of 10
(the fifth pilot, seeds 206 and 207). It prints each run's
final accuracy, its plateau check and its step time.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from normlab.runner.experiments.compare import COMPARE
from normlab.runner.grid.execute import plan_grid, run_cells
from normlab_lab.demo.claims import plateau_check
from normlab_lab.demo.experiment import demo_sections
from normlab_lab.reproduce.mnist1d import FULL_PROTOCOL

SMALL = {  # the second pilot, after the schedule moved: the cells that had missed the plateau, and the slowest learner
    "lr_sweep": {("none", 128)},
    "batch_size": {("bn", 128), ("pws", 4), ("pws", 2), ("bn", 2)},
}
BATCH2 = {"batch_size": {("bn", 2), ("pws", 2)}}  # the third pilot: batch 2 with twice the steps
SMALLB = {"batch_size": {(n, b) for n in ("bn", "brn", "gn", "sn", "pws") for b in (4, 2)}}  # pilots 203-: (b) <128
B2 = {"batch_size": {(n, 2) for n in ("bn", "brn", "gn", "sn", "pws")}}  # the fourth pilot as cut: (b) at batch 2
A5 = {"lr_sweep": None}  # the fifth pilot: every norm of (a) at lr 0.02 and 0.1, 5 epochs
PICKS = {
    "lr_sweep": {("none", 128), ("wn", 128), ("gn", 128), ("bn", 128)},
    "batch_size": {("bn", 128), ("pws", 4), ("pws", 2), ("bn", 2), ("gn", 2)},
}


def main(argv: list[str]) -> int:
    out, seed = Path(argv[0]), int(argv[1]) if len(argv) > 1 else 200
    mode = argv[2] if len(argv) > 2 else ""
    picks = {"small": SMALL, "batch2": BATCH2, "smallb": SMALLB, "b2": B2, "a5": A5}.get(mode, PICKS)
    p = dataclasses.replace(FULL_PROTOCOL, seeds=(seed,), guard_seeds=(seed,))
    if mode == "a5":
        p = dataclasses.replace(p, lr_epochs=5)
    if len(argv) > 3:  # the cap on an epoch's steps in (b)
        p = dataclasses.replace(p, batch_max_steps=int(argv[3]))
    sections = demo_sections(p)
    lrs = (0.02, 0.1) if mode == "a5" else (min(p.lrs),)
    sections["lr_sweep"] = dataclasses.replace(sections["lr_sweep"], lrs=lrs)
    grids = [plan_grid(COMPARE, sections[k], out / k, data_cache=out / "data") for k in picks]
    for g, k in zip(grids, picks):
        g.cells = [c for c in g.cells if picks[k] is None or (c.name, c.batch_size) in picks[k]]
        g.start()
    run_cells(grids, workers=1 if picks is PICKS or picks is SMALL else 2, threads=1, progress=False)
    for g, k in zip(grids, picks):
        for c in g.cells:
            s = json.loads((g.cell_dir(c) / "summary.json").read_text())
            acc = f"acc {s.get('final_test_acc')} / {s.get('final_test_acc_train_mode')}"
            print(k, c.cell_id, acc, f"step {s.get('step_time_s')}", plateau_check(g.cell_dir(c)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
