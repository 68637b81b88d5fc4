"""Smoke test of benchmarks/bench_table.py (the issue-10 table) and run_all's device handling: no timing assertions,
the GPU path is exercised on CPU with small sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_script

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    return load_script(f"benchmarks/{name}.py")


@pytest.mark.slow
def test_quick_table_runs_and_rewrites_its_results_section(tmp_path, one_thread):
    table = _load("bench_table")
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\nintro kept\n")
    args = ["--quick", "--block-ms", "0.2", "--out", str(tmp_path / "t.json"), "--results", str(results)]
    data = table.main(args)
    groups = {row["group"] for row in data["rows"]}
    assert groups == {"layers", "convolutions", "whole step"}
    assert data["fused_check"] == "ok"
    layer_pairs = {(r["candidate"], r["reference"]) for r in data["rows"] if r["group"] == "layers"}
    assert ("SwitchableNorm2d", "nn.BatchNorm2d") in layer_pairs and ("BatchRenorm2d", "nn.BatchNorm2d") in layer_pairs
    for row in data["rows"]:
        if "ratio_median" in row:
            assert row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"]
    nets = [r for r in data["rows"] if r["group"] == "whole step"]
    assert {(r["model"], r["norm"]) for r in nets} == {(m, n) for m in ("plain", "resnet") for n in ("bn", "gn", "pws")}
    assert json.loads((tmp_path / "t.json").read_text())["rows"] == json.loads(json.dumps(data["rows"]))
    table.main(args)  # a second run replaces the section instead of appending another
    text = results.read_text()
    assert text.startswith("# Benchmark results\n\nintro kept\n")
    assert text.count("<!-- bench_table:cpu-quick:start -->") == 1 and "| BatchRenorm2d | nn.BatchNorm2d |" in text


def test_run_all_passes_the_device_and_skips_cpu_only_scripts(tmp_path):
    run_all = _load("run_all")
    args = type("A", (), {"device": "cuda", "quick": False, "results": "benchmarks/RESULTS.md"})()
    assert run_all._commands(BENCH / "bench_batch_renorm.py", args, tmp_path) == []
    assert run_all._commands(BENCH / "count_ops.py", args, tmp_path) == []  # CPU only
    [cmd] = run_all._commands(BENCH / "bench_table.py", args, tmp_path)
    assert cmd[cmd.index("--device") + 1] == "cuda" and "--results" in cmd and "--threads" not in cmd
    [cmd] = run_all._commands(BENCH / "bench_compiled.py", args, tmp_path)
    assert cmd[cmd.index("--device") + 1] == "cuda" and "--results" in cmd
    args.device, args.quick = "cpu", True
    [cmd] = run_all._commands(BENCH / "bench_table.py", args, tmp_path)
    assert "--quick" in cmd and "--results" not in cmd and cmd[cmd.index("--threads") + 1] == "1"
    args.quick = False
    gpt, resnet = run_all._commands(BENCH / "bench_monitor.py", args, tmp_path)  # the monitor on both models
    assert gpt[gpt.index("--model") + 1] == "gpt" and resnet[resnet.index("--model") + 1] == "resnet50"
    assert all("--results" in c and c[c.index("--threads") + 1] == "1" for c in (gpt, resnet))
    assert gpt[gpt.index("--out") + 1] != resnet[resnet.index("--out") + 1]
    [cmd] = run_all._commands(BENCH / "count_ops.py", args, tmp_path)
    assert "--timing" in cmd and "--results" in cmd
    overhead, snapshots = run_all._commands(BENCH / "bench_guard_fsdp.py", args, tmp_path)  # both measurements
    assert "overhead" in overhead and "snapshots" in snapshots
    assert all(c[c.index("--threads") + 1] == "1" for c in (overhead, snapshots))
    args.device = "cuda"
    assert run_all._commands(BENCH / "bench_guard_fsdp.py", args, tmp_path) == []  # 2 gloo ranks on the CPU


def test_bench_monitor_runs_a_timm_model_and_names_a_bad_model(tmp_path, one_thread, capsys):
    bench = _load("bench_monitor")
    out = tmp_path / "m.json"
    argv = ["--model", "timm:resnet10t", "--size", "32", "--batch-size", "2", "--steps", "10", "--repeats", "1"]
    bench.main([*argv, "--out", str(out)])
    printed = capsys.readouterr().out
    assert "timm.create_model('resnet10t')" in printed and "every=10 (default)" in printed
    with pytest.raises(SystemExit):
        bench.main(["--model", "timm:"])
    assert "expected plain, plain1d, resnet50, gpt or timm:<name>, got 'timm:'" in capsys.readouterr().err


def test_bench_monitor_gpt_with_probes(tmp_path, one_thread, capsys):
    bench = _load("bench_monitor")
    out = tmp_path / "g.json"
    argv = ["--model", "gpt", "--batch-size", "2", "--steps", "10", "--repeats", "1", "--probes"]
    bench.main([*argv, "--out", str(out)])
    printed = capsys.readouterr().out
    assert "CharGPT" in printed and "every=10 + probes" in printed
    assert "every=10 + probes" in json.loads(out.read_text())["ratio_to_unmonitored"]


def test_bench_guard_measures_each_store_and_the_step_ratio(tmp_path, one_thread, capsys):
    bench = _load("bench_guard")
    out = tmp_path / "snap.json"
    assert (
        bench.main(["snapshots", "--models", "tinylm", "--repeats", "1", "--tmp", str(tmp_path), "--out", str(out)])
        == 0
    )
    rows = json.loads(out.read_text())["result"]
    assert [r["store"] for r in rows] == ["host", "disk", "dcp"] and all(r["snapshot_bytes"] > 0 for r in rows)
    assert bench.main(["overhead", "--model", "tinylm", "--steps", "3", "--repeats", "2", "--batch-size", "2"]) == 0
    assert "guard at its defaults" in capsys.readouterr().out
