"""The eager floor: dispatched aten ops per training and eval step of every layer, next to torch's layer, and what
one op costs on this machine.

At small shapes a normalization layer's eager cost is its per-op dispatch (a few microseconds each on a CPU), not
its passes over the data, so the number of aten ops a step dispatches is the deterministic twin of the timed ratios
of ``bench_layers.py``: it does not move with the machine's load. Counted with a ``TorchDispatchMode`` over one
training step (forward + backward with a given gradient, after two warm-up steps, gradient accumulation included)
and one eval step (forward under ``no_grad`` after one warm-up), for every layer, dim and layout, beside the torch
layer it stands beside.

``--timing`` adds the measured part (one thread, the thread's CPU time, interleaved): every case and its reference
at a tiny shape, where the passes over the data cost nothing, so the time a layer adds per op it adds is the cost
of one dispatched op; and the floor of the ratio at a shape S: timed side by side at S and at (2, C, 1, 2), the
time the layer adds at the latter is its eager overhead, so its ratio at S is at least
``1 + overhead / T_ref(S)`` (``T_ref(S)``: the reference's step at S), printed beside the ratio measured at S.

    OMP_NUM_THREADS=1 python benchmarks/count_ops.py                      # the counts
    OMP_NUM_THREADS=1 python benchmarks/count_ops.py --verbose            # and each layer's ops by name
    OMP_NUM_THREADS=1 python benchmarks/count_ops.py --timing --results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import normlab.nn as L  # noqa: E402

PAST_WARMUP = 30_000
CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}
# the input shape of each rank for the counts (the route of channels_last InstanceNorm depends on the size per
# sample: these take the route the timed shapes take)
COUNT_SHAPES = {2: (32, 64), 3: (2, 64, 1024), 4: (2, 64, 32, 32), 5: (2, 64, 4, 16, 16)}
TINY = {2: (4, 4), 3: (2, 4, 4), 4: (2, 4, 2, 2), 5: (2, 4, 2, 2, 2)}


class _OpLog(TorchDispatchMode):
    """Counts every aten op dispatched while active."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count_step(module: nn.Module, x: torch.Tensor, warmup: int = 2) -> collections.Counter:
    """aten ops of one forward + backward of ``module`` (in training mode) on ``x`` (a leaf requiring grad), after
    ``warmup`` steps."""
    module.train()
    g = torch.randn_like(x)
    for _ in range(warmup):
        module(x).backward(g)
    with _OpLog() as log:
        module(x).backward(g)
    return log.ops


def count_eval(module: nn.Module, x: torch.Tensor) -> collections.Counter:
    """aten ops of one eval-mode forward under ``no_grad``, after one."""
    module.eval()
    with torch.no_grad():
        module(x)
        with _OpLog() as log:
            module(x)
    return log.ops


# ------------------------------------------------------------------------------------------------ the cases
def _brn(cls, c: int, **kw):
    m = cls(c, **kw)
    if m.schedule is not None:
        m.num_batches_tracked.fill_(PAST_WARMUP)
    return m


