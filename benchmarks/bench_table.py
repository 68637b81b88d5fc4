"""The issue-10 table in one run: normlab layers against their torch references, side by side, on CPU or CUDA.

Every group is timed in one process, interleaved: each round times every case for about ``--block-ms`` (on CPU
call by call in turn, so a slow phase of a shared machine hits every case alike; on CUDA one synchronized block per
case, the order rotated by one per round) and the ratio to the reference is taken per round; the table gives
min / median / max of those per-round ratios and the median absolute time.

- layers (train, forward+backward, float32): BatchRenorm2d (rmax 3, dmax 5, running statistics far from the batch
  so r and d are clipped) and SwitchableNorm2d against nn.BatchNorm2d, InstanceNorm2d against nn.InstanceNorm2d,
  shapes (32,64,32,32) (CIFAR ResNet stage), (8,256,56,56) (ResNet-50 stage), (2,64,32,32) (small batch),
  contiguous and channels_last;
- convolutions: PWSConv2d / WSConv2d against nn.Conv2d (3x3, 64 -> 64 on (32,64,32,32)), train and eval;
- whole training step (SGD, cross entropy) of the paper's plain net and the CIFAR ResNet (width 1.0, batch 64,
  3x32x32) with BN, GN and PWS, and the peak memory of one step (CPU: peak RSS growth over one step in a
  subprocess whose large allocations are returned to the OS; CUDA: torch.cuda.max_memory_allocated);
- torch.compile: BN / BatchRenorm2d / SwitchableNorm2d each compiled, CIFAR shape, both layouts.

Before timing, the fused paths of BatchRenorm and SwitchableNorm are checked against their composite formulas on
the device (so a GPU run also validates them there).

    .venv/bin/python benchmarks/bench_table.py --device cpu --out runs/bench/bench_table.json \
        --results benchmarks/RESULTS.md
    python benchmarks/bench_table.py --device cuda --results benchmarks/RESULTS.md     # < 5 min on a GPU
    python benchmarks/bench_table.py --quick        # seconds: small shapes, the smoke test inside `make test`
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from normlab import functional as NF
from normlab.nn import BatchRenorm2d, InstanceNorm2d, PWSConv2d, SwitchableNorm2d, WSConv2d

LAYOUTS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}
LAYER_SHAPES = [(32, 64, 32, 32), (8, 256, 56, 56), (2, 64, 32, 32)]
QUICK_SHAPES = [(4, 8, 8, 8), (2, 8, 6, 6)]
TARGETS = {  # (candidate, reference) -> largest median ratio the issue accepts
    ("BatchRenorm2d", "nn.BatchNorm2d"): 1.10,
    ("SwitchableNorm2d", "nn.BatchNorm2d"): 1.5,
    ("InstanceNorm2d", "nn.InstanceNorm2d"): 1.0,
    ("PWSConv2d", "nn.Conv2d", "train"): 1.05,
    ("WSConv2d", "nn.Conv2d", "train"): 1.05,
    ("PWSConv2d", "nn.Conv2d", "eval"): 1.01,
    ("WSConv2d", "nn.Conv2d", "eval"): 1.01,
}


# ------------------------------------------------------------------------------------------------ timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _block(fn, iters: int, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / iters


def interleaved(cases: dict, refs: dict, rounds: int, block_s: float, device, warmup: int = 2) -> dict:
    """Time ``cases`` (name -> zero-argument callable) interleaved; ``refs`` maps a case to its reference case.

    Returns ``{name: {"median_ms", "min_ms", "max_ms", "iters"[, "ratio_min", "ratio_median", "ratio_max"]}}`` with
    the ratios to the reference taken per round (both timed in the same round).
    """
    iters = {}
    for name, fn in cases.items():
        for _ in range(warmup):
            fn()
        one = _block(fn, 1, device)
        iters[name] = max(1, round(block_s / max(one, 1e-6)))
    names = list(cases)
    times = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        if device.type == "cuda":  # one synchronized block per case
            for name in order:
                times[name].append(_block(cases[name], iters[name], device))
            continue
        # CPU: interleave call by call (a slow phase of a shared machine then hits every case alike)
        spent = dict.fromkeys(names, 0.0)
        for i in range(max(iters.values())):
            for name in order:
                if i < iters[name]:
                    t0 = time.perf_counter()
                    cases[name]()
                    spent[name] += time.perf_counter() - t0
        for name in names:
            times[name].append(spent[name] / iters[name])
    out = {}
    for name in names:
        out[name] = {
            "median_ms": 1e3 * statistics.median(times[name]),
            "min_ms": 1e3 * min(times[name]),
            "max_ms": 1e3 * max(times[name]),
            "iters": iters[name],
            "times_s": times[name],
        }
    for name, ref in refs.items():
        out[name].update(pair_ratios(out, name, ref))
    return out


def pair_ratios(res: dict, cand: str, ref: str) -> dict:
    """min / median / max over rounds of ``time(cand) / time(ref)`` (both timed in the same round)."""
    ratios = [t / b for t, b in zip(res[cand]["times_s"], res[ref]["times_s"])]
    return {"ratio_min": min(ratios), "ratio_median": statistics.median(ratios), "ratio_max": max(ratios)}


def _train_step(module: nn.Module, x: torch.Tensor, g: torch.Tensor):
    def step():
        x.grad = None
        for p in module.parameters():
            p.grad = None
        module(x).backward(g)

    return step


# ------------------------------------------------------------------------------------------------ groups
def _renorm(c: int, **kw) -> BatchRenorm2d:
    m = BatchRenorm2d(c, rmax=3.0, dmax=5.0, **kw)
    with torch.no_grad():  # running statistics far from the batch: r and d are clipped (the general case)
        m.running_var.fill_(4.0)
        m.running_mean.fill_(0.5)
    return m


def _norm_layers(c: int) -> dict[str, nn.Module]:
    return {
        "nn.BatchNorm2d": nn.BatchNorm2d(c),
        "BatchRenorm2d": _renorm(c),
        "BatchRenorm2d(check_finite=False)": _renorm(c, check_finite=False),
        "SwitchableNorm2d": SwitchableNorm2d(c),
        "nn.InstanceNorm2d": nn.InstanceNorm2d(c, affine=True),
        "InstanceNorm2d": InstanceNorm2d(c, affine=True),
    }


LAYER_PAIRS = (
    ("BatchRenorm2d", "nn.BatchNorm2d"),
    ("BatchRenorm2d(check_finite=False)", "nn.BatchNorm2d"),
    ("SwitchableNorm2d", "nn.BatchNorm2d"),
    ("InstanceNorm2d", "nn.InstanceNorm2d"),
)


def _rows(group: str, res: dict, refs: dict, **fields) -> list[dict]:
    rows = []
    for cand, ref in refs.items():
        r = res[cand]
        key = (cand.split("(")[0], ref) + ((fields["mode"],) if "mode" in fields else ())
        target = TARGETS.get(key) if "compile" not in group else None
        rows.append(
            {
                "group": group,
                **fields,
                "candidate": cand,
                "reference": ref,
                "ratio_min": r["ratio_min"],
                "ratio_median": r["ratio_median"],
                "ratio_max": r["ratio_max"],
                "candidate_ms": r["median_ms"],
                "reference_ms": res[ref]["median_ms"],
                "target": target,
                "met": None if target is None else r["ratio_median"] <= target,
            }
        )
    return rows


def bench_layers(shapes, rounds: int, block_s: float, device, compiled: bool = False) -> list[dict]:
    rows = []
    for shape in shapes:
        for layout, fmt in LAYOUTS.items():
            torch.manual_seed(0)
            x = torch.randn(shape, device=device).contiguous(memory_format=fmt).requires_grad_()
            g = torch.randn(shape, device=device).contiguous(memory_format=fmt)
            layers = {k: m.to(device).train() for k, m in _norm_layers(shape[1]).items()}
            pairs = dict(LAYER_PAIRS)
            if compiled:  # the default BatchRenorm2d's finite check is a host sync (a graph break): compile the rest
                keep = ("nn.BatchNorm2d", "BatchRenorm2d(check_finite=False)", "SwitchableNorm2d")
                layers = {k: torch.compile(layers[k]) for k in keep}
                pairs = {k: v for k, v in pairs.items() if k in layers}
            cases = {k: _train_step(m, x, g) for k, m in layers.items()}
            res = interleaved(cases, pairs, rounds, block_s, device)
            group = "layers (torch.compile)" if compiled else "layers"
            rows += _rows(group, res, pairs, shape=list(shape), layout=layout)
            print(f"  {group} {tuple(shape)} {layout} done", flush=True)
    return rows


def bench_convs(shape, rounds: int, block_s: float, device) -> list[dict]:
    torch.manual_seed(0)
    c = shape[1]
    convs = {
        "nn.Conv2d": nn.Conv2d(c, c, 3, padding=1),
        "PWSConv2d": PWSConv2d(c, c, 3, padding=1),
        "WSConv2d": WSConv2d(c, c, 3, padding=1),
    }
    convs = {k: m.to(device) for k, m in convs.items()}
    x = torch.randn(shape, device=device).requires_grad_()
    g = torch.randn(shape, device=device)
    refs = {"PWSConv2d": "nn.Conv2d", "WSConv2d": "nn.Conv2d"}
    train = {k: _train_step(m.train(), x, g) for k, m in convs.items()}
    rows = _rows(
        "convolutions", interleaved(train, refs, rounds, block_s, device), refs, shape=list(shape), mode="train"
    )

    def infer(m):
        def run():
            with torch.no_grad():
                m(x)

        return run

    evals = {k: infer(m.eval()) for k, m in convs.items()}
    rows += _rows(
        "convolutions", interleaved(evals, refs, rounds, block_s, device), refs, shape=list(shape), mode="eval"
    )
    print("  convolutions done", flush=True)
    return rows


# ------------------------------------------------------------------------------------------------ whole networks
def _net_step(model: str, norm: str, width: float, batch: int, device):
    from normlab.nn import resolve_comparison
    from normlab.runner.models import build_model

    torch.manual_seed(0)
    n, c = resolve_comparison(norm)
    net = build_model(model, n, c, 3, 10, (3, 32, 32), width).to(device).train()
    opt = torch.optim.SGD(net.parameters(), lr=1e-4, momentum=0.9)
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def step():
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def bench_nets(width: float, batch: int, rounds: int, block_s: float, device, norms=("bn", "gn", "pws")) -> list:
    rows = []
    models = ("plain", "resnet")
    memory = peak_memory(models, norms, width, batch, device)
    for model in models:
        cases = {norm: _net_step(model, norm, width, batch, device) for norm in norms}
        res = interleaved(cases, {}, rounds, block_s, device, warmup=1)
        vs = {ref: pair_ratios(res, "pws", ref) for ref in ("bn", "gn")}
        for norm in norms:
            row = {
                "group": "whole step",
                "model": model,
                "norm": norm,
                "width": width,
                "batch": batch,
                "median_ms": res[norm]["median_ms"],
                "min_ms": res[norm]["min_ms"],
                "max_ms": res[norm]["max_ms"],
                "peak_mb": memory.get(f"{model}/{norm}"),
            }
            if norm == "pws":
                for ref in ("bn", "gn"):
                    row.update({f"vs_{ref}_{k}": vs[ref][f"ratio_{k}"] for k in ("min", "median", "max")})
                row["met"] = row["vs_bn_median"] <= 1.0 and row["vs_gn_median"] <= 1.0
            rows.append(row)
        print(f"  whole step {model} done", flush=True)
    return rows


def _rss_mb() -> tuple[float, float]:
    text = Path("/proc/self/status").read_text()
    rss, hwm = (int(re.search(rf"{k}:\s+(\d+) kB", text).group(1)) / 1024 for k in ("VmRSS", "VmHWM"))
    return rss, hwm


def _peak_here(step, device) -> float:
    """Peak memory (MB) one call of ``step`` adds on top of what is allocated before it (after a warm-up call)."""
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    base, _ = _rss_mb()
    step()
    return _rss_mb()[1] - base


def peak_memory(models, norms, width: float, batch: int, device) -> dict:
    """``{"model/norm": MB}``. CUDA: in this process. CPU: in one subprocess with glibc's mmap threshold fixed at
    64 KiB, so that every activation-sized buffer goes back to the OS when freed and the peak RSS of a step measures
    that step (in this process freed memory stays mapped and a later step would show no growth)."""
    pairs = [f"{m}/{n}" for m in models for n in norms]
    if device.type == "cuda":
        return {p: _peak_here(_net_step(*p.split("/"), width, batch, device), device) for p in pairs}
    if not Path("/proc/self/clear_refs").exists():
        return {}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, __file__, "--memory-only", ",".join(pairs), "--width", str(width), "--batch", str(batch)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------ device check
def check_fused_paths(device) -> str:
    """The fused BatchRenorm / SwitchableNorm paths against their composite formulas on ``device`` (float32)."""
    for fmt in LAYOUTS.values():
        x = (torch.randn(4, 8, 6, 5, device=device) * 2 + 1).contiguous(memory_format=fmt)
        g = torch.randn_like(x)
        for fn in (_renorm_pair, _switchable_pair):
            got, ref = fn(x, g, True), fn(x, g, False)
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    return "ok"


def _renorm_pair(x, g, fused: bool):
    c = x.shape[1]
    rm = torch.linspace(-1, 1, c, device=x.device)
    rv = torch.linspace(0.2, 4, c, device=x.device)
    w = torch.linspace(0.5, 1.5, c, device=x.device).requires_grad_()
    b = torch.linspace(-1, 1, c, device=x.device).requires_grad_()
    xx = x.clone().requires_grad_()
    y = NF.batch_renorm(xx, rm, rv, w, b, True, 0.1, 1e-3, 1.5, 0.5, fused=fused)
    y.backward(g)
    return y, xx.grad, w.grad, b.grad, rm, rv


def _switchable_pair(x, g, fused: bool):
    c = x.shape[1]
    params = [
        torch.tensor([0.3, -0.2, 0.1], device=x.device),
        torch.tensor([-0.1, 0.4, 0.0], device=x.device),
        torch.linspace(0.5, 1.5, c, device=x.device),
        torch.linspace(-1, 1, c, device=x.device),
    ]
    params = [p.requires_grad_() for p in params]
    rm, rv = torch.zeros(c, device=x.device), torch.ones(c, device=x.device)
    xx = x.clone().requires_grad_()
    y = NF.switchable_norm(xx, *params, rm, rv, training=True, fused=fused)
    y.backward(g)
    return [y, xx.grad, rm, rv] + [p.grad for p in params]


# ------------------------------------------------------------------------------------------------ report
def machine(device) -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
    }
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        found = re.search(r"model name\s*:\s*(.+)", cpuinfo.read_text())
        info["cpu"] = found.group(1).strip() if found else platform.processor()
    if hasattr(os, "getloadavg"):
        info["load_average"] = round(os.getloadavg()[0], 2)
    if device.type == "cuda":
        info.update(
            gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version()
        )
    return info


def _r(row: dict, prefix: str = "ratio") -> str:
    return " | ".join(f"{row[f'{prefix}_{k}']:.2f}" for k in ("min", "median", "max"))


def _met(row: dict) -> str:
    return "" if row.get("met") is None else ("yes" if row["met"] else "**no**")


def markdown(data: dict) -> str:
    m, cfg = data["machine"], data["config"]
    title = m.get("gpu", m.get("cpu", m["platform"]))
    lines = [
        f"## {m['device']}: {title}",
        "",
        f"torch {m['torch']}" + (f", CUDA {m['cuda']}" if "cuda" in m else "") + f", {m['threads']} thread(s), "
        f"{m['cpu_count']} CPU cores, load average {m.get('load_average', '?')} at the start; {data['date']}; "
        f"{cfg['rounds']} interleaved rounds per group ({data['wall_s']:.0f} s in all).",
        "",
        f"Command: `{data['command']}`",
        "",
        f"Fused BatchRenorm/SwitchableNorm paths checked against the composite formulas on this device: "
        f"{data['fused_check']}.",
        "",
    ]
    for group, rows in _by_group(data["rows"]).items():
        lines += _group_table(group, rows) + [""]
    return "\n".join(lines)


def _by_group(rows):
    out = {}
    for row in rows:
        out.setdefault(row["group"], []).append(row)
    return out


def _group_table(group: str, rows: list[dict]) -> list[str]:
    if group == "whole step":
        r0 = rows[0]
        out = [
            f"### Whole training step (SGD + cross entropy), width {r0['width']}, batch {r0['batch']}, 3x32x32",
            "",
            "| net | norm | median ms | min ms | PWS / BN (min, median, max) | PWS / GN (min, median, max) "
            "| peak MB (one step) | PWS <= BN and <= GN |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            vs = (
                (_r(r, "vs_bn").replace(" | ", ", "), _r(r, "vs_gn").replace(" | ", ", "))
                if r["norm"] == "pws"
                else ("", "")
            )
            peak = "" if r.get("peak_mb") is None else f"{r['peak_mb']:.0f}"
            out.append(
                f"| {r['model']} | {r['norm']} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | {vs[0]} | "
                f"{vs[1]} | {peak} | {_met(r)} |"
            )
        return out
    head = "mode" if group == "convolutions" else "layout"
    out = [
        f"### {group}: ratio = candidate time / reference time in the same round",
        "",
        f"| shape | {head} | candidate | reference | ratio min | median | max | target | met | candidate ms "
        f"| reference ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        target = "" if r["target"] is None else f"<= {r['target']:.2f}"
        out.append(
            f"| {tuple(r['shape'])} | {r.get('mode', r.get('layout'))} | {r['candidate']} | "
            f"{r['reference']} | {_r(r)} | {target} | {_met(r)} | {r['candidate_ms']:.3f} | "
            f"{r['reference_ms']:.3f} |"
        )
    return out


def write_results(path: Path, device: str, section: str) -> None:
    """Replace (or append) this device's section of ``path`` between its markers, keeping the rest."""
    start, end = f"<!-- bench_table:{device}:start -->", f"<!-- bench_table:{device}:end -->"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    block = f"{start}\n{section}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


