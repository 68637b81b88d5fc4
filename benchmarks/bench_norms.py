"""Side-by-side forward+backward timing: normlab InstanceNorm2d / SwitchableNorm2d against torch's layers.

Pairs, each timed in the same process with interleaved repeats (every repeat runs every case once, in a rotated
order), median over repeats:

- InstanceNorm2d (normlab, affine) vs nn.InstanceNorm2d (affine)          -> the speed ratio that matters
- SwitchableNorm2d (normlab) vs an eager SN written the way the official code computes it (reshape to (N, C, HW),
  x.mean / x.var per instance, LN and BN statistics from them, normalize the reshaped tensor) -> the SN ratio
- SwitchableNorm2d (normlab) vs nn.BatchNorm2d and nn.GroupNorm(32)       -> reference points (SN does more work)

each with contiguous and channels_last inputs. Also records whether each output keeps channels_last.

    .venv/bin/python benchmarks/bench_norms.py --out runs/bench/bench_norms.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from normlab.nn.instance_norm import InstanceNorm2d
from normlab.nn.switchable import SwitchableNorm2d

FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


class EagerSwitchableNorm2d(nn.Module):
    """The reference: switchable normalization computed step by step in the style of the official code."""

    def __init__(self, c: int, eps: float = 1e-5, momentum: float = 0.9) -> None:
        super().__init__()
        self.eps, self.momentum = eps, momentum
        self.weight = nn.Parameter(torch.ones(1, c, 1, 1))
        self.bias = nn.Parameter(torch.zeros(1, c, 1, 1))
        self.mean_weight = nn.Parameter(torch.ones(3))
        self.var_weight = nn.Parameter(torch.ones(3))
        self.register_buffer("running_mean", torch.zeros(1, c, 1))
        self.register_buffer("running_var", torch.zeros(1, c, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        x = x.view(n, c, -1)
        mean_in = x.mean(-1, keepdim=True)
        var_in = x.var(-1, keepdim=True)
        mean_ln = mean_in.mean(1, keepdim=True)
        second = var_in + mean_in**2
        var_ln = second.mean(1, keepdim=True) - mean_ln**2
        mean_bn = mean_in.mean(0, keepdim=True)
        var_bn = second.mean(0, keepdim=True) - mean_bn**2
        with torch.no_grad():
            self.running_mean.mul_(self.momentum).add_((1 - self.momentum) * mean_bn)
            self.running_var.mul_(self.momentum).add_((1 - self.momentum) * var_bn)
        mw = torch.softmax(self.mean_weight, 0)
        vw = torch.softmax(self.var_weight, 0)
        mean = mw[0] * mean_in + mw[1] * mean_ln + mw[2] * mean_bn
        var = vw[0] * var_in + vw[1] * var_ln + vw[2] * var_bn
        x = (x - mean) / (var + self.eps).sqrt()
        return x.view(n, c, h, w) * self.weight + self.bias


def make_layers(c: int, device: str) -> dict[str, nn.Module]:
    groups = 32 if c % 32 == 0 else 1
    return {
        "normlab.InstanceNorm2d": InstanceNorm2d(c, affine=True),
        "nn.InstanceNorm2d": nn.InstanceNorm2d(c, affine=True),
        "normlab.SwitchableNorm2d": SwitchableNorm2d(c),
        "eager SwitchableNorm2d (official style)": EagerSwitchableNorm2d(c),
        "nn.BatchNorm2d": nn.BatchNorm2d(c),
        f"nn.GroupNorm({groups})": nn.GroupNorm(groups, c),
    }


def step(layer: nn.Module, x: torch.Tensor, g: torch.Tensor, device: str) -> float:
    """One forward+backward; returns seconds."""
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    y = layer(x)
    y.backward(g)
    if device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    x.grad = None
    for p in layer.parameters():
        p.grad = None
    return dt


def run(shape: tuple[int, ...], repeats: int, warmup: int, inner: int, device: str, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    c = shape[1]
    cases = []
    for fmt_name, fmt in FORMATS.items():
        for name, layer in make_layers(c, device).items():
            layer = layer.to(device=device, dtype=dtype).train()
            x = torch.randn(shape, device=device, dtype=dtype).contiguous(memory_format=fmt).requires_grad_()
            g = torch.randn(shape, device=device, dtype=dtype).contiguous(memory_format=fmt)
            with torch.no_grad():
                keeps = layer(x).is_contiguous(memory_format=torch.channels_last)
            cases.append(
                {
                    "layer": name,
                    "format": fmt_name,
                    "module": layer,
                    "x": x,
                    "g": g,
                    "times": [],
                    "out_channels_last": bool(keeps),
                }
            )
    for case in cases:
        for _ in range(warmup):
            step(case["module"], case["x"], case["g"], device)
    for r in range(repeats):
        order = cases[r % len(cases) :] + cases[: r % len(cases)]
        for case in order:
            case["times"].append(sum(step(case["module"], case["x"], case["g"], device) for _ in range(inner)) / inner)
    results = []
    for case in cases:
        results.append(
            {
                "layer": case["layer"],
                "format": case["format"],
                "median_ms": 1e3 * statistics.median(case["times"]),
                "min_ms": 1e3 * min(case["times"]),
                "max_ms": 1e3 * max(case["times"]),
                "output_channels_last": case["out_channels_last"],
            }
        )
    by_key = {(r["layer"], r["format"]): r["median_ms"] for r in results}
    ratios = []
    gn_name = next(r["layer"] for r in results if r["layer"].startswith("nn.GroupNorm"))
    for fmt in FORMATS:
        for cand, ref in (
            ("normlab.InstanceNorm2d", "nn.InstanceNorm2d"),
            ("normlab.SwitchableNorm2d", "eager SwitchableNorm2d (official style)"),
            ("normlab.SwitchableNorm2d", "nn.BatchNorm2d"),
            ("normlab.SwitchableNorm2d", gn_name),
            ("normlab.SwitchableNorm2d", "nn.InstanceNorm2d"),
        ):
            ratios.append(
                {"candidate": cand, "reference": ref, "format": fmt, "ratio": by_key[(cand, fmt)] / by_key[(ref, fmt)]}
            )
    return {"results": results, "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="32,64,32,32", help="N,C,H,W")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--inner", type=int, default=1, help="forward+backward calls averaged per timed sample")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave torch's default)")
    p.add_argument("--out", default="", help="write the results as JSON to this file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = tuple(int(s) for s in args.shape.split(","))
    if len(shape) != 4:
        p.error(f"--shape must be N,C,H,W, got {args.shape}")
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    data = run(shape, args.repeats, args.warmup, args.inner, args.device, dtype)
    data["config"] = {
        "shape": shape,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "inner": args.inner,
        "device": args.device,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "wall_s": time.perf_counter() - t0,
    }
    print(
        f"forward+backward, shape {shape}, {args.dtype} on {args.device}, {torch.get_num_threads()} threads, "
        f"median of {args.repeats} interleaved repeats"
    )
    print(f"{'layer':28s} {'format':14s} {'median ms':>10s} {'min ms':>9s} {'max ms':>9s}  out channels_last")
    for r in data["results"]:
        print(
            f"{r['layer']:28s} {r['format']:14s} {r['median_ms']:10.2f} {r['min_ms']:9.2f} {r['max_ms']:9.2f}  "
            f"{r['output_channels_last']}"
        )
    print()
    print(f"{'candidate':28s} {'reference':22s} {'format':14s} {'ratio':>7s}")
    for r in data["ratios"]:
        print(f"{r['candidate']:28s} {r['reference']:22s} {r['format']:14s} {r['ratio']:7.2f}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=2))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