def cases():
    """(layer, factory(c), reference, factory(c), rank, layout). The factories build fresh modules."""
    yield (
        "BatchRenorm1d schedule (past warm-up)",
        lambda c: _brn(L.BatchRenorm1d, c),
        "nn.BatchNorm1d",
        nn.BatchNorm1d,
        2,
        "contiguous",
    )  # noqa: E501
    yield (
        "BatchRenorm1d rmax=3, dmax=5",
        lambda c: _brn(L.BatchRenorm1d, c, rmax=3.0, dmax=5.0),
        "nn.BatchNorm1d",
        nn.BatchNorm1d,
        2,
        "contiguous",
    )  # noqa: E501
    yield (
        "BatchRenorm1d rmax=1, dmax=0",
        lambda c: _brn(L.BatchRenorm1d, c, rmax=1.0, dmax=0.0),
        "nn.BatchNorm1d",
        nn.BatchNorm1d,
        2,
        "contiguous",
    )  # noqa: E501
    for rank, k in ((3, 1), (4, 2), (5, 3)):
        bn = getattr(nn, f"BatchNorm{k}d")
        for layout in ["contiguous"] + (["channels_last"] if rank in CHANNELS_LAST else []):
            brn = getattr(L, f"BatchRenorm{k}d")
            yield (
                f"BatchRenorm{k}d schedule (past warm-up)",
                lambda c, brn=brn: _brn(brn, c),
                f"nn.BatchNorm{k}d",
                bn,
                rank,
                layout,
            )  # noqa: E501
            if rank == 4:
                yield (
                    "SyncBatchRenorm (one process)",
                    lambda c: _brn(L.SyncBatchRenorm, c),
                    "nn.SyncBatchNorm",
                    nn.SyncBatchNorm,
                    rank,
                    layout,
                )  # noqa: E501
            yield f"SwitchableNorm{k}d", getattr(L, f"SwitchableNorm{k}d"), f"nn.BatchNorm{k}d", bn, rank, layout
            ours, ref = getattr(L, f"InstanceNorm{k}d"), getattr(nn, f"InstanceNorm{k}d")
            for suffix, kw in (
                ("(affine)", {"affine": True}),
                ("(affine, tracked)", {"affine": True, "track_running_stats": True}),
            ):  # noqa: E501
                yield (
                    f"InstanceNorm{k}d{suffix}",
                    lambda c, o=ours, kw=kw: o(c, **kw),
                    f"nn.InstanceNorm{k}d{suffix}",
                    lambda c, r=ref, kw=kw: r(c, **kw),
                    rank,
                    layout,
                )  # noqa: E501
            conv = getattr(nn, f"Conv{k}d")
            for prefix in ("WS", "PWS"):
                cls = getattr(L, f"{prefix}Conv{k}d")
                yield (
                    f"{prefix}Conv{k}d 3x3",
                    lambda c, cls=cls: cls(c, c, 3, padding=1),
                    f"nn.Conv{k}d 3x3",
                    lambda c, conv=conv: conv(c, c, 3, padding=1),
                    rank,
                    layout,
                )  # noqa: E501


def _input(shape, layout: str, seed: int = 100):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 1.5 + 0.3
    if layout == "channels_last":
        x = x.contiguous(memory_format=CHANNELS_LAST[len(shape)])
    return x.requires_grad_()


def count_rows(shapes=COUNT_SHAPES, verbose: bool = False) -> list[dict]:
    """One row per case: the ops of a training and an eval step, the layer's and its reference's."""
    torch.manual_seed(100)
    rows = []
    for name, make, ref_name, make_ref, rank, layout in cases():
        shape = shapes[rank]
        x, c = _input(shape, layout), shape[1]
        row = {"layer": name, "reference": ref_name, "shape": list(shape), "layout": layout}
        for mode, count in (("train", count_step), ("eval", count_eval)):
            ours, ref = count(make(c), x), count(make_ref(c), x)
            row[mode] = sum(ours.values())
            row[f"{mode}_reference"] = sum(ref.values())
            if verbose:
                row[f"{mode}_ops"] = dict(ours.most_common())
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------ timing
def _step(module, x, g):
    params = list(module.parameters())

    def step():
        x.grad = None
        for p in params:
            p.grad = None
        module(x).backward(g)

    return step