# ------------------------------------------------------------------------------------------------ main
def _args(argv):
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--quick", action="store_true", help="small shapes, 3 rounds, no torch.compile: seconds")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds per group (default 7, quick 3)")
    p.add_argument(
        "--block-ms",
        type=float,
        default=None,
        help="target length of one timed block (default 60 ms on CPU, 20 ms on CUDA, quick 2 ms)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (CPU; default 1)")
    p.add_argument("--sections", default="layers,convs,nets,compile", help="comma-separated subset to run")
    p.add_argument("--out", default="runs/bench/bench_table.json", help="JSON results")
    p.add_argument("--results", default="", help="Markdown file whose section for this device is rewritten")
    p.add_argument("--memory-only", default="", help=argparse.SUPPRESS)
    p.add_argument("--width", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds is not None and args.rounds < 3:
        p.error("--rounds must be >= 3 (min / median / max of the per-round ratios)")
    return args


def run(args, device) -> list[dict]:
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    rounds = args.rounds or (3 if args.quick else 7)
    default_block = 2.0 if args.quick else (20.0 if device.type == "cuda" else 60.0)
    block_s = (args.block_ms or default_block) / 1e3
    rows = []
    if "layers" in sections:
        rows += bench_layers(QUICK_SHAPES if args.quick else LAYER_SHAPES, rounds, block_s, device)
    if "convs" in sections:
        rows += bench_convs((2, 8, 8, 8) if args.quick else (32, 64, 32, 32), rounds, block_s, device)
    if "nets" in sections:
        width, batch = (0.125, 4) if args.quick else (1.0, 64)
        rows += bench_nets(args.width or width, args.batch or batch, rounds, block_s, device)
    if "compile" in sections and not args.quick:
        rows += bench_layers([LAYER_SHAPES[0]], rounds, block_s, device, compiled=True)
    return rows


def main(argv=None) -> dict:
    args = _args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    if args.memory_only:  # internal: the CPU peak-memory subprocess ("model/norm,...")
        pairs = args.memory_only.split(",")
        print(
            json.dumps({p: _peak_here(_net_step(*p.split("/"), args.width, args.batch, device), device) for p in pairs})
        )
        return {}
    t0 = time.perf_counter()
    info = machine(device)
    fused = check_fused_paths(device)
    rows = run(args, device)
    command = " ".join(["python", "benchmarks/bench_table.py"] + (sys.argv[1:] if argv is None else list(argv)))
    data = {
        "machine": info,
        "fused_check": fused,
        "rows": rows,
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "config": {"rounds": args.rounds or (3 if args.quick else 7), "quick": args.quick, "sections": args.sections},
        "wall_s": time.perf_counter() - t0,
    }
    section = markdown(data)
    print(section)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1))
        print(f"wrote {out}")
    if args.results:
        write_results(Path(args.results), device.type + ("-quick" if args.quick else ""), section)
        print(f"updated {args.results}")
    return data


if __name__ == "__main__":
    main()
