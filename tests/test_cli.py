"""The ``normlab`` command line: help, bad input refused with exit code 2 and a one-line reason, a tiny run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import claimed, refused

from normlab.cli import main


def test_python_m_normlab_help():
    r = subprocess.run([sys.executable, "-m", "normlab", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for cmd in ("train", "compare", "report", "monitor", "bench", "export"):
        assert cmd in r.stdout
    for lab in ("demo", "reproduce", "capsules"):  # the lab's commands (normlab-lab)
        assert f"    {lab} " not in r.stdout


@pytest.mark.parametrize("cmd", ["train", "compare", "report"])
def test_subcommand_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    assert "usage: normlab " + cmd in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, must_list",
    [
        (["train", "--norm", "batchnorm"], ("none", "bn", "brn", "gn", "sn", "wn", "ws", "pws")),
        (["train", "--norm", "bn", "--conv", "fancy"], ("conv", "wn", "ws", "pws")),
        (["train", "--model", "vgg"], ("plain", "resnet", "resnet_pws", "cnn1d")),
        (["train", "--dataset", "imagenet"], ("digits", "mnist1d", "cifar10")),
        (["compare", "--norms", "bn,layernorm2"], ("none", "bn", "brn", "gn", "sn", "wn", "ws", "pws")),
        (["compare", "--norms", "bn", "--model", "vgg"], ("plain", "resnet", "cnn1d")),
        (["compare", "--norms", "bn", "--dataset", "svhn"], ("digits", "mnist1d", "cifar10")),
    ],
)
def test_unknown_names_list_valid_ones(argv, must_list, capsys, tmp_path):
    err = refused(argv + ["--out", str(tmp_path / "o")], capsys)
    for name in must_list:
        assert name in err
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_batch_size_larger_than_datasetrefused(capsys, tmp_path):
    err = refused(["train", "--batch-size", "5000", "--out", str(tmp_path / "o")], capsys)
    assert "5000" in err and "larger" in err
    err = refused(["compare", "--norms", "bn,gn", "--batch-sizes", "64,4096", "--out", str(tmp_path / "c")], capsys)
    assert "4096" in err
    assert not (tmp_path / "o").exists() and not (tmp_path / "c").exists()


def test_input_too_small_for_modelrefused(capsys, tmp_path):
    # the plain net needs at least 12x12 inputs; mnist1d samples are 1-D, digits are 2-D
    err = refused(["train", "--dataset", "mnist1d", "--model", "plain", "--out", str(tmp_path / "o")], capsys)
    assert "plain" in err
    err = refused(["train", "--dataset", "digits", "--model", "cnn1d", "--out", str(tmp_path / "o")], capsys)
    assert "cnn1d" in err


def test_bad_list_argument_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["compare", "--lrs", "0.1,fast"])
    assert e.value.code == 2
    assert "learning rates" in capsys.readouterr().err


def test_report_without_resultsrefused(capsys, tmp_path):
    err = refused(["report", str(tmp_path)], capsys)
    assert "results.json" in err


def test_train_tiny_run(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(
        [
            "train",
            "--norm",
            "pws",
            "--width",
            "0.125",
            "--epochs",
            "1",
            "--max-steps-per-epoch",
            "2",
            "--batch-size",
            "16",
            "--out",
            str(out),
            "--quiet",
            "--threads",
            "1",
        ]
    )
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["config"]["norm"] == "none" and s["config"]["conv"] == "pws"
    assert s["config"]["batch_size"] == 16 and s["epochs_run"] == 1
    assert "final test acc" in capsys.readouterr().out


def test_bench_prints_instructions(capsys):
    assert main(["bench"]) == 0
    assert "benchmarks" in capsys.readouterr().out


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "compare" in capsys.readouterr().out


def test_monitor_subcommand_is_wired(capsys):
    with pytest.raises(SystemExit) as e:
        main(["monitor", "--help"])
    assert e.value.code == 0
    assert "usage: normlab monitor" in capsys.readouterr().out


def test_bench_steps_times_each_norm(capsys):
    rc = main(
        [
            "bench",
            "--steps",
            "--norms",
            "bn,pws",
            "--width",
            "0.125",
            "--batch-size",
            "8",
            "--repeats",
            "2",
            "--iters",
            "1",
        ]
    )
    assert rc == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| bn") or r.startswith("| pws")]
    assert len(rows) == 2 and rows[1].endswith("| 1.00x |")
    assert refused(["bench", "--steps", "--norms", "bn,nope"], capsys)


def test_corrupt_checkpoint_is_an_error_not_a_restart(tmp_path, capsys):
    # one cell of a grid holds a corrupt checkpoint: compare records it as failed, ends with a one-line error and
    # leaves it alone
    from normlab.runner.grid.spec import GridSpec, expand_grid

    spec = GridSpec(
        norms=("bn",), lrs=(0.05,), batch_sizes=(16,), seeds=(0,), epochs=1, width=0.125, max_steps_per_epoch=1
    )
    (cell,) = expand_grid(spec)
    ck = tmp_path / "runs" / cell.cell_id / "checkpoint.pt"
    ck.parent.mkdir(parents=True)
    ck.write_bytes(b"not a checkpoint")
    claimed(tmp_path)  # by the grid that wrote the checkpoint
    rc = main(
        [
            "compare",
            "--norms",
            "bn",
            "--lrs",
            "0.05",
            "--batch-sizes",
            "16",
            "--seeds",
            "0",
            "--epochs",
            "1",
            "--width",
            "0.125",
            "--max-steps-per-epoch",
            "1",
            "--workers",
            "1",
            "--threads",
            "1",
            "--no-progress",
            "--out",
            str(tmp_path),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert err[-1].startswith(f"normlab compare: error: 1 run(s) failed (first: {cell.cell_id}: RunError: train:")
    assert "corrupt" in err[-1]
    assert ck.read_bytes() == b"not a checkpoint"
    assert not (ck.parent / "summary.json").exists()


def test_grid_of_another_config_in_out_dirrefused(tmp_path, capsys):
    args = [
        "compare",
        "--norms",
        "gn",
        "--lrs",
        "0.05",
        "--batch-sizes",
        "16",
        "--seeds",
        "0",
        "--width",
        "0.125",
        "--max-steps-per-epoch",
        "1",
        "--workers",
        "1",
        "--threads",
        "1",
        "--no-progress",
        "--out",
        str(tmp_path),
    ]
    assert main(args + ["--epochs", "1"]) == 0
    capsys.readouterr()
    err = refused(args + ["--epochs", "2"], capsys)
    assert "different config" in err and "epochs: 1 -> 2" in err


def test_compare_says_its_size_and_time_first_and_a_long_grid_needs_yes(tmp_path, capsys, monkeypatch):
    from normlab.cli import compare

    args = [
        "compare",
        "--norms",
        "gn",
        "--lrs",
        "0.05",
        "--batch-sizes",
        "16",
        "--seeds",
        "0",
        "--width",
        "0.125",
        "--max-steps-per-epoch",
        "1",
        "--epochs",
        "1",
        "--workers",
        "1",
        "--threads",
        "1",
        "--no-progress",
        "--out",
        str(tmp_path / "c"),
    ]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "normlab compare: 1 run to train (1 norms x 1 lrs x 1 batch sizes x 1 seeds, 1 epochs each" in err
    assert main(args) == 0  # a finished grid trains nothing and says nothing about time
    assert "to train" not in capsys.readouterr().err
    minutes = []
    monkeypatch.setattr(compare, "estimate_minutes", lambda cells, workers: minutes.append(len(cells)) or 60.0)
    long_args = [a if a != str(tmp_path / "c") else str(tmp_path / "d") for a in args]
    err = refused(long_args, capsys)
    assert err.startswith("normlab compare: error: --yes: 1 run to train") and "about 60 min" in err
    assert not (tmp_path / "d").exists()
    assert main(long_args + ["--yes"]) == 0
    assert (tmp_path / "d" / "results.json").exists() and minutes == [1, 1]


def test_estimate_times_a_step_and_counts_the_steps(monkeypatch):
    from normlab.runner.grid import estimate
    from normlab.runner.grid.estimate import cell_steps, estimate_minutes, step_seconds
    from normlab.runner.grid.spec import GridSpec, expand_grid
    from normlab.runner.training.config import TrainConfig

    cfg = TrainConfig(dataset="digits", model="plain", norm="bn", width=0.125, batch_size=16, epochs=3)
    assert cell_steps(cfg) == 3 * (1437 // 16)
    assert cell_steps(TrainConfig(dataset="digits", batch_size=16, epochs=2, max_steps_per_epoch=5)) == 10
    assert 0 < step_seconds(cfg) < 60
    cells = expand_grid(
        GridSpec(
            norms=("bn",), lrs=(0.1,), batch_sizes=(16,), seeds=(0, 1), epochs=1, width=0.125, max_steps_per_epoch=2
        )
    )
    assert estimate_minutes(cells, 1) > 0
    monkeypatch.setattr(estimate, "step_seconds", lambda cfg: 0.5)
    monkeypatch.setattr(estimate, "eval_mode_seconds", lambda cfg: 0.0)
    monkeypatch.setattr(estimate, "RUN_OVERHEAD_S", 0.0)
    assert estimate_minutes(cells, 1) == 2 * 2 * 0.5 / 60  # 2 cells x 2 steps x 0.5 s
    assert estimate_minutes(cells, 2) == 2 * 2 * 0.5 / 60 / 2  # two workers share the cells
    assert estimate_minutes(cells, 8) == 2 * 0.5 / 60  # no more workers than cells


def test_guard_flag_reaches_every_cell_and_its_rescues_are_in_the_results(tmp_path, capsys):
    out = tmp_path / "grid"
    rc = main(
        [
            "compare",
            "--norms",
            "none",
            "--lrs",
            "0.3",
            "--batch-sizes",
            "32",
            "--seeds",
            "100",
            "--epochs",
            "2",
            "--width",
            "0.125",
            "--max-steps-per-epoch",
            "40",
            "--workers",
            "1",
            "--threads",
            "1",
            "--no-progress",
            "--guard",
            "--out",
            str(out),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    (cell,) = results["cells"]
    assert cell["rescues"] == 1 and cell["steps_lost"] > 0 and cell["guard_gave_up"] is None
    assert results["groups"][0]["rescued_count"] == 1
    rc = main(
        [
            "train",
            "--norm",
            "bn",
            "--epochs",
            "1",
            "--width",
            "0.125",
            "--max-steps-per-epoch",
            "2",
            "--guard",
            "--threads",
            "1",
            "--out",
            str(tmp_path / "one"),
        ]
    )
    assert rc == 0
    summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert summary["config"]["guard"] is True and summary["rescues"] == []
    assert summary["config"]["guard_dead"] is False  # the default guard does not measure against chance
    rc = main(
        ["train", "--norm", "bn", "--epochs", "1", "--width", "0.125", "--max-steps-per-epoch", "2", "--guard-dead"]
        + ["--threads", "1", "--out", str(tmp_path / "dead")]
    )
    summary = json.loads((tmp_path / "dead" / "summary.json").read_text())
    assert rc == 0 and summary["config"]["guard"] is True and summary["config"]["guard_dead"] is True


def test_guard_dead_flag_reaches_every_cell_and_a_grid_refuses_the_other_guard(tmp_path, capsys):
    out = tmp_path / "grid"
    args = ["compare", "--norms", "none,bn", "--lrs", "0.05", "--batch-sizes", "32", "--seeds", "100,101"]
    args += ["--epochs", "1", "--width", "0.125", "--max-steps-per-epoch", "2", "--workers", "1", "--threads", "1"]
    args += ["--no-progress", "--out", str(out)]
    assert main([*args, "--guard-dead"]) == 0, capsys.readouterr().err
    cells = json.loads((out / "results.json").read_text())["cells"]
    assert len(cells) == 4
    for c in cells:
        config = json.loads((out / "runs" / c["cell"] / "summary.json").read_text())["config"]
        assert config["guard"] is True and config["guard_dead"] is True
    capsys.readouterr()
    assert main([*args, "--guard"]) != 0  # the same directory with the other guard: refused, nothing reused
    err = capsys.readouterr().err
    assert "guard_dead" in err and len(err.strip().splitlines()) == 1


def _parse_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "argv, typo, suggested",
    [
        (["train", "--epoch", "1"], "--epoch", "--epochs"),  # was silently taken as --epochs
        (["train", "--lrr", "0.1"], "--lrr", "--lr"),
        (["compare", "--lrr", "0.1"], "--lrr", "--lrs"),
        (["compare", "--norm", "bn"], "--norm", "--norms"),
        (["--verison"], "--verison", "--version"),
    ],
)
def test_options_are_never_abbreviated_and_a_typo_gets_the_closest_option(argv, typo, suggested, capsys, tmp_path):
    err = _parse_error(argv + (["--out", str(tmp_path / "o")] if argv[0] != "--verison" else []), capsys)
    assert f"unrecognized arguments: {typo}" in err and f"did you mean {suggested}" in err, err
    assert not (tmp_path / "o").exists()


def test_every_command_refuses_abbreviations():
    from normlab.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # argparse keeps its subparsers here
    assert parser.allow_abbrev is False and commands
    assert all(p.allow_abbrev is False for p in commands.values()), [n for n, p in commands.items() if p.allow_abbrev]


def test_a_mistyped_command_or_choice_gets_the_closest_one(capsys):
    assert "did you mean train?" in _parse_error(["trian"], capsys)
    assert "did you mean paper?" in _parse_error(["train", "--brn-schedule", "papr"], capsys)
    assert "did you mean" not in _parse_error(["train", "--zzzz", "1"], capsys)


def test_every_argument_parser_of_the_repository_refuses_abbreviations():
    """The lab (its scripts too) and the benchmarks too: an abbreviated option silently taken for another is a wrong
    experiment."""
    import re

    from conftest import ROOT

    offenders = []
    for path in [*ROOT.glob("lab/**/*.py"), *ROOT.glob("benchmarks/*.py"), *ROOT.glob("normlab/**/*.py")]:
        for call in re.findall(r"ArgumentParser\((.*?)\)", path.read_text(), flags=re.S):
            if call.strip() and "allow_abbrev=False" not in call:
                offenders.append(path.name)
    assert not offenders, offenders
