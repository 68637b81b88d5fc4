"""What CollapseGuard costs under FSDP2 (``fully_shard``), 2 gloo ranks on CPU, side by side in one run.

``overhead``: bench_monitor_fsdp.py's conv net (PWS convs, Batch Renormalization, a linear head; every conv and linear
layer and the root under ``fully_shard``), AdamW, batch ``--batch-size`` per rank. Blocks of ``--steps`` training steps
(forward, backward, ``opt.step()``) interleaved across the variants (the order rotates every repeat), each a fresh
copy of the same model on the same batches: unguarded; the guard at its defaults (a snapshot of the rank's shards
every 50 steps in host memory, a check - one all_gather - every 10 steps); and the guard checking every step.
Reported: rank 0's CPU time and wall-clock per step (medians over the repeats), their ratio to the unguarded step,
and the per-round ratios.

``snapshots``: an MLP of ``--layers`` layers of ``--hidden`` units under AdamW (a snapshot holds the parameters and
both moments: 3x the parameters), for each store (host, disk, dcp): on each rank, the bytes its snapshot takes where
the store keeps it, the resident memory it gained with the first snapshot, the seconds to take one (an optimizer step
on zero gradients with a check and a snapshot, less the same step unguarded: the median over ``--repeats``) and to
restore one (``guard.report`` on both ranks). Side by side: the same model unsharded on one process, measured by the
parent process before the ranks start.

    .venv/bin/python benchmarks/bench_guard_fsdp.py overhead --out runs/bench_guard_fsdp_overhead.json
    .venv/bin/python benchmarks/bench_guard_fsdp.py snapshots --out runs/bench_guard_fsdp_snapshots.json

The machine may be shared with other jobs: compare ratios and CPU times, not wall-clock, and rerun if noisy.
"""

from __future__ import annotations

import argparse
import datetime
import gc
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
from bench_guard import _rss
from bench_monitor_fsdp import make_model
from torch import nn

from normlab.monitor import CollapseGuard, RescueOptions, SnapshotOptions

WORLD = 2
STORES = ("host", "disk", "dcp")
VARIANTS = {"unguarded": None, "guard (defaults)": {}, "guard, check_every=1": {"check_every": 1}}


