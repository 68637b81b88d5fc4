"""Overhead of VarianceMonitor, side by side in one run (issue 3 target: every=10 within 1.10x of the unmonitored
training step; issue 19 targets with the countdown fed every step: <= 1.15x on plain1d, <= 1.5x on ResNet-50 at
batch 8).

Identical models (same init) train on the same random batches: unmonitored; ``every=10`` with the default rules but
the countdown on recorded steps only (``CountdownRule(every_step=False)``: full records every 10 steps, the countdown
reads only them); ``every=10`` (the default: full records every 10 steps and the light per-step path that feeds the
countdown every step); ``every=1`` (a full record every step).
Timing blocks of ``--steps`` training steps (forward, backward, optimizer step) are interleaved across the
variants (the order rotates every repeat); reported: the per-step median over repeats, its ratio to the
unmonitored median, and the min / median / max of the per-round ratios (variant / unmonitored in the same round).

    .venv/bin/python benchmarks/bench_monitor.py --out runs/bench_monitor.json                 # the plain net
    .venv/bin/python benchmarks/bench_monitor.py --model plain1d --width 0.5 --batch-size 128  # the demo's net
    .venv/bin/python benchmarks/bench_monitor.py --model resnet50 --size 224 --batch-size 8 --steps 10 --repeats 3
    .venv/bin/python benchmarks/bench_monitor.py --model gpt --batch-size 8 --probes   # the collapse benchmark's GPT

``--probes`` adds the variant ``every=10 + probes``: the default monitor plus the transformer probes
(``VarianceMonitor(probes=True)``: the probes run on the recorded steps only). ``--model gpt`` is the collapse
benchmark's pre-LN character-level GPT (``normlab_lab.collapse_bench.setups.CharGPT``: d 64, 2 layers, context 64) on
random token ids (the lab is installed beside normlab by ``make setup``).

The machine may be shared with other jobs: compare the ratios, not absolute times, and rerun if noisy.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from normlab.monitor import VarianceMonitor  # noqa: E402
from normlab.monitor.rules import CountdownRule, FactorRule, RegimeRule  # noqa: E402
from normlab.runner.models import build_model  # noqa: E402

VARIANTS = {  # name: VarianceMonitor arguments, made fresh per model (None: unmonitored)
    "unmonitored": None,
    "every=10 records only": lambda: {
        "every": 10,
        "rules": [FactorRule(), RegimeRule(), CountdownRule(every_step=False)],
    },
    "every=10 (default)": lambda: {"every": 10},
    "every=1": lambda: {"every": 1},
}


def _model_name(text: str) -> str:
    if text in ("plain", "plain1d", "resnet50", "gpt") or (text.startswith("timm:") and len(text) > 5):
        return text
    raise argparse.ArgumentTypeError(f"expected plain, plain1d, resnet50, gpt or timm:<name>, got {text!r}")


def make_model(name: str, norm: str, in_channels: int, size: int, width: float) -> tuple[nn.Module, str, tuple]:
    """The model, its description and the shape of one input (without the batch dim)."""
    if name.startswith("timm:"):  # a timm model definition, built without weights (the test extra installs timm)
        import timm

        arch = name.split(":", 1)[1]
        return timm.create_model(arch, pretrained=False), f"timm.create_model('{arch}')", (3, size, size)
    if name == "gpt":
        from normlab_lab.collapse_bench.setups import CONTEXT, CharGPT

        return CharGPT(96), "normlab_lab.collapse_bench.setups.CharGPT(96)", (CONTEXT,)
    if name == "resnet50":
        import torchvision

        return torchvision.models.resnet50(weights=None), "torchvision.models.resnet50(weights=None)", (3, size, size)
    if name == "plain1d":
        model = build_model(
            "plain1d", norm=norm, conv="conv", in_channels=1, num_classes=10, input_shape=(1, 40), width=width
        )
        return model, "normlab.runner.models.build_model('plain1d')", (1, 40)
    model = build_model(
        "plain",
        norm=norm,
        conv="conv",
        in_channels=in_channels,
        num_classes=10,
        input_shape=(in_channels, size, size),
        width=width,
    )
    return model, "normlab.runner.models.build_model('plain')", (in_channels, size, size)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="plain", type=_model_name, help="plain, plain1d, resnet50 or timm:<name>")
    p.add_argument("--norm", default="bn", help="norm of the plain nets (none, bn, ...)")
    p.add_argument("--width", type=float, default=0.25)
    p.add_argument("--size", type=int, default=16, help="input height = width (plain: >= 12; plain1d: fixed 40)")
    p.add_argument("--channels", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=20, help="steps per timing block (a multiple of 10)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("runs/bench_monitor.json"))
    p.add_argument("--probes", action="store_true", help="add the variant every=10 + probes")
    p.add_argument("--results", default="", help="RESULTS.md: rewrite this model's bench_monitor section")
    p.add_argument(
        "--clock",
        choices=sorted(common.CLOCKS),
        default="wall",
        help="wall: elapsed time; cpu: the thread's CPU time (leaves out the time spent waiting for a core on a "
        "shared machine; one thread only)",
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        help="instead of timing: run this many steps of the unmonitored and the default variant under cProfile and "
        "torch.profiler and print where the default monitor's time goes (its functions, and the aten ops it adds)",
    )
    args = p.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        p.error("--clock cpu measures the calling thread only: use it with --threads 1")
    clock = common.CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base, source, shape = make_model(args.model, args.norm, args.channels, args.size, args.width)
    classes = 1000 if args.model == "resnet50" or args.model.startswith("timm:") else 10
    gen = torch.Generator().manual_seed(0)
    if args.model == "gpt":
        data = [(t[:, :-1], t[:, 1:]) for t in (torch.randint(0, 96, (args.batch_size, shape[0] + 1), generator=gen)
                                                for _ in range(args.steps))]  # fmt: skip
    else:
        data = [
            (
                torch.randn(args.batch_size, *shape, generator=gen),
                torch.randint(0, classes, (args.batch_size,), generator=gen),
            )
            for _ in range(args.steps)
        ]
    specs = dict(VARIANTS)
    if args.probes:
        specs["every=10 + probes"] = lambda: {"every": 10, "probes": True}

    variants = {}
    for name, kwargs in specs.items():
        model = copy.deepcopy(base).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
        mon = VarianceMonitor(model, optimizer=opt, **kwargs()) if kwargs else None
        variants[name] = (model, opt, mon)

    def run_block(model, opt, mon, batches=data) -> float:
        t0 = clock()
        for x, y in batches:
            out = model(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()  # an attached monitor records through the optimizer's step hooks
        return (clock() - t0) / len(batches)

    if args.profile:
        steps = (data * (args.profile // len(data) + 1))[: args.profile]
        profile(lambda v, batches: run_block(*variants[v], batches=batches), steps, source)
        return 0
    load_before = os.getloadavg()[0]  # the machine may be shared: its load is part of the result
    for v in variants.values():  # warm-up: 2 steps (the first is a recording step of every monitor)
        run_block(*v, batches=data[:2])
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(args.repeats):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            times[k].append(run_block(*variants[k]))
    load = [load_before, os.getloadavg()[0]]
    med = {k: statistics.median(v) for k, v in times.items()}
    ref = med["unmonitored"]
    rounds = {k: sorted(a / b for a, b in zip(times[k], times["unmonitored"])) for k in names}
    print(
        f"{source}, norm {args.norm if args.model in ('plain', 'plain1d') else '(its own)'}, width {args.width}, input "
        f"{'x'.join(map(str, shape))}, batch {args.batch_size}, {args.threads} thread(s), {args.repeats} interleaved "
        f"repeats of {args.steps} steps; load average {load[0]:.1f} before, {load[1]:.1f} after"
    )
    print(f"{'variant':<24}{'median ms/step':>16}{'min ms/step':>14}{'ratio':>8}   per-round ratio min/median/max")
    for k in names:
        r = rounds[k]
        print(
            f"{k:<24}{med[k] * 1e3:>16.2f}{min(times[k]) * 1e3:>14.2f}{med[k] / ref:>8.3f}   "
            f"{r[0]:.3f} / {statistics.median(r):.3f} / {r[-1]:.3f}"
        )
    records = {k: len(v[2].records) if v[2] else 0 for k, v in variants.items()}
    result = {
        "benchmark": "bench_monitor",
        "model": source,
        "norm": args.norm,
        "width": args.width,
        "input_shape": [args.batch_size, *shape],
        "variants": {k: None if f is None else {n: repr(v) for n, v in f().items()} for k, f in specs.items()},
        "threads": args.threads,
        "clock": args.clock,
        "steps_per_block": args.steps,
        "repeats": args.repeats,
        "platform": platform.platform(),
        "torch": torch.__version__,
        "note": "shared machine: ratios are the result, absolute times are noisy",
        "load_average_1min": load,
        "median_step_s": med,
        "all_step_s": times,
        "ratio_to_unmonitored": {k: med[k] / ref for k in names},
        "per_round_ratios": rounds,
        "monitor_records": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    if args.results:
        result["command"] = common.command("bench_monitor.py", argv)
        common.write_section(Path(args.results), f"bench_monitor:cpu:{args.model}", markdown(result))
    return 0


def profile(run, steps: list, source: str) -> None:
    """Where the default monitor's time goes over ``steps``: the monitor's Python functions by cumulative time
    (cProfile), and the aten ops the monitored steps dispatch beyond the unmonitored ones (torch.profiler: calls and
    CPU time per op name, monitored minus unmonitored)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for v in ("unmonitored", "every=10 (default)"):
        run(v, steps[:2])
    wall = {}
    prof = cProfile.Profile()
    for v in ("unmonitored", "every=10 (default)"):
        t0 = time.perf_counter()
        if v != "unmonitored":
            prof.enable()
        run(v, steps)
        prof.disable()
        wall[v] = (time.perf_counter() - t0) / len(steps)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(r"normlab/monitor", 30)
    print(f"{source}: {len(steps)} steps; ms/step unmonitored {wall['unmonitored'] * 1e3:.2f}, default (under "
          f"cProfile) {wall['every=10 (default)'] * 1e3:.2f}")  # fmt: skip
    print(out.getvalue())
    ops = {}
    for v in ("unmonitored", "every=10 (default)"):
        with torch_profile(activities=[ProfilerActivity.CPU]) as tp:
            run(v, steps)
        ops[v] = {e.key: (e.count, e.self_cpu_time_total) for e in tp.key_averages()}
    extra = {k: (c - ops["unmonitored"].get(k, (0, 0))[0], t - ops["unmonitored"].get(k, (0, 0))[1])
             for k, (c, t) in ops["every=10 (default)"].items()}  # fmt: skip
    print(f"aten ops the default monitor adds over {len(steps)} steps (calls, self CPU ms), by added time:")
    for k, (c, t) in sorted(extra.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"  {k:<40} {c:>8} {t / 1e3:>9.1f}")


