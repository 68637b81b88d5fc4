"""normlab-lab reproduce: the full MNIST-1D protocol, its smoke run end to end, the CIFAR-10 preset (its protocol and
its smoke run), the plateau criterion, and the progress line (runs remaining, ETA) of every grid command."""

import inspect
import io
import json
import random
import re

import pytest

from normlab.nn import PWSConv2d
from normlab.runner.grid.estimate import cell_steps
from normlab.runner.grid.progress import GridProgress, format_duration
from normlab.runner.grid.spec import expand_grid
from normlab_lab.cli import main
from normlab_lab.demo.claims import plateau_check
from normlab_lab.demo.experiment import PROTOCOL, demo_sections, milestone_epochs
from normlab_lab.reproduce.cifar10 import PAPER, cifar10_grids
from normlab_lab.reproduce.mnist1d import FULL_PROTOCOL, PILOT_SEEDS, REPORT_SEEDS


# ------------------------------------------------------------------------------------------ progress line
def test_progress_prints_plain_lines_with_runs_remaining_and_eta_when_not_a_terminal():
    out = io.StringIO()  # not a tty: a log file, a pipe
    p = GridProgress([3.0, 1.0, 1.0], done=2, label="normlab-lab demo", stream=out, estimate_s=600.0)
    assert "ETA 10 min" in p.line()  # before any run finished: the start's estimate
    p.update("a", "acc 0.9", 3.0)
    p.update("b", "acc 0.8", 1.0)
    p.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 2
    assert lines[0].startswith("normlab-lab demo: 3/5 runs done, 2 remaining, ETA ") and lines[0].endswith(
        "(last: a: acc 0.9)"
    )
    assert lines[1].startswith("normlab-lab demo: 4/5 runs done, 1 remaining, ETA ")
    # the ETA weighs what is left by cost: 1 unit left after 4 done takes a quarter of the time so far
    p.t0 -= 100.0
    assert p.eta_s() == pytest.approx(25.0, rel=0.05)


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_rewrites_one_line_in_place_on_a_terminal():
    out = _Tty()
    p = GridProgress([1.0, 1.0], stream=out, label="normlab-lab reproduce")
    p.update("a", "ok")
    p.update("b", "ok")
    p.close()
    text = out.getvalue()
    assert text.count("\r") == 2 and text.count("\n") == 1 and text.endswith("\n")
    assert "2/2 runs done, 0 remaining, ETA 0 s" in text
    quiet = io.StringIO()
    q = GridProgress([1.0], stream=quiet, enabled=False)
    q.update("a", "ok")
    q.close()
    assert quiet.getvalue() == "" and q.done == 1


def test_format_duration():
    assert [format_duration(x) for x in (None, 4.4, 90, 3900)] == ["n/a", "4 s", "2 min", "1 h 05 min"]


# --------------------------------------------------------------------------------------- plateau criterion
def _trace(tmp_path, losses):
    (tmp_path / "loss_trace.json").write_text(json.dumps({"window": 10, "losses": losses}))
    return plateau_check(tmp_path)


def test_plateau_check_relative_fall_or_an_absolute_floor_near_zero(tmp_path):
    # a loss near zero still falling 20 % (0.005 -> 0.004 nats) has fit its training set: a plateau (the floor)
    near_zero = _trace(tmp_path, [0.005] * 40 + [0.004] * 10)
    assert near_zero["plateau"] and near_zero["fall"] == pytest.approx(0.2) and near_zero["fall_nats"] < 0.01
    # a loss still falling 0.1 nats over the last fifth is not at its plateau; a flat one is
    assert not _trace(tmp_path, [0.5] * 40 + [0.4] * 10)["plateau"]
    assert _trace(tmp_path, [0.5] * 50)["plateau"]
    assert not _trace(tmp_path, [0.5] * 40 + [float("nan")] * 10)["plateau"]


def _two_sample_losses(rng, n, p_wrong):
    """``n`` steps of batch 2: each step's loss is the mean of two samples', 0.02 nats if right, 4 if wrong."""
    return [sum(4.0 if rng.random() < p_wrong else 0.02 for _ in range(2)) / 2 for _ in range(n)]


def test_plateau_check_a_fall_within_the_noise_of_a_two_sample_loss_is_a_plateau(tmp_path):
    rng = random.Random(100)
    # a converged batch-2 run: a true fall of 0.01 nats from 0.27, under a per-step noise of ~0.9 nats
    flat = _trace(tmp_path, _two_sample_losses(rng, 12_000, 0.065) + _two_sample_losses(rng, 4_000, 0.0625))
    assert flat["plateau"] and flat["noise_nats"] > 0.01
    # the same noise, a run still learning (0.27 -> 0.19 nats): not a plateau
    falling = _trace(tmp_path, _two_sample_losses(rng, 12_000, 0.065) + _two_sample_losses(rng, 4_000, 0.045))
    assert not falling["plateau"] and falling["fall_nats"] > 2 * falling["noise_nats"]
    # a noiseless trace falling 10 % (0.05 nats): no noise to hide in
    smooth = _trace(tmp_path, [0.5] * 40 + [0.45] * 10)
    assert not smooth["plateau"] and smooth["noise_nats"] == pytest.approx(0.0, abs=1e-12)


