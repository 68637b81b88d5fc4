"""Collapse benchmark: does a detector warn before a training run collapses, and how often does it cry wolf?

    python scripts/collapse_bench.py all      --out runs/collapse_bench --seeds 300-302 --workers 2  # the three below
    python scripts/collapse_bench.py collect  --out runs/collapse_bench --seeds 300-302 --workers 2
    python scripts/collapse_bench.py evaluate --out runs/collapse_bench --seeds 300-302 [--json table.json]
    python scripts/collapse_bench.py guard    --out runs/collapse_bench --seeds 300-302 --guard-healthy 3

``collect`` trains every run of the protocol (set-up x learning rate x seed; the set-ups are in
scripts/bench_setups.py) and writes one JSONL per run: a header line (set-up, lr, seed, chance loss), then one line per
optimizer step with the training loss, the gradient norm before the step, the learning rates, the monitor's per-layer
records of that step (the monitor records every step, with no rule) and the probes' values
(:mod:`normlab.monitor.probes`). A finished run is not rerun. Nothing reads an alarm during collection.

``evaluate`` labels each run from its losses alone with :func:`normlab.monitor.collapse.label_collapse` (the
library's one collapse definition, fixed before any alarm was read) and replays every detector over the same recorded
runs (:func:`normlab.monitor.rules.replay`), so detectors are compared on identical data. Per detector:

- *warned*: warnable collapses whose first alarm came >= ``LEAD`` steps before the collapse step. A collapse is
  *warnable* when its step is >= ``LEAD`` steps after the first recorded step (step 0), i.e. step >= ``LEAD``;
  collapses without a step (a net that never learned) are not warnable and are counted apart;
- *median lead*: the median of (collapse step - alarm step) over the warned collapses;
- *false alarms per 10 healthy runs*: healthy runs with any alarm, per 10 healthy runs.

The monitor's records are replayed every ``--every`` steps (default 10, the monitor's default recording interval);
rules with ``every_step = True`` see every step's scalars (loss, gradient norm). ``guard`` trains runs again under
the default :class:`normlab.monitor.CollapseGuard` (scripts/bench_guard.py). Pilot seeds are 200-209 (set-up grids
and rule parameters were fixed on them), report seeds 300-302, 310-312 and 320-322 (rounds 1-3,
docs/monitor_benchmark.md); seeds below 100 are never used. ``--setups`` defaults to the report's set-ups; the
pilot-only ones (``bench_setups.PILOT_SETUPS``) run when named.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "scripts")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_setups import ALL_SETUPS, SETUPS, batches, build  # noqa: E402

LEAD = 5  # a warning counts when it comes >= LEAD steps before the collapse step
WINDOW = 10  # steps of the smoothed loss of the collapse label (label_collapse's default)
MIN_SEED = 100


# ---------------------------------------------------------------------------------------------- collection
def run_name(cfg: dict) -> str:
    return f"{cfg['setup']}_lr{cfg['lr']:g}_s{cfg['seed']}"


def configs(seeds, setups=tuple(SETUPS)) -> list[dict]:
    """Every run of the protocol: set-up x lr x seed."""
    return [dict(setup=s, lr=lr, seed=seed) for seed in seeds for s in setups for lr in ALL_SETUPS[s]["lrs"]]


def _monitor(model):
    """A VarianceMonitor that records every step and checks nothing (the rules run offline)."""
    from normlab.monitor import VarianceMonitor

    params = inspect.signature(VarianceMonitor).parameters
    if "rules" in params:
        return VarianceMonitor(model, every=1, rules=[])
    return VarianceMonitor(model, every=1, countdown=False, risk=False, factor_rules=False)


def _num(v):
    if isinstance(v, float):
        return v if not math.isfinite(v) else float(f"{v:.6g}")
    return v


def _record(rec) -> dict:
    return {k: _num(v) for k, v in dict(rec).items() if isinstance(v, (int, float, str, bool)) or v is None}


def train_run(cfg: dict, path: Path, steps: int | None = None) -> dict:
    """Train one run and write its JSONL; returns a summary (name, steps run, seconds)."""
    from normlab.monitor.collapse import CollapseTracker
    from normlab.monitor.optim_step import is_adaptive
    from normlab.monitor.probes import ProbeSet

    torch.set_num_threads(1)
    setup = ALL_SETUPS[cfg["setup"]]
    steps = steps or setup["steps"]
    model, opt, lr_at, chance = build(cfg["setup"], cfg["lr"], cfg["seed"])
    mon, probes = _monitor(model), ProbeSet(model)
    data = batches(setup["model"], setup["batch"], cfg["seed"] + 1)
    tracker = CollapseTracker(chance, window=WINDOW)  # stops the run at its collapse (the label needs no more)
    start, tmp = time.time(), path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        head = dict(header=True, **cfg, steps=steps, chance_loss=chance, batch=setup["batch"])
        f.write(json.dumps(dict(head, adaptive=is_adaptive(opt))) + "\n")
        for step in range(steps):
            line = _train_step(model, opt, mon, probes, data, lr_at(step), step)
            f.write(json.dumps(line) + "\n")
            if tracker.update(line["loss"]) is not None:
                break
    mon.close()
    os.replace(tmp, path)
    return dict(name=path.stem, steps=step + 1, seconds=round(time.time() - start, 1))


def _train_step(model, opt, mon, probes, data, lr: float, step: int) -> dict:
    for g in opt.param_groups:
        g["lr"] = lr
    x, y = next(data)
    probes.start()
    out = model(x)
    loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grads = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
    gnorm = float(torch.stack(grads).norm()) if grads else 0.0
    n = len(mon.records)
    mon.step(opt)
    pv = probes.stop()
    return dict(
        step=step,
        loss=loss.item(),
        grad_norm=_num(gnorm),
        lrs=[g["lr"] for g in opt.param_groups],
        records=[_record(r) for r in mon.records[n:]],
        probes={k: _num(v) for k, v in pv.items()},
    )


def _collect_one(cfg: dict, out: str, steps: int | None) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    path = Path(out) / f"{run_name(cfg)}.jsonl"
    if path.exists():
        return dict(name=path.stem, steps=None, seconds=0.0, cached=True)
    return train_run(cfg, path, steps)


def collect(
    out: Path, seeds, setups, workers: int = 1, steps: int | None = None, log=lambda s: print(s, flush=True)
) -> list[dict]:
    """Train every run not on disk yet (``workers`` processes), printing one progress line per run."""
    out.mkdir(parents=True, exist_ok=True)
    cfgs = configs(seeds, setups)
    done, t0, results = 0, time.time(), []
    if workers <= 1:
        it = (_collect_one(c, str(out), steps) for c in cfgs)
        for r in it:
            done += 1
            results.append(r)
            log(
                f"[{done}/{len(cfgs)}] {r['name']} steps={r['steps']} {r['seconds']}s (elapsed {time.time() - t0:.0f}s)"
            )
        return results
    with ProcessPoolExecutor(workers) as pool:
        futures = [pool.submit(_collect_one, c, str(out), steps) for c in cfgs]
        for fut in as_completed(futures):
            r = fut.result()
            done += 1
            results.append(r)
            log(
                f"[{done}/{len(cfgs)}] {r['name']} steps={r['steps']} {r['seconds']}s (elapsed {time.time() - t0:.0f}s)"
            )
    return results


# ---------------------------------------------------------------------------------------------- loading
def load_run(path: Path) -> tuple[dict, list[dict]]:
    """``(header, steps)`` of one run's JSONL."""
    with open(path) as f:
        lines = [json.loads(s) for s in f if s.strip()]
    return lines[0], lines[1:]


