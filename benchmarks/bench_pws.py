"""Speed of PWSConv2d vs nn.Conv2d vs an official-style PWS conv, side by side (training step and eval forward).

All candidates run in one process, interleaved (every repeat times each candidate once, in rotating order); the
median over repeats is reported with its ratio to nn.Conv2d.

* ``train``: forward + backward (gradients for input, weight, bias and alpha), parameters' grads reset each step.
* ``eval``: forward under ``torch.no_grad()`` in eval mode. ``PWSConv2d`` then uses its inference kernel cache
  (default ``weight_cache="auto"``: verified by a value comparison on CPU, off on other devices);
  ``(identity)`` trusts the tensor identity/version key only; ``(no cache)`` recomputes the kernel every call
  (what training mode and torch.compile do).
* ``official-style PWS``: the authors' layout re-implemented (square integer kernel, kernel recomputed from
  ``weight.view(C_out, -1)`` statistics on every call, no cache).

    python benchmarks/bench_pws.py --shape 32 64 32 32 --repeats 15 --iters 5 --out bench_pws.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from normlab.nn.weight_std import PWSConv2d


class OfficialStylePWSConv(nn.Module):
    """PWS written the way the official code does it: square int kernel, statistics from weight.view(C_out, -1)."""

    def __init__(self, cin: int, cout: int, k: int, padding: int, gamma: float = 1e-3):
        super().__init__()
        self.padding, self.gamma = padding, gamma
        self.weight = nn.Parameter(torch.empty(cout, cin, k, k))
        nn.init.kaiming_normal_(self.weight, mode="fan_in", nonlinearity="relu")
        self.bias = nn.Parameter(torch.zeros(cout))
        self.alpha = nn.Parameter(torch.ones(cout, 1, 1, 1))
        self.fan_in = cin * k * k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.view(self.weight.size(0), -1)
        mean = w.mean(1, keepdim=True)
        var = w.var(1, unbiased=False, keepdim=True)
        w = (w - mean) / torch.sqrt(var + self.gamma) * math.sqrt(2.0 / self.fan_in)
        w = w.view_as(self.weight) * self.alpha
        return F.conv2d(x, w, self.bias, padding=self.padding)


def _candidates(c_in: int, c_out: int, k: int, device) -> dict[str, nn.Module]:
    pad = k // 2
    mods = {
        "nn.Conv2d": nn.Conv2d(c_in, c_out, k, padding=pad),
        "PWSConv2d": PWSConv2d(c_in, c_out, k, padding=pad),
        "PWSConv2d (no cache)": PWSConv2d(c_in, c_out, k, padding=pad, weight_cache="off"),
        "PWSConv2d (identity)": PWSConv2d(c_in, c_out, k, padding=pad, weight_cache="identity"),
        "official-style PWS": OfficialStylePWSConv(c_in, c_out, k, pad),
    }
    return {name: m.to(device) for name, m in mods.items()}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_train(m: nn.Module, x, grad, iters: int, device) -> float:
    m.train()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        x.grad = None
        for p in m.parameters():
            p.grad = None
        m(x).backward(grad)
    _sync(device)
    return (time.perf_counter() - start) / iters


def _time_eval(m: nn.Module, x, grad, iters: int, device) -> float:
    m.eval()
    _sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(iters):
            m(x)
    _sync(device)
    return (time.perf_counter() - start) / iters


def run(shape, c_out: int, k: int, repeats: int, iters: int, warmup: int, device, seed: int = 0) -> list[dict]:
    torch.manual_seed(seed)
    n, c, h, w = shape
    x = torch.randn(shape, device=device).requires_grad_()
    mods = _candidates(c, c_out, k, device)
    with torch.no_grad():
        y0 = mods["nn.Conv2d"](x)
    grad = torch.randn_like(y0)
    rows = []
    for mode, timer in (("train", _time_train), ("eval", _time_eval)):
        names = [nm for nm in mods if not (mode == "train" and nm.startswith("PWSConv2d ("))]
        for nm in names:
            timer(mods[nm], x, grad, warmup, device)
        times = {nm: [] for nm in names}
        for rep in range(repeats):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for nm in order:
                times[nm].append(timer(mods[nm], x, grad, iters, device))
        base = statistics.median(times["nn.Conv2d"])
        for nm in names:
            med = statistics.median(times[nm])
            rows.append(
                {
                    "mode": mode,
                    "module": nm,
                    "median_ms": med * 1e3,
                    "min_ms": min(times[nm]) * 1e3,
                    "ratio_vs_conv": med / base,
                }
            )
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=4, default=[32, 64, 32, 32], metavar=("N", "C", "H", "W"))
    p.add_argument("--out-channels", type=int, default=64)
    p.add_argument("--kernel", type=int, default=3)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = run(tuple(args.shape), args.out_channels, args.kernel, args.repeats, args.iters, args.warmup, device)
    print(
        f"conv {args.kernel}x{args.kernel} {args.shape[1]}->{args.out_channels}, float32, input {tuple(args.shape)}, "
        f"{device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"median of {args.repeats} x {args.iters} iterations"
    )
    print(f"{'mode':<6} {'module':<22} {'median ms':>10} {'min ms':>9} {'vs conv':>8}")
    for r in rows:
        print(
            f"{r['mode']:<6} {r['module']:<22} {r['median_ms']:>10.3f} {r['min_ms']:>9.3f} {r['ratio_vs_conv']:>8.3f}"
        )
    if args.out:
        meta = {
            "shape": args.shape,
            "out_channels": args.out_channels,
            "kernel": args.kernel,
            "repeats": args.repeats,
            "iters": args.iters,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "device": str(device),
        }
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