def test_plateau_noise_counts_correlated_steps_by_their_blocks(tmp_path):
    # the same values, once shuffled, once in slow waves: the waves' block means spread, so their noise is larger
    wave = [0.3 + 0.1 * ((i // 40) % 2) for i in range(1_000)]
    shuffled = wave[:]
    random.Random(101).shuffle(shuffled)
    assert _trace(tmp_path, wave)["noise_nats"] > 2 * _trace(tmp_path, shuffled)["noise_nats"]


def test_a_batch_size_without_a_finished_run_is_named_not_run():
    # a record that did not finish: claim 3's plateau condition names what is missing instead of "None steps"
    from normlab_lab.demo.claims import _plateau_state

    b = {"spec": {"batch_sizes": [128, 2], "norms": ["bn"]}, "cells": [{"cell": "x", "name": "bn", "batch_size": 128}]}
    ok = {"plateau": {"x": {"steps": 10, "fall": 0.0, "plateau": True}}}
    assert _plateau_state(b, ok, ("bn",)) == ["BN at batch 2 (not run)"]
    falling = {"plateau": {"x": {"steps": 10, "fall": 0.2, "plateau": False}}}
    assert _plateau_state(b, falling, ("bn",))[0] == "BN at batch 128 (10 steps, loss still falling 20 %)"


# -------------------------------------------------------------------------------------------- the protocol
def test_full_protocol_uses_report_seeds_epochs_and_a_schedule():
    # report seeds: not the demo's 0-2, not the reserved 3-99, not the pilots'
    for seeds in (FULL_PROTOCOL.seeds, FULL_PROTOCOL.guard_seeds):
        assert seeds == REPORT_SEEDS and all(s >= 100 for s in seeds) and not set(seeds) & set(PILOT_SEEDS)
    sections = demo_sections(FULL_PROTOCOL)
    assert set(sections) == set(demo_sections(PROTOCOL))  # the demo's sections, all of them
    for name, spec in sections.items():
        cells = expand_grid(spec)
        assert all(c.config.num_samples == 25_000 and c.config.num_train is None for c in cells), name
        assert all(c.config.milestones and c.config.epochs >= 5 for c in cells), name
    batch = {c.batch_size: c.config for c in expand_grid(sections["batch_size"])}
    assert cell_steps(batch[128]) == 20 * (20_000 // 128)  # every sample, 20 full epochs at batch 128
    assert cell_steps(batch[2]) == cell_steps(batch[4]) == 20 * 1000
    assert batch[2].lr == pytest.approx(0.05 * (2 / 128) ** 0.5)
    collapse = expand_grid(sections["collapse"])[0].config
    assert collapse.monitor_dense_steps == 200 and collapse.monitor_dense_every == 1
    assert milestone_epochs(FULL_PROTOCOL, 10) == (4, 6) and milestone_epochs(FULL_PROTOCOL, 5) == (2, 3)
    assert milestone_epochs(FULL_PROTOCOL, 1) == ()


def test_the_records_stages_train_every_cell_of_the_full_run_once():
    # lab/scripts/record_reproduce.py only reorders normlab-lab reproduce's runs: each cell in exactly one stage
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "record_reproduce.py"
    spec = importlib.util.spec_from_file_location("record_reproduce", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for key, grid in demo_sections(FULL_PROTOCOL).items():
        for cell in expand_grid(grid):
            hits = [label for label, section, pick in mod.STAGES if section == key and pick(cell)]
            assert len(hits) == 1, (key, cell.cell_id, hits)


def test_the_quick_demo_cells_are_unchanged_by_the_full_protocols_fields():
    # the demo's cells keep their configs (a resumed demo directory stays valid): no schedule, its step caps
    for name, spec in demo_sections(PROTOCOL).items():
        assert "milestones" not in spec.train_kwargs and spec.epochs == 1, name
    assert demo_sections(PROTOCOL)["batch_size"].train_kwargs["num_train"] == 2000


# ------------------------------------------------------------------------------------------- end to end
def test_reproduce_smoke_runs_the_whole_pipeline(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["reproduce", "--smoke", "--out", str(out), "--workers", "1", "--threads", "1"]) == 0
    stdout, err = capsys.readouterr()
    assert "normlab-lab reproduce: 14 runs to train: about" in err
    # plain lines (pytest's capture is not a terminal); the runs done, the ETA is the reporting the estimate named
    reporting = re.search(r"then (\d+) s of reporting", err).group(1)
    assert f"14/14 runs done, 0 remaining, ETA {reporting} s" in err
    assert re.search(r"\(last: \w+/[^:]+: test acc \d+\.\d %", err)  # the section, the run, accuracy in percent
    assert "\r" not in err
    demo = json.loads((out / "demo.json").read_text())
    assert demo["mode"] == "smoke" and demo["quick"]
    assert set(demo["evidence"]["plateau_all"]) == set(demo["sections"])
    report = (out / "report.md").read_text()
    assert report.startswith("# normlab-lab reproduce") and "2 epochs, lr x0.1 after 50 % of them" in report
    assert "The protocol: `normlab_lab.reproduce.mnist1d.SMOKE_PROTOCOL`" in report
    assert re.search(r"\*\*Plateau\*\*: (all 14 runs|\d+ of 14 runs) reached their plateau", report)
    assert "| 3 |" in stdout and str(out / "report.md") in stdout
    # resumable: a second call trains nothing
    assert main(["reproduce", "--smoke", "--out", str(out), "--workers", "1", "--threads", "1"]) == 0
    assert "0 runs to train, 14 already done" in capsys.readouterr().err


def test_the_plateau_summary_counts_every_run_and_names_each_miss_by_how_it_missed():
    from normlab_lab.demo.report import plateau_summary

    ok = {"plateau": True, "fall": 0.01, "fall_nats": 0.001, "noise_nats": 0.001, "steps": 100}
    falling = {"plateau": False, "fall": 0.099, "fall_nats": 0.0183, "noise_nats": 0.0064, "steps": 100}
    died = {"plateau": False, "fall": None, "steps": 40}
    assert plateau_summary({"lr_sweep": {"a": ok}, "batch_size": {"b": ok}}, {})[0].startswith(
        "**Plateau**: all 2 runs reached their plateau"
    )
    line = plateau_summary(
        {"lr_sweep": {"a": ok, "x": died}, "batch_size": {"y": falling}},
        {"x": {"collapse_reason": "non_finite_loss"}, "y": {"collapse_reason": None}},
    )[0]
    assert line.startswith("**Plateau**: 1 of 3 runs reached their plateau")
    assert "(a) x (collapsed: non finite loss)" in line and "(b) y (fell 9.9 %, 0.0183 nats vs 2 x 0.0064)" in line


# ---------------------------------------------------------------------------------------- CIFAR-10 preset
def test_cifar10_preset_is_the_papers_protocol(tmp_path):
    grids = cifar10_grids((300,), str(tmp_path))
    assert set(grids) == {"plain", "resnet"}
    assert inspect.signature(PWSConv2d).parameters["gamma"].default == PAPER["gamma"] == 1e-3
    for model, spec in grids.items():
        cells = expand_grid(spec)
        assert {c.name for c in cells} == {"bn", "gn", "sn", "wn", "pws"} and len(cells) == 10
        for c in cells:
            cfg = c.config
            assert (cfg.dataset, cfg.model, cfg.batch_size, cfg.epochs) == ("cifar10", model, 128, 200)
            assert cfg.milestones == (100, 150, 180) and cfg.lr_gamma == 0.1
            assert (cfg.momentum, cfg.weight_decay, cfg.width) == (0.9, 5e-4, 1.0)
            assert cfg.lr in (0.01, 0.1) and cfg.max_steps_per_epoch is None and cfg.num_train is None


def test_cifar10_preset_smoke_runs_on_random_cifar_shaped_images(tmp_path, capsys):
    out = tmp_path / "c"
    args = ["reproduce", "--preset", "cifar10-pws", "--smoke", "--out", str(out), "--workers", "1"]
    assert main([*args, "--device", "cpu", "--no-progress"]) == 0
    stdout, err = capsys.readouterr()
    assert "random CIFAR-shaped images" in stdout and "20 runs to train: about" in err
    for model in ("plain", "resnet"):
        results = json.loads((out / model / "results.json").read_text())
        assert results["complete"] and len(results["cells"]) == 10
        assert results["spec"]["dataset"] == "cifar10" and results["spec"]["model"] == model
        assert all(c["steps_run"] == 2 and c["final_test_acc"] is not None for c in results["cells"])
        assert "## Headline effects" in (out / model / "results.md").read_text()  # the paper's, judged
    assert "[info] Norms that do not train at the highest learning rate" in stdout  # ... and printed


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--data-dir", "x"], "--data-dir applies to --preset cifar10-pws"),
        (["--download"], "--download applies to --preset cifar10-pws"),
        (["--preset", "cifar10-pws"], "--download to fetch them, or --smoke"),
        (["--preset", "cifar10-pws", "--download"], "--download: expected a --data-dir"),
        (["--address", "auto"], "--address applies to --backend ray"),
    ],
)
def test_reproduce_refuses_options_that_do_not_fit_in_one_line(tmp_path, capsys, argv, expected):
    assert main(["reproduce", *argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1 and not (tmp_path / "o").exists()
