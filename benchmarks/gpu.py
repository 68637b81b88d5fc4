"""The GPU run in one command: under 8 minutes on one CUDA device, one JSON file and one RESULTS.md section.

    python benchmarks/gpu.py --out runs/bench/gpu.json --results benchmarks/RESULTS.md
    python benchmarks/gpu.py --smoke --device cpu --out /tmp/gpu.json    # seconds: the code path on a CPU (make test)

Sections, in the order they run (each timed side by side in one process, interleaved, the device synchronized
around every sample; a ratio is candidate / reference within a round, median (min-max) over ``--rounds`` rounds):

1. ``readbacks``: device-to-host reads of one training step (forward + backward) and one eval step of every layer
   (BatchRenorm1d/2d/3d, SyncBatchRenorm on one process, SwitchableNorm, InstanceNorm, WSConv/PWSConv, every dim),
   counted two ways: the aten ops that copy a value to the host (``_local_scalar_dense``, ``is_nonzero``, ``item``,
   ``equal``, a copy to the CPU: what ``tests/test_readbacks.py`` counts on the CPU) and, on CUDA, the
   synchronizations ``torch.cuda.set_sync_debug_mode("warn")`` reports. torch's layers make none.
2. ``layers``: every layer against the torch layer it stands beside (bench_compiled.py's groups) at (256, 256),
   (32, 64), (32, 64, 32, 32), (8, 256, 56, 56), (32, 64, 4, 16, 16), contiguous and channels_last, forward +
   backward, eager, in float32 and in bfloat16 (bf16 input under ``torch.autocast``).
3. ``steps``: the CrossQ critic update (Adam; BatchRenorm1d vs BatchNorm1d) eager and ``torch.compile(step)``, and a
   ResNet-50 training step (torchvision's definition, no weights, 64 x 3 x 224 x 224, channels_last, SGD) with
   BatchNorm against the same model converted to BatchRenorm, SwitchableNorm and PWS, eager in float32 and bf16
   autocast; compiled if time is left.
4. ``monitor``: the default ``VarianceMonitor`` (every=10, the default rules) against the unmonitored step on the
   collapse benchmark's GPT and on ResNet-50.
5. ``compiled``: a subset of the layer pairs compiled (``fullgraph=True``), both dtypes, with the time left.

Before each compiled or long case the script checks a time budget (``--budget-s``, default 360 s, so that the run
with its imports and its last case stays under 8 minutes) and records what it skipped. ``--smoke``: tiny shapes,
one round, ResNet-18 at 64 x 64 instead of ResNet-50, compiled cases with the ``aot_eager`` backend (no kernels
generated): a test of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_compiled  # noqa: E402
import common  # noqa: E402
import count_ops  # noqa: E402

aten = torch.ops.aten
READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.item.default, aten.equal.default}
LAYER_SHAPES = [(256, 256), (32, 64), (32, 64, 32, 32), (8, 256, 56, 56), (32, 64, 4, 16, 16)]
SMOKE_SHAPES = [(8, 16), (2, 8, 6, 6)]
COMPILED = [  # (shape, layout, group) compiled in both dtypes
    ((256, 256), "contiguous", "batchnorm"),
    ((32, 64), "contiguous", "batchnorm"),
    ((32, 64, 32, 32), "contiguous", "batchnorm"),
    ((32, 64, 32, 32), "channels_last", "batchnorm"),
    ((32, 64, 32, 32), "contiguous", "instancenorm"),
    ((32, 64, 32, 32), "channels_last", "conv"),
    ((8, 256, 56, 56), "channels_last", "batchnorm"),
]
SMOKE_COMPILED = [((8, 16), "contiguous", "batchnorm"), ((2, 8, 6, 6), "channels_last", "batchnorm")]
READBACK_SHAPES = {2: (8, 4), 3: (4, 4, 6), 4: (4, 4, 5, 6), 5: (4, 4, 3, 4, 5)}


class _Budget:
    """The run's deadline: ``left()`` seconds remain; ``skip(what)`` records a case not run for lack of time."""

    def __init__(self, seconds: float):
        self.deadline = time.perf_counter() + seconds
        self.skipped: list[str] = []

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def allows(self, what: str, needs_s: float) -> bool:
        if self.left() >= needs_s:
            return True
        self.skipped.append(what)
        print(f"  skipped (time budget): {what}", flush=True)
        return False


