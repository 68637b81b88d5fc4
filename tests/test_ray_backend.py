"""Grids on Ray, for real: one local Ray session (2 CPUs, loopback only) for the whole module.

The same results and files as the process backend, resume across backends, a killed worker retried, a cell that
raises recorded as failed, and Ctrl-C of ``normlab compare --backend ray --address`` (a second driver on the
module's cluster) leaving the finished cells on disk."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
from conftest import claimed, needs

from normlab.runner.experiments.compare import run_grid
from normlab.runner.grid.execute import CellsFailed
from normlab.runner.grid.results import load_results
from normlab.runner.grid.spec import GridSpec, expand_grid
from normlab.runner.training.train import Trainer

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


def _spec(**kw) -> GridSpec:
    base = dict(
        norms=("bn", "gn", "pws"),
        lrs=(0.05,),
        batch_sizes=(16,),
        seeds=(0,),
        epochs=2,
        width=0.125,
        max_steps_per_epoch=3,
    )
    return GridSpec(**{**base, **kw})


def _without_timing(obj):
    if isinstance(obj, dict):
        return {k: _without_timing(v) for k, v in obj.items() if k not in _TIMING}
    if isinstance(obj, list):
        return [_without_timing(v) for v in obj]
    return obj


def _files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


def _interrupt_after_epochs(monkeypatch, n: int) -> None:
    """In this process, the n-th end of an epoch (checkpoint written) raises KeyboardInterrupt."""
    real, calls = Trainer._end_epoch, []

    def end_epoch(self, epoch, win):
        stop = real(self, epoch, win)
        calls.append(epoch)
        if len(calls) == n:
            raise KeyboardInterrupt
        return stop

    monkeypatch.setattr(Trainer, "_end_epoch", end_epoch)


def test_ray_matches_process_backend_and_resumes_its_grid(ray_cluster, tmp_path, monkeypatch):
    spec = _spec()
    ref = run_grid(spec, tmp_path / "process", workers=1, threads=1, progress=False, render=False)
    out = tmp_path / "mixed"
    _interrupt_after_epochs(monkeypatch, 3)  # first cell finished, second cell half-trained (epoch 1 of 2)
    with pytest.raises(KeyboardInterrupt):
        run_grid(spec, out, workers=1, threads=1, progress=False, render=False)
    monkeypatch.undo()
    first, second, third = (out / "runs" / c.cell_id for c in expand_grid(spec))
    assert (first / "summary.json").is_file() and (second / "checkpoint.pt").is_file()
    assert not (second / "summary.json").exists() and not third.exists()
    first_mtime = (first / "summary.json").stat().st_mtime_ns

    res = run_grid(spec, out, threads=1, progress=False, render=False, backend="ray")
    assert (first / "summary.json").stat().st_mtime_ns == first_mtime  # done locally, not rerun on Ray
    assert res["complete"] and res["failed"] == []
    assert _without_timing(load_results(out)) == _without_timing(load_results(tmp_path / "process"))
    assert _without_timing(res) == _without_timing(ref)
    assert _files(out) == _files(tmp_path / "process")
    whole = run_grid(spec, tmp_path / "ray", threads=1, progress=False, render=False, backend="ray")  # Ray only
    assert _without_timing(whole) == _without_timing(ref) and _files(tmp_path / "ray") == _files(out)
    for cell in expand_grid(spec):  # the resumed cell trained exactly as an uninterrupted one
        a, b = (d / "runs" / cell.cell_id / "metrics.jsonl" for d in (out, tmp_path / "process"))
        assert _without_timing([json.loads(x) for x in a.read_text().splitlines()]) == _without_timing(
            [json.loads(x) for x in b.read_text().splitlines()]
        )


def test_ray_records_a_cell_that_raises_and_finishes_the_others(ray_cluster, tmp_path):
    spec = _spec(norms=("bn", "gn"), epochs=1)
    bad, good = expand_grid(spec)
    (claimed(tmp_path) / "runs" / bad.cell_id).mkdir(parents=True)  # by the grid that wrote the checkpoint
    (tmp_path / "runs" / bad.cell_id / "checkpoint.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CellsFailed, match=f"1 run\\(s\\) failed \\(first: {bad.cell_id}: RunError: .*corrupt"):
        run_grid(spec, tmp_path, threads=1, progress=False, backend="ray")
    res = load_results(tmp_path)
    assert [c["cell"] for c in res["cells"]] == [good.cell_id]
    assert [f["cell"] for f in res["failed"]] == [bad.cell_id] and "corrupt or unreadable" in res["failed"][0]["error"]
    assert "Failed runs" in (tmp_path / "results.md").read_text()
    (tmp_path / "runs" / bad.cell_id / "checkpoint.pt").unlink()  # the user moves the bad file away and reruns
    res = run_grid(spec, tmp_path, threads=1, progress=False, render=False, backend="ray")
    assert res["complete"] and res["failed"] == [] and len(res["cells"]) == 2


def _ray_workers(cell_id: str) -> list[int]:
    """Processes running the Ray task of ``cell_id`` (Ray names them ``ray::normlab:<cell id>``)."""
    pids = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if f.read().startswith(f"ray::normlab:{cell_id}".encode()):
                    pids.append(int(d))
        except (OSError, ValueError):
            pass
    return pids


def _kill_when_training(cell_dir: Path, cell_id: str, killed: list, stop: threading.Event) -> None:
    """SIGKILL the worker of ``cell_id`` once it has written its first checkpoint."""
    while not stop.is_set() and not killed:
        pids = _ray_workers(cell_id) if (cell_dir / "checkpoint.pt").exists() else []
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        time.sleep(0.02)


def test_ray_retries_a_cell_whose_worker_is_killed(ray_cluster, tmp_path):
    spec = _spec(norms=("bn",), epochs=6, max_steps_per_epoch=8)
    (cell,) = expand_grid(spec)
    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(
        target=_kill_when_training, args=(tmp_path / "runs" / cell.cell_id, cell.cell_id, killed, stop), daemon=True
    )
    killer.start()
    try:
        res = run_grid(spec, tmp_path, threads=1, progress=False, render=False, backend="ray")
    finally:
        stop.set()
        killer.join()
    assert killed, "the cell finished before its worker could be killed"
    assert res["complete"] and res["failed"] == [] and res["cells"][0]["epochs_run"] == 6
    assert json.loads((tmp_path / "runs" / cell.cell_id / "summary.json").read_text())["epochs_run"] == 6


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_masks(pid: int) -> str:
    """The process's signal masks (pending, blocked, ignored, caught) from /proc, for a report."""
    status = Path(f"/proc/{pid}/status")
    lines = status.read_text().splitlines() if status.exists() else []
    return "; ".join(ln for ln in lines if ln.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")))


def _interrupt(proc: subprocess.Popen) -> str:
    """Ctrl-C, as a user presses it: SIGINT, a second one if the first did not stop the command within 60 s, then
    SIGTERM (the CLI treats both alike); a signal beyond the first is reported as a warning with the process's signal
    masks. Returns the command's stderr."""
    steps = ((signal.SIGINT, 60), (signal.SIGINT, 30), (signal.SIGTERM, 60))
    for i, (sig, wait) in enumerate(steps):
        if i:
            masks = _signal_masks(proc.pid)
            warnings.warn(f"normlab compare on Ray still running: sending {sig.name} ({masks})", stacklevel=2)
        proc.send_signal(sig)
        try:
            return proc.communicate(timeout=wait)[1]
        except subprocess.TimeoutExpired:
            continue
    proc.kill()
    err = proc.communicate()[1]
    raise AssertionError(f"normlab compare on Ray did not stop on SIGINT, SIGINT, SIGTERM: {err[-3000:]}")


def test_compare_on_a_ray_cluster_stops_on_ctrl_c_and_keeps_finished_cells(ray_cluster, tmp_path):
    address = ray_cluster.get_runtime_context().gcs_address
    out = tmp_path / "grid"
    # lr 1000 diverges in its first epoch (a finished, collapsed cell); lr 0.05 trains for minutes (4000 epochs:
    # about 400 s, so that a loaded machine still interrupts it long before its end)
    slow, fast = expand_grid(_spec(norms=("none",), lrs=(0.05, 1000.0), epochs=4000, max_steps_per_epoch=5))
    argv = [
        sys.executable,
        "-m",
        "normlab",
        "compare",
        "--backend",
        "ray",
        "--address",
        address,
        "--norms",
        "none",
        "--lrs",
        "0.05,1000",
        "--batch-sizes",
        "16",
        "--seeds",
        "0",
        "--epochs",
        "4000",
        "--width",
        "0.125",
        "--max-steps-per-epoch",
        "5",
        "--threads",
        "1",
        "--no-progress",
        "--yes",  # a long grid on purpose (its runs are monitored: the estimate passes 15 minutes)
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
        # Ctrl-C as at a terminal: a command started in the background of a non-interactive shell inherits SIGINT
        # ignored (a CI job's `cmd &`), and Python then never raises KeyboardInterrupt
        preexec_fn=_default_sigint,
    )
    try:
        deadline = time.monotonic() + 240
        while not (
            (out / "results.json").is_file()
            and load_results(out)["cells"]
            and (out / "runs" / slow.cell_id / "checkpoint.pt").is_file()
        ):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no cell finished"
            time.sleep(0.2)
        err = _interrupt(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "interrupted" in err.splitlines()[-1], err
    res = load_results(out)
    assert [c["cell"] for c in res["cells"]] == [fast.cell_id] and res["cells"][0]["collapsed"]
    assert not res["complete"] and (out / "runs" / fast.cell_id / "summary.json").is_file()
    assert (out / "runs" / slow.cell_id / "checkpoint.pt").is_file()  # resumable by the same command
    assert not (out / "runs" / slow.cell_id / "summary.json").exists()
    deadline = time.monotonic() + 30
    while _ray_workers(slow.cell_id) and time.monotonic() < deadline:  # the cancelled cell's worker is killed
        time.sleep(0.2)
    assert not _ray_workers(slow.cell_id)
    assert not (out / ".normlab.lock").exists()


def test_refusals_before_any_cell_runs(tmp_path, monkeypatch):
    from normlab.cli import main
    from normlab.runner.errors import RunError, UsageError
    from normlab.runner.experiments.compare import COMPARE
    from normlab.runner.grid import ray_backend
    from normlab.runner.grid.execute import plan_grid

    with pytest.raises(UsageError, match="cuda:1 with --backend ray.*use --device cuda"):
        ray_backend._gpus("cuda:1", 8)
    assert ray_backend._gpus("cuda", 0) == 1 and ray_backend._gpus("cpu", 8) == 0 and ray_backend._gpus("auto", 1) == 1
    with pytest.raises(UsageError, match="cuda:1 with --backend ray"):  # what compare checks before writing
        ray_backend.check_device("cuda:1")
    for ok in ("cuda", "cuda:0", "cpu", "auto"):
        ray_backend.check_device(ok)
    grid = plan_grid(COMPARE, _spec(norms=("bn",)), tmp_path)
    with pytest.raises(RunError, match="not visible on .*needs --out on a filesystem shared by every node"):
        ray_backend._check_visible(grid, grid.cells[0], "other-host")  # finished elsewhere, no files here
    for address, words in (
        ("ray://h:10001", "expected host:port"),
        ("h", "expected host:port"),
        ("127.0.0.1:1", "no Ray cluster answers there"),
    ):  # port 1 on the loopback: closed
        with pytest.raises(UsageError, match=words):
            ray_backend.check_address(address)
    assert main(["compare", "--backend", "ray", "--address", "127.0.0.1:1", "--out", str(tmp_path / "cli")]) == 2
    monkeypatch.setitem(sys.modules, "ray", None)  # Ray not installed
    with pytest.raises(UsageError, match=r"--backend ray needs Ray: pip install 'normlab\[ray\]'"):
        run_grid(_spec(norms=("gn",)), tmp_path / "g", progress=False, backend="ray")
    assert main(["compare", "--backend", "ray", "--norms", "bn", "--out", str(tmp_path / "cli")]) == 2
    assert not (tmp_path / "cli").exists()  # refused before anything was written
