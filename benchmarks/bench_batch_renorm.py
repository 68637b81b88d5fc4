"""Forward+backward speed of BatchRenorm2d vs nn.BatchNorm2d vs a naive eager renorm ("typical port"), side by side.

All candidates run in one process, interleaved (every repeat times each candidate once, in rotating order), and the
median over repeats is reported with its ratio to nn.BatchNorm2d in the same memory format.

    python benchmarks/bench_batch_renorm.py --shape 32 64 32 32 --repeats 15 --iters 10 --out bench_brn.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from torch import nn

from normlab.nn.batch_renorm import BatchRenorm2d


class NaiveBatchRenorm2d(nn.Module):
    """The formula written with eager autograd ops, as earlier PyTorch ports do (kept correct: eps inside sqrt)."""

    def __init__(self, c: int, eps: float = 1e-5, momentum: float = 0.1, rmax: float = 3.0, dmax: float = 5.0):
        super().__init__()
        self.eps, self.momentum, self.rmax, self.dmax = eps, momentum, rmax, dmax
        self.weight = nn.Parameter(torch.ones(c))
        self.bias = nn.Parameter(torch.zeros(c))
        self.register_buffer("running_mean", torch.zeros(c))
        self.register_buffer("running_var", torch.ones(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims, shape = (0, 2, 3), (1, -1, 1, 1)
        mean = x.mean(dims)
        var = x.var(dims, unbiased=False)
        std = torch.sqrt(var + self.eps)
        running_std = torch.sqrt(self.running_var + self.eps)
        r = (std.detach() / running_std).clamp(1 / self.rmax, self.rmax)
        d = ((mean.detach() - self.running_mean) / running_std).clamp(-self.dmax, self.dmax)
        xhat = (x - mean.reshape(shape)) / std.reshape(shape) * r.reshape(shape) + d.reshape(shape)
        with torch.no_grad():
            n = x.numel() / x.shape[1]
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / (n - 1), self.momentum)
        return self.weight.reshape(shape) * xhat + self.bias.reshape(shape)


def _candidates(c: int):
    def renorm(**kw):
        m = BatchRenorm2d(c, rmax=3.0, dmax=5.0, **kw)
        with torch.no_grad():  # running stats far from the batch: r and d are clipped (the general case)
            m.running_var.fill_(4.0)
            m.running_mean.fill_(0.5)
        return m

    return {
        "nn.BatchNorm2d": nn.BatchNorm2d(c),
        "BatchRenorm2d": renorm(),
        "BatchRenorm2d(check_finite=False)": renorm(check_finite=False),
        "naive eager renorm": NaiveBatchRenorm2d(c),
    }


def _time(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        x.grad = None
        module(x).backward(grad)
    return (time.perf_counter() - start) / iters


def run(shape, repeats: int, iters: int, warmup: int, seed: int = 0) -> list[dict]:
    torch.manual_seed(seed)
    rows = []
    for layout in ("contiguous", "channels_last"):
        fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
        x = torch.randn(shape).to(memory_format=fmt).requires_grad_()
        grad = torch.randn(shape).to(memory_format=fmt)
        mods = _candidates(shape[1])
        for m in mods.values():
            _time(m, x, grad, warmup)
        times = {name: [] for name in mods}
        names = list(mods)
        for rep in range(repeats):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                times[name].append(_time(mods[name], x, grad, iters))
        base = statistics.median(times["nn.BatchNorm2d"])
        for name in names:
            med = statistics.median(times[name])
            rows.append(
                {
                    "layout": layout,
                    "module": name,
                    "median_ms": med * 1e3,
                    "min_ms": min(times[name]) * 1e3,
                    "ratio_vs_bn": med / base,
                }
            )
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=4, default=[32, 64, 32, 32], metavar=("N", "C", "H", "W"))
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(tuple(args.shape), args.repeats, args.iters, args.warmup)
    print(
        f"forward+backward, float32, shape {tuple(args.shape)}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats} x {args.iters} iterations"
    )
    print(f"{'layout':<14} {'module':<36} {'median ms':>10} {'min ms':>9} {'vs BN':>7}")
    for r in rows:
        print(
            f"{r['layout']:<14} {r['module']:<36} {r['median_ms']:>10.3f} {r['min_ms']:>9.3f} {r['ratio_vs_bn']:>7.2f}"
        )
    if args.out:
        meta = {
            "shape": args.shape,
            "repeats": args.repeats,
            "iters": args.iters,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "device": "cpu",
        }
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
