"""Collapse demonstration for the variance-transmission monitor (issue 3).

The paper's plain net (normlab.models.build_model("plain")) on sklearn digits (16x16), SGD momentum 0.9, wd 5e-4,
batch 64, at a learning rate where the net without normalization collapses. A VarianceMonitor watches every layer;
we report the epoch/step of the collapse warning, the epoch where the training loss first becomes non-finite, which
quantity grew in the flagged layer and the two terms of Var[Y] = n E[W^2] Var[X] + E^2[X] Var_o[n E[W_o]] at init and
at the warning. The same run with BatchNorm (and PWS convs if available) must give no warning.

    .venv/bin/python benchmarks/collapse_demo.py --lr 0.07 --epochs 30 --every 5 --plots --out runs/collapse_demo

Weights are re-initialised with the paper's He init (n Var[W] = 2, ``--init he``): with PyTorch's default conv
init (n Var[W] = 1/3) the plain net without normalization does not train at all (the signal shrinks ~6x per layer).

Prints a table and writes JSON (and the monitor logs, rendered as PNGs) under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from normlab.monitor import VarianceMonitor


def build(norm: str, conv: str, width: float, in_channels: int, input_shape, seed: int, init: str = "he"):
    from normlab.models import build_model

    torch.manual_seed(seed)
    model = build_model("plain", norm=norm, conv=conv, in_channels=in_channels, num_classes=10,
                        input_shape=input_shape, width=width)
    if init == "he":  # the paper's init: n Var[W] = 2 (kaiming normal, fan_in, ReLU gain), zero bias
        for m in model.modules():
            if isinstance(m, torch.nn.Conv2d | torch.nn.Linear):
                torch.nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
                if m.bias is not None:
                    torch.nn.init.zeros_(m.bias)
    return model


def run_one(norm: str, conv: str, args, out_dir: Path) -> dict:
    from normlab.data import get_dataset

    train_ds, _, info = get_dataset("digits")
    model = build(norm, conv, args.width, info["in_channels"], info["input_shape"], args.seed, args.init)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    mon = VarianceMonitor(model, every=args.every, explode_factor=args.factor)
    mon.add_signal_propagation((64, *info["input_shape"]))  # SPP at init
    n = len(train_ds)
    gen = torch.Generator().manual_seed(args.seed)
    steps_per_epoch = math.ceil(n / args.batch_size)
    history, nonfinite_epoch, alarm_epoch, nonfinite_step = [], None, None, None
    diverged_step = diverged_epoch = None
    t0 = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        perm = torch.randperm(n, generator=gen)
        losses = []
        for i in range(steps_per_epoch):
            x, y = train_ds.batch(perm[i * args.batch_size:(i + 1) * args.batch_size])
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            mon.step(opt)
            losses.append(loss.item())
            if not math.isfinite(losses[-1]) and nonfinite_step is None:
                nonfinite_step = mon.current_step - 1
            if not (losses[-1] < args.diverge_loss) and diverged_step is None:
                diverged_step, diverged_epoch = mon.current_step - 1, epoch
            if mon.alarm is not None and alarm_epoch is None:
                alarm_epoch = epoch
        mean_loss = sum(losses) / len(losses)
        finite = all(math.isfinite(v) for v in losses)
        history.append({"epoch": epoch, "train_loss": mean_loss, "finite": finite,
                        "max_output_var": max((r["output_var"] for r in mon.records if r["step"] >= mon.current_step
                                               - steps_per_epoch and r.get("output_var") is not None),
                                              default=float("nan"))})
        if not finite and nonfinite_epoch is None:
            nonfinite_epoch = epoch
            break
    log = mon.to_jsonl(out_dir / f"monitor_{norm}_{conv}.jsonl")
    mon.to_csv(out_dir / f"monitor_{norm}_{conv}.csv")
    mon.close()
    result = {"norm": norm, "conv": conv, "lr": args.lr, "steps_per_epoch": steps_per_epoch,
              "epochs_run": len(history), "nonfinite_epoch": nonfinite_epoch, "nonfinite_step": nonfinite_step,
              "diverged_step": diverged_step, "diverged_epoch": diverged_epoch,
              "alarm": None,
              "alarm_epoch": alarm_epoch, "history": history, "log": str(log), "time_s": time.perf_counter() - t0}
    if mon.alarm is not None:
        a = mon.alarm
        result["alarm"] = a.to_dict()
        result["layer_terms"] = terms_for(mon.records, a.layer, a.step)
    return result


def terms_for(records, layer: str, step: int) -> dict:
    """Decomposition terms of ``layer`` at its first record and at ``step`` (the warning step)."""
    out = {}
    rows = [r for r in records if r["layer"] == layer]
    for tag, r in (("init", rows[0]), ("warning", next(r for r in rows if r["step"] == step))):
        d = {k: r.get(k) for k in ("step", "output_var", "shift", "shift_scale_free", "weight_var",
                                   "input_mean_sq", "input_ratio", "fan_in")}
        if r.get("input_mean_sq") is not None and r.get("input_ratio") and r.get("weight_var") is not None:
            ex2 = r["input_mean_sq"] / r["input_ratio"]
            var_x = ex2 - r["input_mean_sq"]
            d["variance_term"] = r["fan_in"] * r["weight_var"] * var_x
            d["shift_term"] = r["input_mean_sq"] * r["shift"]
        out[tag] = d
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lr", type=float, default=0.07)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--width", type=float, default=0.25)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--factor", type=float, default=100.0)
    p.add_argument("--diverge-loss", type=float, default=10.0,
                   help="a step whose training loss is >= this (or non-finite) counts as diverged")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", choices=("he", "default"), default="he",
                   help="he: kaiming normal fan_in (the paper's init); default: the model's own init")
    p.add_argument("--variants", default="none:conv,bn:conv,none:pws",
                   help="comma list of norm:conv pairs (norm none/bn/..., conv conv/pws/...)")
    p.add_argument("--out", type=Path, default=Path("runs/collapse_demo"))
    p.add_argument("--plots", action="store_true", help="render the monitor PNGs of each run")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for pair in args.variants.split(","):
        norm, conv = pair.split(":")
        try:
            results.append(run_one(norm, conv, args, args.out))
        except (ImportError, ValueError) as e:
            print(f"skipping {norm}/{conv}: {e}")
    print(f"\nplain net width {args.width}, digits 16x16, SGD lr {args.lr} m0.9 wd5e-4 bs {args.batch_size}, "
          f"monitor every {args.every}, factor {args.factor:g}")
    print("steps are global optimizer steps (0-based); epochs 1-based; "
          f"{results[0]['steps_per_epoch'] if results else '?'} steps per epoch")
    print(f"{'norm/conv':<12}{'epochs':>7}{'warning step (ep)':>19}{'diverged step (ep)':>20}"
          f"{'non-finite step (ep)':>22}  layer / quantity / growth")
    for r in results:
        a = r["alarm"]
        desc = f"{a['layer']} / {a['quantity']} / {a['growth']:.3g}x" if a else "no warning"
        warn = f"{a['step']} ({r['alarm_epoch']})" if a else "-"
        div = f"{r['diverged_step']} ({r['diverged_epoch']})" if r["diverged_step"] is not None else "-"
        nf = f"{r['nonfinite_step']} ({r['nonfinite_epoch']})" if r["nonfinite_step"] is not None else "-"
        print(f"{r['norm'] + '/' + r['conv']:<12}{r['epochs_run']:>7}{warn:>19}{div:>20}{nf:>22}  {desc}")
        if a:
            for tag, d in r["layer_terms"].items():
                print(f"    {tag:<8} step {d['step']:>5}: Var[Y] {d['output_var']:.4g}  shift {d['shift']:.4g}  "
                      f"scale-free {d['shift_scale_free']:.4g}  n*Var[W] {d['fan_in'] * d['weight_var']:.4g}  "
                      f"E^2[X] {d['input_mean_sq']:.4g}  variance term {d.get('variance_term', float('nan')):.4g}"
                      f"  shift term {d.get('shift_term', float('nan')):.4g}")
            i, w = r["layer_terms"]["init"], r["layer_terms"]["warning"]
            if "shift_term" in i and "shift_term" in w:
                print(f"    growth init -> warning: Var[Y] x{w['output_var'] / i['output_var']:.3g}, "
                      f"shift x{w['shift'] / i['shift']:.3g}, "
                      f"variance term x{w['variance_term'] / i['variance_term']:.3g}, "
                      f"shift term x{w['shift_term'] / i['shift_term']:.3g}")
        print("    loss per epoch: " + " ".join(f"{h['train_loss']:.3g}" for h in r["history"]))
        if args.plots:
            from normlab.monitor.plots import render_monitor_plots

            render_monitor_plots(r["log"], args.out / f"plots_{r['norm']}_{r['conv']}")
    (args.out / "collapse_demo.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {args.out / 'collapse_demo.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
