"""Cost of VarianceMonitor on an FSDP2 model (``fully_shard``), 2 gloo ranks on CPU, side by side in one run.

The issue's model grown to a small conv net (PWS convs, Batch Renormalization, ReLU, a linear head), every conv and
linear layer and the whole model under ``fully_shard``, SGD. Variants, each a fresh copy of the same model on the
same batches: unmonitored; ``every=10`` (the default monitor: full records every 10 steps, merged over the ranks in
one all-reduce, and the countdown's light step - each layer's output variance, merged in one small all-reduce - on
the other steps); ``every=1`` (a full record every step). Timing blocks of ``--steps`` training steps (forward,
backward, optimizer step) are interleaved across the variants (the order rotates every repeat); reported: rank 0's
per-step median over repeats, its ratio to the unmonitored median, and the min / median / max of the per-round
ratios. Both ranks run the same blocks (FSDP2's collectives keep them in step).

    .venv/bin/python benchmarks/bench_monitor_fsdp.py --out runs/bench_monitor_fsdp.json

The machine may be shared with other jobs: compare the ratios, not absolute times, and rerun if noisy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from normlab.monitor import VarianceMonitor
from normlab.nn import BatchRenorm2d, PWSConv2d

WORLD = 2
VARIANTS = {"unmonitored": None, "every=10 (default)": {"every": 10}, "every=1": {"every": 1}}


def make_model(width: int) -> nn.Module:
    """PWSConv -> BRN -> ReLU blocks (3 -> w -> 2w -> 2w channels, stride 2 twice), pooling, a linear head."""
    torch.manual_seed(100)
    layers: list[nn.Module] = []
    for c_in, c_out, stride in ((3, width, 1), (width, 2 * width, 2), (2 * width, 2 * width, 2)):
        layers += [PWSConv2d(c_in, c_out, 3, stride=stride, padding=1), BatchRenorm2d(c_out), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, 10))


def _sharded(width: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = make_model(width)
    for m in model:
        if isinstance(m, nn.Conv2d | nn.Linear):
            fully_shard(m)
    fully_shard(model)
    return model


def _timings(rank: int, args) -> dict[str, list[tuple[float, float]]]:
    """Per variant, per timing block: (wall-clock, this process's CPU time) per step."""
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own samples
    shape = (args.batch_size, 3, args.size, args.size)
    data = [
        (torch.randn(shape, generator=gen), torch.randint(0, 10, (args.batch_size,), generator=gen))
        for _ in range(args.steps)
    ]
    variants = {}
    for name, kwargs in VARIANTS.items():
        model = _sharded(args.width)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        variants[name] = (model, opt, VarianceMonitor(model, optimizer=opt, **kwargs) if kwargs else None)

    def block(model, opt, mon, batches=data) -> tuple[float, float]:
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()  # attached monitors record through the optimizer's hooks
        return (time.perf_counter() - t0) / len(batches), (time.process_time() - c0) / len(batches)

    for v in variants.values():  # warm-up: 2 steps (the first is a recording step of every monitor)
        block(*v, batches=data[:2])
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(args.repeats):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            times[k].append(block(*variants[k]))
    return times


def _worker(rank: int, port: int, args, out: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(minutes=5),
    )
    try:
        times = _timings(rank, args)
        if rank == 0:
            Path(out).write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--width", type=int, default=16, help="channels of the first conv")
    p.add_argument("--size", type=int, default=16, help="input height = width")
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank")
    p.add_argument("--steps", type=int, default=20, help="steps per timing block (a multiple of 10)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--out", type=Path, default=Path("runs/bench_monitor_fsdp.json"))
    args = p.parse_args(argv)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "times.json")
        mp.spawn(_worker, args=(_free_port(), args, path), nprocs=WORLD, join=True)
        times = json.loads(Path(path).read_text())
    load = [load_before, os.getloadavg()[0]]
    names = list(VARIANTS)
    print(
        f"bench_monitor_fsdp: {WORLD} gloo ranks, fully_shard on every conv/linear, width {args.width}, input "
        f"3x{args.size}x{args.size}, batch {args.batch_size} per rank, {args.threads} thread(s) per rank, "
        f"{args.repeats} interleaved repeats of {args.steps} steps; load average {load[0]:.1f} before, "
        f"{load[1]:.1f} after"
    )
    result = {
        "benchmark": "bench_monitor_fsdp",
        "world": WORLD,
        "backend": "gloo",
        "model": f"make_model(width={args.width})",
        "input_shape_per_rank": [args.batch_size, 3, args.size, args.size],
        "variants": VARIANTS,
        "threads_per_rank": args.threads,
        "steps_per_block": args.steps,
        "repeats": args.repeats,
        "platform": platform.platform(),
        "torch": torch.__version__,
        "note": "shared machine: ratios are the result, absolute times are noisy",
        "load_average_1min": load,
    }
    for which, clock in ((0, "wall-clock"), (1, "rank 0's CPU time")):
        series = {k: [t[which] for t in v] for k, v in times.items()}
        med = {k: statistics.median(v) for k, v in series.items()}
        rounds = {k: sorted(a / b for a, b in zip(series[k], series["unmonitored"])) for k in names}
        print(f"{clock}:\n{'variant':<22}{'median ms/step':>16}{'ratio':>8}   per-round ratio min/median/max")
        for k in names:
            r = rounds[k]
            spread = f"{r[0]:.3f} / {statistics.median(r):.3f} / {r[-1]:.3f}"
            print(f"{k:<22}{med[k] * 1e3:>16.2f}{med[k] / med['unmonitored']:>8.3f}   {spread}")
        key = "wall" if which == 0 else "cpu"
        result[key] = {
            "median_step_s": med,
            "all_step_s": series,
            "ratio_to_unmonitored": {k: med[k] / med["unmonitored"] for k in names},
            "per_round_ratios": rounds,
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
