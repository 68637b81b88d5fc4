"""Overhead of VarianceMonitor on the paper's plain net, side by side in one run (issue 3 target: every=10
within 1.10x of the unmonitored training step).

Three identical models (same init) train on the same random batches: unmonitored, monitor every=10 and every=1.
Timing blocks of ``--steps`` training steps (forward, backward, optimizer step) are interleaved across the three
variants (the order rotates every repeat) and the per-step median over repeats is reported with ratios.

    .venv/bin/python benchmarks/bench_monitor.py --out runs/bench_monitor.json

The machine may be shared with other jobs: compare the ratios, not absolute times, and rerun if noisy.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from normlab.monitor import VarianceMonitor
from normlab.runner.models import build_model


def make_model(norm: str, in_channels: int, size: int, width: float) -> tuple[nn.Module, str]:
    model = build_model(
        "plain",
        norm=norm,
        conv="conv",
        in_channels=in_channels,
        num_classes=10,
        input_shape=(in_channels, size, size),
        width=width,
    )
    return model, "normlab.runner.models.build_model('plain')"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--norm", default="bn", help="norm of the plain net (none, bn, ...)")
    p.add_argument("--width", type=float, default=0.25)
    p.add_argument("--size", type=int, default=16, help="input height = width (the plain net needs >= 12)")
    p.add_argument("--channels", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=20, help="steps per timing block (a multiple of 10)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("runs/bench_monitor.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base, source = make_model(args.norm, args.channels, args.size, args.width)
    gen = torch.Generator().manual_seed(0)
    data = [
        (
            torch.randn(args.batch_size, args.channels, args.size, args.size, generator=gen),
            torch.randint(0, 10, (args.batch_size,), generator=gen),
        )
        for _ in range(args.steps)
    ]

    variants = {}
    for name, every in (("unmonitored", None), ("every=10", 10), ("every=1", 1)):
        model = copy.deepcopy(base).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
        mon = VarianceMonitor(model, every=every) if every else None
        variants[name] = (model, opt, mon)

    def run_block(model, opt, mon) -> float:
        t0 = time.perf_counter()
        for x, y in data:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if mon is None:
                opt.step()
            else:
                mon.step(opt)
        return (time.perf_counter() - t0) / len(data)

    for v in variants.values():  # warm-up
        run_block(*v)
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(args.repeats):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            times[k].append(run_block(*variants[k]))
    med = {k: statistics.median(v) for k, v in times.items()}
    ref = med["unmonitored"]
    print(
        f"plain net ({source}), norm {args.norm}, width {args.width}, input {args.channels}x{args.size}x"
        f"{args.size}, batch {args.batch_size}, {args.threads} thread(s), {args.repeats} interleaved repeats of "
        f"{args.steps} steps"
    )
    print(f"{'variant':<14}{'median ms/step':>16}{'min ms/step':>14}{'ratio':>8}")
    for k in names:
        print(f"{k:<14}{med[k] * 1e3:>16.2f}{min(times[k]) * 1e3:>14.2f}{med[k] / ref:>8.3f}")
    records = {k: len(v[2].records) if v[2] else 0 for k, v in variants.items()}
    result = {
        "benchmark": "bench_monitor",
        "model": source,
        "norm": args.norm,
        "width": args.width,
        "input_shape": [args.batch_size, args.channels, args.size, args.size],
        "threads": args.threads,
        "steps_per_block": args.steps,
        "repeats": args.repeats,
        "platform": platform.platform(),
        "torch": torch.__version__,
        "note": "shared machine: ratios are the result, absolute times are noisy",
        "median_step_s": med,
        "all_step_s": times,
        "ratio_to_unmonitored": {k: med[k] / ref for k in names},
        "monitor_records": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
