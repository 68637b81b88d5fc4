"""Run every side-by-side benchmark in this folder and collect their JSON into one directory.

Usage: python benchmarks/run_all.py [--out runs/bench] [--only bench_pws,bench_batch_renorm]

Each ``bench_*.py`` script times normlab's code and its reference in the same process, interleaved, and reports
ratios; this runner only calls them one after the other (never in parallel: they would disturb each other).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench", help="directory for the JSON results")
    parser.add_argument("--only", default="", help="comma-separated script names (without .py)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scripts = sorted(HERE.glob("bench_*.py"))
    if args.only:
        wanted = {s.strip() for s in args.only.split(",") if s.strip()}
        unknown = wanted - {s.stem for s in scripts}
        if unknown:
            parser.error(f"unknown benchmark(s) {sorted(unknown)}; available: {[s.stem for s in scripts]}")
        scripts = [s for s in scripts if s.stem in wanted]
    failed = []
    for script in scripts:
        print(f"== {script.stem}", flush=True)
        rc = subprocess.call([sys.executable, str(script), "--out", str(out / f"{script.stem}.json")])
        if rc != 0:
            failed.append(script.stem)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"results in {out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
