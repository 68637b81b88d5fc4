"""The collapse benchmark's collection: every run of the protocol trained once, each step recorded in a JSONL.

One line per optimizer step: the training loss, the gradient norm before the step, the learning rates, the monitor's
per-layer records of that step (a :class:`~normlab.monitor.VarianceMonitor` that records every step and checks no
rule: the rules run offline, :mod:`~normlab_lab.collapse_bench.evaluate`) and the probes' values
(:class:`~normlab.monitor.probes.ProbeSet`). A run stops at its collapse (the label needs no more).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch

from normlab.monitor import VarianceMonitor
from normlab.monitor.collapse import CollapseTracker
from normlab.monitor.optim_step import is_adaptive
from normlab.monitor.probes import ProbeSet
from normlab_lab.collapse_bench.protocol import configs, criteria, run_path
from normlab_lab.collapse_bench.setups import ALL_SETUPS, batches, build
from normlab_lab.steps import train_steps

__all__ = ["train_run", "collect"]


def _monitor(model, opt) -> VarianceMonitor:
    """A VarianceMonitor on ``opt``'s steps that records every step and checks nothing (the rules run offline)."""
    return VarianceMonitor(model, every=1, rules=[], optimizer=opt)


def _num(v):
    if isinstance(v, float):
        return v if not math.isfinite(v) else float(f"{v:.6g}")
    return v


def _record(rec) -> dict:
    return {k: _num(v) for k, v in dict(rec).items() if isinstance(v, (int, float, str, bool)) or v is None}


def train_run(cfg: dict, path: Path, steps: int | None = None) -> dict:
    """Train one run and write its JSONL; returns a summary (name, steps run, seconds)."""
    torch.set_num_threads(1)
    setup = ALL_SETUPS[cfg["setup"]]
    steps = steps or setup["steps"]
    model, opt, lr_at, chance = build(cfg["setup"], cfg["lr"], cfg["seed"])
    mon, probes = _monitor(model, opt), ProbeSet(model)
    data = batches(setup["model"], setup["batch"], cfg["seed"] + 1)
    tracker = CollapseTracker(criteria(chance))  # stops the run at its collapse (the label needs no more)
    start, tmp = time.time(), path.with_suffix(".tmp")

    def before(t: int) -> bool:
        for g in opt.param_groups:
            g["lr"] = lr_at(t)
        probes.start()
        return True

    def step(t: int, loss: torch.Tensor) -> dict:
        grads = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
        gnorm = float(torch.stack(grads).norm()) if grads else 0.0
        n = len(mon.records)
        opt.step()  # the monitor records it
        pv = probes.stop()
        return dict(
            step=t,
            loss=loss.item(),
            grad_norm=_num(gnorm),
            lrs=[g["lr"] for g in opt.param_groups],
            records=[_record(r) for r in mon.records[n:]],
            probes={k: _num(v) for k, v in pv.items()},
        )

    with open(tmp, "w") as f:
        head = dict(header=True, **cfg, steps=steps, chance_loss=chance, batch=setup["batch"])
        f.write(json.dumps(dict(head, adaptive=is_adaptive(opt))) + "\n")

        def after(t: int, loss: torch.Tensor, line: dict) -> bool:
            f.write(json.dumps(line) + "\n")
            return tracker.update(line["loss"]) is None

        taken = train_steps(model, opt, data, steps, step, before=before, after=after)
    mon.close()
    os.replace(tmp, path)
    return dict(name=path.stem, steps=taken, seconds=round(time.time() - start, 1))


def _collect_one(cfg: dict, out: str, steps: int | None) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    path = run_path(Path(out), cfg)
    if path.exists():
        return dict(name=path.stem, steps=None, seconds=0.0, cached=True)
    return train_run(cfg, path, steps)


def collect(
    out: Path,
    seeds: Sequence[int],
    setups: Sequence[str],
    workers: int = 1,
    steps: int | None = None,
    log: Callable[[str], None] = lambda s: print(s, flush=True),
) -> list[dict]:
    """Train every run not on disk yet (``workers`` processes), printing one progress line per run."""
    out.mkdir(parents=True, exist_ok=True)
    cfgs = configs(seeds, setups)
    t0, results = time.time(), []

    def report(r: dict) -> None:
        results.append(r)
        log(
            f"[{len(results)}/{len(cfgs)}] {r['name']} steps={r['steps']} {r['seconds']}s "
            f"(elapsed {time.time() - t0:.0f}s)"
        )

    if workers <= 1:
        for c in cfgs:
            report(_collect_one(c, str(out), steps))
        return results
    with ProcessPoolExecutor(workers) as pool:
        futures = [pool.submit(_collect_one, c, str(out), steps) for c in cfgs]
        for fut in as_completed(futures):
            report(fut.result())
    return results
