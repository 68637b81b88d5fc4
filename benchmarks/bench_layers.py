"""The layer-cost table of issue 25: each normlab layer against the torch op it reduces to, side by side.

Forward + backward of one training step, ratios to the reference measured in the same process, interleaved (every
repeat times each candidate once, in rotating order); ``--rounds`` rounds, each reporting the median over its
repeats, so a ratio is given as the range of its per-round values.

- ``brn``: BatchRenorm1d/2d/3d (the default schedule past its warm-up, step 30,000: renormalization active) vs
  nn.BatchNorm1d/2d/3d at (256, 256), (32, 64), (2, 64, 32, 32), (32, 64, 32, 32), (8, 256, 56, 56) and
  (4, 64, 8, 16, 16), contiguous and channels_last, and with constant limits (rmax=3, dmax=5) and the identity
  limits (rmax=1, dmax=0); torchrl's BatchRenorm1d (past its warm-up) for the 1d shapes
  when torchrl can be imported.
- ``sn``: SwitchableNorm2d vs nn.BatchNorm2d; ``in``: InstanceNorm2d vs nn.InstanceNorm2d (with and without running
  statistics), contiguous and channels_last.
- ``routes`` (not in the default sections): BatchRenorm's two training routes through
  :func:`normlab.functional.batch_renorm` (constant limits, no non-finite bookkeeping) vs nn.BatchNorm at the brn
  shapes: the fused route (one statistics pass) and the fold of REFERENCE section 3 (``fused=False``), which
  the eager layer would take if it had a single route.
- ``crossq``: one critic update as CrossQ does it (Bhatt et al. 2024): an MLP 23 -> 256 -> 256 -> 1 with a
  normalization after each hidden linear layer, the (s, a) and (s', a') batches of 256 joined into one forward,
  TD loss, Adam step; normlab BatchRenorm1d vs nn.BatchNorm1d vs torchrl's BatchRenorm1d.
- ``--compile``: the brn and sn rows again with both sides under torch.compile (inductor).

- ``--clock cpu``: time each sample with the timing thread's CPU time (``time.thread_time``) instead of the
  elapsed time: on a machine shared with other jobs it leaves out the time the thread waits for a core (it still
  includes the cache and memory-bandwidth effects of the other jobs). One thread only.

    OMP_NUM_THREADS=1 python benchmarks/bench_layers.py --threads 1 --rounds 3 --out runs/bench/bench_layers.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import normlab.nn as L  # noqa: E402

TORCHRL_MISSING = "torchrl is not installed (pip install 'normlab[bench]' with the torch pin): no torchrl column"

BRN_SHAPES = [(256, 256), (32, 64), (2, 64, 32, 32), (32, 64, 32, 32), (8, 256, 56, 56), (4, 64, 8, 16, 16)]
NORM_SHAPES = [(2, 64, 32, 32), (32, 64, 32, 32)]
DIM = {2: 1, 3: 1, 4: 2, 5: 3}
CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}
PAST_WARMUP = 30_000


def _load():
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def _torchrl_brn():
    """torchrl's BatchRenorm1d class, or None when torchrl is not importable."""
    try:
        from torchrl.modules import BatchRenorm1d
    except Exception:  # noqa: BLE001 - any import failure means: no torchrl column
        return None
    return BatchRenorm1d


def _normlab_brn(dim: int, c: int, device) -> nn.Module:
    m = getattr(L, f"BatchRenorm{dim}d")(c, device=device)
    m.num_batches_tracked.fill_(PAST_WARMUP)
    return m


def _torchrl_layer(cls, c: int, device) -> nn.Module:
    m = cls(c, warmup_steps=10_000).to(device)
    m.num_batches_tracked.fill_(PAST_WARMUP)
    return m


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
_clock = time.perf_counter


def _time(fn, iters: int) -> float:
    start = _clock()
    for _ in range(iters):
        fn()
    return (_clock() - start) / iters


