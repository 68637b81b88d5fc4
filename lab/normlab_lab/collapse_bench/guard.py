"""The collapse benchmark's guard check (``normlab-lab collapse-bench guard``): live re-runs under CollapseGuard.

Each run of the protocol (same set-up, learning rate, seed, data order) is trained again with
:class:`normlab.monitor.CollapseGuard` at its defaults around a :class:`normlab.monitor.VarianceMonitor` at its
defaults (its default rules; probes when the monitor takes them), both on the run's optimizer, with the run's chance
loss in the failure taxonomy's criteria (:func:`~normlab_lab.collapse_bench.protocol.criteria`). The warm-up, if any,
is a ``LambdaLR`` schedule the guard lowers with the optimizer. Reported per run: the label of the kept trajectory
(:func:`normlab.monitor.collapse.label_collapse` on the losses of the steps the guard kept), the rescues, and whether
the guard gave up (:class:`normlab.monitor.RunCollapsed`). A collapsing run is *saved* when its guarded trajectory
ends healthy; a healthy run is *changed* when the guard rolled it back at least once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from normlab.monitor import CollapseGuard, RunCollapsed, VarianceMonitor
from normlab.monitor.collapse import label_collapse
from normlab_lab.collapse_bench.evaluate import label
from normlab_lab.collapse_bench.protocol import configs, criteria, load_run, run_path
from normlab_lab.collapse_bench.setups import ALL_SETUPS, batches, build
from normlab_lab.steps import train_steps

__all__ = ["guard_run", "guard_all", "guard_table", "runs_to_guard"]


def _guarded(model, opt, chance: float, warmup: int):
    mon = VarianceMonitor(model, probes=True, optimizer=opt)
    scheds = []
    if warmup:
        scheds = [torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))]
    return mon, scheds, CollapseGuard(model, opt, mon, schedulers=scheds, criteria=criteria(chance))


def guard_run(cfg: dict, steps: int | None = None) -> dict:
    """Train one run under the default guard (``steps``: override the set-up's step count); its summary."""
    torch.set_num_threads(1)
    setup = ALL_SETUPS[cfg["setup"]]
    model, opt, _lr_at, chance = build(cfg["setup"], cfg["lr"], cfg["seed"])
    mon, scheds, guard = _guarded(model, opt, chance, setup["warmup"])
    data = batches(setup["model"], setup["batch"], cfg["seed"] + 1)
    losses: dict[int, torch.Tensor] = {}  # by the guard's step: a rollback's steps are taken again, overwritten
    gave_up, start = False, time.time()
    steps = steps or setup["steps"]

    def step(t: int, loss: torch.Tensor) -> bool:
        nonlocal gave_up
        losses[guard.steps] = loss.detach()
        guard.observe_loss(loss)
        try:
            opt.step()  # the guard checks (and rolls back) inside
        except RunCollapsed:
            gave_up = True
            return False
        if not guard.rolled_back:  # after a rollback the schedulers are the snapshot's
            for s in scheds:
                s.step()
        return True

    # a rolled-back step is taken again: at most 3 x steps calls for ``steps`` kept steps
    train_steps(model, opt, data, 3 * steps, step, before=lambda t: guard.steps < steps, after=lambda t, _, go: go)
    kept = [float(losses[s]) for s in range(guard.steps)]  # the trajectory the model is on
    lab = label_collapse(kept, criteria(chance), finished=not gave_up)
    guard.close()
    mon.close()
    return dict(**cfg, rescues=len(guard.rescues), gave_up=gave_up, steps=guard.steps, collapsed=lab.collapsed,
                kind=lab.kind, seconds=round(time.time() - start, 1))  # fmt: skip


def guard_all(
    out: Path, runs: list[dict], workers: int, log: Callable[[str], None] = print, steps: int | None = None
) -> list[dict]:
    """Guard re-runs of ``runs`` (label dicts from the evaluation), cached in ``out/guard.jsonl``."""
    cache = out / "guard.jsonl"
    done = {}
    if cache.exists():
        for line in cache.read_text().splitlines():
            r = json.loads(line)
            done[(r["setup"], r["lr"], r["seed"])] = r
    todo = [r for r in runs if (r["setup"], r["lr"], r["seed"]) not in done]
    with ProcessPoolExecutor(max(1, workers)) as pool, open(cache, "a") as f:
        cfgs = [dict(setup=r["setup"], lr=r["lr"], seed=r["seed"]) for r in todo]
        for k, res in enumerate(pool.map(guard_run, cfgs, [steps] * len(cfgs))):
            f.write(json.dumps(res) + "\n")
            f.flush()
            done[(res["setup"], res["lr"], res["seed"])] = res
            log(f"[guard {k + 1}/{len(cfgs)}] {res}")
    return [done[(r["setup"], r["lr"], r["seed"])] for r in runs]


def runs_to_guard(out: Path, seeds: Sequence[int], setups: Sequence[str], healthy: int | None) -> list[dict]:
    """The collected runs to guard, labelled from their losses: every collapsing run and, per set-up, the first
    ``healthy`` healthy ones (None: all of them)."""
    runs = []
    for cfg in configs(seeds, setups):
        path = run_path(out, cfg)
        if path.exists():
            runs.append(dict(**cfg, collapsed=label(*load_run(path)).collapsed))
    if healthy is None:
        return runs
    kept, count = [], {}
    for r in runs:
        if not r["collapsed"]:
            count[r["setup"]] = count.get(r["setup"], 0) + 1
            if count[r["setup"]] > healthy:
                continue
        kept.append(r)
    return kept


def guard_table(runs: list[dict], guarded: list[dict], setups) -> str:
    """Per set-up: collapsing runs saved (guarded trajectory healthy) and healthy runs changed (rolled back)."""
    lines = ["| set-up | collapsing runs saved | healthy runs changed |", "|---|---|---|"]
    rows = [("all set-ups", None), *((s, s) for s in setups)]
    for title, s in rows:
        pairs = [(r, g) for r, g in zip(runs, guarded) if s is None or r["setup"] == s]
        col = [g for r, g in pairs if r["collapsed"]]
        healthy = [g for r, g in pairs if not r["collapsed"]]
        saved = sum(not g["collapsed"] for g in col)
        changed = sum(g["rescues"] > 0 for g in healthy)
        lines.append(f"| {title} | {saved}/{len(col)} | {changed}/{len(healthy)} |")
    return "\n".join(lines)
