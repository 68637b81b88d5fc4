"""The speed benchmarks' generators (no timing assertions): the op-count table covers every layer in training and
eval; the GPU script runs end to end on the CPU in its smoke mode; the compiled-parity and eager reports render
and merge; the monitor benchmark writes its section."""

from __future__ import annotations

import json

import pytest
from conftest import load_script

import normlab.nn as L
from normlab.nn.registry import CONV_KINDS, NORM_NAMES, conv_entry, norm_entry


def _normlab_layers() -> set[str]:
    """Every layer class normlab defines that the registry names, and SyncBatchRenorm."""
    entries = [norm_entry(n) for n in NORM_NAMES] + [conv_entry(k) for k in CONV_KINDS]
    names = {cls.__name__ for entry in entries for cls in entry.classes.values()}
    return {n for n in names if hasattr(L, n) and getattr(L, n).__module__.startswith("normlab")} | {"SyncBatchRenorm"}


def test_op_count_table_covers_every_layer_in_training_and_eval(tmp_path, one_thread):
    ops = load_script("benchmarks/count_ops.py")
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\nkept\n")
    data = ops.main(["--out", str(tmp_path / "ops.json"), "--results", str(results)])
    rows = data["counts"]
    assert _normlab_layers() <= {r["layer"].split()[0].split("(")[0] for r in rows}
    for r in rows:
        assert all(isinstance(r[k], int) and r[k] > 0 for k in ("train", "train_reference", "eval", "eval_reference"))
    by_name = {(r["layer"], tuple(r["shape"]), r["layout"]): r for r in rows}
    brn = {k[0]: v for k, v in by_name.items() if k[1] == (32, 64)}
    # BatchNorm's own training call is the cheapest route; eval is BatchNorm's inference call (the same ops)
    assert brn["BatchRenorm1d rmax=1, dmax=0"]["train"] < brn["BatchRenorm1d rmax=3, dmax=5"]["train"]
    assert all(r["eval"] == r["eval_reference"] for r in brn.values())
    ops.main(["--results", str(results)])  # a second run replaces its section
    text = results.read_text()
    assert text.startswith("# Benchmark results\n\nkept\n") and text.count("<!-- count_ops:cpu:start -->") == 1
    assert "| SwitchableNorm3d | (2, 64, 4, 16, 16) | channels_last |" in text
    assert json.loads((tmp_path / "ops.json").read_text())["counts"] == rows


@pytest.mark.slow
def test_gpu_script_runs_on_the_cpu_in_smoke_mode(tmp_path, one_thread):
    gpu = load_script("benchmarks/gpu.py")
    results = tmp_path / "RESULTS.md"
    data = gpu.main(["--smoke", "--device", "cpu", "--out", str(tmp_path / "gpu.json"), "--results", str(results)])
    assert json.loads((tmp_path / "gpu.json").read_text())["smoke"] is True
    layers = {r["layer"].split()[0].split("(")[0] for r in data["readbacks"]}
    assert _normlab_layers() <= layers
    assert all(r["train"][0] == 0 and r["eval"][0] == 0 for r in data["readbacks"])  # no host read, as the CPU test
    modes = {(r["mode"], r["dtype"]) for r in data["layers"]}
    assert modes == {(m, d) for m in ("eager", "compiled") for d in ("float32", "bfloat16")}
    steps = {(r["model"].split()[0], r["mode"], r["candidate"]) for r in data["steps"]}
    assert {("CrossQ", "eager", "BatchRenorm1d"), ("CrossQ", "compiled", "BatchRenorm1d")} <= steps
    assert {c for m, _, c in steps if m == "resnet18"} == {"BatchRenorm", "SwitchableNorm", "PWS"}
    assert len(data["monitor"]) == 2 and not data["skipped"]
    text = results.read_text()
    assert "<!-- gpu:cpu-smoke:start -->" in text and "SMOKE TEST, not a measurement" in text


def _row(section, candidate, reference, ratio, **fields):
    return {
        "section": section,
        **fields,
        "candidate": candidate,
        "reference": reference,
        "candidate_us": 110.0,
        "reference_us": 100.0,
        "ratio": {"min": ratio - 0.01, "median": ratio, "max": ratio + 0.01},
        "target": 1.10 if section == "layers" else 1.05,
        "met": ratio <= (1.10 if section == "layers" else 1.05),
        "load": [1.0, 1.5],
    }