def _interleaved(steps: dict, repeats: int, iters: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds per call of each zero-argument step, timed interleaved in rotating order."""
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    names, samples = list(steps), {n: [] for n in steps}
    for rep in range(repeats):
        for k in range(len(names)):
            name = names[(rep + k) % len(names)]
            samples[name].append(_time(steps[name], iters))
    return {n: statistics.median(v) for n, v in samples.items()}


def _layer_step(module: nn.Module, x: torch.Tensor, g: torch.Tensor):
    def step():
        x.grad = None
        module(x).backward(g)

    return step


def _input(shape, layout: str, device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 1.5 + 0.3).to(device)
    g = torch.randn(shape, generator=gen).to(device)
    if layout == "channels_last":
        x, g = (
            x.contiguous(memory_format=CHANNELS_LAST[len(shape)]),
            g.contiguous(memory_format=CHANNELS_LAST[len(shape)]),
        )
    return x.requires_grad_(), g


def _sizes(shape) -> tuple[int, int]:
    """(repeats, iters) that keep one candidate's sample around 5-20 ms on one CPU thread."""
    n = 1
    for s in shape:
        n *= s
    if n >= 4_000_000:
        return 5, 1
    if n >= 500_000:
        return 7, 3
    return 15, 50


def _layouts(shape):
    return ["contiguous", "channels_last"] if len(shape) in CHANNELS_LAST else ["contiguous"]


def _rows(section: str, candidates_for, shapes, args) -> list[dict]:
    """One row per shape, layout and candidate; the first candidate is the reference of the ratios."""
    rows = []
    if args.shape:  # the given shapes instead, those of a rank the section takes
        ranks = {len(shape) for shape in shapes}
        shapes = [s for s in (tuple(int(n) for n in text.split(",")) for text in args.shape) if len(s) in ranks]
    for shape in shapes:
        if args.max_numel and math.prod(shape) > args.max_numel:
            continue
        for layout in _layouts(shape):
            repeats, iters = _sizes(shape)
            cands = candidates_for(shape)
            reference = next(iter(cands))
            x, g = _input(shape, layout, args.device, 100)
            steps = {name: _layer_step(m, x, g) for name, m in cands.items()}
            if args.compile:
                steps = {name: _layer_step(torch.compile(m), x, g) for name, m in cands.items()}
            load = [_load()]
            rounds = [_interleaved(steps, repeats, iters) for _ in range(args.rounds)]
            load.append(_load())
            for name in cands:
                ratios = [r[name] / r[reference] for r in rounds]
                rows.append(
                    {
                        "section": section + ("-compiled" if args.compile else ""),
                        "shape": list(shape),
                        "layout": layout,
                        "candidate": name,
                        "reference": reference,
                        "median_us": [1e6 * r[name] for r in rounds],
                        "ratio": ratios,
                        "load": load,
                    }
                )
                print(
                    f"{rows[-1]['section']:14s} {str(tuple(shape)):20s} {layout:13s} {name:28s} "
                    f"{1e6 * statistics.median(r[name] for r in rounds):10.1f} us  "
                    f"x{min(ratios):.2f}-{max(ratios):.2f} {reference}",
                    flush=True,
                )
    return rows


def _brn_candidates(args, trl):
    def make(shape):
        dim, c = DIM[len(shape)], shape[1]
        cands = {
            f"nn.BatchNorm{dim}d": getattr(nn, f"BatchNorm{dim}d")(c, device=args.device),
            f"normlab BatchRenorm{dim}d": _normlab_brn(dim, c, args.device),
            "normlab rmax=3,dmax=5": getattr(L, f"BatchRenorm{dim}d")(c, device=args.device, rmax=3.0, dmax=5.0),
            "normlab rmax=1,dmax=0": getattr(L, f"BatchRenorm{dim}d")(c, device=args.device, rmax=1.0, dmax=0.0),
        }
        if dim == 1 and trl is not None:
            cands["torchrl BatchRenorm1d"] = _torchrl_layer(trl, c, args.device)
        return cands

    return make


class _RenormRoute(nn.Module):
    """:func:`normlab.functional.batch_renorm` in training with constant limits (rmax=3, dmax=5) on one route: the
    fused one (one statistics pass, BatchNorm's kernels through an autograd Function) or the composite one
    (``fused=False``: the fold of REFERENCE section 3, batch statistics without gradient, then BatchNorm's training
    call with ``weight * r`` and ``bias + weight * d``, which takes the statistics again). No non-finite guard,
    counters or schedule on either: the two routes' own cost, side by side."""

    def __init__(self, c: int, fused: bool, device):
        super().__init__()
        self.fused = fused
        self.weight = nn.Parameter(torch.ones(c, device=device))
        self.bias = nn.Parameter(torch.zeros(c, device=device))
        self.register_buffer("running_mean", torch.zeros(c, device=device))
        self.register_buffer("running_var", torch.ones(c, device=device))

    def forward(self, x):
        from normlab.functional import batch_renorm

        return batch_renorm(
            x, self.running_mean, self.running_var, self.weight, self.bias, True, 0.1, 1e-5, 3.0, 5.0, self.fused
        )


def _route_candidates(args):
    def make(shape):
        dim, c = DIM[len(shape)], shape[1]
        return {
            f"nn.BatchNorm{dim}d": getattr(nn, f"BatchNorm{dim}d")(c, device=args.device),
            "fused route": _RenormRoute(c, True, args.device),
            "fold route (fused=False)": _RenormRoute(c, False, args.device),
        }

    return make


def _sn_candidates(args):
    return lambda shape: {
        "nn.BatchNorm2d": nn.BatchNorm2d(shape[1], device=args.device),
        "normlab SwitchableNorm2d": L.SwitchableNorm2d(shape[1], device=args.device),
    }


def _in_candidates(args, track: bool):
    suffix = "(track_running_stats)" if track else ""
    return lambda shape: {
        f"nn.InstanceNorm2d{suffix}": nn.InstanceNorm2d(shape[1], affine=True, track_running_stats=track).to(
            args.device
        ),
        f"normlab InstanceNorm2d{suffix}": L.InstanceNorm2d(
            shape[1], affine=True, track_running_stats=track, device=args.device
        ),
    }


# ------------------------------------------------------------------------------------------------ CrossQ critic
def _critic(norm, obs: int = 17, act: int = 6, hidden: int = 256) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(obs + act, hidden), norm(hidden), nn.ReLU(), nn.Linear(hidden, hidden), norm(hidden), nn.ReLU(),
        nn.Linear(hidden, 1),
    )  # fmt: skip