# ------------------------------------------------------------------------------------------------ 1. read-backs
class _HostReads(TorchDispatchMode):
    """Counts the aten ops that copy a device value to the host."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        to_host = func is aten._to_copy.default and str((kwargs or {}).get("device", "")) == "cpu"
        if func in READS or (to_host and args[0].device.type != "cpu"):
            self.n += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _count_syncs(device: torch.device):
    """``[host reads, synchronizations]`` of the block (the second only on CUDA, else None)."""
    counts = [0, None]
    with warnings.catch_warnings(record=True) as caught, _HostReads() as reads:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    counts[0] = reads.n
    if device.type == "cuda":
        counts[1] = sum("synchroniz" in str(w.message) for w in caught)


def readback_rows(device: torch.device) -> list[dict]:
    """Host reads of one training and one eval step of every layer (count_ops.py's cases and references)."""
    rows, seen = [], set()
    for name, make, ref_name, make_ref, rank, layout in count_ops.cases():
        shape = READBACK_SHAPES[rank]
        for label, factory in ((name, make), (ref_name, make_ref)):
            if (label, rank, layout) in seen:
                continue
            seen.add((label, rank, layout))
            m = factory(shape[1]).to(device)
            x = count_ops._input(shape, layout).detach().to(device).requires_grad_()
            for _ in range(2):
                m(x).backward(torch.ones_like(x))
            with _count_syncs(device) as train:
                m(x).backward(torch.ones_like(x))
                common.synchronizer(device)()
            m.eval()
            with torch.no_grad(), _count_syncs(device) as ev:
                m(x)
            row = {"layer": label, "shape": list(shape), "layout": layout, "train": train, "eval": ev}
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------ 2. layers
def _autocast(device: torch.device, dtype: str):
    if dtype == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _layer_step(module, x, g, device, dtype):
    params = list(module.parameters())

    def step():
        x.grad = None
        for p in params:
            p.grad = None
        with _autocast(device, dtype):
            y = module(x)
        y.backward(g)

    return step


def layer_rows(args, device, budget: _Budget, compiled: bool) -> list[dict]:
    rows = []
    cases = [(s, lay, None) for s in args.layer_shapes for lay in _layouts(s)]
    if compiled:
        cases = args.compiled_cases
    for shape, layout, only in cases:
        for group, modules in bench_compiled.layer_groups(shape, device):
            if only is not None and group != only:
                continue
            what = f"{'compiled' if compiled else 'eager'} {group} {shape} {layout}"
            if not budget.allows(what, 60 if compiled else 10):
                continue
            rows += _layer_group(args, device, shape, layout, modules, compiled)
    return rows


def _layouts(shape) -> list[str]:
    return ["contiguous"] + (["channels_last"] if len(shape) in (4, 5) else [])


def _layer_group(args, device, shape, layout, modules: dict, compiled: bool) -> list[dict]:
    rows = []
    for dtype in ("float32", "bfloat16"):
        torch._dynamo.reset()
        x, g = bench_compiled._input(shape, layout, device)
        if dtype == "bfloat16":
            x, g = x.detach().to(torch.bfloat16).requires_grad_(), g.to(torch.bfloat16)
        mods = {
            n: torch.compile(m, fullgraph=True, backend=args.backend) if compiled else m for n, m in modules.items()
        }
        steps = {n: _layer_step(m, x, g, device, dtype) for n, m in mods.items()}
        times, load = _timed(steps, args, device)
        mode = "compiled" if compiled else "eager"
        for r in bench_compiled._rows("layers", times, next(iter(modules)), load, shape=list(shape), layout=layout):
            rows.append({**r, "mode": mode, "dtype": dtype})
            print(f"  {mode:8s} {dtype:8s} {bench_compiled._line(r)}", flush=True)
    return rows


def _timed(steps: dict, args, device):
    sync, clock = common.synchronizer(device), common.CLOCKS["wall"]
    load = [common.load()]
    iters = {n: common.calibrate(fn, args.block_ms / 1e3, clock, sync) for n, fn in steps.items()}
    times = common.interleaved(steps, args.rounds, args.repeats, iters, clock, sync)
    return times, load + [common.load()]


# ------------------------------------------------------------------------------------------------ 3. steps
def step_rows(args, device, budget: _Budget) -> list[dict]:
    rows = []
    for mode in ("eager", "compiled"):
        if mode == "compiled" and not budget.allows("compiled CrossQ critic update", 90):
            continue
        torch._dynamo.reset()
        steps = bench_compiled.crossq_steps(device, False)
        if mode == "compiled":
            steps = {n: torch.compile(s, backend=args.backend) for n, s in steps.items()}
        times, load = _timed(steps, args, device)
        new = bench_compiled._rows("steps", times, "nn.BatchNorm1d", load, model="CrossQ critic (Adam)", mode=mode)
        rows += [{**r, "dtype": "float32"} for r in new]
    for mode, dtype in args.resnet_modes:
        what = f"{mode} {args.resnet} step ({dtype})"
        if not budget.allows(what, 300 if mode == "compiled" else 30):
            continue
        rows += _resnet_rows(args, device, mode, dtype)
    for r in rows:
        print(f"  {r['dtype']:8s} {bench_compiled._line(r)}", flush=True)
    return rows


def _resnet_rows(args, device, mode: str, dtype: str) -> list[dict]:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(104)
    x = torch.randn(args.resnet_shape, generator=gen).to(device)
    y = torch.randint(0, 10, (args.resnet_shape[0],), generator=gen).to(device)
    models = bench_compiled.resnet_models(args.resnet, args.resnet_shape, device)
    if device.type == "cuda":
        models = {n: m.to(memory_format=torch.channels_last) for n, m in models.items()}
        x = x.contiguous(memory_format=torch.channels_last)
    steps = {n: _amp_step(m, x, y, device, dtype) for n, m in models.items()}
    if mode == "compiled":
        steps = {n: torch.compile(s, backend=args.backend) for n, s in steps.items()}
    times, load = _timed(steps, args, device)
    model = f"{args.resnet} {'x'.join(map(str, args.resnet_shape))} (SGD)"
    return [
        {**r, "dtype": dtype} for r in bench_compiled._rows("steps", times, "BatchNorm", load, model=model, mode=mode)
    ]


def _amp_step(model, x, y, device, dtype: str):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step():
        with _autocast(device, dtype):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


# ------------------------------------------------------------------------------------------------ 4. monitor
def monitor_rows(args, device, budget: _Budget) -> list[dict]:
    import bench_monitor

    from normlab.monitor import VarianceMonitor

    rows = []
    for name, batch, size in args.monitor_models:
        if not budget.allows(f"monitor on {name}", 40):
            continue
        torch.manual_seed(105)
        try:
            base, source, shape = bench_monitor.make_model(name, "bn", 3, size, 0.25)
        except ImportError as e:  # the GPT is the lab's (pip install -e ./lab, as make setup does)
            budget.skipped.append(f"monitor on {name} ({e})")
            continue
        steps, monitors = {}, []
        for variant in ("unmonitored", "every=10 (default)"):
            model = _clone(base).to(device).train()
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            if variant != "unmonitored":
                monitors.append(VarianceMonitor(model, optimizer=opt))  # records through the optimizer's step hooks
            steps[variant] = _monitored_step(model, opt, name, shape, batch, device)
        times, load = _timed(steps, args, device)
        new = bench_compiled._rows("steps", times, "unmonitored", load, model=source, mode=f"batch {batch}")
        rows += [{**r, "dtype": "float32", "target": 1.10, "met": r["ratio"]["median"] <= 1.10} for r in new]
        print(f"  monitor {bench_compiled._line(rows[-1])}", flush=True)
    return rows


def _clone(model):
    import copy

    return copy.deepcopy(model)


def _monitored_step(model, opt, name: str, shape, batch: int, device):
    gen = torch.Generator().manual_seed(106)
    if name == "gpt":
        tokens = torch.randint(0, 96, (batch, shape[0] + 1), generator=gen).to(device)
        x, y = tokens[:, :-1], tokens[:, 1:]
    else:
        x = torch.randn(batch, *shape, generator=gen).to(device)
        y = torch.randint(0, 1000, (batch,), generator=gen).to(device)

    def step():
        out = model(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()  # an attached monitor records through the optimizer's step hooks

    return step


# ------------------------------------------------------------------------------------------------ report
def markdown(data: dict) -> str:
    m = data["machine"]
    lines = [
        "### GPU run (benchmarks/gpu.py)" + (" - SMOKE TEST, not a measurement" if data["smoke"] else ""),
        "",
        f"{data['date']}: `{data['command']}`; {common.describe(m)}; load average {m['load_average']} at the start; "
        f"{data['rounds']} rounds x {data['repeats']} samples; {data['wall_s']:.0f} s.",
        "",
        "Host reads per step (aten read-back ops / CUDA synchronizations reported by the sync debug mode) of "
        "a training step (forward + backward) and an eval step:",
        "",
    ]
    zero = [r for r in data["readbacks"] if r["train"][0] == r["eval"][0] == 0 and not (r["train"][1] or r["eval"][1])]
    others = [r for r in data["readbacks"] if r not in zero]
    if zero:
        names = sorted({f"{r['layer']} ({r['layout']})" for r in zero})
        lines += [f"- none in {len(zero)} of {len(data['readbacks'])} cases: " + ", ".join(names) + ".", ""]
    if others:
        body = [[r["layer"], tuple(r["shape"]), r["layout"], _reads(r["train"]), _reads(r["eval"])] for r in others]
        lines += common.table(["layer", "shape", "layout", "training step", "eval step"], body) + [""]
    head = ["mode", "dtype", "where", "candidate", "reference", "ratio", "target", "candidate us", "reference us"]
    body = [
        [r["mode"], r["dtype"], f"{tuple(r['shape'])} {r['layout']}" if "shape" in r else r["model"], r["candidate"],
         r["reference"], common.fmt_ratio(r["ratio"]), f"<= {r['target']:.2f}", f"{r['candidate_us']:.0f}",
         f"{r['reference_us']:.0f}"]
        for r in data["layers"] + data["steps"] + data["monitor"]
    ]  # fmt: skip
    lines += ["Layers, whole steps and the monitor (ratio = candidate / reference in the same round):", ""]
    lines += common.table(head, body)
    if data["skipped"]:
        lines += ["", "Skipped for the time budget: " + "; ".join(data["skipped"]) + "."]
    return "\n".join(lines)


def _reads(counts) -> str:
    return f"{counts[0]} / {'-' if counts[1] is None else counts[1]}"


def _args(argv):
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one round: a test of the script")
    p.add_argument("--sections", default="readbacks,layers,compiled,steps,monitor")
    p.add_argument("--budget-s", type=float, default=360.0, help="skip compiled and long cases after this")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--block-ms", type=float, default=20.0)
    p.add_argument("--out", default="runs/bench/gpu.json")
    p.add_argument("--results", default="", help="RESULTS.md whose gpu section is rewritten")
    args = p.parse_args(argv)
    args.backend = "aot_eager" if args.smoke else "inductor"
    args.layer_shapes = SMOKE_SHAPES if args.smoke else LAYER_SHAPES
    args.compiled_cases = SMOKE_COMPILED if args.smoke else COMPILED
    args.resnet, args.resnet_shape = ("resnet18", (2, 3, 64, 64)) if args.smoke else ("resnet50", (64, 3, 224, 224))
    args.resnet_modes = [("eager", "float32"), ("eager", "bfloat16"), ("compiled", "float32")]
    if args.smoke:  # the compiled step's path is the CrossQ update's
        args.resnet_modes = [("eager", "bfloat16")]
    args.monitor_models = (
        [("gpt", 2, 16), ("resnet50", 2, 64)] if args.smoke else [("gpt", 8, 16), ("resnet50", 32, 224)]
    )
    if args.smoke:
        args.rounds, args.repeats, args.block_ms = 1, 1, 1.0
    return args


def main(argv=None) -> dict:
    args = _args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    sections, t0, budget = set(args.sections.split(",")), time.perf_counter(), _Budget(args.budget_s)
    data = {"machine": common.machine(device), "smoke": args.smoke, "rounds": args.rounds, "repeats": args.repeats}
    parts = {  # in order of priority: the compiled layers take what time is left
        "readbacks": lambda: readback_rows(device),
        "layers": lambda: layer_rows(args, device, budget, False),
        "steps": lambda: step_rows(args, device, budget),
        "monitor": lambda: monitor_rows(args, device, budget),
        "compiled": lambda: layer_rows(args, device, budget, True),
    }
    data["section_s"] = {}
    for name, run in parts.items():
        t = time.perf_counter()
        data[name] = run() if name in sections else []
        data["section_s"][name] = round(time.perf_counter() - t, 1)
        print(f"== {name}: {data['section_s'][name]} s", flush=True)
    data["layers"] += data.pop("compiled")
    data.update(
        skipped=budget.skipped,
        wall_s=time.perf_counter() - t0,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command=common.command("gpu.py", argv),
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    print(f"wrote {out} ({data['wall_s']:.0f} s)")
    if args.results:
        key = f"gpu:{device.type}" + ("-smoke" if args.smoke else "")
        common.write_section(Path(args.results), key, markdown(data))
    return data


if __name__ == "__main__":
    main()
