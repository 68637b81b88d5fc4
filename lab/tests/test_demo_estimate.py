"""The demo's estimate of its work after the runs: section (d)'s timed steps and the report."""

import pytest

from normlab_lab.demo import experiment


def test_the_demo_estimate_names_the_work_after_the_runs(monkeypatch):
    monkeypatch.setattr(experiment, "step_seconds", lambda cfg: 0.5)
    p = experiment.QUICK_PROTOCOL  # section (d): 3 norms at batch 32, 2 warm-up steps and 1 x 1 timed
    assert experiment.after_runs_seconds(p) == pytest.approx(experiment.REPORT_S + 3 * 3 * 0.5)