TARGET = 1.10  # the default monitor (every=10) against the unmonitored step (issue 24)


def markdown(result: dict) -> str:
    """This model's rows: each variant's median step, its ratio to the unmonitored one, the per-round ratios."""
    shape = "x".join(map(str, result["input_shape"]))
    load = result["load_average_1min"]
    lines = [
        f"#### Monitor cost: {result['model']}, input {shape}, {result['threads']} thread(s)",
        "",
        f"`{result['command']}`; clock {result['clock']}; {result['repeats']} interleaved repeats of "
        f"{result['steps_per_block']} steps; load average {load[0]:.1f} before, {load[1]:.1f} after; torch "
        f"{result['torch']}. Target: the default "
        f"(`every=10`) <= {TARGET:.2f}x the unmonitored step.",
        "",
        "| variant | median ms/step | ratio of medians | per-round ratio min / median / max | target met |",
        "|---|---|---|---|---|",
    ]
    for k, med in result["median_step_s"].items():
        r = result["per_round_ratios"][k]
        ratio = result["ratio_to_unmonitored"][k]
        met = ("yes" if ratio <= TARGET else "**no**") if k == "every=10 (default)" else ""
        lines.append(
            f"| {k} | {med * 1e3:.1f} | {ratio:.3f} | {r[0]:.3f} / {statistics.median(r):.3f} / {r[-1]:.3f} | {met} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