def test_compiled_report_merges_runs_and_marks_the_targets(tmp_path):
    bench = load_script("benchmarks/bench_compiled.py")
    run = {
        "date": "d",
        "command": "c",
        "clock": "cpu",
        "rounds": 5,
        "repeats": 3,
        "wall_s": 1.0,
        "machine": {"device": "cpu", "cpu": "x", "torch": "t", "threads": 1, "cpu_count": 2, "load_average": 1},
    }
    first = [_row("layers", "BatchRenorm1d", "nn.BatchNorm1d", 1.2, shape=[32, 64], layout="contiguous")]
    first.append(_row("layers", "BatchRenorm1d", "nn.BatchNorm1d", 1.0, shape=[256, 256], layout="contiguous"))
    data = bench.merge({}, first, run)
    again = [_row("layers", "BatchRenorm1d", "nn.BatchNorm1d", 1.05, shape=[32, 64], layout="contiguous")]
    again.append(_row("steps", "BatchRenorm", "BatchNorm", 1.02, model="resnet18", mode="compiled"))
    data = bench.merge(data, again, run)
    assert len(data["runs"]) == 2 and len(data["rows"]) == 3  # (32, 64) measured again: replaced, not added
    text = bench.markdown(data)
    assert "| (32, 64) | contiguous | BatchRenorm1d | nn.BatchNorm1d | 1.05 (1.04-1.06) | <= 1.10 | yes |" in text
    assert "| resnet18 | compiled | BatchRenorm | BatchNorm | 1.02 (1.01-1.03) | <= 1.05 | yes |" in text


def test_eager_report_says_when_torchrl_is_missing():
    bench = load_script("benchmarks/bench_layers.py")
    meta = {"device": "cpu", "command": "c", "torch": "t", "threads": 1, "machine": "m", "clock": "cpu", "rounds": 3}
    meta["torchrl"] = None
    rows = [
        {"section": "brn", "shape": [32, 64], "layout": "contiguous", "candidate": "normlab BatchRenorm1d",
         "reference": "nn.BatchNorm1d", "median_us": [10.0], "ratio": [3.0, 3.2, 3.1], "load": [1, 2]},
        {"section": "brn", "shape": [32, 64, 32, 32], "layout": "contiguous", "candidate": "normlab BatchRenorm2d",
         "reference": "nn.BatchNorm2d", "median_us": [10.0], "ratio": [1.2, 1.3, 1.25], "load": [1, 2]},
    ]  # fmt: skip
    text = bench.markdown({"meta": meta, "rows": rows})
    assert "torchrl is not installed" in text and "| torchrl not installed |" in text
    assert "| 1.25 (1.20-1.30) | <= 1.1 | **no** |" in text


def test_monitor_benchmark_writes_its_section(tmp_path, one_thread):
    bench = load_script("benchmarks/bench_monitor.py")
    results = tmp_path / "RESULTS.md"
    argv = ["--model", "gpt", "--batch-size", "2", "--steps", "10", "--repeats", "1", "--out", str(tmp_path / "m.json")]
    bench.main([*argv, "--results", str(results)])
    text = results.read_text()
    assert "<!-- bench_monitor:cpu:gpt:start -->" in text and "| every=10 (default) |" in text


@pytest.mark.slow
def test_the_performance_page_example_runs(monkeypatch):
    """docs/performance.md's compiled CrossQ update runs as written (compiled without generating kernels here)."""
    import re
    from pathlib import Path

    import torch

    text = (Path(__file__).resolve().parents[1] / "docs" / "performance.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn: compile_(fn, backend="aot_eager"))
    scope: dict = {}
    exec(compile(code, "performance.md", "exec"), scope)
    gen = torch.Generator().manual_seed(100)
    before = [p.detach().clone() for p in scope["critic"].parameters()]
    for _ in range(2):
        scope["update"](*(torch.randn(256, k, generator=gen) for k in (23, 23, 1)))
    assert all(not torch.equal(a, b) for a, b in zip(before, scope["critic"].parameters()))
