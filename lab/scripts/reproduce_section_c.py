"""Section (c) of the full reproduction alone (the collapse diagnosis and its guarded twins, seeds 300-302), with
the monitor's rules of today, and its alarm audit.

``normlab-lab reproduce`` runs every section (about an hour on 2 cores); this runs the grids ``collapse``, ``guard``
and ``guard_dead`` of :data:`normlab_lab.reproduce.mnist1d.FULL_PROTOCOL` exactly as it does (the same specs, data
and seeds, planned and run the same way) and prints, per run, how it ended and what the monitor said, then the
audit of the 12 unguarded runs (:func:`normlab_lab.demo.diagnosis.alarm_audit`): the quick way to see what new
monitor rules or a new guard say of section (c) (lab/docs/reproduction.md, "Command and expected time").

    OMP_NUM_THREADS=1 python lab/scripts/reproduce_section_c.py runs/reproduce_c --workers 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from normlab.runner.data.datasets import get_dataset
from normlab.runner.data.mnist1d import load_mnist1d
from normlab.runner.experiments.compare import COMPARE
from normlab.runner.grid.execute import plan_grid, run_cells
from normlab_lab.demo.diagnosis import alarm_audit, diagnose_run
from normlab_lab.demo.experiment import demo_sections
from normlab_lab.reproduce.mnist1d import FULL_PROTOCOL, SMOKE_PROTOCOL

SECTIONS = ("collapse", "guard", "guard_dead")


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="the seconds-long protocol (checks the pipeline)")
    args = parser.parse_args()
    p = SMOKE_PROTOCOL if args.smoke else FULL_PROTOCOL
    load_mnist1d(p.num_samples, args.out / "data", workers=args.workers)
    get_dataset("mnist1d", args.out / "data", num_samples=p.num_samples)
    specs = demo_sections(p)
    grids = {k: plan_grid(COMPARE, specs[k], args.out / k, data_cache=args.out / "data") for k in SECTIONS}
    for grid in grids.values():
        grid.start()
    run_cells(list(grids.values()), workers=args.workers, threads=1, progress=True, label="section (c)")
    diagnoses = {}
    for key, grid in grids.items():
        grid.finish(render=False)
        for run_dir in sorted(d.parent for d in (args.out / key).rglob("summary.json")):
            d = diagnose_run(run_dir)
            diagnoses.setdefault(key, {})[run_dir.name] = d
            alarm = d["alarm"] and f"{d['alarm']['layer']} step {d['alarm']['step']} {d['alarm']['quantity']}"
            print(f"{key} {run_dir.name}: collapsed={d['collapsed']} ({d['collapse_reason']}, step "
                  f"{d['collapse_step']}), acc {d['final_test_acc']}, alarm {alarm}, lead {d['lead_steps']}, "
                  f"regime {d['risk'] and d['risk'].get('step')}, rescues {len(d['rescues'])}, "
                  f"lost {d['steps_lost']}")  # fmt: skip
    audit = alarm_audit(list(diagnoses["collapse"].values()))
    print(json.dumps(audit))


if __name__ == "__main__":
    main()
