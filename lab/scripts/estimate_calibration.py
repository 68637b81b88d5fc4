"""The demo's pre-start estimate by part, and the seconds a run takes besides its steps, evaluations and monitor.

``parts OUT``: plans the demo into OUT (its data generated there once) and prints the estimate of its runs split into
steps, evaluations, the monitor and the runs' own overhead (two workers), the work after the runs, and how long the
timing took. ``overhead OUT``: trains the first cell of sections (a), (b) and (c) for 2 steps, 3 times each, and
prints the wall time against the estimate of its parts (the first run of a process also pays its imports).
Record: lab/docs/estimate_calibration.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch

from normlab.runner.experiments.compare import train_cell
from normlab.runner.grid import estimate as E
from normlab_lab.demo.experiment import PROTOCOL, after_runs_seconds, plan_demo


def _timed(cfg) -> dict[str, float]:
    step = E.step_seconds(cfg)
    monitor = E.monitor_seconds(cfg, plain=step) if E.cell_recorded_steps(cfg) else 0.0
    return {"step": step, "eval": E.eval_seconds(cfg), "monitor": monitor}


def parts(out: Path, workers: int = 2) -> None:
    t0 = time.perf_counter()
    cells = [c for g in plan_demo(out, PROTOCOL).values() for c in g.cells]
    timed: dict[tuple, dict[str, float]] = {}
    total = {"steps": 0.0, "evaluations": 0.0, "monitor": 0.0}
    for cell in cells:
        cfg = cell.config
        key = (cfg.norm, cfg.conv, cfg.width, cfg.batch_size, cfg.eval_train_mode)
        if key not in timed:
            timed[key] = _timed(cfg)
        t = timed[key]
        total["steps"] += E.cell_steps(cfg) * t["step"]
        total["evaluations"] += E.cell_evals(cfg) * t["eval"]
        total["monitor"] += E.cell_recorded_steps(cfg) * t["monitor"]
    total["run overhead"] = len(cells) * E.RUN_OVERHEAD_S
    runs = {k: v / workers for k, v in total.items()}
    after = after_runs_seconds(PROTOCOL)
    print(", ".join(f"{k} {v:.1f} s" for k, v in runs.items()) + f" ({workers} workers)")
    print(
        f"runs {sum(runs.values()):.1f} s, after the runs {after:.1f} s, estimate {sum(runs.values()) + after:.1f} s; "
        f"steps only (the estimate before): {runs['steps']:.1f} s; timing took {time.perf_counter() - t0:.1f} s"
    )


def overhead(out: Path) -> None:
    torch.set_num_threads(1)
    grids = plan_demo(out, PROTOCOL)
    for section in ("lr_sweep", "batch_size", "collapse"):
        cfg = dataclasses.replace(grids[section].cells[0].config, max_steps_per_epoch=2, epochs=1, evals_per_epoch=1)
        walls = []
        for _ in range(3):
            with tempfile.TemporaryDirectory() as d:
                t0 = time.perf_counter()
                train_cell(cfg, d)
                walls.append(time.perf_counter() - t0)
        parts_s = E.cell_seconds(cfg, _timed(cfg)) - E.RUN_OVERHEAD_S
        print(
            f"{section} {cfg.norm} batch {cfg.batch_size}: 2-step runs {', '.join(f'{w:.2f}' for w in walls)} s, "
            f"their parts {parts_s:.2f} s, overhead {statistics.median(walls[1:]) - parts_s:.2f} s"
        )


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("parts", "overhead"))
    p.add_argument("out", type=Path, help="the demo's output folder (its data is generated there once)")
    args = p.parse_args()
    (parts if args.what == "parts" else overhead)(args.out)


if __name__ == "__main__":
    main()
