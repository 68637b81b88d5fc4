"""The lab's grids on Ray, for real: one local Ray session (2 CPUs, loopback only) for the whole module. The capsule
experiment and the reproduction get the grid engine's Ray backend with the same cells and results as on processes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from normlab_lab.capsules.experiment import CapsSpec, run_capsules
from normlab_lab.demo.experiment import run_demo
from normlab_lab.reproduce.mnist1d import SMOKE_PROTOCOL

from .labtest import needs

_TIMING = ("step_time_s", "time_s")


@pytest.fixture(scope="module")
def ray_cluster():
    ray = needs("ray")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=128 * 2**20,
        _node_ip_address="127.0.0.1",
        logging_level=logging.WARNING,
    )
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")  # the loopback only (conftest)
    yield ray
    ray.shutdown()


def _without_timing(obj):
    if isinstance(obj, dict):
        return {k: _without_timing(v) for k, v in obj.items() if k not in _TIMING}
    if isinstance(obj, list):
        return [_without_timing(v) for v in obj]
    return obj


def _files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


def test_the_capsule_grid_runs_on_ray_like_on_processes(ray_cluster, tmp_path):
    # one engine: the capsule experiment gets the Ray backend of the grid, with the same cells and results
    spec = CapsSpec(
        iterations=(1, 2),
        grads=("detached",),
        recons=("off",),
        seeds=(0,),
        epochs=1,
        max_steps_per_epoch=2,
        test_subset=16,
    )
    kw = dict(threads=1, progress=False, render=False, log=lambda s: None)
    here = run_capsules(spec, tmp_path / "process", workers=1, **kw)
    there = run_capsules(spec, tmp_path / "ray", backend="ray", **{**kw, "log": logging.info})
    assert [c["cell"] for c in there["cells"]] == [c["cell"] for c in here["cells"]] and there["complete"]
    assert [c["final_test_margin"] for c in there["cells"]] == [c["final_test_margin"] for c in here["cells"]]
    assert _files(tmp_path / "ray") == _files(tmp_path / "process")


def test_the_reproduction_runs_on_ray_with_the_process_pools_results(ray_cluster, tmp_path):
    # normlab-lab reproduce --backend ray: every section's cells as Ray tasks, the same results as the local pool
    kw = dict(protocol=SMOKE_PROTOCOL, mode="smoke", threads=1, progress=False)
    here = run_demo(tmp_path / "process", workers=1, **kw)
    there = run_demo(tmp_path / "ray", backend="ray", **kw)
    assert set(there["sections"]) == set(here["sections"])
    for name, section in here["sections"].items():
        assert _without_timing(there["sections"][name]["cells"]) == _without_timing(section["cells"]), name
    assert _files(tmp_path / "ray" / "lr_sweep") == _files(tmp_path / "process" / "lr_sweep")
