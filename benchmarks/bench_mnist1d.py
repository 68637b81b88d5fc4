"""MNIST-1D generation, serial (mnist1d's make_dataset) against parallel (normlab.runner.data.mnist1d_parallel),
timed side by side in one process: the demo's first stage.

Usage: python benchmarks/bench_mnist1d.py [--samples 25000] [--workers 2] [--rounds 3] [--out FILE.json]

Each round times both, the order alternating from round to round; the ratio is parallel time / serial time within
the round, and the script prints min / median / max of the per-round ratios with the machine's load. The two data
sets are checked to be equal, element for element, once.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from normlab.runner.data import mnist1d


def _time(args: dict, workers: int) -> tuple[float, dict]:
    t0 = time.perf_counter()
    arrays = mnist1d._generate(args, workers)
    return time.perf_counter() - t0, arrays


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=mnist1d.DEFAULT_SAMPLES)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    args = mnist1d.generation_args(a.samples)
    rounds = []
    for r in range(a.rounds):
        order = (1, a.workers) if r % 2 == 0 else (a.workers, 1)
        times, got = {}, {}
        for w in order:
            times[w], got[w] = _time(args, w)
        if r == 0:
            assert all(np.array_equal(got[1][k], got[a.workers][k]) for k in got[1]), "parallel != serial"
        rounds.append({"serial_s": times[1], "parallel_s": times[a.workers], "ratio": times[a.workers] / times[1]})
        print(
            f"round {r}: serial {times[1]:.1f} s, parallel ({a.workers} workers) {times[a.workers]:.1f} s, "
            f"ratio {rounds[-1]['ratio']:.2f}",
            flush=True,
        )
    ratios = [x["ratio"] for x in rounds]
    result = {
        "samples": a.samples,
        "workers": a.workers,
        "rounds": rounds,
        "ratio_min_median_max": [min(ratios), statistics.median(ratios), max(ratios)],
        "load_avg": os.getloadavg(),
        "cpus": os.cpu_count(),
        "identical": True,
    }
    print(
        f"parallel / serial: min {min(ratios):.2f}, median {statistics.median(ratios):.2f}, max {max(ratios):.2f} "
        f"(load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs); the arrays are identical"
    )
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
