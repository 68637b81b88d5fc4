"""normlab.runner.training.train: metrics, determinism, kill/resume, collapse handling, bad input, monitor, DDP."""

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import normlab.monitor
import normlab.runner.training.train
from normlab.monitor.optim_step import step_hooks
from normlab.monitor.rules import Event
from normlab.nn import param_groups
from normlab.runner.models import build_model
from normlab.runner.training.config import TrainConfig
from normlab.runner.training.train import train

REPO = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(**kw):
    base = dict(width=0.05, batch_size=32, epochs=2, max_steps_per_epoch=3, lr=0.05)
    base.update(kw)
    return TrainConfig(**base)


def without_time(history):
    return [{k: v for k, v in h.items() if k != "time_s"} for h in history]


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def load_ckpt(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def test_run_writes_metrics_checkpoint_and_summary(tmp_path, capfd):
    cfg = tiny(epochs=3, milestones=(2,), target_acc=0.0)
    s = train(cfg, tmp_path / "run", progress=False)
    assert capfd.readouterr().err == ""  # progress=False: no bar
    assert set(s) >= {
        "config",
        "final_test_acc",
        "best_test_acc",
        "collapsed",
        "collapse_epoch",
        "epochs_to_target",
        "step_time_s",
        "epochs_run",
        "history",
    }
    assert s["epochs_run"] == 3 and not s["collapsed"] and s["collapse_epoch"] is None
    assert s["epochs_to_target"] == 1
    assert s["step_time_s"] > 0
    hist = s["history"]
    assert [h["epoch"] for h in hist] == [1, 2, 3]
    assert [h["lr"] for h in hist] == pytest.approx([0.05, 0.05, 0.005])  # x0.1 after milestone 2
    assert s["final_test_acc"] == hist[-1]["test_acc"] and s["best_test_acc"] == max(h["test_acc"] for h in hist)
    for h in hist:
        assert set(h) == {"epoch", "step", "train_loss", "train_acc", "test_loss", "test_acc", "lr", "time_s"}
        assert 0.0 <= h["train_acc"] <= 1.0 and 0.0 <= h["test_acc"] <= 1.0
    out = tmp_path / "run"
    assert read_jsonl(out / "metrics.jsonl") == hist
    assert json.loads((out / "summary.json").read_text())["history"] == hist
    assert s["config"] == json.loads(json.dumps(dataclasses.asdict(cfg)))
    ck = load_ckpt(out / "checkpoint.pt")
    assert ck["state"]["finished"] and ck["state"]["epoch"] == 3
    # SGD momentum 0.9; weight decay only on the kernels (conv weights are the only >1-D parameters here)
    groups = ck["optimizer"]["param_groups"]
    assert all(g["momentum"] == 0.9 for g in groups)
    n_kernels = sum(v.dim() > 1 for k, v in ck["model"].items() if k.endswith("weight"))
    assert sorted((g["weight_decay"], len(g["params"])) for g in groups) == [
        (0.0, len(groups[0]["params"]) + len(groups[1]["params"]) - n_kernels),
        (5e-4, n_kernels),
    ]
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp"))
    # a finished run is returned as is
    again = train(cfg, out, progress=True)
    assert again["history"] == hist
    # the progress bar shows epoch, loss and accuracy
    train(tiny(epochs=1, max_steps_per_epoch=1), tmp_path / "bar", progress=True)
    err = capfd.readouterr().err
    assert "epoch 1/1" in err and "loss=" in err
    shown = re.findall(r"train_acc=(\d+\.\d) %", err)  # a percent, as the summary line shows accuracy
    assert shown and all(0 <= float(x) <= 100 for x in shown), err


def test_training_learns_and_is_deterministic(tmp_path):
    cfg = tiny(epochs=2, max_steps_per_epoch=6, width=0.1, lr=0.05)
    a = train(cfg, tmp_path / "a", progress=False)
    b = train(cfg, tmp_path / "b", progress=False)
    assert without_time(a["history"]) == without_time(b["history"])
    ka, kb = load_ckpt(tmp_path / "a" / "checkpoint.pt"), load_ckpt(tmp_path / "b" / "checkpoint.pt")
    assert all(torch.equal(ka["model"][k], kb["model"][k]) for k in ka["model"])
    assert a["history"][-1]["train_loss"] < a["history"][0]["train_loss"] or a["final_test_acc"] > 0.3
    c = train(dataclasses.replace(cfg, seed=1), tmp_path / "c", progress=False)
    assert without_time(c["history"]) != without_time(a["history"])


def _run_in_subprocess(cfg, out_dir, threads, log):
    code = textwrap.dedent(
        f"""
        import torch
        torch.set_num_threads({threads})
        from normlab.runner.training.config import TrainConfig
        from normlab.runner.training.train import train
        train(TrainConfig(**{dataclasses.asdict(cfg)!r}), {str(out_dir)!r}, progress=False)
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL, stderr=open(log, "wb")
    )  # a file, not a pipe: a full pipe would block the child
    proc.log = log
    return proc


def _kill_when(proc, predicate, timeout=120):
    t0 = time.monotonic()
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"training subprocess ended early: {Path(proc.log).read_text()[-2000:]}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            raise AssertionError("training subprocess made no progress")
        # SIGKILL: no cleanup handlers run, exactly like an OOM kill or a power cut
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL


def _lines(path):
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_sigkill_and_resume_gives_identical_metrics(tmp_path):
    threads = torch.get_num_threads()
    cfg = tiny(epochs=4, max_steps_per_epoch=6, milestones=(3,), width=0.1)
    ref = train(cfg, tmp_path / "ref", progress=False)

    out = tmp_path / "killed"
    ckpt, metrics = out / "checkpoint.pt", out / "metrics.jsonl"
    # 1st kill: as soon as the first (pre-training) checkpoint exists
    _kill_when(_run_in_subprocess(cfg, out, threads, tmp_path / "log1.txt"), ckpt.exists)
    assert _lines(metrics) < 4
    # 2nd kill: after two epochs were checkpointed (the run is then in its third epoch)
    _kill_when(_run_in_subprocess(cfg, out, threads, tmp_path / "log2.txt"), lambda: _lines(metrics) >= 2)
    done_before = load_ckpt(ckpt)["state"]["epoch"]
    assert 2 <= done_before < 4, "the kill must happen mid-run for this test to mean anything"
    resumed = train(cfg, out, progress=False)
    assert without_time(resumed["history"]) == without_time(ref["history"])
    assert without_time(read_jsonl(metrics)) == without_time(read_jsonl(tmp_path / "ref" / "metrics.jsonl"))
    ka, kb = load_ckpt(ckpt), load_ckpt(tmp_path / "ref" / "checkpoint.pt")
    assert all(torch.equal(ka["model"][k], kb["model"][k]) for k in ka["model"])
    assert resumed["final_test_acc"] == ref["final_test_acc"]


def test_corrupt_checkpoint_and_orphan_results_are_refused(tmp_path):
    out = tmp_path / "run"
    cfg = tiny(epochs=2, max_steps_per_epoch=1)
    train(cfg, out, progress=False)
    metrics_before = (out / "metrics.jsonl").read_text()
    raw = (out / "checkpoint.pt").read_bytes()
    for broken in (b"this is not a checkpoint", raw[: len(raw) // 2]):  # garbage, truncated file
        (out / "checkpoint.pt").write_bytes(broken)
        with pytest.raises(RuntimeError, match=r"checkpoint\.pt.*corrupt"):
            train(cfg, out, progress=False)
        assert (out / "metrics.jsonl").read_text() == metrics_before  # nothing restarted over the results
        assert (out / "checkpoint.pt").read_bytes() == broken
    (out / "checkpoint.pt").unlink()
    with pytest.raises(RuntimeError, match="no checkpoint"):
        train(cfg, out, progress=False)
    other = tmp_path / "other"
    train(cfg, other, progress=False)
    with pytest.raises(ValueError, match="lr"):
        train(dataclasses.replace(cfg, lr=0.1), other, progress=False)
    ck = load_ckpt(other / "checkpoint.pt")  # an unfinished run of 2 DDP processes cannot resume in 1
    ck["state"].update(world_size=2, finished=False)
    torch.save(ck, other / "checkpoint.pt")
    with pytest.raises(ValueError, match="same number of processes"):
        train(cfg, other, progress=False)


def test_divergence_is_recorded_as_collapse(tmp_path):
    out = tmp_path / "run"
    cfg = tiny(norm="none", lr=1e6, epochs=5, max_steps_per_epoch=4)
    s = train(cfg, out, progress=False)
    assert s["collapsed"] and s["collapse_reason"] == "non_finite_loss"
    assert s["collapse_epoch"] == s["epochs_run"] < 5
    rows = read_jsonl(out / "metrics.jsonl")  # valid JSON (no NaN tokens)
    assert len(rows) == s["epochs_run"]
    ck = load_ckpt(out / "checkpoint.pt")
    assert ck["state"]["finished"] and ck["state"]["collapse_epoch"] == s["collapse_epoch"]
    assert all(torch.isfinite(v).all() for v in ck["model"].values() if v.is_floating_point())  # last good weights
    again = train(cfg, out, progress=False)
    assert again["collapsed"] and again["history"] == s["history"]


def test_bad_configurations_fail_before_training(tmp_path):
    with pytest.raises(ValueError, match="batch_size: batch size 2000 is larger"):
        train(tiny(batch_size=2000), tmp_path / "a", progress=False)
    with pytest.raises(ValueError, match="2-D inputs"):  # the 2-D plain net on 1-D data
        train(tiny(dataset="mnist1d"), tmp_path / "b", progress=False)
    with pytest.raises(ValueError, match="unknown norm"):
        train(tiny(norm="batchnorm"), tmp_path / "c", progress=False)
    with pytest.raises(ValueError, match="unknown dataset"):
        train(tiny(dataset="svhn"), tmp_path / "d", progress=False)
    with pytest.raises(ValueError, match="lr"):
        train(tiny(lr=-1.0), tmp_path / "e", progress=False)
    with pytest.raises(ValueError, match="milestones"):
        train(tiny(milestones=(3, 2)), tmp_path / "f", progress=False)
    with pytest.raises(TypeError):
        train({"lr": 0.1}, tmp_path / "g")
    with pytest.raises(ValueError, match="device"):
        train(tiny(device="gpu0"), tmp_path / "h", progress=False)
    with pytest.raises(ValueError, match="seed"):
        train(tiny(seed=-1), tmp_path / "i", progress=False)
    with pytest.raises(ValueError, match="TrainConfig guard_dead must be False unless guard is True"):
        train(tiny(guard_dead=True), tmp_path / "j", progress=False)
    with pytest.raises(ValueError, match="TrainConfig guard_dead must be True or False, got 1"):
        train(tiny(guard=True, guard_dead=1), tmp_path / "k", progress=False)
    assert not any((tmp_path / n).exists() for n in "abcdefghijk")


def test_weight_decay_skips_norm_parameters_biases_and_alpha():
    torch.manual_seed(0)
    m = build_model("resnet", "bn", "pws", 1, 10, (1, 8, 8), width=0.25, blocks=1)
    groups = param_groups(m, 5e-4)
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in m.parameters())  # every parameter exactly once
    wd = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    for name, p in m.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        is_norm = isinstance(m.get_submodule(name.rsplit(".", 1)[0]), torch.nn.BatchNorm2d)
        if leaf in ("bias", "alpha") or is_norm:
            assert wd[id(p)] == 0, name
        else:
            assert wd[id(p)] == 5e-4, name
    single = param_groups(m, 5e-4, no_decay=())
    assert len(single) == 1 and single[0]["weight_decay"] == 5e-4


def test_real_monitor_writes_records_and_continues_after_resume(tmp_path):
    cfg = tiny(epochs=3, max_steps_per_epoch=3, monitor_every=2)
    s = train(cfg, tmp_path / "m", progress=False)
    recs = read_jsonl(tmp_path / "m" / "monitor.jsonl")
    steps = sorted({r["step"] for r in recs if "layer" in r})
    assert steps == [0, 2, 4, 6, 8]  # 9 optimizer steps, recorded every 2nd
    assert all("output_var" in r for r in recs if "layer" in r)
    assert not s["collapsed"]
    assert s["monitor_risk"] is None  # 9 healthy steps: no regime warning (the key is there; its plumbing: below)
    # interrupted after epoch 1 (simulated: the first epoch's checkpoint), then resumed: same record steps
    part = tmp_path / "part"
    train(dataclasses.replace(cfg, epochs=1), part, progress=False)
    ck = load_ckpt(part / "checkpoint.pt")
    ck["config"]["epochs"], ck["state"]["finished"] = 3, False
    torch.save(ck, part / "checkpoint.pt")
    with open(part / "monitor.jsonl", "a") as f:  # a record written after the checkpoint must be dropped
        f.write(json.dumps({"step": 99, "layer": "stale"}) + "\n")
    train(cfg, part, progress=False)
    recs2 = read_jsonl(part / "monitor.jsonl")
    assert [(r["step"], r["layer"]) for r in recs2] == [(r["step"], r["layer"]) for r in recs]
    assert recs2 == recs  # deterministic training: the very same statistics


def fake_alarm(step: int) -> Event:
    """A factor-rule alarm as VarianceMonitor keeps it (``mon.alarm``)."""
    details = {"baseline": 1.0, "ratio": 1e6, "reason": "grew 1e+06x > factor 100", "direction": "grew"}
    return Event(
        "factor", "alarm", step, "layer 'features.0.conv' shift = 1e+06", "features.0.conv", "shift", 1e6, details
    )


def fake_risk(step: int) -> Event:
    """A regime-rule warning (its details are the summary's ``monitor_risk`` besides step and layer)."""
    return Event("regime", "warning", step, "unstable regime", "features.1.conv", "shift_term", 2.5, {"ratio": 2.5})


class FakeMonitor:
    """Stands in for VarianceMonitor: records every step, raises the regime warning at step ``risk_at`` and the alarm
    at step ``fire_at``."""

    fire_at = 4
    risk_at = 1

    def __init__(self, model, every=10, rules=None, optimizer=None):
        self.model, self.every, self.current_step, self.records, self.events = model, every, 0, [], []
        self.optimizer = optimizer
        step_hooks(optimizer).add(0, lambda: None, self._after)  # attached as VarianceMonitor is

    @property
    def alarm(self):
        return next((e for e in self.events if e.severity == "alarm"), None)

    def observe_loss(self, loss):
        pass

    def _after(self, stepped, loss):
        self.records.append({"step": self.current_step, "layer": "x", "output_var": 1.0})
        if self.current_step == self.risk_at:
            self.events.append(fake_risk(self.current_step))
        if self.current_step == self.fire_at:
            self.events.append(fake_alarm(self.current_step))
        self.current_step += 1

    def state_dict(self):
        return {"current_step": self.current_step}

    def close(self):
        pass


def test_monitor_alarm_stops_cleanly_and_keeps_last_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(normlab.runner.training.train, "VarianceMonitor", FakeMonitor)
    out = tmp_path / "run"
    cfg = tiny(epochs=4, max_steps_per_epoch=3, monitor_every=1, stop_on="alarm")
    s = train(cfg, out, progress=False)
    # the alarm fires at step 4 = the 2nd step of epoch 2
    assert s["collapsed"] and s["collapse_reason"] == "monitor_alarm" and s["collapse_epoch"] == 2
    assert s["stopped_early"] == "alarm"
    assert s["monitor_alarm"]["layer"] == "features.0.conv" and s["monitor_alarm"]["step"] == 4
    assert s["monitor_risk"] == {"step": 1, "layer": "features.1.conv", "ratio": 2.5}  # the regime warning, as is
    assert s["epochs_run"] == 2
    ck = load_ckpt(out / "checkpoint.pt")
    assert ck["state"]["finished"]
    ref = tiny(epochs=1, max_steps_per_epoch=3, monitor_every=1)
    r = train(ref, tmp_path / "ref", progress=False)  # same first epoch without the alarm
    kr = load_ckpt(tmp_path / "ref" / "checkpoint.pt")
    assert all(torch.equal(ck["model"][k], kr["model"][k]) for k in kr["model"])  # weights after epoch 1
    assert r["history"][0]["test_acc"] == s["history"][0]["test_acc"]
    lines = read_jsonl(out / "monitor.jsonl")
    assert [x["step"] for x in lines if "layer" in x and x.get("event") is None] == [0, 1, 2, 3, 4]
    assert [(x["rule"], x["severity"]) for x in lines if x.get("event") == "rule"] == [
        ("regime", "warning"),
        ("factor", "alarm"),
    ]
    assert lines[-1]["event"] == "rule" and lines[-1]["severity"] == "alarm"
    # without stop_on="alarm" the alarm is recorded but training goes on (no collapse confirms it)
    for stop_on in ("non_finite", "confirmed"):
        s2 = train(dataclasses.replace(cfg, stop_on=stop_on), tmp_path / stop_on, progress=False)
        assert not s2["collapsed"] and s2["epochs_run"] == 4 and s2["monitor_alarm"]["step"] == 4
        assert s2["stopped_early"] is None
    assert s2["monitor_risk"]["step"] == 1


def test_cifar10_format_trains_with_augmentation(tmp_path, monkeypatch):
    # every training batch goes through flip_crop (with the run's generator), no evaluation batch does, and the
    # augmented batch differs from the stored images; the run is still deterministic for its seed
    import pickle

    import numpy as np

    from normlab.runner.data import datasets

    seen = []

    def recording(x, generator=None, pad=4):
        out = flip_crop(x, generator, pad)
        seen.append((generator is not None, len(x), not torch.equal(out, x)))
        return out

    flip_crop = datasets.flip_crop
    monkeypatch.setattr(datasets, "flip_crop", recording)

    d = tmp_path / "data" / "cifar-10-batches-py"
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(d / name, "wb") as f:
            pickle.dump(
                {b"data": rng.integers(0, 256, (8, 3072), dtype=np.uint8), b"labels": rng.integers(0, 10, 8).tolist()},
                f,
            )
    cfg = tiny(dataset="cifar10", data_dir=str(tmp_path / "data"), batch_size=8, epochs=1, max_steps_per_epoch=2)
    s = train(cfg, tmp_path / "run", progress=False)
    assert s["epochs_run"] == 1 and s["history"][0]["train_loss"] is not None
    assert seen == [(True, 8, True)] * s["steps_run"] and s["steps_run"] == 2  # training batches only
    again = train(cfg, tmp_path / "again", progress=False)
    assert again["history"][0]["train_loss"] == s["history"][0]["train_loss"]


def _ddp_worker(rank, world, port, root, cfg_dict):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    from normlab.runner.training.config import TrainConfig
    from normlab.runner.training.train import train

    s = train(TrainConfig(**cfg_dict), Path(root) / f"rank{rank}", progress=False)
    left = not dist.is_initialized()  # train joined the torchrun group, so it left it (no gloo abort at exit)
    # a group the caller initialised stays the caller's
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=world)  # not the port
    again = train(
        TrainConfig(**{**cfg_dict, "epochs": 1, "max_steps_per_epoch": 1}), Path(root) / "again", progress=False
    )
    kept = dist.is_initialized()
    dist.barrier()
    Path(root, f"summary{rank}.json").write_text(
        json.dumps({**s, "left": left, "kept": kept, "again": again["world_size"]})
    )
    dist.destroy_process_group()


def test_ddp_two_processes(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = tiny(epochs=2, max_steps_per_epoch=3, batch_size=16, guard=True)  # the guard's checks shared by the ranks
    ctx = mp.spawn(_ddp_worker, args=(2, port, str(tmp_path), dataclasses.asdict(cfg)), nprocs=2, join=False)
    deadline = time.monotonic() + 240
    while not ctx.join(timeout=1):  # raises if a worker failed
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise AssertionError("DDP workers did not finish (hung process group?)")
    s0 = json.loads((tmp_path / "summary0.json").read_text())
    s1 = json.loads((tmp_path / "summary1.json").read_text())
    assert s0["world_size"] == s1["world_size"] == 2
    assert s0["left"] and s1["left"] and s0["kept"] and s1["kept"] and s0["again"] == s1["again"] == 2
    # DDP keeps the replicas identical: both evaluate to exactly the same test loss; train metrics are all-reduced
    assert without_time(s0["history"]) == without_time(s1["history"])
    assert s0["epochs_run"] == 2 and s0["rescues"] == s1["rescues"] == [] and s0["guard_gave_up"] is None
    # only rank 0 writes files
    assert (tmp_path / "rank0" / "metrics.jsonl").exists() and (tmp_path / "rank0" / "checkpoint.pt").exists()
    assert not (tmp_path / "rank1").exists()
    assert len(read_jsonl(tmp_path / "rank0" / "metrics.jsonl")) == 2


def test_mnist1d_cnn1d_and_resnet_model_kwargs(tmp_path):
    s = train(
        tiny(dataset="mnist1d", model="cnn1d", width=0.2, epochs=1, max_steps_per_epoch=3),
        tmp_path / "a",
        progress=False,
    )
    assert s["epochs_run"] == 1 and s["history"][0]["train_loss"] is not None
    s = train(
        tiny(
            model="resnet_pws",
            norm="none",
            conv="pws",
            width=0.125,
            epochs=1,
            max_steps_per_epoch=2,
            model_kwargs={"blocks": 1},
        ),
        tmp_path / "b",
        progress=False,
    )
    assert s["config"]["model_kwargs"] == {"blocks": 1} and s["history"][0]["train_loss"] is not None


def _resume_after_first_epoch(cfg, out, strip_monitor=False):
    """Run epoch 1 only, turn its checkpoint into the checkpoint of an interrupted ``cfg`` run, resume it."""
    train(dataclasses.replace(cfg, epochs=1), out, progress=False)
    ck = load_ckpt(out / "checkpoint.pt")
    ck["config"]["epochs"], ck["state"]["finished"] = cfg.epochs, False
    if strip_monitor:  # a checkpoint written before the monitor state was saved
        del ck["monitor"]
    torch.save(ck, out / "checkpoint.pt")
    return train(cfg, out, progress=False)


def test_resume_restores_monitor_baselines_and_gives_the_same_alarm(tmp_path):
    # plain net without normalization at a rate where a layer's shift explodes in epoch 2 (steps 2-3)
    cfg = tiny(norm="none", lr=0.3, epochs=3, max_steps_per_epoch=2, monitor_every=1)
    ref = train(cfg, tmp_path / "ref", progress=False)
    alarm = ref["monitor_alarm"]
    assert alarm is not None and alarm["step"] >= 2, "the alarm must fire after the interruption to test anything"
    key = lambda a: (a["layer"], a["step"], a["quantity"])  # noqa: E731

    ck = load_ckpt(tmp_path / "ref" / "checkpoint.pt")
    mon_state = ck["monitor"]  # plain types: loads with weights_only=True
    first_alarm = next(e for e in mon_state["events"] if e["severity"] == "alarm")
    assert mon_state["current_step"] == 6 and first_alarm["step"] == alarm["step"]
    assert len(mon_state["rules"]["factor"]["baselines"]) > 0

    resumed = _resume_after_first_epoch(cfg, tmp_path / "part")
    assert key(resumed["monitor_alarm"]) == key(alarm)
    got = resumed["monitor_alarm"]
    assert (got["value"], got["initial"]) == (alarm["value"], alarm["initial"])
    assert without_time(resumed["history"]) == without_time(ref["history"])
    assert read_jsonl(tmp_path / "part" / "monitor.jsonl") == read_jsonl(tmp_path / "ref" / "monitor.jsonl")

    # an old checkpoint without monitor state still resumes (same metrics); its baseline restarts after the resume,
    # which changes the alarm here: the saved state is what makes the resumed alarm right
    old = _resume_after_first_epoch(cfg, tmp_path / "old", strip_monitor=True)
    assert without_time(old["history"]) == without_time(ref["history"])
    assert old["monitor_alarm"] is None or key(old["monitor_alarm"]) != key(alarm)


def test_batch_renorm_schedule_follows_the_run(tmp_path):
    """With brn_schedule="paper" a short run never leaves the 5k-step warm-up (BRN == BN, bit for bit);
    the default "run" compresses the schedule to the run, so r and d act and the results differ."""
    kw = dict(epochs=2, max_steps_per_epoch=8, batch_size=8, width=0.1)
    bn = train(tiny(norm="bn", **kw), tmp_path / "bn", progress=False)
    paper = train(tiny(norm="brn", brn_schedule="paper", **kw), tmp_path / "paper", progress=False)
    run = train(tiny(norm="brn", **kw), tmp_path / "run", progress=False)
    assert without_time(paper["history"]) == without_time(bn["history"])
    assert without_time(run["history"]) != without_time(bn["history"])
    with pytest.raises(ValueError, match="brn_schedule"):
        tiny(norm="brn", brn_schedule="linear").validate()


def test_renorm_schedule_scaled_keeps_paper_proportions():
    from normlab.nn import RenormSchedule

    assert RenormSchedule.scaled(40000) == RenormSchedule()
    s = RenormSchedule.scaled(16)
    assert (s.warmup_steps, s.dmax_steps, s.rmax_steps) == (2, 10, 16)
    assert s(2) == (1.0, 0.0) and s(16) == (3.0, 5.0)


def test_resume_accepts_another_device_spelling(tmp_path):
    # the fields that may change between a run and its resumption are defined once (they used to differ between
    # train and the grid: a half-trained cell refused a new --device that a finished one accepted)
    from normlab.runner.training.config import RESUME_FREE

    assert {"device", "data_dir"} <= set(RESUME_FREE)
    cfg = tiny(epochs=1, max_steps_per_epoch=1)
    train(cfg, tmp_path / "r", progress=False)
    assert train(dataclasses.replace(cfg, device="auto"), tmp_path / "r", progress=False)["epochs_run"] == 1
    ck = load_ckpt(tmp_path / "r" / "checkpoint.pt")
    ck["state"]["finished"] = False  # as if killed after its last epoch's checkpoint
    torch.save(ck, tmp_path / "r" / "checkpoint.pt")
    assert train(dataclasses.replace(cfg, device="auto"), tmp_path / "r", progress=False)["epochs_run"] == 1
    with pytest.raises(ValueError, match="different config .*lr"):
        train(dataclasses.replace(cfg, lr=0.5), tmp_path / "r", progress=False)


def test_evaluations_within_an_epoch_make_curves(tmp_path):
    s = train(tiny(epochs=2, max_steps_per_epoch=6, evals_per_epoch=3), tmp_path / "c", progress=False)
    hist = s["history"]
    assert [h["epoch"] for h in hist] == [0.3333, 0.6667, 1, 1.3333, 1.6667, 2]
    assert [h["step"] for h in hist] == [2, 4, 6, 8, 10, 12]
    assert s["epochs_run"] == 2 and s["steps_run"] == 12
    assert read_jsonl(tmp_path / "c" / "metrics.jsonl") == hist


def test_train_mode_accuracy_is_reported_and_equals_eval_mode_without_batch_statistics(tmp_path):
    from normlab.runner.data.datasets import get_dataset
    from normlab.runner.training.evaluation import evaluate, evaluate_train_mode

    s = train(tiny(norm="gn", epochs=1, max_steps_per_epoch=4, eval_train_mode=True), tmp_path / "g", progress=False)
    assert s["final_test_acc_train_mode"] is not None
    _, test, _ = get_dataset("digits")
    torch.manual_seed(0)
    for norm in ("none", "gn", "ln"):
        m = build_model("plain", norm, "conv", 1, 10, (1, 16, 16), width=0.1)
        first = type(test)(test.x[:352], test.y[:352])  # 11 whole batches of 32 (the first 352 test samples)
        assert evaluate_train_mode(m, test, torch.device("cpu"), 32) == evaluate(m, first, torch.device("cpu"))[1]
    bn = build_model("plain", "bn", "conv", 1, 10, (1, 16, 16), width=0.1)
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    evaluate_train_mode(bn, test, torch.device("cpu"), 2)
    assert all(torch.equal(before[k], v) for k, v in bn.state_dict().items())  # running stats untouched


def test_dead_network_is_a_collapse_with_a_finite_loss(tmp_path):
    # lr 1e-7: the loss never leaves chance level; after >= 4 loss windows the run counts as a dead network
    s = train(tiny(lr=1e-7, epochs=3, max_steps_per_epoch=44, width=0.05), tmp_path / "d", progress=False)
    assert s["collapsed"] and s["collapse_reason"] == "never_left_chance" and s["collapse_step"] is None
    assert s["epochs_run"] == 3 and s["history"][-1]["train_loss"] is not None
    trace = json.loads((tmp_path / "d" / "loss_trace.json").read_text())
    assert trace["window"] == 32 and len(trace["losses"]) == 132


def test_guard_leaves_a_healthy_run_unchanged(tmp_path):
    cfg = tiny(epochs=2, max_steps_per_epoch=25, seed=100)
    plain = train(cfg, tmp_path / "plain", progress=False)
    guarded = train(dataclasses.replace(cfg, guard=True), tmp_path / "guarded", progress=False)
    assert guarded["rescues"] == [] and guarded["steps_lost"] == 0 and guarded["guard_gave_up"] is None
    assert without_time(guarded["history"]) == without_time(plain["history"])
    a, b = load_ckpt(tmp_path / "plain" / "checkpoint.pt"), load_ckpt(tmp_path / "guarded" / "checkpoint.pt")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_guard_rolls_a_diverging_run_back_with_half_the_rate(tmp_path):
    """The plain net without normalization at lr 0.3 (seed 100) hits a NaN loss at step 5; the guard goes back to
    its step-0 snapshot, halves the rate (the history shows 0.15) and the run trains on instead of stopping."""
    cfg = tiny(norm="none", width=0.125, lr=0.3, epochs=2, max_steps_per_epoch=40, seed=100)
    plain = train(cfg, tmp_path / "plain", progress=False)
    assert plain["collapse_reason"] == "non_finite_loss" and plain["epochs_run"] == 1
    s = train(dataclasses.replace(cfg, guard=True), tmp_path / "guarded", progress=False)
    assert s["collapse_reason"] != "non_finite_loss" and s["epochs_run"] == 2 and s["guard_gave_up"] is None
    (r,) = s["rescues"]
    assert r["reason"].startswith("non-finite") and r["restored_step"] == 0 and r["steps_lost"] == r["step"] + 1
    assert r["lr_before"] == 0.3 and r["lr_after"] == pytest.approx(0.15)
    assert [h["lr"] for h in s["history"]] == pytest.approx([0.15, 0.15])
    assert s["steps_run"] == 2 * 40 - r["steps_lost"]  # the lost steps count the one that found the NaN
    losses = json.loads((tmp_path / "guarded" / "loss_trace.json").read_text())["losses"]
    assert len(losses) == s["steps_run"] and all(v is not None for v in losses)


def test_a_rollback_into_an_earlier_epoch_leaves_no_abandoned_records_in_monitor_jsonl(tmp_path):
    # epochs of 5 steps, snapshots every 50 steps: the NaN losses at steps 3, 4, 5 (seed 100, lr 1.0; each after an
    # alarm) each go back to step 0, the later ones past records an earlier epoch already wrote; the log then holds
    # each (step, layer) once, the steps actually kept
    cfg = tiny(norm="none", width=0.125, lr=1.0, epochs=4, max_steps_per_epoch=5, seed=100, guard=True, monitor_every=1)
    s = train(cfg, tmp_path / "run", progress=False)
    assert [(r["step"], r["restored_step"]) for r in s["rescues"]] == [(3, 0), (4, 0), (5, 0)]
    lost = sum(r["steps_lost"] for r in s["rescues"])
    assert lost > 5 and s["steps_run"] > 0  # a rollback reached into an earlier epoch; some steps were kept
    log = normlab.monitor.load_log(tmp_path / "run" / "monitor.jsonl")
    keys = [(rec["step"], rec["layer"]) for rec in log.records]
    assert len(keys) == len(set(keys))
    assert {k[0] for k in keys} == set(range(s["steps_run"]))


def test_a_non_finite_test_loss_is_trouble_for_the_guard_dated_to_the_waiting_alarm(tmp_path):
    # seed 100, lr 0.3: the training losses stay finite (1e17) but the test loss after epoch 1 is not; the guard's
    # alarm from step 2 is still waiting for confirmation, so the rollback goes back to before it
    cfg = tiny(norm="none", width=0.125, lr=0.3, epochs=4, max_steps_per_epoch=5, seed=100, guard=True, monitor_every=1)
    s = train(cfg, tmp_path / "run", progress=False)
    (r, *_) = s["rescues"]
    assert r["reason"].startswith("non-finite test loss after epoch 1, after the monitor alarm: collapse warning")
    assert r["onset"] == 2 and r["restored_step"] == 0 and s["history"][0]["rescued"] is True
    assert s["collapse_reason"] is None and s["epochs_run"] == 4 and s["history"][-1]["test_loss"] is not None
    last = train(dataclasses.replace(cfg, epochs=1), tmp_path / "last", progress=False)
    assert last["collapse_reason"] == "non_finite_loss" and last["rescues"] == []  # no rollback after the last epoch


def test_guard_dead_rolls_back_a_net_that_never_learned_after_its_alarm(tmp_path):
    # seed 100, lr 0.2: the unnormalized net alarms at step 16 and never leaves chance. The default guard dismisses
    # the alarm (nothing it counts as trouble follows); guard_dead (chance_loss = ln 10) keeps it waiting while the
    # net has not learned and confirms it once the net is judged never to have learned (4 windows of 16 steps at
    # batch 64, over about 1,024 examples each): back to before the alarm
    base = dict(dataset="mnist1d", model="plain1d", norm="none", width=0.25, lr=0.2, batch_size=64, epochs=3)
    base.update(max_steps_per_epoch=25, seed=100, num_samples=2000, monitor_every=1, guard=True)
    plain = train(TrainConfig(**base), tmp_path / "guard", progress=False)
    assert plain["collapse_reason"] == "never_left_chance" and plain["rescues"] == []
    assert [d["step"] for d in plain["alarms_dismissed"]] == [16]
    again = train(TrainConfig(**base), tmp_path / "guard", progress=False)  # the finished run, read back, keeps them
    assert again["alarms_dismissed"] == plain["alarms_dismissed"]
    dead = train(TrainConfig(**base, guard_dead=True), tmp_path / "dead", progress=False)
    (r,) = dead["rescues"]
    assert r["reason"].startswith("never learned: its 16-step mean") and "at chance (2.303)" in r["reason"]
    assert r["kind"] == "never_left_chance" and r["step"] == 4 * 16 - 1  # judged after 4 windows
    assert (r["onset"], r["restored_step"], r["lr_after"]) == (16, 0, 0.1) and dead["alarms_dismissed"] == []
    assert dead["config"]["guard_dead"] is True


@pytest.mark.parametrize("dead", [False, True])
def test_a_guarded_run_interrupted_while_its_alarm_waits_resumes_exactly(tmp_path, dead):
    # the dead net above: at the end of epoch 1 (step 25) its alarm from step 16 still waits. Resumed from that
    # checkpoint, the default guard dismisses it at the same step and guard_dead rolls back to before it, as in
    # the uninterrupted run
    base = dict(dataset="mnist1d", model="plain1d", norm="none", width=0.25, lr=0.2, batch_size=64, epochs=3)
    cfg = TrainConfig(
        **base, max_steps_per_epoch=25, seed=100, num_samples=2000, monitor_every=1, guard=True, guard_dead=dead
    )
    ref = train(cfg, tmp_path / "ref", progress=False)
    assert len(ref["rescues"]) == int(dead) and len(ref["alarms_dismissed"]) == int(not dead)
    resumed = _resume_after_first_epoch(cfg, tmp_path / "part")
    assert resumed["rescues"] == ref["rescues"] and resumed["alarms_dismissed"] == ref["alarms_dismissed"]
    assert without_time(resumed["history"]) == without_time(ref["history"])
    assert resumed["final_test_acc"] == ref["final_test_acc"]


def test_guard_gives_up_as_a_collapse_and_resumes_with_its_rescues(tmp_path):
    cfg = tiny(norm="none", width=0.125, lr=10.0, epochs=3, max_steps_per_epoch=20, seed=100, guard=True)
    s = train(cfg, tmp_path / "run", progress=False)
    assert s["collapse_reason"] == "non_finite_loss" and len(s["rescues"]) == 3
    assert s["guard_gave_up"].startswith("CollapseGuard: gave up after 3 rescue(s)")
    assert train(cfg, tmp_path / "run", progress=False)["rescues"] == s["rescues"]  # the finished run, read back
    ok = tiny(epochs=2, max_steps_per_epoch=3, guard=True)
    ck = tmp_path / "ok"
    train(ok, ck, progress=False)
    state = load_ckpt(ck / "checkpoint.pt")["state"]
    assert state["guard"]["steps"] == state["steps_total"] == 6 and state["rescues"] == []


def test_the_train_command_loads_the_data_and_builds_the_model_once(tmp_path, monkeypatch):
    """`normlab train` checks its run (data, batch size, model, dry run) before it writes anything, and the trainer
    trains what the check built: MNIST-1D generated once, the model built once (it used to be twice each)."""
    from normlab.cli import main
    from normlab.runner.data import datasets, mnist1d
    from normlab.runner.training import setup

    counts = {"generated": 0, "loaded": 0, "built": 0}

    def counting(key, fn):
        def wrapper(*a, **kw):
            counts[key] += 1
            return fn(*a, **kw)

        return wrapper

    monkeypatch.setattr(mnist1d, "_memory", {})
    monkeypatch.setattr(setup, "_MEMORY", {})
    monkeypatch.setattr(mnist1d, "_generate", counting("generated", mnist1d._generate))
    monkeypatch.setattr(setup, "get_dataset", counting("loaded", datasets.get_dataset))
    monkeypatch.setattr(setup, "build_builtin", counting("built", setup.build_builtin))
    argv = ["train", "--dataset", "mnist1d", "--model", "plain1d", "--num-samples", "500", "--width", "0.125"]
    argv += ["--epochs", "1", "--max-steps-per-epoch", "2", "--batch-size", "16", "--quiet", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert counts == {"generated": 1, "loaded": 1, "built": 1}
    assert json.loads((tmp_path / "summary.json").read_text())["steps_run"] == 2