def _sharded(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for m in model.modules():
        if isinstance(m, nn.Conv2d | nn.Linear):
            fully_shard(m)
    fully_shard(model)
    return model


# ------------------------------------------------------------------------------------------------ per step
def _overhead(rank: int, args) -> dict[str, list[tuple[float, float]]]:
    """Per variant, per timing block: (wall-clock, this process's CPU time) per step."""
    gen = torch.Generator().manual_seed(100 + rank)
    shape = (args.batch_size, 3, args.size, args.size)
    data = [(torch.randn(shape, generator=gen), torch.randint(0, 10, (args.batch_size,), generator=gen))]
    data = data * args.steps  # the same batch: the guard never sees trouble, every variant does the same work
    variants = {}
    for name, kwargs in VARIANTS.items():
        model = _sharded(make_model(args.width))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        guard = None if kwargs is None else CollapseGuard(model, opt, rescue=RescueOptions(**kwargs))
        variants[name] = (model, opt, guard)

    def block(model, opt, guard, batches=data) -> tuple[float, float]:
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if guard is not None:
                guard.observe_loss(loss)
            opt.step()
        return (time.perf_counter() - t0) / len(batches), (time.process_time() - c0) / len(batches)

    for v in variants.values():
        block(*v, batches=data[:2])  # warm-up
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(args.repeats):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            times[k].append(block(*variants[k]))
    assert all(not v[2].rescues for v in variants.values() if v[2] is not None)
    return times


def _report_overhead(times: dict) -> dict:
    names = list(VARIANTS)
    out = {}
    for which, clock in ((1, "rank 0's CPU time"), (0, "wall-clock")):
        series = {k: [t[which] for t in v] for k, v in times.items()}
        med = {k: statistics.median(v) for k, v in series.items()}
        rounds = {k: sorted(a / b for a, b in zip(series[k], series["unguarded"])) for k in names}
        print(f"{clock}:\n{'variant':<24}{'median ms/step':>16}{'ratio':>8}   per-round ratio min/median/max")
        for k in names:
            r = rounds[k]
            spread = f"{r[0]:.3f} / {statistics.median(r):.3f} / {r[-1]:.3f}"
            print(f"{k:<24}{med[k] * 1e3:>16.2f}{med[k] / med['unguarded']:>8.3f}   {spread}")
        out["cpu" if which else "wall"] = {
            "median_step_s": med,
            "ratio": {k: med[k] / med["unguarded"] for k in names},
            "per_round_ratios": rounds,
        }
    return out


# ------------------------------------------------------------------------------------------------ per snapshot
def _mlp(args) -> nn.Module:
    torch.manual_seed(100)
    layers: list[nn.Module] = [nn.Linear(64, args.hidden)]
    for _ in range(args.layers - 1):
        layers += [nn.ReLU(), nn.Linear(args.hidden, args.hidden)]
    return nn.Sequential(*layers)


def _with_adam_state(model: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # the moments exist now: a snapshot holds them
    return opt


def _timed(fn) -> tuple[float, float]:
    """(wall-clock, this process's CPU time) of ``fn()``, the ranks starting together."""
    if dist.is_initialized():
        dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _minus(a: list, b: list, which: int) -> float:
    return statistics.median(x[which] - y[which] for x, y in zip(a, b))


def snapshot_costs(model: nn.Module, store: str, repeats: int, directory: Path) -> dict:
    """One store on this process (a rank, or the whole model alone): bytes, memory, seconds to take and restore."""
    opt = _with_adam_state(model)
    plain = [_timed(opt.step) for _ in range(repeats)]  # the step alone (zero gradients)
    gc.collect()
    rss0 = _rss()
    opts = SnapshotOptions(every=1, keep=2, store=store, directory=None if store == "host" else directory)
    rescue = RescueOptions(check_every=1, max_rescues=repeats + 1)
    first = time.perf_counter()
    guard = CollapseGuard(model, opt, snapshots=opts, rescue=rescue)
    first = time.perf_counter() - first  # the first snapshot allocates its buffers
    rss1 = _rss()
    key = guard._snaps[-1].key
    held = guard._store.nbytes(key)
    if store == "dcp":  # this rank's file: its shards (the directory holds every rank's)
        rank = dist.get_rank() if dist.is_initialized() else 0
        held = (guard._store.directory / f"dcp-{key}" / f"__{rank}_0.distcp").stat().st_size
    guarded = [_timed(opt.step) for _ in range(repeats)]  # every step checks and takes a snapshot (buffers reused)
    restore = [_timed(lambda: guard.report("benchmark")) for _ in range(min(repeats, 2))]
    guard.close()
    return {
        "store": store,
        "params": sum(p.numel() for p in model.parameters()),
        "snapshot_bytes": held,
        "rss_gain_first_snapshot": rss1 - rss0,
        "first_snapshot_s": first,
        "snapshot_s": _minus(guarded, plain, 0),
        "snapshot_cpu_s": _minus(guarded, plain, 1),
        "restore_s": statistics.median(r[0] for r in restore),
        "restore_cpu_s": statistics.median(r[1] for r in restore),
        "plain_step_s": statistics.median(p[0] for p in plain),
    }


def _snapshots(rank: int, args) -> list[dict]:
    rows = []
    for store in args.stores.split(","):
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            d = Path(tmp)  # the ranks must share it: rank 0's name, broadcast
            name = [str(d)]
            dist.broadcast_object_list(name, src=0)
            rows.append(snapshot_costs(_sharded(_mlp(args)), store, args.repeats, Path(name[0])))
            dist.barrier()
        gc.collect()
    return rows


# ------------------------------------------------------------------------------------------------ the ranks
def _worker(rank: int, port: int, args, out: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(minutes=10),
    )
    try:
        result = _overhead(rank, args) if args.what == "overhead" else _snapshots(rank, args)
        Path(out.format(rank=rank)).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(args) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank{rank}.json")
        mp.spawn(_worker, args=(_free_port(), args, path), nprocs=WORLD, join=True)
        return [json.loads(Path(path.format(rank=r)).read_text()) for r in range(WORLD)]


def _report_snapshots(alone: list[dict], ranks: list[list[dict]]) -> list[dict]:
    rows = []
    keys = ("snapshot_bytes", "snapshot_cpu_s", "snapshot_s", "restore_cpu_s", "restore_s")
    print(
        f"{'store':<6}{'where':<12}{'MiB':>7}{'x':>6}{'RSS+ MiB':>9}{'take CPU s':>11}{'x':>6}{'wall s':>8}"
        f"{'restore CPU s':>14}{'x':>6}{'wall s':>8}"
    )
    for i, one in enumerate(alone):
        for where, row in [("one process", one)] + [(f"rank {r}", ranks[r][i]) for r in range(WORLD)]:
            ratios = {k: row[k] / one[k] for k in keys}
            rows.append({"where": where, **row, "ratio_to_one_process": ratios})
            print(
                f"{row['store']:<6}{where:<12}{row['snapshot_bytes'] / 2**20:>7.1f}{ratios['snapshot_bytes']:>6.2f}"
                f"{row['rss_gain_first_snapshot'] / 2**20:>9.1f}{row['snapshot_cpu_s']:>11.3f}"
                f"{ratios['snapshot_cpu_s']:>6.2f}{row['snapshot_s']:>8.3f}{row['restore_cpu_s']:>14.3f}"
                f"{ratios['restore_cpu_s']:>6.2f}{row['restore_s']:>8.3f}"
            )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("what", nargs="?", default="overhead", choices=("overhead", "snapshots"))
    p.add_argument("--width", type=int, default=16, help="overhead: channels of the first conv")
    p.add_argument("--size", type=int, default=16, help="overhead: input height = width")
    p.add_argument("--batch-size", type=int, default=32, help="overhead: samples per rank")
    p.add_argument("--steps", type=int, default=50, help="overhead: steps per timing block (>= 50: a snapshot)")
    p.add_argument("--hidden", type=int, default=1024, help="snapshots: the MLP's width")
    p.add_argument("--layers", type=int, default=8, help="snapshots: the MLP's linear layers")
    p.add_argument("--stores", default=",".join(STORES), help="snapshots: comma-separated stores")
    p.add_argument("--tmp", default=None, help="snapshots: where the disk and dcp stores write")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    load = [os.getloadavg()[0]]
    meta = {"world": WORLD, "backend": "gloo", "threads": args.threads, "torch": torch.__version__}
    meta["platform"] = platform.platform()
    if args.what == "overhead":
        times = _run_ranks(args)[0]
        load.append(os.getloadavg()[0])
        print(
            f"bench_guard_fsdp overhead: {WORLD} gloo ranks, width {args.width}, input 3x{args.size}x{args.size}, "
            f"batch {args.batch_size} per rank, {args.repeats} interleaved repeats of {args.steps} steps; load "
            f"average {load[0]:.1f} before, {load[1]:.1f} after"
        )
        result = _report_overhead(times)
    else:
        alone = []
        for store in args.stores.split(","):
            with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
                alone.append(snapshot_costs(_mlp(args), store, args.repeats, Path(tmp)))
            gc.collect()
        ranks = _run_ranks(args)
        load.append(os.getloadavg()[0])
        print(
            f"bench_guard_fsdp snapshots: MLP {args.layers} x {args.hidden} ({alone[0]['params'] / 1e6:.1f}M "
            f"parameters, AdamW), {args.repeats} repeats; load average {load[0]:.1f} before, {load[1]:.1f} after"
        )
        result = _report_snapshots(alone, ranks)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": {**meta, "load_average_1min": load}, "result": result}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
