"""The output directory: one run at a time (lock), no worker outlives its parent, nothing written through a planted
link, stale temporary files cleaned, and a later grid in the same directory adds to it (the union)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import claimed

from normlab.cli import main
from normlab.runner.errors import UsageError
from normlab.runner.experiments.compare import COMPARE, run_grid
from normlab.runner.grid.execute import plan_grid
from normlab.runner.grid.spec import GridSpec, expand_grid
from normlab.runner.io import TEMP_SUFFIX, check_dir_option
from normlab.runner.lock import CLAIM_NAME, LOCK_NAME, dir_claim, lock_holder, out_lock

LINUX = sys.platform.startswith("linux") and os.path.isdir("/proc")


def _tiny(**kw) -> GridSpec:
    base = dict(
        norms=("bn", "gn"), lrs=(0.05,), batch_sizes=(16,), seeds=(0,), epochs=1, width=0.125, max_steps_per_epoch=1
    )
    return GridSpec(**{**base, **kw})


# ------------------------------------------------------------------------------------------------ the lock
def test_lock_names_holder_creates_and_removes_only_what_it_made(tmp_path):
    out = tmp_path / "a" / "b" / "c"
    with out_lock(out, "compare") as d:
        assert d == out and lock_holder(out)["pid"] == os.getpid() and lock_holder(out)["command"] == "compare"
        with out_lock(out, "compare"):  # re-entrant in one process (run_grid inside the CLI's lock)
            pass
        assert (out / LOCK_NAME).is_file()
    assert not (tmp_path / "a").exists()  # the directories it created were empty: removed
    with pytest.raises(RuntimeError), out_lock(out, "x"):
        (out / "result.txt").write_text("kept")
        raise RuntimeError
    assert (out / "result.txt").read_text() == "kept" and not (out / LOCK_NAME).exists()


def test_lock_refuses_a_planted_link(tmp_path):
    outside = tmp_path / "outside"
    outside.write_text("keep")
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).symlink_to(outside)
    with pytest.raises(UsageError, match="lock file"), out_lock(out, "train"):
        pass
    assert outside.read_text() == "keep"


def test_check_dir_option_refusals(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for bad, words in (
        ("", "empty"),
        (str(f), "is a file"),
        (str(f / "x" / "y"), "which is a file"),
        (str(tmp_path / "dangling"), "missing path"),
    ):
        with pytest.raises(UsageError, match=words):
            check_dir_option(bad, "--out")
    (tmp_path / "link").symlink_to(tmp_path)  # a link to a directory is the user's choice
    assert check_dir_option(tmp_path / "link" / "new") == tmp_path / "link" / "new"
    assert not (tmp_path / "link" / "new").exists()


# ------------------------------------------------------------------------------------- processes: no orphans
def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _stat(int(d))) is not None and int(st[1]) == pid:
            kids.append(int(d))
    return kids


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def _workers(pid: int) -> list[int]:
    out = []
    for k in _children(pid):
        try:
            with open(f"/proc/{k}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    out.append(k)
        except OSError:
            pass
    return out


def _start_compare(out: Path, in_cells: bool = True) -> subprocess.Popen:
    """A 2-worker compare that trains for minutes; returns once both workers are inside their cells (or, with
    ``in_cells=False``, once both worker processes exist)."""
    argv = [
        sys.executable,
        "-m",
        "normlab",
        "compare",
        "--norms",
        "bn,gn",
        "--lrs",
        "0.05",
        "--batch-sizes",
        "16",
        "--seeds",
        "0",
        "--epochs",
        "500",
        "--width",
        "0.05",
        "--max-steps-per-epoch",
        "20",
        "--workers",
        "2",
        "--threads",
        "1",
        "--no-progress",
        "--yes",  # it trains for minutes on purpose: its estimate (timed on this machine) must not stop it
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    cells = [out / "runs" / c.cell_id / "checkpoint.pt" for c in expand_grid(_tiny())]
    deadline = time.monotonic() + 240
    while not (all(c.exists() for c in cells) if in_cells else len(_workers(proc.pid)) >= 2):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.2)
    return proc


def _wait_gone(pids: list[int], seconds: float = 20.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


@pytest.mark.skipif(not LINUX, reason="scans /proc")
def test_killed_parent_leaves_no_worker_and_a_second_run_is_refused(tmp_path, capsys):
    out = tmp_path / "grid"
    proc = _start_compare(out)
    try:
        kids = _children(proc.pid)
        assert len([k for k in kids if _alive(k)]) >= 2  # two workers (and the resource tracker)
        # the same command on the same --out while the first one runs: one line naming the holder
        rc = main(
            [
                "compare",
                "--norms",
                "bn,gn",
                "--lrs",
                "0.05",
                "--batch-sizes",
                "16",
                "--seeds",
                "0",
                "--epochs",
                "500",
                "--width",
                "0.05",
                "--max-steps-per-epoch",
                "20",
                "--workers",
                "1",
                "--no-progress",
                "--out",
                str(out),
            ]
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and f"pid {proc.pid}" in err[0] and "in use" in err[0], err
        proc.kill()  # SIGKILL: no handler runs in the parent
        proc.wait(timeout=30)
        assert _wait_gone(kids) == [], "children survived their parent"
    finally:
        if proc.poll() is None:
            proc.kill()
    assert lock_holder(out)["pid"] == proc.pid  # the dead holder's file is still there ...
    with out_lock(out, "test"):  # ... and is taken over
        assert lock_holder(out)["pid"] == os.getpid()


@pytest.mark.skipif(not LINUX, reason="scans /proc")
def test_sigterm_stops_workers_and_exits_130(tmp_path):
    out = tmp_path / "grid"
    proc = _start_compare(out, in_cells=False)
    try:
        kids = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
        assert "interrupted" in proc.stderr.read()
        assert _wait_gone(kids) == []
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (out / LOCK_NAME).exists()


# --------------------------------------------------------------------------- files: links, temps, the union
def _plant(out: Path, names: list[str], outside: Path, run: str = "normlab compare") -> None:
    """Links at ``names`` in ``out``, a directory claimed by ``run`` (as its first run left it)."""
    out.mkdir(parents=True, exist_ok=True)
    if not (out / CLAIM_NAME).exists():
        claimed(out, run)
    for n in names:
        (out / n).symlink_to(outside)


def test_grid_union_links_and_stale_temps(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    out = tmp_path / "grid"
    _plant(out, ["grid.json"], outside)  # a link where normlab reads its own record: refused, nothing written
    with pytest.raises(UsageError, match="grid.json is not a normlab grid"):
        run_grid(_tiny(), out, workers=1, progress=False, threads=1)
    (out / "grid.json").unlink()
    _plant(out, ["results.json", "results.md", "loss_curves.png"], outside)
    stale = out / "runs" / "gn_lr0.05_bs16_s0" / f".checkpoint.pt.abc{TEMP_SUFFIX}"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"left by a killed writer")
    run_grid(_tiny(), out, workers=1, progress=False, threads=1)
    assert outside.read_text() == "keep"
    assert not any((out / n).is_symlink() for n in ("grid.json", "results.json", "results.md"))
    assert not stale.exists()
    # a rerun with a subset keeps every finished cell in results.json / results.md
    results = run_grid(_tiny(norms=("bn",)), out, workers=1, progress=False, threads=1)
    assert sorted(c["name"] for c in results["cells"]) == ["bn", "gn"] and results["complete"]
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["spec"]["norms"] == ["bn", "gn"] and len(on_disk["cells"]) == 2
    assert "| gn |" in (out / "results.md").read_text()
    # a grid with other settings is refused in one line, and nothing changes
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(UsageError, match="different config.*epochs: 1 -> 2.*another output directory"):
        plan_grid(COMPARE, _tiny(norms=("pws",), epochs=2), out)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_monitor_outputs_never_follow_links(tmp_path):
    import torch

    from normlab.monitor import VarianceMonitor, render_monitor_plots

    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.ReLU(), torch.nn.Conv2d(2, 2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with VarianceMonitor(model, every=1, optimizer=opt) as mon:
        for _ in range(2):
            model(torch.randn(2, 1, 6, 6)).mean().backward()
            opt.step()
    _plant(tmp_path / "o", ["log.jsonl", "log.csv", "fig1a_update_ratio.png"], outside)
    log = mon.to_jsonl(tmp_path / "o" / "log.jsonl")
    mon.to_csv(tmp_path / "o" / "log.csv")
    render_monitor_plots(log, tmp_path / "o")
    assert outside.read_text() == "keep"
    assert not any(p.is_symlink() for p in (tmp_path / "o").iterdir())
    assert (tmp_path / "o" / "fig1a_update_ratio.png").read_bytes()[:4] == b"\x89PNG"


def test_train_cleans_stale_temps_of_a_killed_writer(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    stale = out / f".checkpoint.pt.dead{TEMP_SUFFIX}"
    stale.write_bytes(b"half a checkpoint")
    claimed(out, "normlab train")  # by the run that was killed
    rc = main(
        [
            "train",
            "--norm",
            "bn",
            "--width",
            "0.125",
            "--epochs",
            "1",
            "--max-steps-per-epoch",
            "1",
            "--batch-size",
            "16",
            "--out",
            str(out),
            "--quiet",
            "--threads",
            "1",
        ]
    )
    assert rc == 0 and not stale.exists() and (out / "summary.json").is_file()
    assert not (out / LOCK_NAME).exists()


# ------------------------------------------------------------------- one command per output directory (the claim)
def test_claim_takes_a_new_or_empty_directory_resumes_its_own_and_refuses_the_rest(tmp_path):
    new = tmp_path / "new" / "out"
    with out_lock(new, "demo", claim="normlab-lab demo --quick", record="demo.json") as d:
        assert dir_claim(d) == {"run": "normlab-lab demo --quick", "record": "demo.json"}
        (d / "demo.json").write_text("{}")
    with out_lock(new, "demo", claim="normlab-lab demo --quick"):  # the same command resumes
        pass
    # another command, or the same one in another mode: one line naming the command and its record
    for other in ("normlab-lab demo", "normlab compare", "normlab train"):
        with pytest.raises(UsageError) as e, out_lock(new, "x", claim=other):
            pass
        msg = str(e.value)
        assert "\n" not in msg and "holds a `normlab-lab demo --quick` run (demo.json)" in msg, msg
        assert "pass another --out" in msg
    empty = tmp_path / "empty"
    empty.mkdir()
    with out_lock(empty, "train", claim="normlab train"):
        (empty / "summary.json").write_text("{}")
    assert dir_claim(empty)["run"] == "normlab train"
    # the user's own files: refused, named, left as they were, nothing written
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match=r"holds files no normlab run wrote \(notes.txt\); pass an empty"):
        with out_lock(mine, "compare", claim="normlab compare"):
            pass
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    # a claim file that is no claim, or a link, is refused rather than trusted
    (mine / CLAIM_NAME).write_text("[1]")
    with pytest.raises(UsageError, match="not a normlab claim file"), out_lock(mine, "x", claim="normlab train"):
        pass


def test_a_run_that_writes_nothing_leaves_nothing_and_a_lock_alone_claims_nothing(tmp_path):
    out = tmp_path / "a" / "b"
    with pytest.raises(RuntimeError), out_lock(out, "compare", claim="normlab compare"):
        raise RuntimeError  # e.g. a grid refused after the claim: the claim goes with the empty directory
    assert not (tmp_path / "a").exists()
    claimed = tmp_path / "c"
    with out_lock(claimed, "compare", claim="normlab compare"):
        (claimed / "grid.json").write_text("{}")
    with out_lock(claimed, "report", option="DIR"):  # `normlab report DIR` reads any run's directory
        pass
    assert dir_claim(claimed)["run"] == "normlab compare"


def _tiny_train(out: Path) -> list[str]:
    return ["train", "--norm", "bn", "--width", "0.125", "--epochs", "1", "--max-steps-per-epoch", "1",
            "--batch-size", "16", "--out", str(out), "--quiet", "--threads", "1"]  # fmt: skip


def _tiny_compare(out: Path) -> list[str]:
    grid = ["--norms", "bn", "--lrs", "0.05", "--batch-sizes", "16", "--seeds", "100", "--epochs", "1"]
    return ["compare", *grid, "--width", "0.125", "--max-steps-per-epoch", "1", "--workers", "1", "--no-progress",
            "--out", str(out)]  # fmt: skip


def test_train_and_compare_never_share_a_directory_or_take_the_users(tmp_path, capsys):
    train_dir, grid_dir = tmp_path / "train", tmp_path / "grid"
    assert main(_tiny_train(train_dir)) == 0
    assert main(_tiny_train(train_dir)) == 0  # rerun: resumes (the run is finished)
    assert main(_tiny_compare(grid_dir)) == 0
    capsys.readouterr()
    for argv, holder, record in (
        (_tiny_compare(train_dir), "normlab train", "summary.json"),
        (_tiny_train(grid_dir), "normlab compare", "grid.json"),
    ):
        d = Path(argv[argv.index("--out") + 1])
        before = {p: p.read_bytes() for p in d.rglob("*") if p.is_file()}
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--out {d} holds a `{holder}` run ({record})" in err[0], err
        assert {p: p.read_bytes() for p in d.rglob("*") if p.is_file()} == before
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    for argv in (_tiny_train(mine), _tiny_compare(mine)):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "holds files no normlab run wrote (notes.txt)" in err[0], err
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
