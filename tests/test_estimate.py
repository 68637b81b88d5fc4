"""normlab.runner.grid.estimate and the progress line: the estimate counts what a run does besides its steps (its
evaluations, its monitor's recorded steps, its start) and the work after its runs, and the ETA keeps that work until
it is done."""

from __future__ import annotations

import io

import pytest

from normlab.monitor.log import load_log
from normlab.runner.grid import estimate
from normlab.runner.grid.estimate import cell_evals, cell_recorded_steps, cell_steps, plan_text
from normlab.runner.grid.progress import GridProgress
from normlab.runner.grid.spec import GridSpec, expand_grid
from normlab.runner.training.config import TrainConfig
from normlab.runner.training.train import train


@pytest.mark.parametrize(
    ("steps", "evals", "every", "dense"),
    [(7, 3, 3, 0), (6, 1, 1, 0), (9, 4, 5, 3), (5, 9, 0, 0)],
)
def test_the_evaluations_and_recorded_steps_counted_are_those_a_run_makes(tmp_path, steps, evals, every, dense):
    cfg = TrainConfig(
        dataset="digits",
        model="plain",
        norm="bn",
        width=0.125,
        batch_size=16,
        epochs=1,
        max_steps_per_epoch=steps,
        evals_per_epoch=evals,
        monitor_every=every,
        monitor_dense_steps=dense,
        stop_on="non_finite",
    )
    train(cfg, tmp_path, progress=False)
    metrics = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert cell_steps(cfg) == steps and cell_evals(cfg) == len(metrics)
    recorded = {r["step"] for r in load_log(tmp_path / "monitor.jsonl").records} if every else set()
    assert cell_recorded_steps(cfg) == len(recorded)


def test_the_estimate_adds_evaluations_the_monitor_and_each_runs_start(monkeypatch):
    cells = expand_grid(
        GridSpec(
            norms=("bn",),
            lrs=(0.1,),
            batch_sizes=(16,),
            seeds=(0, 1),
            epochs=1,
            width=0.125,
            max_steps_per_epoch=4,
            train_kwargs={"evals_per_epoch": 2, "monitor_every": 2},
        )
    )
    monkeypatch.setattr(estimate, "step_seconds", lambda cfg: 0.5)
    monkeypatch.setattr(estimate, "eval_mode_seconds", lambda cfg: 0.25)
    monkeypatch.setattr(estimate, "monitor_seconds", lambda cfg, plain=None: 0.1)
    one = 4 * 0.5 + 2 * 0.25 + 2 * 0.1 + estimate.RUN_OVERHEAD_S  # 4 steps, 2 evaluations, steps 0 and 2 recorded
    assert estimate.estimate_seconds(cells) == pytest.approx([one, one])
    assert estimate.estimate_minutes(cells, 2) == pytest.approx(one / 60)


def test_each_pass_is_timed_once_per_what_it_depends_on(monkeypatch):
    """The eval-mode pass once per model (not per batch size); the step, the train-mode pass and the monitor once
    per model and batch size; an evaluation is the eval-mode pass plus the train-mode pass of the cell's batch."""
    cells = expand_grid(
        GridSpec(
            norms=("bn", "gn"),
            lrs=(0.1,),
            batch_sizes=(16, 4, 2),
            seeds=(0, 1),
            epochs=1,
            width=0.125,
            max_steps_per_epoch=4,
            train_kwargs={"evals_per_epoch": 1, "monitor_every": 2, "eval_train_mode": True},
        )
    )
    calls: dict[str, list] = {"step": [], "eval": [], "train": [], "monitor": []}

    def timer(kind, value):
        return lambda cfg, plain=None: calls[kind].append((cfg.norm, cfg.batch_size)) or value(cfg)

    monkeypatch.setattr(estimate, "step_seconds", timer("step", lambda cfg: 0.5))
    monkeypatch.setattr(estimate, "eval_mode_seconds", timer("eval", lambda cfg: 0.25))
    monkeypatch.setattr(estimate, "train_mode_seconds", timer("train", lambda cfg: 0.01 * cfg.batch_size))
    monkeypatch.setattr(estimate, "monitor_seconds", timer("monitor", lambda cfg: 0.1))
    seconds = estimate.estimate_seconds(cells)
    assert sorted(calls["eval"]) == [("bn", 16), ("gn", 16)]  # one per model, at the first batch size seen
    for kind in ("step", "train", "monitor"):
        assert sorted(calls[kind]) == sorted({(n, b) for n in ("bn", "gn") for b in (16, 4, 2)})
    for cell, s in zip(cells, seconds):
        b = cell.config.batch_size
        assert s == pytest.approx(4 * 0.5 + (0.25 + 0.01 * b) + 2 * 0.1 + estimate.RUN_OVERHEAD_S)


def test_an_evaluation_and_a_recorded_step_cost_time_when_timed():
    cfg = TrainConfig(dataset="digits", model="plain", norm="bn", width=0.125, batch_size=4, eval_train_mode=True)
    assert estimate.eval_seconds(cfg) > 0 and estimate.monitor_seconds(cfg) >= 0


def test_the_estimate_names_the_work_after_the_runs_and_the_eta_keeps_it(monkeypatch):
    monkeypatch.setattr(estimate, "estimate_minutes", lambda todo, workers: 2.0)
    cells = expand_grid(GridSpec(norms=("bn",), lrs=(0.1,), batch_sizes=(16,), seeds=(0,), epochs=1))
    text, minutes = plan_text(cells, cells, 2, after_s=30.0)
    assert (
        minutes == 2.5
        and text == "1 run to train: about 2.5 min with 1 worker(s) here (runs 2.0 min, then 30 s of reporting)"
    )
    out = io.StringIO()
    bar = GridProgress([1.0, 1.0], stream=out, estimate_s=150.0, after_s=30.0)
    assert bar.eta_s() == 150.0  # before a run finished: the whole estimate
    bar.update("a", "ok", 1.0)
    assert bar.eta_s() >= 30.0  # the runs left, then the reporting
    bar.update("b", "ok", 1.0)
    assert bar.eta_s() == 30.0 and "ETA 30 s" in out.getvalue().splitlines()[-1]  # runs done: the reporting is left