def _timed(pairs: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds (thread CPU time) per training step of each (module, input) in ``pairs``, interleaved."""
    clock, sync = time.thread_time, common.synchronizer(torch.device("cpu"))
    steps = {n: _step(m.train(), x, torch.randn_like(x)) for n, (m, x) in pairs.items()}
    iters = {n: common.calibrate(fn, 0.01, clock, sync) for n, fn in steps.items()}
    return common.interleaved(steps, rounds, 3, iters, clock, sync)


def per_op_cost(rows: list[dict], rounds: int) -> list[dict]:
    """Every case and its reference timed at a tiny shape (C = 4), all interleaved: the time a case adds to its
    reference's step, per op it adds."""
    pairs, rows_out = {}, []
    for (name, make, ref_name, make_ref, rank, layout), row in zip(cases(), rows):
        shape, tag = TINY[rank], f" {layout} rank {rank}"
        pairs.setdefault(ref_name + tag, (make_ref(shape[1]), _input(shape, layout)))
        pairs[name + tag] = (make(shape[1]), _input(shape, layout))
        extra = row["train"] - row["train_reference"]
        rows_out.append({"layer": name, "reference": ref_name, "key": name + tag, "ref_key": ref_name + tag,
                         "shape": list(shape), "layout": layout, "extra_ops": extra})  # fmt: skip
    times = _timed(pairs, rounds)
    for r in rows_out:
        r["us"] = 1e6 * statistics.median(times[r.pop("key")])
        r["reference_us"] = 1e6 * statistics.median(times[r.pop("ref_key")])
        r["us_per_extra_op"] = (r["us"] - r["reference_us"]) / r["extra_ops"] if r["extra_ops"] else None
    return rows_out


FLOOR_CASES = [  # (layer, factory, reference, factory, shape)
    ("BatchRenorm1d schedule", lambda c: _brn(L.BatchRenorm1d, c), "nn.BatchNorm1d", nn.BatchNorm1d, (32, 64)),
    ("BatchRenorm1d schedule", lambda c: _brn(L.BatchRenorm1d, c), "nn.BatchNorm1d", nn.BatchNorm1d, (256, 256)),
    ("BatchRenorm2d schedule", lambda c: _brn(L.BatchRenorm2d, c), "nn.BatchNorm2d", nn.BatchNorm2d, (2, 64, 32, 32)),
    ("BatchRenorm2d schedule", lambda c: _brn(L.BatchRenorm2d, c), "nn.BatchNorm2d", nn.BatchNorm2d, (32, 64, 32, 32)),
    ("SwitchableNorm2d", L.SwitchableNorm2d, "nn.BatchNorm2d", nn.BatchNorm2d, (2, 64, 32, 32)),
    ("SwitchableNorm2d", L.SwitchableNorm2d, "nn.BatchNorm2d", nn.BatchNorm2d, (32, 64, 32, 32)),
]


def floor_rows(rounds: int) -> list[dict]:
    """At each FLOOR_CASES shape S, side by side: the layer and its reference at S and at (2, C[, 1, ..., 2]) (the
    same per-channel tensors, two values per instance; the passes over the data cost nothing there). The time the
    layer adds there is its eager overhead, so its ratio at S is at least ``1 + overhead / T_ref(S)``."""
    rows = []
    for name, make, ref_name, make_ref, shape in FLOOR_CASES:
        c = shape[1]
        tiny = (2, c) + (1,) * (len(shape) - 3) + (2,) * (len(shape) > 2)
        x, xt = _input(shape, "contiguous"), _input(tiny, "contiguous")
        extra = sum(count_step(make(c), x).values()) - sum(count_step(make_ref(c), x).values())
        pairs = {
            "ours": (make(c), x),
            "ref": (make_ref(c), x),
            "ours_tiny": (make(c), xt),
            "ref_tiny": (make_ref(c), xt),
        }
        t = _timed(pairs, rounds)
        times = {k: 1e6 * statistics.median(v) for k, v in t.items()}
        overhead = times["ours_tiny"] - times["ref_tiny"]
        rows.append(
            {
                "layer": name,
                "reference": ref_name,
                "shape": list(shape),
                "extra_ops": extra,
                "overhead_us": overhead,
                "us_per_extra_op": overhead / extra,
                "reference_us": times["ref"],
                "floor": 1 + overhead / times["ref"],
                "measured": common.ratios(t, "ours", "ref"),
                "load": common.load(),
            }
        )
    return rows


# ------------------------------------------------------------------------------------------------ report
def markdown(data: dict) -> str:
    lines = [
        "### The eager floor: dispatched ops per step (count_ops.py)",
        "",
        f"`{data['command']}`, {data['date']}. Counts: aten ops dispatched by one training step (forward + "
        "backward, after two warm-up steps) and one eval step (forward under `no_grad`), at the shape given "
        "(the count does not depend on it, but for channels_last InstanceNorm's route); deterministic.",
        "",
    ]
    body = [
        [r["layer"], tuple(r["shape"]), r["layout"], r["train"], r["train_reference"], r["eval"], r["eval_reference"],
         r["reference"]]
        for r in data["counts"]
    ]  # fmt: skip
    head = ["layer", "shape", "layout", "train ops", "torch's train ops", "eval ops", "torch's eval ops", "torch's"]
    lines += common.table(head, body) + [""]
    if "cost" in data:
        lines += _timing_md(data)
    return "\n".join(lines)


def _timing_md(data: dict) -> list[str]:
    m = data["machine"]
    costs = [r["us_per_extra_op"] for r in data["cost"] if abs(r["extra_ops"]) >= 9]
    median, low, high = statistics.median(costs), min(costs), max(costs)
    lines = [
        f"**What one dispatched op costs on this machine** ({common.describe(m)}; load average "
        f"{m['load_average']} at the start of the run; thread CPU time, {data['rounds']} interleaved rounds): every "
        "case above and its reference timed at a tiny shape (C = 4: 4 x 4, 2 x 4 x 4, 2 x 4 x 2 x 2, "
        "2 x 4 x 2 x 2 x 2), where the passes over the data cost nothing; the time a layer adds to torch's step "
        f"divided by the ops it adds: median **{median:.1f} us per op**, {low:.1f}-{high:.1f} over the "
        f"{len(costs)} cases that add at least 9 ops (fewer make the quotient noise).",
        "",
    ]
    head = ["layer", "layout", "shape", "extra ops", "us", "torch's us", "us per extra op"]
    body = [[r["layer"], r["layout"], tuple(r["shape"]), r["extra_ops"], f"{r['us']:.0f}", f"{r['reference_us']:.0f}",
             "-" if r["us_per_extra_op"] is None else f"{r['us_per_extra_op']:.1f}"] for r in data["cost"]]  # fmt: skip
    lines += common.table(head, body) + [""]
    lines += [
        "**The floor at a shape S**: the layer runs torch's kernels (BatchRenorm: BatchNorm's three; "
        "SwitchableNorm: more, see above) plus `extra ops` on per-channel tensors. Timed side by side at S and at "
        "(2, C, 1, 2) (the same per-channel tensors, no data), the time it adds there is its eager overhead, so "
        "`ratio(S) >= 1 + overhead / T_ref(S)`:",
        "",
    ]
    head = ["layer", "shape S", "extra ops", "overhead us (us per op)", "torch's step at S, us", "floor",
            "measured ratio at S", "load"]  # fmt: skip
    body = [
        [r["layer"], tuple(r["shape"]), r["extra_ops"], f"{r['overhead_us']:.0f} ({r['us_per_extra_op']:.1f})",
         f"{r['reference_us']:.0f}", f"{r['floor']:.2f}", common.fmt_ratio(r["measured"]), r["load"]]
        for r in data["floors"]
    ]  # fmt: skip
    return lines + common.table(head, body)


def print_counts(rows: list[dict], verbose: bool) -> None:
    print(f"{'layer':<40} {'shape':<20} {'layout':<13} {'train':>6} {'torch':>6} {'eval':>6} {'torch':>6}")
    for r in rows:
        print(
            f"{r['layer']:<40} {str(tuple(r['shape'])):<20} {r['layout']:<13} {r['train']:>6} "
            f"{r['train_reference']:>6} {r['eval']:>6} {r['eval_reference']:>6}"
        )
        if verbose:
            print("    train: " + ", ".join(f"{k} x{v}" for k, v in r["train_ops"].items()))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--verbose", action="store_true", help="list each layer's ops by name")
    parser.add_argument("--timing", action="store_true", help="measure the cost per op and the floors")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the timing")
    parser.add_argument("--out", default="", help="JSON file")
    parser.add_argument("--results", default="", help="RESULTS.md whose count_ops section is rewritten")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = {
        "command": common.command("count_ops.py", argv),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": common.machine(torch.device("cpu")),
        "counts": count_rows(verbose=args.verbose),
    }
    print_counts(data["counts"], args.verbose)
    if args.timing:
        data["rounds"] = args.rounds
        data["cost"] = per_op_cost(data["counts"], args.rounds)
        data["floors"] = floor_rows(args.rounds)
        print("\n".join(_timing_md(data)))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(data, indent=1))
    if args.results:
        common.write_section(Path(args.results), "count_ops:cpu", markdown(data))
    return data


if __name__ == "__main__":
    main()