def _crossq_step(critic: nn.Module, batch, gamma: float = 0.99):
    """One CrossQ critic update: (s, a) and (s', a') joined in one forward (the batch statistics of both), the TD
    target from the second half without gradient, MSE, Adam."""
    opt = torch.optim.Adam(critic.parameters(), lr=3e-4)
    s, a, r, s2, a2 = batch

    def step():
        q_all = critic(torch.cat([torch.cat([s, a], 1), torch.cat([s2, a2], 1)], 0))
        q, q_next = q_all.chunk(2)
        target = r + gamma * q_next.detach()
        loss = (q - target).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def _crossq_rows(args, trl) -> list[dict]:
    gen = torch.Generator().manual_seed(101)
    batch = [torch.randn(256, k, generator=gen).to(args.device) for k in (17, 6, 1, 17, 6)]
    norms = {
        "nn.BatchNorm1d": lambda c: nn.BatchNorm1d(c, device=args.device),
        "normlab BatchRenorm1d": lambda c: _normlab_brn(1, c, args.device),
    }
    if trl is not None:
        norms["torchrl BatchRenorm1d"] = lambda c: _torchrl_layer(trl, c, args.device)
    steps = {}
    for name, norm in norms.items():
        torch.manual_seed(102)
        steps[name] = _crossq_step(_critic(norm).to(args.device), batch)
    load = [_load()]
    rounds = [_interleaved(steps, 15, 20) for _ in range(args.rounds)]
    load.append(_load())
    rows = []
    for name in steps:
        ratios = [r[name] / r["nn.BatchNorm1d"] for r in rounds]
        rows.append(
            {
                "section": "crossq",
                "shape": [512, 23],
                "layout": "contiguous",
                "candidate": name,
                "reference": "nn.BatchNorm1d",
                "median_us": [1e6 * r[name] for r in rounds],
                "ratio": ratios,
                "load": load,
            }
        )
        print(
            f"crossq critic update (2x256 batch) {name:24s} {1e6 * statistics.median(r[name] for r in rounds):10.1f} "
            f"us  x{min(ratios):.2f}-{max(ratios):.2f} nn.BatchNorm1d",
            flush=True,
        )
    return rows


# ------------------------------------------------------------------------------------------------ report
LARGE = 32 * 64 * 32 * 32  # from this many values on, eager BatchRenorm's target is <= 1.10x BatchNorm


def _target(row: dict) -> float | None:
    """The eager target of a row: BatchRenorm <= 1.10x BatchNorm at (32, 64, 32, 32) and larger; SwitchableNorm
    <= 1.50x BatchNorm (issue 10); InstanceNorm <= 1.00x torch's (issue 10); none otherwise (at the small shapes the
    target is to be ahead of torchrl's BatchRenorm1d)."""
    name = row["candidate"]
    if name.startswith("normlab BatchRenorm") and math.prod(row["shape"]) >= LARGE:
        return 1.10
    return {"normlab SwitchableNorm2d": 1.50}.get(name, 1.00 if name.startswith("normlab InstanceNorm") else None)