def parse_seeds(text: str) -> list[int]:
    """ "300-305" or "300,302" -> seeds; seeds below 100 are refused (reserved)."""
    seeds: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        seeds += list(range(int(a), int(b or a) + 1))
    if min(seeds) < MIN_SEED:
        raise SystemExit(f"collapse_bench: seeds must be >= {MIN_SEED} (0-99 are reserved), got {min(seeds)}")
    return seeds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("all", "collect", "evaluate", "guard"))
    p.add_argument("--out", default="runs/collapse_bench")
    p.add_argument("--seeds", default="300-302")
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=None, help="override every set-up's step count (tests)")
    p.add_argument("--every", type=int, default=10, help="evaluate: the monitor's recording interval replayed")
    p.add_argument("--json", default=None, help="evaluate/guard: also write the table as JSON here")
    p.add_argument("--guard-healthy", type=int, default=3, help="guard: at most this many healthy runs per set-up")
    args = p.parse_args(argv)
    seeds, setups = parse_seeds(args.seeds), [s for s in args.setups.split(",") if s]
    for s in setups:
        if s not in ALL_SETUPS:
            raise SystemExit(f"collapse_bench: unknown set-up {s!r}; expected one of {', '.join(ALL_SETUPS)}")
    if args.command in ("collect", "all"):
        collect(Path(args.out), seeds, setups, args.workers, args.steps)
        if args.command == "collect":
            return 0
    if args.command == "guard":
        return _guard(args, seeds, setups)
    from bench_evaluate import evaluate_dir

    table = evaluate_dir(Path(args.out), seeds, setups, every=args.every)
    print(table["markdown"])
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    if args.command == "all":
        args.json = None if args.json is None else str(Path(args.json).with_suffix(".guard.json"))
        return _guard(args, seeds, setups)
    return 0


def _guard(args, seeds, setups) -> int:
    """Guard re-runs of every collapsing run and of up to ``--guard-healthy`` healthy runs per set-up."""
    from bench_evaluate import label
    from bench_guard import guard_all, guard_table

    runs = []
    for cfg in configs(seeds, setups):
        path = Path(args.out) / f"{run_name(cfg)}.jsonl"
        if path.exists():
            lab = label(*load_run(path))
            runs.append(dict(**cfg, collapsed=lab.collapsed))
    if args.guard_healthy is not None:
        kept, count = [], {}
        for r in runs:
            if not r["collapsed"]:
                count[r["setup"]] = count.get(r["setup"], 0) + 1
                if count[r["setup"]] > args.guard_healthy:
                    continue
            kept.append(r)
        runs = kept
    guarded = guard_all(Path(args.out), runs, args.workers, log=lambda s: print(s, flush=True), steps=args.steps)
    text = guard_table(runs, guarded, setups)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(runs=runs, guarded=guarded, markdown=text), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
