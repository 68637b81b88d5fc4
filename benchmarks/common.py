"""Helpers the newer benchmark scripts share: interleaved timing, the machine and its load, RESULTS.md sections.

Not a benchmark itself (``run_all.py`` runs ``bench_*.py`` only). A script imports it with its own folder on
``sys.path`` (``python benchmarks/x.py`` puts it there; :func:`importable` does it for a script loaded another way).
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def importable() -> None:
    """Put this folder on ``sys.path`` so that the scripts can import each other (``import bench_layers``)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))


# ------------------------------------------------------------------------------------------------ the machine
def load() -> float | None:
    """The 1-minute load average (None where the OS has none): part of every result on a shared machine."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def machine(device: torch.device) -> dict:
    """What a result was measured on."""
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
        "load_average": load(),
    }
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        found = re.search(r"model name\s*:\s*(.+)", cpuinfo.read_text())
        info["cpu"] = found.group(1).strip() if found else platform.processor()
    if device.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    return info


def describe(info: dict) -> str:
    """One line: device, CPU or GPU, torch, threads, cores."""
    what = info.get("gpu") or info.get("cpu") or info["platform"]
    return (
        f"{info['device']} ({what}), torch {info['torch']}, {info['threads']} thread(s), {info['cpu_count']} CPU cores"
    )


# ------------------------------------------------------------------------------------------------ timing
def synchronizer(device: torch.device):
    """A function that waits for the device (a no-op on the CPU)."""
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def calibrate(fn, block_s: float, clock, sync) -> int:
    """Calls of ``fn`` that take about ``block_s`` (at least 1), from one timed call after a warm-up call."""
    fn()
    sync()
    t0 = clock()
    fn()
    sync()
    return max(1, round(block_s / max(clock() - t0, 1e-7)))


def interleaved(steps: dict, rounds: int, repeats: int, iters: dict, clock, sync) -> dict[str, list[float]]:
    """Seconds per call of each zero-argument step: ``rounds`` values per step, each the median of ``repeats``
    samples of ``iters[name]`` calls; within a round the steps take turns, the order rotated by one per sample,
    so a slow phase of a shared machine hits every step alike."""
    names = list(steps)
    out = {n: [] for n in names}
    k = 0
    for _ in range(rounds):
        samples = {n: [] for n in names}
        for _ in range(repeats):
            for name in names[k % len(names) :] + names[: k % len(names)]:
                sync()
                t0 = clock()
                for _ in range(iters[name]):
                    steps[name]()
                sync()
                samples[name].append((clock() - t0) / iters[name])
            k += 1
        for n in names:
            out[n].append(statistics.median(samples[n]))
    return out


def ratios(times: dict[str, list[float]], name: str, reference: str) -> dict:
    """min / median / max over rounds of ``time(name) / time(reference)`` (both from the same round)."""
    r = sorted(a / b for a, b in zip(times[name], times[reference]))
    return {"min": r[0], "median": statistics.median(r), "max": r[-1]}


def fmt_ratio(r: dict) -> str:
    return f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"


# ------------------------------------------------------------------------------------------------ RESULTS.md
_OUTPUTS = {"--out": 1, "--results": 1, "--merge": 0, "--render": 0}


def command(script: str, argv: list[str] | None) -> str:
    """The command line that measured (``argv``, default ``sys.argv[1:]``) without the options that only say where
    the results go."""
    args, kept = list(sys.argv[1:] if argv is None else argv), []
    while args:
        a = args.pop(0)
        name = a.split("=", 1)[0]
        if name in _OUTPUTS:
            if "=" not in a:
                del args[: _OUTPUTS[name]]
            continue
        kept.append(a)
    return " ".join(["python", f"benchmarks/{script}", *kept])


def write_section(path: Path, key: str, text: str) -> None:
    """Replace (or append) the part of ``path`` between ``<!-- key:start -->`` and ``<!-- key:end -->``."""
    start, end = f"<!-- {key}:start -->", f"<!-- {key}:end -->"
    old = path.read_text() if path.exists() else "# Benchmark results\n"
    block = f"{start}\n{text.rstrip()}\n{end}"
    if start in old and end in old:
        new = old[: old.index(start)] + block + old[old.index(end) + len(end) :]
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(new)


def table(head: list[str], rows: list[list]) -> list[str]:
    """A Markdown table."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
