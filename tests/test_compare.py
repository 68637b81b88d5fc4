"""Comparing normalizations on the user's own model and data (normlab.runner.experiments.compare.compare and
`normlab compare --model ... --dataset ...`): a factory of a test-side module and a timm model, the norm put in by
convert_norm or by norm_layer=, worker processes rebuilding them by name, resume after a kill, the early stop of an
alarm confirmed by a collapse, the per-norm report, torchrun (DDP), and the one-line refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import user_factories as uf

from normlab.runner.errors import UsageError
from normlab.runner.experiments.compare import compare
from normlab.runner.grid.report import norm_table
from normlab.runner.grid.results import per_norm
from normlab.runner.training.config import TrainConfig
from normlab.runner.training.setup import prepare

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
PNG = b"\x89PNG\r\n\x1a\n"
TINY = {"seeds": [100], "epochs": 1, "max_steps_per_epoch": 3, "batch_sizes": [32], "progress": False, "threads": 1}

pytestmark = pytest.mark.usefixtures("one_thread")


def _summary(out: Path, cell: str) -> dict:
    return json.loads((out / "runs" / cell / "summary.json").read_text())


def _weights(out: Path, cell: str) -> dict:
    return torch.load(out / "runs" / cell / "checkpoint.pt", map_location="cpu", weights_only=True)["model"]


# ------------------------------------------------------------------ the norm is really put in, both ways


@pytest.mark.parametrize("factory", ["user_factories:small_cnn", "user_factories:bn_cnn"])
def test_each_comparison_name_puts_its_layers_into_a_factory_model(factory):
    """norm_layer= (small_cnn takes it) and convert_norm (bn_cnn does not) give every comparison its own layers."""
    from normlab.nn import PWSConv2d, SwitchableNorm2d, WSConv2d

    want = {
        "bn": (torch.nn.BatchNorm2d, torch.nn.Conv2d),
        "gn": (torch.nn.GroupNorm, torch.nn.Conv2d),
        "sn": (SwitchableNorm2d, torch.nn.Conv2d),
        "ws+gn": (torch.nn.GroupNorm, WSConv2d),
        "pws": (None, PWSConv2d),
    }
    for name, (norm, conv) in want.items():
        from normlab.nn import resolve_comparison

        n, c = resolve_comparison(name)
        model = prepare(TrainConfig(dataset="user_factories:digits16", model=factory, norm=n, conv=c).validate()).model
        kinds = [type(m) for m in model.modules()]
        assert all(type(m) is conv for m in model.modules() if isinstance(m, torch.nn.Conv2d)), (name, kinds)
        norms = [k for k in kinds if k in (torch.nn.BatchNorm2d, torch.nn.GroupNorm, SwitchableNorm2d)]
        assert norms == ([norm, norm] if norm else []), (name, kinds)
    wn = prepare(TrainConfig(dataset="user_factories:digits16", model=factory, norm="none", conv="wn").validate()).model
    assert sum(torch.nn.utils.parametrize.is_parametrized(m, "weight") for m in wn.modules()) == 2


def test_a_model_is_built_once_from_its_seed_and_a_data_loader_keeps_its_dataset():
    """The same seed gives the same weights; a DataLoader's own batch size is not the run's (normlab draws the
    batches), and its dataset's number of classes is the dict's."""
    cfg = TrainConfig(dataset="user_factories:digits16_loaders", model="user_factories:small_cnn", seed=101).validate()
    a, b = prepare(cfg), prepare(cfg)
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))
    assert a.info["num_classes"] == 10 and a.info["input_shape"] == (1, 16, 16) and len(a.train) == 1400
    x, y = a.train.batch(torch.arange(32))
    assert x.shape == (32, 1, 16, 16) and y.shape == (32,) and y.dtype == torch.int64


# ------------------------------------------------------------------ the Python API, end to end


@pytest.fixture(scope="module")
def user_grid(tmp_path_factory):
    """A user factory (passed as the function itself) on user data, 3 norms x 2 lrs, in 2 worker processes."""
    out = tmp_path_factory.mktemp("user")
    results = compare(uf.small_cnn, uf.digits16, norms=["bn", "gn", "pws"], lrs=[0.05, 0.2], out=out, workers=2, **TINY)
    return out, results


def test_python_api_trains_every_norm_of_a_user_factory_in_worker_processes(user_grid):
    out, results = user_grid
    assert results["spec"]["model"] == "user_factories:small_cnn"  # recorded by its import path
    assert results["spec"]["dataset"] == "user_factories:digits16"
    assert len(results["cells"]) == 6 and results["complete"]
    assert [n["name"] for n in results["norms"]] == ["bn", "gn", "pws"]
    for c in results["cells"]:
        s = _summary(out, c["cell"])
        assert s["config"]["monitor_every"] == 10 and s["config"]["stop_on"] == "confirmed"  # the compare defaults
        assert s["num_classes"] == 10 and s["steps_run"] == 3
    assert any(k.endswith("alpha") for k in _weights(out, "pws_lr0.05_bs32_s100"))  # PWS convs
    assert not any(k.endswith("running_mean") for k in _weights(out, "gn_lr0.05_bs32_s100"))  # GroupNorm, no BN
    assert any(k.endswith("running_mean") for k in _weights(out, "bn_lr0.05_bs32_s100"))
    assert (out / "runs" / "bn_lr0.05_bs32_s100" / "monitor.jsonl").is_file()  # every run monitored


def test_the_report_has_a_row_per_norm_and_the_demos_plots(user_grid):
    out, results = user_grid
    md = (out / "results.md").read_text()
    assert "## Per normalization" in md and "Model `user_factories:small_cnn` on data `user_factories:digits16`" in md
    table = norm_table(results).splitlines()
    assert table[0].startswith("| norm | highest lr that trained |") and len(table) == 2 + 3
    assert [row.split(" | ")[0] for row in table[2:]] == ["| bn", "| gn", "| pws"]
    for png in ("metric_vs_lr.png", "loss_curves.png"):
        assert (out / png).read_bytes()[:8] == PNG and f"]({png})" in md


def test_a_timm_model_by_name(tmp_path):
    """timm:NAME is built without weights, its classes and channels from the data, its BatchNorms converted."""
    timm = pytest.importorskip("timm")
    results = compare("timm:test_resnet", "user_factories:digits16", norms=["bn", "gn"], lrs=[0.05], out=tmp_path,
                      workers=1, **TINY)  # fmt: skip
    assert [c["name"] for c in results["cells"]] == ["bn", "gn"] and not results["failed"]
    gn = _weights(tmp_path, "gn_lr0.05_bs32_s100")
    ref = timm.create_model("test_resnet", num_classes=10, in_chans=1).state_dict()
    assert gn["fc.weight"].shape == ref["fc.weight"].shape == (10, ref["fc.weight"].shape[1])
    assert not any(k.endswith("running_mean") for k in gn) and any(k.endswith("running_mean") for k in ref)


def test_a_lambda_runs_here_and_is_refused_with_workers(tmp_path):
    def data():  # a nested function: no import path
        return uf.digits16(600)

    with pytest.raises(UsageError, match="data: .*no import path.*2 worker processes"):
        compare(uf.small_cnn, data, norms=["bn"], lrs=[0.05], out=tmp_path / "w", workers=2, **TINY)
    assert not (tmp_path / "w").exists()
    results = compare(uf.small_cnn, data, norms=["bn"], lrs=[0.05], out=tmp_path / "here", **TINY)  # this process
    assert results["cells"][0]["steps_run"] == 3 and results["spec"]["dataset"].endswith("<locals>.data")


def test_a_user_metric_and_loss_by_function(tmp_path):
    results = compare("user_factories:small_cnn", "user_factories:digits16", norms=["gn"], lrs=[0.05],
                      metric=uf.top2, loss="torch.nn.functional:cross_entropy", out=tmp_path, **TINY)  # fmt: skip
    assert results["metric"] == "user_factories:top2" and "test top2" in (tmp_path / "results.md").read_text()
    s = _summary(tmp_path, results["cells"][0]["cell"])
    assert 0 <= s["final_test_acc"] <= 1 and s["history"][-1]["train_acc"] is not None


# ------------------------------------------------------------------ a confirmed collapse stops the run


class _AlarmAt4:
    """Stands in for VarianceMonitor: its alarm is raised at step 4 (long before any collapse)."""

    def __init__(self, model, every=10, rules=None, optimizer=None):
        from normlab.monitor.rules import Event

        self._event = Event("factor", "alarm", 4, "layer '0' shift grew", "0", "shift", 1e6, {"baseline": 1.0})
        self.current_step, self.records, self.events = 0, [], []
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self._stepped())  # as the monitor's own hooks

    @property
    def alarm(self):
        return self.events[0] if self.events else None

    def observe_loss(self, loss):
        pass

    def _stepped(self):
        if self.current_step == 4:
            self.events.append(self._event)
        self.current_step += 1

    def add_sink(self, sink):
        pass

    def state_dict(self):
        return {"current_step": self.current_step}

    def close(self):
        pass


def test_an_alarm_confirmed_by_a_collapse_stops_the_run_and_records_it(tmp_path, monkeypatch):
    """The scripted loss: 2 for 10 steps (the reference), 0.5 (learned), then 3: the smoothed loss (10 steps at
    batch 120) is back at 0.95 x 2 once 6 steps of 3 are in its window, at step 25 (dated to the window's first
    step, 16); with the alarm of step 4 that is a confirmed collapse: the run stops after 26 steps (epoch 3 of 5, 11
    steps each). Without stop_on=confirmed it is
    recorded the same and trains on to the end."""
    import normlab.runner.training.train as T

    monkeypatch.setattr(T, "VarianceMonitor", _AlarmAt4)
    runs = {}
    for stop_on in ("confirmed", "non_finite"):
        uf.STEPS["n"] = 0
        runs[stop_on] = compare(uf.small_cnn, "user_factories:digits16", norms=["bn"], lrs=[0.05], batch_sizes=[120],
                                seeds=[100], epochs=5, max_steps_per_epoch=11, loss=uf.scripted_loss, metric="none",
                                stop_on=stop_on, out=tmp_path / stop_on, workers=1, progress=False)  # fmt: skip
    stopped = _summary(tmp_path / "confirmed", "bn_lr0.05_bs120_s100")
    assert stopped["collapsed"] and stopped["collapse_step"] == 16
    assert stopped["collapse_reason"] == "returned_to_chance"  # chance estimated by the first loss (a user's loss)
    assert stopped["stopped_early"] == "confirmed" and stopped["steps_run"] == 26 and stopped["epochs_run"] == 3
    assert stopped["monitor_alarm"]["step"] == 4 and stopped["final_test_acc"] is None  # metric "none"
    went_on = _summary(tmp_path / "non_finite", "bn_lr0.05_bs120_s100")
    assert went_on["collapsed"] and went_on["collapse_step"] == 16 and went_on["stopped_early"] is None
    assert went_on["steps_run"] == 55
    row = runs["confirmed"]["norms"][0]
    assert row["stopped_early"] == 1 and row["collapsed"] == 1 and row["highest_lr_trained"] is None
    assert "| 1/1 | 1/1 | 1/1 (`0` 1) |" in norm_table(runs["confirmed"])


# ------------------------------------------------------------------ the per-norm table, from hand-made results


def _cell(name, lr, seed, acc, loss, collapsed=False, learned=True, alarm=None, risk=None, step=0.01, bs=64):
    return {"name": name, "lr": lr, "batch_size": bs, "seed": seed, "cell": f"{name}_{lr}_{seed}", "history": [],
            "final_test_acc": acc, "final_test_loss": loss, "collapsed": collapsed, "learned": learned,
            "alarm": alarm, "risk": risk, "step_time_s": step, "monitored": True, "stopped_early": None,
            "collapse_reason": "non_finite_loss" if collapsed else None}  # fmt: skip


def _hand_results(cells):
    from normlab.runner.grid.results import _group_record

    groups = {}
    for c in cells:
        groups.setdefault((c["name"], c["lr"], c["batch_size"]), []).append(
            {**c, "best_test_acc": c["final_test_acc"], "final_test_acc_train_mode": None, "epochs_to_target": None}
        )
    spec = {"norms": ["bn", "pws"], "lrs": [0.01, 0.1, 1.0], "batch_sizes": [64], "seeds": [1, 2], "epochs": 1,
            "dataset": "d:f", "model": "m:f", "width": 1.0, "layout": "product", "base_lr": 0.01,
            "base_batch_size": 64}  # fmt: skip
    res = {"spec": spec, "metric": "accuracy", "num_classes": 10, "cells": cells,
           "groups": [_group_record(*k, v) for k, v in groups.items()]}  # fmt: skip
    res["norms"] = per_norm(res)
    return res


def test_per_norm_highest_lr_best_point_and_monitor_view_follow_their_definitions():
    alarm = {"layer": "features.3", "step": 7}
    cells = [
        _cell("bn", 0.01, 1, 0.90, 0.40), _cell("bn", 0.01, 2, 0.92, 0.30),
        _cell("bn", 0.1, 1, 0.95, 0.20), _cell("bn", 0.1, 2, 0.93, 0.25),
        _cell("bn", 1.0, 1, 0.10, 2.30, collapsed=True, alarm=alarm), _cell("bn", 1.0, 2, 0.97, 0.10),
        _cell("pws", 0.01, 1, 0.80, 0.60), _cell("pws", 0.01, 2, 0.82, 0.55),
        _cell("pws", 0.1, 1, 0.85, 0.45, learned=False, risk={"case": "shift", "layer": "features.0", "step": 3}),
        _cell("pws", 0.1, 2, 0.86, 0.44),
        _cell("pws", 1.0, 1, 0.10, 2.30, collapsed=True, alarm=alarm), _cell("pws", 1.0, 2, 0.1, 2.3, alarm=alarm),
    ]  # fmt: skip
    bn, pws = _hand_results(cells)["norms"]
    # highest lr at which every seed trained: bn 1.0 has a collapsed seed; pws 0.1 has a seed that never learned
    assert bn["highest_lr_trained"] == 0.1 and pws["highest_lr_trained"] == 0.01
    # the lowest mean test loss where no seed collapsed: bn lr 0.1 (0.225), not lr 1.0 (a seed collapsed)
    assert bn["best"] == {"lr": 0.1, "batch_size": 64, "n_seeds": 2} and bn["best_test_loss"] == pytest.approx(0.225)
    assert bn["best_metric_mean"] == pytest.approx(0.94)
    assert pws["best"]["lr"] == 0.1 and pws["best_test_loss"] == pytest.approx(0.445)
    assert (bn["alarms"], pws["alarms"], pws["alarm_layers"]) == (1, 2, [["features.3", 2]])
    assert pws["regime_warnings"] == 1 and pws["regime"]["case"] == "shift" and bn["collapsed"] == 1
    table = norm_table(_hand_results(cells))
    assert "| bn | 0.1 (of 3) | 0.1, 64 | 0.225 | 94.0 ± 1.4 | 10.0 | 1/6 | 0/6 | 1/6 (`features.3` 1) | 0/6 |" in table
    assert "| pws | 0.01 (of 3) | 0.1, 64 | 0.445 | 85.5 ± 0.7 |" in table and "1/6: shift at `features.0`" in table


def test_the_plots_use_log_axes_where_values_span_decades(tmp_path):
    import matplotlib

    matplotlib.use("Agg", force=True)
    from normlab.runner.grid import plots

    res = _hand_results([_cell(n, lr, s, 0.5 + lr / 4, 1.0) for n in ("bn", "pws") for lr in (0.01, 0.1, 1.0)
                         for s in (1, 2)])  # fmt: skip
    axes_seen = []
    real = plots.save_figure

    def keep(fig, path, *a, **kw):
        axes_seen.extend(ax.get_xscale() for ax in fig.axes if ax.get_visible())
        return real(fig, path, *a, **kw)

    plots.save_figure = keep
    try:
        assert plots.metric_lr_plot(res, tmp_path / "lr.png").read_bytes()[:8] == PNG
    finally:
        plots.save_figure = real
    assert axes_seen == ["log", "log"]
    assert plots.spans_decades([0.01, 0.1]) and not plots.spans_decades([0.05, 0.2]) and not plots.spans_decades([0, 1])


# ------------------------------------------------------------------ the command line: resume after a kill, DDP


def _cli(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "normlab", "compare", "--model", "user_factories:small_cnn", "--dataset",
            "user_factories:digits16", "--norms", "bn,gn", "--lrs", "0.05", "--batch-sizes", "16", "--seeds", "100",
            "--epochs", "3", "--max-steps-per-epoch", "8", "--threads", "1", "--no-progress", "--out", str(out),
            *extra]  # fmt: skip


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")]))


def _comparable(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in ("step_time_s", "history")} | {
        "history": [{k: v for k, v in h.items() if k != "time_s"} for h in summary["history"]]
    }


def test_cli_on_a_user_factory_resumes_after_a_kill_with_the_same_results(tmp_path):
    ref = tmp_path / "ref"
    done = subprocess.run(_cli(ref, "--workers", "1"), env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "| bn |" in done.stdout and "| gn |" in done.stdout
    out = tmp_path / "killed"
    with open(tmp_path / "log.txt", "wb") as log:
        proc = subprocess.Popen(_cli(out, "--workers", "1"), env=_env(), stdout=log, stderr=log)
        first = out / "runs" / "bn_lr0.05_bs16_s100" / "summary.json"
        t0 = time.monotonic()
        while not (first.exists() and (out / "runs" / "gn_lr0.05_bs16_s100" / "checkpoint.pt").exists()):
            assert proc.poll() is None, (tmp_path / "log.txt").read_text()[-2000:]
            assert time.monotonic() - t0 < 300
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)  # in the middle of the second run: no handler runs
        proc.wait()
    assert not (out / "runs" / "gn_lr0.05_bs16_s100" / "summary.json").exists()
    again = subprocess.run(_cli(out, "--workers", "1"), env=_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert "1 of 2 runs already done" in again.stderr and "1 run to train, 1 already done" in again.stderr
    for cell in ("bn_lr0.05_bs16_s100", "gn_lr0.05_bs16_s100"):
        assert _comparable(_summary(out, cell)) == _comparable(_summary(ref, cell))


def test_torchrun_trains_each_run_over_the_processes(tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += _cli(out)[1:]
    r = subprocess.run(cmd, env={**_env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for cell in ("bn_lr0.05_bs16_s100", "gn_lr0.05_bs16_s100"):
        s = _summary(out, cell)
        assert s["world_size"] == 2 and s["epochs_run"] == 3
    assert r.stdout.count("| bn |") == 1  # rank 0 prints the table, alone
    assert json.loads((out / "results.json").read_text())["complete"]


def test_a_refusal_raised_in_a_worker_reaches_the_parent_whole():
    """A FieldError pickles (a worker process or a Ray task raises it; it used to arrive as 'cannot deserialize')."""
    import pickle

    from normlab.runner.errors import FieldError

    e = FieldError("TrainConfig", "model", "{lrs} too high", ("lrs",), sep=" ")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is FieldError and str(back) == str(e) == "TrainConfig model lrs too high"
    assert str(back.for_options(lambda f: "--" + f)) == "--model --lrs too high"


def test_ray_tasks_import_a_factory_of_this_process(tmp_path):
    """The embedded Ray's workers import from this process's path (tests/ here, the current directory for the CLI)."""
    from conftest import needs

    needs("ray")
    results = compare("user_factories:small_cnn", "user_factories:digits16", norms=["gn"], lrs=[0.05], out=tmp_path,
                      backend="ray", workers=1, **TINY)  # fmt: skip
    assert not results["failed"] and results["cells"][0]["steps_run"] == 3


def test_a_built_module_is_refused_and_a_redefined_data_function_is_loaded_again(tmp_path):
    with pytest.raises(UsageError, match="model: 'Sequential': pass the function .* not a built module"):
        compare(uf.small_cnn(10, 1), uf.digits16, norms=["bn"], out=tmp_path / "m", **TINY)
    for n in (600, 700):  # a notebook redefines its data function under the same name

        def data(n=n):
            return uf.digits16(n)

        results = compare(uf.small_cnn, data, norms=["bn"], lrs=[0.05], out=tmp_path / str(n), **TINY)
        assert _summary(tmp_path / str(n), results["cells"][0]["cell"])["num_classes"] == 10
    from normlab.runner.training import setup

    loaded = {v[2]["num_train"] for k, v in setup._MEMORY.items() if k[0].endswith("<locals>.data")}
    assert loaded == {600, 700}  # the second function's data, not the first one's kept under the same name


# ------------------------------------------------------------------ a norm registered by the model's own module
@pytest.fixture
def user_norm_module():
    """The user's module (tests/user_norm_module.py) not yet imported; its norm unregistered afterwards."""
    from normlab.nn import unregister_norm

    sys.modules.pop("user_norm_module", None)
    yield "user_norm_module"
    if sys.modules.pop("user_norm_module", None) is not None:
        unregister_norm("user_frn")


def test_a_norm_registered_by_the_models_module_is_a_name_the_grid_takes(user_norm_module, tmp_path, capsys):
    from normlab.cli import main

    out = tmp_path / "grid"
    argv = ["compare", "--model", f"{user_norm_module}:small_net", "--dataset", "user_factories:digits16",
            "--norms", "user_frn,bn", "--lrs", "0.05", "--batch-sizes", "32", "--seeds", "100", "--epochs", "1",
            "--max-steps-per-epoch", "2", "--workers", "2", "--no-progress", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err  # refused before: the names were checked before the import
    results = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in results["norms"]] == ["user_frn", "bn"] and results["complete"]
    summary = _summary(out, "user-frn_lr0.05_bs32_s100")  # the cell id spells it with a dash
    assert summary["config"]["norm"] == "user_frn" and summary["config"]["model"] == f"{user_norm_module}:small_net"
