"""lab/scripts/stop_gradient.py, which produces every number of lab/docs/gradients.md: the statements the document makes
hold for the numbers the script computes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from .labtest import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sg():
    return load_script("lab/scripts/stop_gradient.py")


def test_mean_is_stationary(sg):
    d = sg.mean_stationarity()
    assert abs(d["at the batch mean"]) < 1e-10
    assert abs(d["at the batch mean + 0.1"] - 200.0) < 1e-8  # -2 * sum(x - mean - 0.1) = 2 * 1000 * 0.1


def test_first_derivatives_unchanged_by_the_stop_gradient(sg):
    rows = sg.first_order()
    assert len(rows) == 3 * 3 + 2  # three variances per reduction, torch's BN and IN
    for r in rows:
        assert r["norm_grad_rel_diff"] < 1e-13, r
        assert r["var_grad_rel_diff"] is None or r["var_grad_rel_diff"] < 1e-13, r


def test_second_derivatives_changed_by_tf_restored_by_moments(sg):
    for r in sg.second_order():
        if r["variance"].startswith("tf"):
            assert r["H v, random v: rel diff"] > 1e-3 and r["H 1: max abs (exact 0)"] > 1e-3, r
        else:
            assert r["H v, random v: rel diff"] < 1e-13 and r["H 1: max abs (exact 0)"] < 1e-13, r
        assert r["penalty gradient: rel diff"] < 1e-13, r  # dL/dx has zero mean: the penalty does not see it


def test_half_precision_overflow(sg):
    h = sg.half_precision()
    assert h["float64 reference"] == 90000.0 > h["float16 max"]
    assert math.isinf(h["naive float16"]) and math.isinf(h["torch.var float16"])
    assert h["moments"] == 90000.0 and h["moments dtype"] == "torch.float32"
    assert abs(h["instance norm, naive float16: max abs error"] - 1.0) < 1e-9  # every output 0 instead of +-1
    assert h["instance norm, normlab: max abs error"] < 1e-6


def test_routing(sg):
    one = sg.routing_one_iteration()
    assert one["v identical"] and one["gradient identical"] and one["max abs gradient difference"] == 0.0
    rows = sg.routing_frozen_coupling()
    for r in rows:
        assert r["detached vs frozen c: rel diff"] < 1e-13, r
        assert r["detached vs full: rel diff"] > 1e-5, r
    large = [r for r in rows if r["u_hat scale"] == 0.3]
    assert max(r["detached vs full: rel diff"] for r in large) > 0.3  # sharp coupling: a large change


def test_docs_show_the_scripts_output(sg, one_thread):
    """lab/docs/gradients.md ends with exactly what the script prints (rerun the script after changing it)."""
    doc = (ROOT / "docs" / "gradients.md").read_text()
    assert doc.rstrip().endswith(sg.markdown().rstrip())