def _vs_torchrl(rows: list[dict], row: dict) -> str:
    """normlab / torchrl in the same rounds, for a normlab BatchRenorm1d row: both ratios are to the same
    BatchNorm timings, so their quotient is the time quotient."""
    if row["candidate"] != "normlab BatchRenorm1d":
        return ""
    trl = [r for r in rows if r["candidate"].startswith("torchrl") and r["shape"] == row["shape"]]
    trl = [r for r in trl if r["section"] == row["section"]]
    if not trl:
        return "torchrl not installed"
    q = sorted(a / b for a, b in zip(row["ratio"], trl[0]["ratio"]))
    return f"{statistics.median(q):.2f} ({q[0]:.2f}-{q[-1]:.2f}): {'ahead' if q[-1] < 1 else '**not ahead**'}"


def markdown(data: dict) -> str:
    meta, rows = data["meta"], [r for r in data["rows"] if r["candidate"] != r["reference"]]
    lines = [
        f"### Eager layers beside torch's (bench_layers.py, {meta['device']})",
        "",
        f"`{meta['command']}`; torch {meta['torch']}, {meta['threads']} thread(s), {meta['machine']}, clock "
        f"{meta['clock']}, {meta['rounds']} rounds. Ratio = candidate / reference in the same round: median "
        f"(min-max) over the rounds. torchrl: {meta['torchrl'] or TORCHRL_MISSING}.",
        "",
    ]
    head = ["section", "shape", "layout", "candidate", "reference", "ratio", "target", "met", "us", "vs torchrl",
            "load"]  # fmt: skip
    body = []
    for r in rows:
        q = sorted(r["ratio"])
        target = _target(r)
        met = "" if target is None else ("yes" if statistics.median(q) <= target else "**no**")
        body.append([r["section"], tuple(r["shape"]), r["layout"], r["candidate"], r["reference"],
                     f"{statistics.median(q):.2f} ({q[0]:.2f}-{q[-1]:.2f})", "" if target is None else f"<= {target}",
                     met, f"{statistics.median(r['median_us']):.0f}", _vs_torchrl(rows, r),
                     "-".join(str(v) for v in r.get("load", []))])  # fmt: skip
    return "\n".join(lines + common.table(head, body))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3, help="side-by-side rounds (the range of their ratios)")
    parser.add_argument("--sections", default="brn,sn,in,crossq", help="comma-separated: brn, routes, sn, in, crossq")
    parser.add_argument("--compile", action="store_true", help="brn and sn with both sides under torch.compile")
    parser.add_argument("--max-numel", type=int, default=0, help="skip shapes with more elements (0: none skipped)")
    parser.add_argument(
        "--shape",
        action="append",
        default=None,
        help="this shape instead of the section's own (those of a rank the section takes), e.g. 4,64,8,16,16; "
        "repeat for more",
    )
    parser.add_argument("--out", default=None, help="JSON file for the rows")
    parser.add_argument("--results", default="", help="RESULTS.md whose bench_layers section is rewritten")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall: elapsed time; cpu: the timing thread's CPU time (time.thread_time), which leaves out the time "
        "the thread waits for a core on an oversubscribed machine (with --threads 1 only)",
    )
    args = parser.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu measures the calling thread only: use it with --threads 1")
    global _clock
    _clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    trl = _torchrl_brn()
    if trl is None:
        print(TORCHRL_MISSING, flush=True)
    sections = {s.strip() for s in args.sections.split(",")}
    rows = []
    if "brn" in sections:
        rows += _rows("brn", _brn_candidates(args, trl), BRN_SHAPES, args)
    if "routes" in sections and not args.compile:
        rows += _rows("routes", _route_candidates(args), BRN_SHAPES, args)
    if "sn" in sections:
        rows += _rows("sn", _sn_candidates(args), NORM_SHAPES, args)
    if "in" in sections and not args.compile:
        rows += _rows("in", _in_candidates(args, False), NORM_SHAPES, args)
        rows += _rows("in", _in_candidates(args, True), NORM_SHAPES, args)
    if "crossq" in sections and not args.compile:
        rows += _crossq_rows(args, trl)
    meta = {
        "torch": torch.__version__,
        "torchrl": None if trl is None else __import__("torchrl").__version__,
        "device": args.device,
        "threads": args.threads,
        "rounds": args.rounds,
        "clock": args.clock,
        "machine": platform.processor() or platform.machine(),
        "command": common.command("bench_layers.py", argv),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if args.results:
        key = f"bench_layers:{args.device}" + ("-compiled" if args.compile else "")
        common.write_section(Path(args.results), key, markdown({"meta": meta, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
