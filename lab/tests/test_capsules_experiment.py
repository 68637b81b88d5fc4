"""``normlab-lab capsules``: the routing experiment end to end (quick mode), resume, refusals, and the statistics
behind its verdicts (paired differences, t intervals, the claim criteria)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from normlab.runner.errors import UsageError
from normlab.runner.lock import CLAIM_NAME
from normlab_lab.capsules.experiment import CapsSpec, coupling_entropy, expand_cells, run_capsules
from normlab_lab.capsules.stats import paired, t_quantile, verdicts
from normlab_lab.cli import main

from .labtest import refused


def test_quick_mode_end_to_end_and_resume(tmp_path, capsys, one_thread):
    out = tmp_path / "caps"
    assert main(["capsules", "--quick", "--workers", "1", "--no-progress", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    for name in (
        "results.json",
        "results.md",
        "capsules.json",
        "error_by_variant.png",
        "training_curves.png",
        "step_time.png",
        "coupling_entropy.png",
    ):
        assert (out / name).is_file(), name
    res = json.loads((out / "results.json").read_text())
    assert res["kind"] == "capsules" and res["complete"] and len(res["cells"]) == 12
    assert {v["variant"] for v in res["variants"]} == {
        "r1",
        "r3 detached",
        "r3 full",
        "r1 +rec",
        "r3 detached +rec",
        "r3 full +rec",
    }
    for v in res["variants"]:  # one iteration keeps the coupling uniform: entropy ln 10
        if v["iterations"] == 1:
            assert abs(v["entropy_mean"] - math.log(10)) < 1e-5
    for c in res["cells"]:  # the gradient diagnostics exist exactly where they mean something
        assert (c["detach_effect"] is None) == (c["iterations"] == 1)
        assert (c["recon_share"] is None) == (c["recon"] == "off")
        assert len(c["entropy_by_iteration"]) == c["iterations"]
    assert [t["cells_run"] for t in res["timings"]] == [12] and res["timings"][0]["cpu_s"] > 0
    assert any(v["verdict"] for v in res["verdicts"]) and "## Verdicts" in (out / "results.md").read_text()
    assert "r3 detached" in captured.out
    # rerun: every cell is skipped, the report is rewritten from the same summaries
    before = {c["cell"]: c["final_test_err"] for c in res["cells"]}
    assert main(["capsules", "--quick", "--workers", "1", "--no-progress", "--out", str(out)]) == 0
    assert "12 of 12 cells already done" in capsys.readouterr().err
    again = json.loads((out / "results.json").read_text())
    assert {c["cell"]: c["final_test_err"] for c in again["cells"]} == before
    assert again["timings"] == res["timings"]  # the measured run's time survives a rerun
    assert set(res["step_bench"]) == {v["variant"] for v in res["variants"]}
    assert again["step_bench"] == res["step_bench"]  # timed once, not again on a rerun


def _tiny(**kw) -> CapsSpec:
    base = dict(
        iterations=(1, 2),
        grads=("detached",),
        recons=("off",),
        seeds=(0,),
        epochs=1,
        max_steps_per_epoch=2,
        test_subset=16,
    )
    return CapsSpec(**{**base, **kw})


def test_same_seed_same_result_and_changed_configrefused(tmp_path, one_thread):
    a = run_capsules(_tiny(), tmp_path / "a", workers=1, progress=False, render=False, log=lambda s: None)
    b = run_capsules(_tiny(), tmp_path / "b", workers=1, progress=False, render=False, log=lambda s: None)
    assert [c["final_test_margin"] for c in a["cells"]] == [c["final_test_margin"] for c in b["cells"]]
    with pytest.raises(UsageError, match="different config"):
        run_capsules(_tiny(lr=2e-3), tmp_path / "a", workers=1, progress=False, render=False)


def test_r1_is_run_once_and_cells_are_paired():
    cells = expand_cells(CapsSpec(iterations=(1, 3), seeds=(0, 1)))
    ids = [c.cell_id for c in cells]
    assert len(ids) == len(set(ids)) == 2 * (1 + 2) * 2  # recon x (r1 + r3 detached/full) x seeds
    assert "r1_rec-on_s0" in ids and "r3_detached_rec-off_s1" in ids
    same_seed = [c.config for c in cells if c.seed == 1]
    assert all(cfg.seed == 1 for cfg in same_seed)
    assert {cfg.detach_inner for cfg in same_seed if cfg.iterations == 3} == {True, False}


@pytest.mark.parametrize(
    "argv, must",
    [
        (["--iterations", "0"], ">= 1"),
        (["--iterations", "1,0,3"], ">= 1"),
        (["--iterations", "two"], "integers"),
        (["--grads", "detached,stop"], "detached, full"),
        (["--recon", "maybe"], "off, on"),
        (["--dataset", "cifar10"], "digits, mnist1d"),
        (["--seeds", "-1"], ">= 0"),
        (["--seeds", "1,1"], "duplicates"),
    ],
)
def test_bad_arguments_one_line(argv, must, capsys, tmp_path):
    err = refused(["capsules", *argv, "--out", str(tmp_path / "o")], capsys)
    assert must in err
    assert not (tmp_path / "o").exists()


def test_spec_refusals():
    with pytest.raises(UsageError, match="CapsSpec iterations: expected integers >= 1"):
        CapsSpec(iterations=(0, 1))
    with pytest.raises(UsageError, match="CapsSpec grads: unknown value 'half'"):
        CapsSpec(grads=("detached", "half"))
    with pytest.raises(UsageError, match="epochs"):
        CapsSpec(epochs=0)


def test_coupling_entropy():
    uniform = torch.full((2, 5, 10), 0.1)
    assert abs(coupling_entropy(uniform).item() - math.log(10)) < 1e-6
    onehot = torch.nn.functional.one_hot(torch.zeros(2, 5, dtype=torch.long), 10).float()
    assert coupling_entropy(onehot).item() == pytest.approx(0.0, abs=1e-6)


# --------------------------------------------------------------------------------------------------
# statistics and verdicts on hand-made results
# --------------------------------------------------------------------------------------------------


def _results(errs: dict[str, list[float]]) -> dict:
    """A results dict with the given per-seed test errors; the margin loss mirrors the error."""
    cells, variants = [], []
    for name, xs in errs.items():
        r = int(name.split()[0][1:])
        grad = "-" if r == 1 else name.split()[1]
        for s, x in enumerate(xs):
            cells.append({"variant": name, "seed": s, "final_test_err": x, "final_test_margin": x / 10})
        variants.append({"variant": name, "iterations": r, "grad": grad, "recon": "off", "err_mean": sum(xs) / len(xs)})
    spec = {"iterations": [1, 3], "grads": ["detached", "full"], "recons": ["off"]}
    return {"spec": spec, "cells": cells, "variants": variants}


def test_t_quantile_and_paired_interval():
    assert t_quantile(4) == 2.776 and t_quantile(1) == 12.706
    assert abs(t_quantile(200) - 1.972) < 2e-3  # exact: 1.9719
    res = _results({"r3 detached": [0.010, 0.012, 0.011, 0.013, 0.009], "r1": [0.020, 0.021, 0.019, 0.024, 0.016]})
    p = paired(res, "r3 detached", "r1")
    d = [-0.010, -0.009, -0.008, -0.011, -0.007]
    m = sum(d) / 5
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / 4)
    assert p["n"] == 5 and abs(p["mean"] - m) < 1e-15
    assert abs(p["hi"] - (m + 2.776 * sd / math.sqrt(5))) < 1e-12 and p["real"]
    assert paired(res, "r3 detached", "r3 full") is None  # not run


def test_verdicts_follow_the_criteria():
    base = [0.020, 0.021, 0.019, 0.024, 0.016]
    better = [x - 0.005 + 0.001 * (i % 2) for i, x in enumerate(base)]  # really lower
    noisy = [x + d for x, d in zip(base, (0.001, -0.001, 0.0005, -0.0008, 0.0003))]  # within noise
    v = {x["id"]: x for x in verdicts(_results({"r1": base, "r3 detached": better, "r3 full": noisy}))}
    assert v["seed-detached-3-best-off"]["verdict"] == "reproduced"
    assert v["seed-full-1-best-off"]["verdict"] == "not resolved"
    assert v["paper-iterations-off"]["verdict"] == "consistent"  # the paper: no gain without reconstruction
    assert v["seed-stop-gradient-right-off"]["verdict"] == "reproduced"
    worse = [x + 0.005 - 0.001 * (i % 2) for i, x in enumerate(base)]
    v = {x["id"]: x for x in verdicts(_results({"r1": base, "r3 detached": worse, "r3 full": better}))}
    assert v["seed-detached-3-best-off"]["verdict"] == "contradicted"
    assert v["seed-full-1-best-off"]["verdict"] == "contradicted"
    assert v["paper-iterations-off"]["verdict"] == "contradicted"
    assert v["seed-stop-gradient-right-off"]["verdict"] == "contradicted"


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["capsules", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: normlab-lab capsules" in out and "--iterations" in out and "--quick" in out


def test_the_capsule_grid_runs_on_the_grid_engine_failed_cells_and_merging(tmp_path, one_thread):
    # a cell that raises is recorded (results.json 'failed') and the others finish; a later run with other seeds
    # extends the grid in the same directory instead of dropping the finished cells
    from normlab.runner.grid.execute import CellsFailed

    out = tmp_path / "caps"
    spec = _tiny()
    bad = expand_cells(spec)[1]
    (out / "runs" / bad.cell_id / "summary.json").mkdir(parents=True)  # its summary cannot be written
    (out / CLAIM_NAME).write_text(json.dumps({"run": "normlab-lab capsules", "record": None}))  # by an earlier run
    with pytest.raises(CellsFailed, match=f"first: {bad.cell_id}"):
        run_capsules(spec, out, workers=1, progress=False, render=False, log=lambda s: None)
    res = json.loads((out / "results.json").read_text())
    assert [f["cell"] for f in res["failed"]] == [bad.cell_id] and not res["complete"]
    assert [c["cell"] for c in res["cells"]] == [expand_cells(spec)[0].cell_id]
    (out / "runs" / bad.cell_id / "summary.json").rmdir()
    more = run_capsules(_tiny(seeds=(1,)), out, workers=1, progress=False, render=False, log=lambda s: None)
    assert more["spec"]["seeds"] == [0, 1] and not more["failed"] and not more["complete"]
    every = sorted(c.cell_id for c in expand_cells(_tiny(seeds=(0, 1))))
    assert sorted(c["cell"] for c in more["cells"]) == [c for c in every if c != bad.cell_id]
    assert json.loads((out / "capsules.json").read_text())["seeds"] == [0, 1]
    again = run_capsules(spec, out, workers=1, progress=False, render=False, log=lambda s: None)  # retries it
    assert sorted(c["cell"] for c in again["cells"]) == every and again["complete"]
