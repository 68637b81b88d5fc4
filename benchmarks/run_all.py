"""Run every side-by-side benchmark in this folder and collect their JSON into one directory.

Usage: python benchmarks/run_all.py [--device cpu|cuda] [--quick] [--out runs/bench] [--only bench_table,...]
       [--results benchmarks/RESULTS.md]

Each ``bench_*.py`` script times normlab's code and its reference in the same process, interleaved, and reports
ratios; this runner only calls them one after the other (never in parallel: they would disturb each other), on one
CPU thread. ``bench_table`` is the issue-10 table (layers, convolutions, whole networks, peak memory,
torch.compile) and rewrites this device's section of ``--results``.

``bench_layers`` is issue 25's layer-cost table (BatchRenorm/SwitchableNorm/InstanceNorm against torch's layers at
the issue's shapes, and a CrossQ critic update against BatchNorm and torchrl's BatchRenorm1d when torchrl imports).
``bench_compiled`` puts every layer and whole training steps (CrossQ, ResNet-18) under torch.compile beside torch's
(about an hour on one CPU thread); ``count_ops --timing`` counts the dispatched ops per step of every layer and
measures what one costs; ``bench_monitor`` runs on the collapse benchmark's GPT and on ResNet-50. Each of them,
``bench_layers`` and ``bench_table`` rewrite their own sections of ``--results``. The GPU run is a separate script,
``benchmarks/gpu.py`` (under 8 minutes on one GPU).

- ``--device cuda``: the scripts that take a device (bench_table, bench_norms, bench_pws, bench_layers) on the GPU;
  the CPU-only ones (bench_batch_renorm, bench_monitor, bench_monitor_fsdp and bench_guard_fsdp: 2 gloo ranks) are
  skipped. bench_table alone takes under 5 minutes on a GPU.
- ``--quick``: only ``bench_table --quick`` (small shapes, 3 rounds, no torch.compile, seconds), results to
  ``--out`` only: a smoke test, not a measurement.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TAKES_DEVICE = {"bench_table", "bench_norms", "bench_pws", "bench_layers", "bench_compiled"}
TAKES_THREADS = {
    "bench_table",
    "bench_norms",
    "bench_pws",
    "bench_batch_renorm",
    "bench_monitor",
    "bench_monitor_fsdp",
    "bench_layers",
    "bench_guard",
    "bench_guard_fsdp",
    "bench_compiled",
}
WRITES_RESULTS = {"bench_table", "bench_layers", "bench_compiled", "bench_monitor", "count_ops"}
RUNS = {  # the runs of a script with more than one: (name of its JSON, extra arguments)
    "bench_monitor": [
        ("bench_monitor-gpt", ["--model", "gpt", "--batch-size", "8", "--repeats", "5"]),
        (
            "bench_monitor-resnet50",
            ["--model", "resnet50", "--size", "128", "--batch-size", "8", "--steps", "10", "--repeats", "3"],
        ),
    ],  # fmt: skip
    "count_ops": [("count_ops", ["--timing"])],
    "bench_guard_fsdp": [
        ("bench_guard_fsdp-overhead", ["overhead", "--repeats", "9"]),
        ("bench_guard_fsdp-snapshots", ["snapshots"]),
    ],
}


def _commands(script: Path, args, out: Path) -> list[list[str]]:
    """The command lines that run ``script`` (none: not on this device)."""
    name = script.stem
    if args.device != "cpu" and name not in TAKES_DEVICE:
        return []
    cmds = []
    for json_name, extra in RUNS.get(name, [(name, [])]):
        cmd = [sys.executable, str(script), "--out", str(out / f"{json_name}.json"), *extra]
        if name in TAKES_DEVICE:
            cmd += ["--device", args.device]
        if name in TAKES_THREADS and args.device == "cpu":
            cmd += ["--threads", "1"]
        if name == "bench_table" and args.quick:
            cmd += ["--quick"]
        elif name in WRITES_RESULTS and args.results:
            cmd += ["--results", args.results]
        cmds.append(cmd)
    return cmds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="runs/bench", help="directory for the JSON results")
    parser.add_argument("--only", default="", help="comma-separated script names (without .py)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--quick", action="store_true", help="bench_table --quick only (a smoke test)")
    parser.add_argument("--results", default="benchmarks/RESULTS.md", help="Markdown table bench_table rewrites")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scripts = sorted(HERE.glob("bench_*.py")) + [HERE / "count_ops.py"]
    if args.only:
        wanted = {s.strip() for s in args.only.split(",") if s.strip()}
        unknown = wanted - {s.stem for s in scripts}
        if unknown:
            parser.error(f"unknown benchmark(s) {sorted(unknown)}; available: {[s.stem for s in scripts]}")
        scripts = [s for s in scripts if s.stem in wanted]
    if args.quick:
        scripts = [s for s in scripts if s.stem == "bench_table"]
    failed = []
    for script in scripts:
        cmds = _commands(script, args, out)
        if not cmds:
            print(f"== {script.stem}: skipped (CPU only)", flush=True)
        for cmd in cmds:
            print(f"== {script.stem} {' '.join(cmd[2:])}", flush=True)
            if subprocess.call(cmd) != 0:
                failed.append(script.stem)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"results in {out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
