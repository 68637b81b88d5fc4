"""Collapse demonstration for the variance-transmission monitor (issue 3), on the real training loop.

Trains the paper's plain net (``build_model("plain")``, He init) with :func:`normlab.train.train` and
``TrainConfig(monitor_every=...)`` once per variant (default: no normalization, BatchNorm, PWS convs without a norm)
at ONE learning rate, then reads ``monitor.jsonl`` / ``summary.json`` of each run and prints, per variant:

- the collapse warning: step, epoch (1-based), layer, quantity and growth over its baseline;
- the epoch where the train or test loss became non-finite ("never" if it stayed finite), and the first epoch from which
  the net sat at chance (train accuracy <= ``--chance-acc`` until the end: dead ReLUs, a collapse with a FINITE loss);
- for the flagged layer, the two terms of ``Var[Y] = n Var[W] Var[X] + E^2[X] Var_o[n E[W_o]]`` (variance term and
  shift term) at init (step 0) and at the warning.

    .venv/bin/python benchmarks/collapse_demo.py --out runs/collapse_demo     # defaults below, ~1 min, 1 thread

Defaults: digits, width 0.25, SGD lr 0.2 momentum 0.9 wd 5e-4, batch 256 (5 steps/epoch), 15 epochs, monitor every
step, seeds 0,1,2. "non-finite ep" is the epoch where train() saw a non-finite train or test loss.

Measured 2026-11-30 (CPU, 1 thread, 54 s), default detector:
- none/conv: seed 0 flagged at step 2 (epoch 1) in features.8.conv, quantity shift (120x; shift term 0.82 -> 6.4 while
  the variance term went 0.95 -> 0.44), loss non-finite in epoch 2 (>= 3 steps later): target met, but only because an
  epoch is 5 steps. Seed 1: shift flag at step 3, then dead at chance with a FINITE loss. Seed 2: loss non-finite at
  step 1 (Var[Y] 10.8 already at init), output_var flag in the same epoch: not met.
- bn/conv: no flag for any seed (test acc 0.99-1.0).
- none/pws: the PWS plain net without a norm itself diverges at this rate (non-finite in epoch 3 for every seed) and is
  flagged on output_var (the variance term; its shift term is 0) in the same epoch: "no flag with PWS" is not met
  because PWS does not survive the rate. It diverged at every rate >= 0.05 tried (batch 64 and 256); it trains at 0.03.
The issue's target is therefore NOT met as stated. On these small data sets the unnormalized plain net either trains
(lr <= 0.045 at batch 64), dies at chance with a finite loss (lr 0.05-0.14; at 0.1-0.14 after a shift blow-up in
the first 5-10 steps, which the monitor flags; at 0.05-0.07 with no flag), or goes non-finite within the first ~20
steps (lr >= 0.15, or width 0.5/1 from lr 0.05-0.07). cnn1d on mnist1d at lr 0.25-0.3 drifts up over several epochs
but ends at chance with a finite loss. No setting tried (lr 0.005-1, width 0.25/0.5/1, wd 0/5e-4, batch 64/256,
digits plain and mnist1d cnn1d, seeds 0-2) showed a loss drifting up over epochs to non-finite.

Runs are kept in ``--out/<norm>_<conv>_s<seed>`` (delete them to rerun; ``train`` resumes/returns finished runs)
and a JSON summary in ``--out/collapse_demo.json``. ``--plots`` renders each monitor log as PNGs.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch


def read_records(path: Path) -> list[dict]:
    """Per-layer monitor records of a ``monitor.jsonl`` (alarm / spp events left out)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "layer" in r and r.get("event") is None]


def terms(rec: dict) -> dict:
    """Variance term n Var[W] Var[X] and shift term E^2[X] Var_o[n E[W_o]] of one conv/linear record."""
    out = {k: rec.get(k) for k in ("step", "output_var", "shift", "shift_scale_free", "weight_var", "input_mean_sq")}
    m2, ratio = rec.get("input_mean_sq"), rec.get("input_ratio")
    if m2 is not None and ratio and rec.get("weight_var") is not None and rec.get("shift") is not None:
        var_x = m2 / ratio - m2
        out["variance_term"] = rec["fan_in"] * rec["weight_var"] * var_x
        out["shift_term"] = m2 * rec["shift"]
    return out


