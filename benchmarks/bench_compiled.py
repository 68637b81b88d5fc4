"""Compiled parity: every normlab layer and whole training steps under torch.compile, beside torch's own.

RL practitioners compile the whole update (torchrl's CrossQ: ``torch.compile(update)``), and fused normalization
kernels exist for GPUs only, so on a CPU the compiled route is the fast one. Side by side in one process, one
thread, interleaved (every sample times each case once, the order rotated per sample), ``--rounds`` rounds each the
median of ``--repeats`` samples; a ratio is candidate / reference within a round, reported as its median (min-max)
over the rounds. Every compiled pair starts from ``torch._dynamo.reset()`` and static shapes.

- ``layers``: forward + backward of one training step, every layer compiled with ``fullgraph=True`` beside the
  compiled torch layer it stands beside: BatchRenorm1d/2d/3d (the default schedule past its warm-up, step 30,000:
  renormalizing) and SwitchableNorm1d/2d/3d vs BatchNorm*d, SyncBatchRenorm vs SyncBatchNorm (one process),
  InstanceNorm*d vs InstanceNorm*d (affine), WSConv*d / PWSConv*d vs Conv*d (C -> C, 3x3 padding 1; 1x1 at the
  largest shapes), at (256, 256), (32, 64) (BatchRenorm1d only), their (N, C, L) and (N, C, D, H, W) analogues of
  (2, 64, 32, 32), (32, 64, 32, 32), (8, 256, 56, 56) (same number of values), contiguous and channels_last.
  Target: <= 1.10x.
- ``steps``: whole training steps, compiled as users compile them (``torch.compile(step)``, the backward a graph
  break) and eager: the CrossQ critic update with Adam (``bench_layers.py``'s, BatchRenorm1d vs BatchNorm1d) and a
  ResNet-18 step (torchvision's definition, no weights, 16 x 3 x 64 x 64, SGD) with BatchNorm against the same
  model converted by ``normlab.convert.convert_norm`` to BatchRenorm, SwitchableNorm and PWS. Target (compiled):
  <= 1.05x.

Runs can be split and merged (``--merge``: the rows of an earlier JSON at ``--out`` that this run did not measure
are kept); ``--results`` rewrites the ``bench_compiled:<device>`` section of RESULTS.md from all rows (``--render``:
from the JSON alone, measuring nothing).

    OMP_NUM_THREADS=1 python benchmarks/bench_compiled.py --out runs/bench/bench_compiled.json \
        --results benchmarks/RESULTS.md                                   # everything (about an hour on 1 CPU thread)
    ... --sections layers --ranks 2,4 --max-numel 300000 --merge          # a part, merged into the same JSON
    ... --quick                                                           # seconds per case: a smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import normlab.nn as L  # noqa: E402

PAST_WARMUP = 30_000
TARGETS = {"layers": 1.10, "steps": 1.05}
SHAPES = {
    2: [(256, 256), (32, 64)],
    3: [(2, 64, 1024), (32, 64, 1024), (8, 256, 3136)],
    4: [(2, 64, 32, 32), (32, 64, 32, 32), (8, 256, 56, 56)],
    5: [(2, 64, 4, 16, 16), (32, 64, 4, 16, 16), (8, 256, 4, 28, 28)],
}
QUICK_SHAPES = {2: [(8, 16)], 3: [(2, 8, 16)], 4: [(2, 8, 6, 6)], 5: [(2, 8, 3, 4, 4)]}
CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


# ------------------------------------------------------------------------------------------------ layers
def _brn(cls, c: int, device) -> nn.Module:
    m = cls(c, device=device)
    m.num_batches_tracked.fill_(PAST_WARMUP)
    return m


def _conv_kernel(shape) -> int:
    return 1 if math.prod(shape) > 4_000_000 else 3


def layer_groups(shape, device) -> list[tuple[str, dict[str, nn.Module]]]:
    """(group, {name: module}) for an input shape; the first module of a group is its reference."""
    rank, c = len(shape), shape[1]
    k = {2: 1, 3: 1, 4: 2, 5: 3}[rank]
    bn = {f"nn.BatchNorm{k}d": getattr(nn, f"BatchNorm{k}d")(c, device=device)}
    if rank == 2:
        return [("batchnorm", {**bn, "BatchRenorm1d": _brn(L.BatchRenorm1d, c, device)})]
    norms = {f"BatchRenorm{k}d": _brn(getattr(L, f"BatchRenorm{k}d"), c, device)}
    norms[f"SwitchableNorm{k}d"] = getattr(L, f"SwitchableNorm{k}d")(c, device=device)
    ks = _conv_kernel(shape)
    groups = [("batchnorm", {**bn, **norms})]
    if rank == 4:
        sync = {"nn.SyncBatchNorm": nn.SyncBatchNorm(c, device=device)}
        groups.append(("sync", {**sync, "SyncBatchRenorm": _brn(L.SyncBatchRenorm, c, device)}))
    groups.append(
        (
            "instancenorm",
            {
                f"nn.InstanceNorm{k}d": getattr(nn, f"InstanceNorm{k}d")(c, affine=True, device=device),
                f"InstanceNorm{k}d": getattr(L, f"InstanceNorm{k}d")(c, affine=True, device=device),
            },
        )
    )
    convs = {f"nn.Conv{k}d": getattr(nn, f"Conv{k}d")}
    convs.update({f"{p}Conv{k}d": getattr(L, f"{p}Conv{k}d") for p in ("WS", "PWS")})
    groups.append(("conv", {n: cls(c, c, ks, padding=ks // 2, device=device) for n, cls in convs.items()}))
    return groups


def _input(shape, layout: str, device):
    gen = torch.Generator().manual_seed(100)
    x = (torch.randn(shape, generator=gen) * 1.5 + 0.3).to(device)
    g = torch.randn(shape, generator=gen).to(device)
    if layout == "channels_last":
        fmt = CHANNELS_LAST[len(shape)]
        x, g = x.contiguous(memory_format=fmt), g.contiguous(memory_format=fmt)
    return x.requires_grad_(), g


def _train_step(module, x, g):
    params = list(module.parameters())

    def step():
        x.grad = None
        for p in params:
            p.grad = None
        module(x).backward(g)

    return step


def _time_group(steps: dict, args, sync) -> dict[str, list[float]]:
    clock = common.CLOCKS[args.clock]
    iters = {n: common.calibrate(fn, args.block_ms / 1e3, clock, sync) for n, fn in steps.items()}
    return common.interleaved(steps, args.rounds, args.repeats, iters, clock, sync)


def _rows(section: str, times: dict, reference: str, load: list, **fields) -> list[dict]:
    rows = []
    for name in times:
        if name == reference:
            continue
        r = common.ratios(times, name, reference)
        rows.append(
            {
                "section": section,
                **fields,
                "candidate": name,
                "reference": reference,
                "candidate_us": 1e6 * statistics.median(times[name]),
                "reference_us": 1e6 * statistics.median(times[reference]),
                "ratio": r,
                "target": TARGETS[section],
                "met": r["median"] <= TARGETS[section],
                "load": load,
            }
        )
    return rows


def bench_layers(args, device) -> list[dict]:
    sync, rows = common.synchronizer(device), []
    shapes = QUICK_SHAPES if args.quick else SHAPES
    for rank in args.ranks:
        for shape in shapes[rank]:
            if args.max_numel and math.prod(shape) > args.max_numel:
                continue
            for layout in ["contiguous"] + (["channels_last"] if rank in CHANNELS_LAST else []):
                for _group, modules in layer_groups(shape, device):
                    torch._dynamo.reset()
                    x, g = _input(shape, layout, device)
                    load = [common.load()]
                    steps = {n: _train_step(torch.compile(m, fullgraph=True, dynamic=False), x, g)
                             for n, m in modules.items()}  # fmt: skip
                    times = _time_group(steps, args, sync)
                    load.append(common.load())
                    new = _rows("layers", times, next(iter(modules)), load, shape=list(shape), layout=layout)
                    rows += new
                    for r in new:
                        print(_line(r), flush=True)
    return rows


def _line(r: dict) -> str:
    where = f"{tuple(r['shape'])} {r['layout']}" if "shape" in r else f"{r['model']} {r['mode']}"
    return (
        f"{r['section']:7s} {where:36s} {r['candidate']:20s} {r['candidate_us']:10.1f} us  "
        f"x{common.fmt_ratio(r['ratio'])} {r['reference']}  (load {r['load'][0]}-{r['load'][1]})"
    )


# ------------------------------------------------------------------------------------------------ whole steps
def crossq_steps(device, compiled: bool) -> dict:
    """The CrossQ critic update of ``bench_layers.py`` (Adam), BatchNorm1d vs BatchRenorm1d past its warm-up."""
    common.importable()
    import bench_layers

    gen = torch.Generator().manual_seed(101)
    batch = [torch.randn(256, k, generator=gen).to(device) for k in (17, 6, 1, 17, 6)]
    norms = {
        "nn.BatchNorm1d": lambda c: nn.BatchNorm1d(c, device=device),
        "BatchRenorm1d": lambda c: _brn(L.BatchRenorm1d, c, device),
    }
    steps = {}
    for name, norm in norms.items():
        torch.manual_seed(102)
        step = bench_layers._crossq_step(bench_layers._critic(norm).to(device), batch)
        steps[name] = torch.compile(step) if compiled else step
    return steps


def resnet_models(arch: str, shape, device) -> dict[str, nn.Module]:
    """torchvision's ``arch`` (no weights) with BatchNorm, and converted to BatchRenorm (past its warm-up),
    SwitchableNorm and PWS by :func:`normlab.convert.convert_norm`."""
    import torchvision

    from normlab.convert import convert_norm

    torch.manual_seed(103)
    base = getattr(torchvision.models, arch)(weights=None, num_classes=10)
    example = torch.randn(2, *shape[1:])
    models = {"BatchNorm": base}
    for name, to in (("BatchRenorm", "brn"), ("SwitchableNorm", "sn"), ("PWS", "pws")):
        models[name] = convert_norm(base, to=to, inplace=False, example_input=example)
    for m in models["BatchRenorm"].modules():
        if isinstance(m, L.BATCH_RENORM_TYPES):
            m.num_batches_tracked.fill_(PAST_WARMUP)
    return {n: m.to(device).train() for n, m in models.items()}


def sgd_step(model: nn.Module, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def bench_steps(args, device) -> list[dict]:
    sync, rows = common.synchronizer(device), []
    shape = (2, 3, 32, 32) if args.quick else (16, 3, 64, 64)
    for mode in ("eager", "compiled"):
        torch._dynamo.reset()
        load = [common.load()]
        times = _time_group(crossq_steps(device, mode == "compiled"), args, sync)
        load.append(common.load())
        rows += _rows("steps", times, "nn.BatchNorm1d", load, model="CrossQ critic (Adam)", mode=mode)
        torch._dynamo.reset()
        gen = torch.Generator().manual_seed(104)
        x = torch.randn(shape, generator=gen).to(device)
        y = torch.randint(0, 10, (shape[0],), generator=gen).to(device)
        steps = {n: sgd_step(m, x, y) for n, m in resnet_models(args.resnet, shape, device).items()}
        if mode == "compiled":
            steps = {n: torch.compile(s) for n, s in steps.items()}
        load = [common.load()]
        times = _time_group(steps, args, sync)
        load.append(common.load())
        model = f"{args.resnet} {'x'.join(map(str, shape))} (SGD)"
        rows += _rows("steps", times, "BatchNorm", load, model=model, mode=mode)
        for r in rows[-4:]:
            print(_line(r), flush=True)
    return rows


# ------------------------------------------------------------------------------------------------ report
def _key(row: dict) -> tuple:
    return (
        row["section"],
        str(row.get("shape", row.get("model"))),
        row.get("layout", row.get("mode")),
        row["candidate"],
    )


def merge(old: dict, new_rows: list[dict], run: dict) -> dict:
    """Rows of ``old`` not measured again, then the new ones; the runs that measured them."""
    measured = {_key(r) for r in new_rows}
    rows = [r for r in old.get("rows", []) if _key(r) not in measured] + new_rows
    return {"runs": old.get("runs", []) + [run], "rows": rows}


def markdown(data: dict) -> str:
    lines = ["### torch.compile: every layer and whole training steps beside torch's (bench_compiled.py)", ""]
    for run in data["runs"]:
        lines.append(
            f"- {run['date']}: `{run['command']}`; {common.describe(run['machine'])}; clock {run['clock']}; "
            f"{run['rounds']} rounds x {run['repeats']} samples; load average {run['machine']['load_average']} at "
            f"the start; {run['wall_s']:.0f} s."
        )
    lines += ["", "Ratio = candidate / reference in the same round: median (min-max) over the rounds.", ""]
    head = ["shape", "layout", "candidate", "reference", "ratio", "target", "met", "candidate us", "reference us"]
    layer_rows = [r for r in data["rows"] if r["section"] == "layers"]
    body = [_cells(r, (tuple(r["shape"]), r["layout"])) for r in sorted(layer_rows, key=_order)]
    lines += ["#### Single layers, compiled with fullgraph=True, forward + backward", ""]
    lines += common.table(head + ["load"], body) + [""]
    step_rows = [r for r in data["rows"] if r["section"] == "steps"]
    lines += ["#### Whole training steps (`torch.compile(step)` and eager)", ""]
    body = [_cells(r, (r["model"], r["mode"])) for r in step_rows]
    lines += common.table(["model", "mode"] + head[2:] + ["load"], body)
    return "\n".join(lines)


def _order(r: dict):
    return (len(r["shape"]), math.prod(r["shape"]), r["shape"], r["layout"] != "contiguous", r["reference"])


def _cells(r: dict, where: tuple) -> list:
    met = "yes" if r["met"] else "**no**"
    if r["section"] == "steps" and r["mode"] == "eager":
        met = "-"  # the target is the compiled step's
    return [
        *where,
        r["candidate"],
        r["reference"],
        common.fmt_ratio(r["ratio"]),
        f"<= {r['target']:.2f}",
        met,
        f"{r['candidate_us']:.0f}",
        f"{r['reference_us']:.0f}",
        f"{r['load'][0]}-{r['load'][1]}",
    ]


# ------------------------------------------------------------------------------------------------ main
def _args(argv):
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sections", default="layers,steps", help="comma-separated: layers, steps")
    p.add_argument("--ranks", default="2,3,4,5", help="input ranks of the layers section (2: (N, C), 4: 2d, ...)")
    p.add_argument("--max-numel", type=int, default=0, help="skip layer shapes with more values (0: none)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="samples per round (the round's value is their median)")
    p.add_argument("--block-ms", type=float, default=20.0, help="length of one sample")
    p.add_argument("--clock", choices=sorted(common.CLOCKS), default="wall", help="cpu: the thread's CPU time")
    p.add_argument("--resnet", default="resnet18", help="torchvision model of the steps section")
    p.add_argument("--quick", action="store_true", help="tiny shapes, 3 rounds of 1 sample: a smoke test")
    p.add_argument("--out", default="runs/bench/bench_compiled.json")
    p.add_argument("--merge", action="store_true", help="keep the rows of --out that this run does not measure")
    p.add_argument("--results", default="", help="RESULTS.md whose bench_compiled section is rewritten")
    p.add_argument("--render", action="store_true", help="measure nothing: rewrite --results from the JSON at --out")
    args = p.parse_args(argv)
    args.ranks = [int(r) for r in args.ranks.split(",")]
    if args.quick:
        args.rounds, args.repeats, args.block_ms = 3, 1, 1.0
    return args


def main(argv=None) -> dict:
    args = _args(argv)
    device = torch.device(args.device)
    if args.render:
        data = json.loads(Path(args.out).read_text())
        common.write_section(Path(args.results), f"bench_compiled:{device.type}", markdown(data))
        return data
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    info = common.machine(device)
    sections = {s.strip() for s in args.sections.split(",")}
    rows = (bench_layers(args, device) if "layers" in sections else []) + (
        bench_steps(args, device) if "steps" in sections else []
    )
    run = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": common.command("bench_compiled.py", argv),
        "machine": info,
        "clock": args.clock,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "wall_s": time.perf_counter() - t0,
    }
    out = Path(args.out)
    old = json.loads(out.read_text()) if args.merge and out.exists() else {}
    data = merge(old, rows, run)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    if args.results:
        common.write_section(Path(args.results), f"bench_compiled:{device.type}", markdown(data))
    return data


if __name__ == "__main__":
    main()
