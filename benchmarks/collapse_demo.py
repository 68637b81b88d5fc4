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
step, seeds 0,1,2. "non-finite ep" is the epoch where train() saw a non-finite train or test loss; "lead" is the number
of steps from the alarm to the first non-finite loss (exact with --every 1: the step after the last recorded one, or
the end of the epoch when only the test loss was non-finite). The target column gives the issue's reading (alarm in an
earlier epoch) and says whether the lead is also >= one epoch of steps.

Measured 2026-11-30 (CPU, 1 thread, 53 s), default detector, defaults:
- none/conv: seed 0 shift flag at step 2 (epoch 1, features.8.conv, 120x; shift term 0.82 -> 6.4 while the variance
  term went 0.95 -> 0.44), loss non-finite at step 7 (epoch 2), lead 5 steps: met. Seed 1: shift flag at step 3, then
  dead at chance with a FINITE loss. Seed 2: output_var flag at step 1, non-finite in epoch 1 (lead 2): not met.
- bn/conv: no flag (test acc 0.99-1.0). none/pws: diverges itself in epoch 3 (flagged on output_var 2 steps
  before; its shift term is 0): "no flag with PWS" not met.

Search for a setting that meets the target (2026-11-30, ~130 runs of train() with the default detector, seeds 0-2):
digits plain net width 0.25/0.5/0.75/1.0, lr 0.02-2.5, batch 64/128/256, momentum 0/0.9, wd 0/5e-4; resnet
(norm none, blocks 1-2); cnn1d on mnist1d; PWS with the data-dependent init_alpha. None met it for >= 2 of 3 seeds
with BN and PWS both surviving the same rate. The closest, at the paper's width 1.0 (5.2 min):

    .venv/bin/python benchmarks/collapse_demo.py --width 1.0 --lr 0.045 --epochs 10 --out runs/collapse_demo_w1

  none/conv: every seed flagged on the shift of features.8.conv (121-132x; at the alarm the shift term is 5-11x the
  variance term, e.g. seed 2: shift term 1.97 -> 163, variance term 2.52 -> 15.2); non-finite in epoch 2 / 5 / 2,
  leads 5 / 20 / 4 steps: met for seeds 1, 2 (epoch reading), seed 0 flagged at the first step of the epoch whose
  test loss went non-finite. bn/conv: no flag, test acc 0.99-1.0. none/pws: seed 1 trains (0.97, no flag); seeds 0
  and 2 diverge in epoch 8 (late catapult after the loss had fallen to ~1; flagged on output_var 2-3 steps before).
What the search showed: the unnormalized net fails in one of three ways depending on the seed, at any one rate:
non-finite within the first ~10 steps, death at chance with a finite loss (dead ReLUs, after a shift blow-up the
monitor flags), or, less often, a shift flag followed by a non-finite loss epochs later (width 0.5 lr 0.06-0.07 batch
128/256, width 1.0 lr 0.04-0.045 batch 256). The PWS plain net without any norm has its own ceiling, lower for narrow
nets (width 0.25: diverges from lr 0.05; 0.5: from 0.06 at batch 128, 0.07 at 256; 1.0: from 0.045-0.05 at batch
256) and it lies at or below the rates where the plain net goes non-finite slowly. An alarm >= 1 epoch ahead on this
data set is in any case only a few steps (1437 training images, 5-22 steps per epoch).

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
    from normlab.runner.config import TrainConfig
    from normlab.runner.data import get_dataset
    from normlab.runner.train import train

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
    # first step whose loss was non-finite: train() stops before mon.step on it, so (every=1) it is the step after
    # the last recorded one; when the train loss of that epoch stayed finite, it was the test loss after the epoch
    nonfinite_step = None
    if nonfinite is not None and args.every == 1 and recs:
        last = max(r["step"] for r in recs)
        nonfinite_step = last + 1 if hist[-1]["train_loss"] is None else nonfinite * steps_per_epoch
    res = {"norm": norm, "conv": conv, "seed": seed, "name": f"{norm}/{conv} s{seed}",
           "steps_per_epoch": steps_per_epoch, "epochs_run": s["epochs_run"],
           "nonfinite_epoch": nonfinite,
           "nonfinite_step": nonfinite_step, "chance_from_epoch": chance, "final_test_acc": s["final_test_acc"],
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
    """Steps from the alarm to the first non-finite loss (exact with --every 1, else a lower bound marked '>=')."""
    a, e, k = r["alarm"], r["nonfinite_epoch"], r.get("nonfinite_step")
    if a is None or e is None:
        return "-"
    return str(k - a["step"]) if k is not None else ">=" + str((e - 1) * r["steps_per_epoch"] - a["step"])


def _target(r: dict) -> str:
    """The issue's target for this run: no norm -> flagged >= 1 epoch before the loss went non-finite; else no flag."""
    a, e = r["alarm"], r["nonfinite_epoch"]
    if r["norm"] != "none" or r["conv"] in ("pws", "ws", "wn"):
        return "met (no flag)" if a is None else "NOT met (flag)"
    if e is None:
        return "n/a (loss stayed finite)"
    if a is None or r["alarm_epoch"] >= e:
        return "NOT met"
    k = r.get("nonfinite_step")
    strict = k is not None and k - a["step"] >= r["steps_per_epoch"]
    return "met (epochs; lead >= 1 epoch of steps too)" if strict else "met (epochs only; lead < 1 epoch of steps)"


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
          f"value; the output layer (classifier) only when non-finite.\nlead = steps from the alarm to the "
          f"first non-finite loss; target = alarm in an earlier epoch than the non-finite loss "
          f"(strict: lead >= {spe} steps)")
    print(f"{'norm/conv':<13}{'alarm step':>11}{'ep':>4}  {'layer':<17}{'quantity':<11}{'growth':>9}"
          f"{'non-finite ep':>15}{'lead':>7}{'chance from ep':>16}{'test acc':>10}  target")
    for r in results:
        a = r["alarm"]
        print(f"{r['name']:<13}{(a['step'] if a else '-'):>11}{r.get('alarm_epoch', '-'):>4}  "
              f"{(a['layer'] if a else 'no flag'):<17}{(a['quantity'] if a else '-'):<11}{_g(r.get('growth')):>9}"
              f"{(r['nonfinite_epoch'] or 'never'):>15}{_lead(r):>7}{(r['chance_from_epoch'] or 'never'):>16}"
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