def run_variant(norm: str, conv: str, seed: int, args) -> dict:
    from normlab.data import get_dataset
    from normlab.train import TrainConfig, train

    out = args.out / f"{norm}_{conv}_s{seed}"
    cfg = TrainConfig(dataset=args.dataset, model=args.model, norm=norm, conv=conv, width=args.width, lr=args.lr,
                      batch_size=args.batch_size, epochs=args.epochs, weight_decay=args.weight_decay,
                      seed=seed, monitor_every=args.every)
    t0 = time.perf_counter()
    s = train(cfg, out, progress=False)
    hist = s["history"]
    recs = read_records(out / "monitor.jsonl")
    steps_per_epoch = len(get_dataset(args.dataset)[0]) // args.batch_size
    nonfinite = s["collapse_epoch"] if s["collapse_reason"] == "non_finite_loss" else None
    chance = None
    for h in reversed(hist):
        if h["train_acc"] is not None and h["train_acc"] <= args.chance_acc or h["train_loss"] is None:
            chance = h["epoch"]
        else:
            break
    res = {"norm": norm, "conv": conv, "seed": seed, "name": f"{norm}/{conv} s{seed}",
           "steps_per_epoch": steps_per_epoch, "epochs_run": s["epochs_run"],
           "nonfinite_epoch": nonfinite, "chance_from_epoch": chance, "final_test_acc": s["final_test_acc"],
           "train_loss": [h["train_loss"] for h in hist], "alarm": s["monitor_alarm"],
           "time_s": time.perf_counter() - t0, "dir": str(out)}
    a = s["monitor_alarm"]
    if a is not None:
        res["alarm_epoch"] = a["step"] // steps_per_epoch + 1
        rows = [r for r in recs if r["layer"] == a["layer"]]
        res["init"] = terms(rows[0])
        res["at_alarm"] = terms(next(r for r in rows if r["step"] == a["step"]))
        events = [json.loads(line) for line in (out / "monitor.jsonl").read_text().splitlines() if line.strip()]
        res["growth"] = next((e.get("growth") for e in events if e.get("event") == "alarm"), None)
    if args.plots:
        from normlab.monitor.plots import render_monitor_plots

        render_monitor_plots(out / "monitor.jsonl", out / "plots")
    return res


def _g(v, fmt=".3g"):
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)


def _lead(r: dict) -> str:
    a, e = r["alarm"], r["nonfinite_epoch"]
    return "-" if a is None or e is None else str((e - 1) * r["steps_per_epoch"] - a["step"])


def _target(r: dict) -> str:
    """The issue's target for this run: no norm -> flagged >= 1 epoch before the loss went non-finite; else no flag."""
    a, e = r["alarm"], r["nonfinite_epoch"]
    if r["norm"] != "none" or r["conv"] in ("pws", "ws", "wn"):
        return "met (no flag)" if a is None else "NOT met (flag)"
    if e is None:
        return "n/a (loss stayed finite)"
    return "met" if a is not None and r["alarm_epoch"] < e else "NOT met"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--dataset", default="digits")
    p.add_argument("--model", default="plain")
    p.add_argument("--width", type=float, default=0.25)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--seeds", default="0,1,2", help="comma list of seeds; every variant runs once per seed")
    p.add_argument("--chance-acc", type=float, default=0.15,
                   help="train accuracy at or below this until the end of the run counts as collapsed to chance")
    p.add_argument("--variants", default="none:conv,bn:conv,none:pws", help="comma list of norm:conv pairs")
    p.add_argument("--out", type=Path, default=Path("runs/collapse_demo"))
    p.add_argument("--plots", action="store_true", help="render the monitor PNGs of each run")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    seeds = [int(x) for x in args.seeds.split(",")]
    results = [run_variant(*pair.split(":"), seed, args) for pair in args.variants.split(",") for seed in seeds]

    spe = results[0]["steps_per_epoch"]
    print(f"\n{args.model} net width {args.width}, {args.dataset}, SGD lr {args.lr} momentum 0.9 wd "
          f"{args.weight_decay:g} batch {args.batch_size} ({spe} steps/epoch), {args.epochs} epochs, monitor every "
          f"{args.every}\ndefault detector: output_var x1e3 over max(step-0 value, 1), shift x100 over its step-0 "
          f"value; the output layer (classifier) only when non-finite.\nlead = steps from the alarm to the first step "
          f"of the epoch whose loss went non-finite (a lower bound); target = alarm at least 1 epoch earlier")
    print(f"{'norm/conv':<13}{'alarm step':>11}{'ep':>4}  {'layer':<17}{'quantity':<11}{'growth':>9}"
          f"{'non-finite ep':>15}{'lead':>6}{'chance from ep':>16}{'test acc':>10}  target")
    for r in results:
        a = r["alarm"]
        print(f"{r['name']:<13}{(a['step'] if a else '-'):>11}{r.get('alarm_epoch', '-'):>4}  "
              f"{(a['layer'] if a else 'no flag'):<17}{(a['quantity'] if a else '-'):<11}{_g(r.get('growth')):>9}"
              f"{(r['nonfinite_epoch'] or 'never'):>15}{_lead(r):>6}{(r['chance_from_epoch'] or 'never'):>16}"
              f"{_g(r['final_test_acc']):>10}  {_target(r)}")
    print("\nflagged layer, decomposition terms (variance term n Var[W] Var[X], shift term E^2[X] Var_o[n E[W_o]]):")
    for r in results:
        if r["alarm"] is None:
            continue
        for tag in ("init", "at_alarm"):
            d = r[tag]
            print(f"  {r['name']:<13}{tag:<9} step {d['step']:>4}: Var[Y] {_g(d['output_var'])}"
                  f"  variance term {_g(d.get('variance_term'))}  shift term {_g(d.get('shift_term'))}"
                  f"  shift {_g(d['shift'])}  scale-free shift {_g(d['shift_scale_free'])}")
    print("\ntrain loss per epoch:")
    for r in results:
        print(f"  {r['name']:<13}" + " ".join(_g(v) if v is not None else "NaN" for v in r["train_loss"]))
    (args.out / "collapse_demo.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {args.out / 'collapse_demo.json'}; total {sum(r['time_s'] for r in results):.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
