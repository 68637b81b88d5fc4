"""Collapse study: which monitor signals warn before a collapse on MNIST-1D ``plain1d`` (docs/monitor.md).

    python scripts/collapse_study.py collect  [--out runs/collapse_study] [--seeds 100-109] [--workers 2]
    python scripts/collapse_study.py analyze  [--out runs/collapse_study] [--doc-table]
    python scripts/collapse_study.py guard    [--out runs/collapse_study] [--half report-seeds]

``collect`` trains every run of the protocol (norm x width x lr x seed) with a small loop of its own and writes one
JSONL per run (first line: the run's header with the layer list; then one line per step with the loss, the gradient
norm and per layer output_var, shift_term, variance_term, input_sq). A finished run is not rerun. ``analyze`` fits
every candidate rule's threshold on one half of the seeds (seed parity) and reports it on the other, then swaps.
``guard`` trains runs again under :class:`normlab.monitor.CollapseGuard`.

Seeds 0-99 are never used (kept for independent checks).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from torch import nn

NORMS = {"none": ("none", "conv"), "bn": ("bn", "conv"), "pws": ("none", "pws")}
LRS = (0.05, 0.1, 0.2)
WIDTHS = (0.5, 1.0)
CONTROL_LR = 0.01  # healthy controls: BN at lr 0.01
STEPS = 300
BATCH = 128
NUM_SAMPLES = 8000
LEAD = 5  # a warning counts when it comes >= LEAD steps before the collapse
WARNABLE = 7  # collapses at step <= WARNABLE cannot be warned LEAD steps ahead
FIRST_SEED = 100


# ---------------------------------------------------------------------------------------------- collection
def configs(seeds):
    out = []
    for seed in seeds:
        for norm in NORMS:
            for width in WIDTHS:
                for lr in LRS:
                    out.append(dict(norm=norm, width=width, lr=lr, seed=seed))
        for width in WIDTHS:
            out.append(dict(norm="bn", width=width, lr=CONTROL_LR, seed=seed))
    return out


def run_name(cfg) -> str:
    return f"{cfg['norm']}_w{cfg['width']}_lr{cfg['lr']}_s{cfg['seed']}"


def _data():
    from normlab.runner.data import get_dataset

    train, test, _ = get_dataset("mnist1d", num_samples=NUM_SAMPLES)
    return train.x.float(), train.y, test.x.float(), test.y


def _build(cfg):
    from normlab.runner.models import build_model

    norm, conv = NORMS[cfg["norm"]]
    return build_model("plain1d", norm, conv, 1, 10, (1, 40), cfg["width"])


def _grad_norm(model) -> float:
    gs = [p.grad.detach().flatten() for p in model.parameters() if p.grad is not None]
    return float(torch.cat(gs).norm()) if gs else 0.0


def _layer_line(records) -> dict:
    out = {}
    for r in records:
        d = {k: r.get(k) for k in ("output_var", "shift_term", "variance_term", "input_sq")}
        out[r["layer"]] = [None if (v is None or not math.isfinite(v)) else v for v in d.values()]
    return out


def _accuracy(model, x, y) -> float:
    model.eval()
    with torch.no_grad():
        acc = float((model(x).argmax(1) == y).float().mean())
    model.train()
    return acc


def train_run(cfg, steps=STEPS, guard_kwargs=None):
    """Train one run; returns (header, step lines, summary). ``guard_kwargs``: train under a CollapseGuard."""
    from normlab.monitor import CollapseGuard, RunCollapsed, VarianceMonitor
    from normlab.runner.collapse import CollapseTracker

    torch.manual_seed(cfg["seed"])
    x, y, xt, yt = _data()
    model = _build(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    mon = VarianceMonitor(model, every=1, optimizer=opt)
    guard = None if guard_kwargs is None else CollapseGuard(model, opt, monitor=mon, **guard_kwargs)
    gen = torch.Generator().manual_seed(cfg["seed"])
    tracker = CollapseTracker(10)
    lines, loss_fn, gave_up = [], nn.CrossEntropyLoss(), None
    for step in range(steps):
        idx = torch.randint(0, x.shape[0], (BATCH,), generator=gen)
        loss = loss_fn(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        gnorm = _grad_norm(model)
        n_rec = len(mon.records)
        try:
            guard.step(loss) if guard is not None else opt.step()
        except RunCollapsed as e:
            gave_up = str(e)
            break
        lv = float(loss.detach())
        tracker.update(lv if math.isfinite(lv) else None)
        lines.append({"t": step, "loss": lv if math.isfinite(lv) else None,
                      "gnorm": gnorm if math.isfinite(gnorm) else None, "L": _layer_line(mon.records[n_rec:])})
        del mon.records[:]
        if guard is None and tracker.kind == "non_finite":
            break
    kind = tracker.finish()
    layers = [[n, k] for n, _, k in mon.layers]
    order = sorted(mon._order, key=mon._order.get)
    header = {"cfg": cfg, "layers": layers, "order": order}
    summary = {"kind": kind, "collapse_step": tracker.step, "steps": len(lines),
               "test_acc": _accuracy(model, xt, yt) if kind != "non_finite" else None,
               "alarm": None if mon.alarm is None else {"step": mon.alarm.step, "layer": mon.alarm.layer},
               "risk": None if getattr(mon, "risk", None) is None else mon.risk.to_dict()}
    if guard is not None:
        summary["rescues"] = [r.to_dict() for r in guard.rescues]
        summary["gave_up"] = gave_up
    mon.close()
    return header, lines, summary


def _collect_one(args):
    cfg, out_dir = args
    torch.set_num_threads(1)
    path = Path(out_dir) / f"{run_name(cfg)}.jsonl"
    if path.is_file():
        return run_name(cfg), "done before", 0.0
    t0 = time.time()
    header, lines, summary = train_run(cfg)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps({**header, "summary": summary}) + "\n")
        for line in lines:
            f.write(json.dumps(line) + "\n")
    os.replace(tmp, path)
    return run_name(cfg), summary["kind"], time.time() - t0


def parse_seeds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    seeds = list(range(int(lo), int(hi or lo) + 1))
    if min(seeds) < FIRST_SEED:
        raise SystemExit(f"seeds below {FIRST_SEED} are kept for independent checks, got {text}")
    return seeds


def collect(out_dir: Path, seeds, workers: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    _data()  # generate once so that the workers read the same arrays
    jobs = [(cfg, str(out_dir)) for cfg in configs(seeds)]
    with ProcessPoolExecutor(workers) as ex:
        for name, kind, dt in ex.map(_collect_one, jobs):
            print(f"{name}: {kind} ({dt:.0f} s)", flush=True)


# ---------------------------------------------------------------------------------------------- loading
def load_runs(out_dir: Path) -> list[dict]:
    runs = []
    for path in sorted(out_dir.glob("*.jsonl")):
        with open(path) as f:
            head = json.loads(f.readline())
            head["steps"] = [json.loads(line) for line in f]
        runs.append(head)
    return runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["collect", "analyze", "guard"])
    p.add_argument("--out", type=Path, default=Path("runs/collapse_study"))
    p.add_argument("--seeds", default="100-103")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=STEPS)
    a = p.parse_args(argv)
    if a.command == "collect":
        collect(a.out, parse_seeds(a.seeds), a.workers)
    elif a.command == "analyze":
        from collapse_analysis import analyze  # noqa: F401  (defined below once the protocol is fixed)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
