"""The collapse benchmark (``normlab-lab collapse-bench``): collect + evaluate end to end on a tiny budget, the guard
check, and the scoring definitions."""

from __future__ import annotations

import json

import pytest

from normlab.runner.errors import UsageError
from normlab_lab.cli import main
from normlab_lab.collapse_bench import evaluate as bench_evaluate
from normlab_lab.collapse_bench import guard as bench_guard
from normlab_lab.collapse_bench import protocol
from normlab_lab.collapse_bench.setups import ALL_SETUPS, PILOT_SETUPS, SETUPS


def bench(*argv: str) -> int:
    return main(["collapse-bench", *argv])


def test_collect_and_evaluate_end_to_end(tmp_path, capsys):
    out = tmp_path / "runs"
    args = ["--out", str(out), "--seeds", "100", "--setups", "gpt_nowarmup,mlp_sgd", "--steps", "12"]
    assert bench("collect", *args, "--workers", "1") == 0
    files = sorted(out.glob("*.jsonl"))
    assert len(files) == len(protocol.configs([100], ["gpt_nowarmup", "mlp_sgd"]))
    header, steps = protocol.load_run(files[0])
    assert header["header"] and header["seed"] == 100 and header["chance_loss"] > 0
    line = steps[0]
    assert {"step", "loss", "grad_norm", "lrs", "records", "probes"} <= set(line)
    assert line["records"] and all("layer" in r for r in line["records"])
    gpt = [f for f in files if f.name.startswith("gpt")][0]
    assert any(k.startswith("attn_logit/") for k in protocol.load_run(gpt)[1][0]["probes"])
    mtime = files[0].stat().st_mtime_ns
    bench("collect", *args, "--workers", "1")  # finished runs are not rerun
    assert files[0].stat().st_mtime_ns == mtime
    capsys.readouterr()
    table = tmp_path / "table.json"
    assert bench("evaluate", *args, "--every", "2", "--json", str(table)) == 0
    text = capsys.readouterr().out
    assert "| detector |" in text and "gpt_nowarmup" in text
    data = json.loads(table.read_text())
    assert len(data["runs"]) == len(files)
    assert "transformer:attn_logit_growth" in data["alarms"] and "practitioner:loss_spike" in data["alarms"]
    assert all(len(v) == len(files) for v in data["alarms"].values())


def test_all_runs_collect_evaluate_and_guard(tmp_path, capsys):
    out = tmp_path / "runs"
    args = ["--out", str(out), "--seeds", "101", "--setups", "mlp_sgd", "--steps", "12", "--workers", "1"]
    assert bench("all", *args, "--guard-healthy", "1") == 0
    text = capsys.readouterr().out
    assert "| detector |" in text and "| set-up | collapsing runs saved | healthy runs changed |" in text
    assert (out / "guard.jsonl").exists()


def test_reserved_seeds_refused(capsys, tmp_path):
    with pytest.raises(UsageError, match="reserved"):
        protocol.parse_seeds("3-5")
    assert protocol.parse_seeds("300-302,310") == [300, 301, 302, 310]
    assert bench("collect", "--seeds", "3-5", "--out", str(tmp_path / "o")) == 2  # one line, nothing written
    err = capsys.readouterr().err.strip()
    assert err.startswith("normlab-lab collapse-bench: error: --seeds") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_score_definitions():
    runs = [
        dict(collapsed=False, step=None),  # healthy
        dict(collapsed=False, step=None),  # healthy
        dict(collapsed=True, step=50),  # warnable
        dict(collapsed=True, step=50),  # warnable
        dict(collapsed=True, step=3),  # too early to warn
        dict(collapsed=True, step=None),  # never learned: not warnable
    ]
    alarms = {"d": [None, 7, 40, 47, 0, 1]}
    s = bench_evaluate.score(runs, alarms)["d"]
    assert (s["warned"], s["warnable"]) == (1, 2)  # 47 is only 3 steps ahead
    assert s["median_lead"] == 10
    assert (s["false_alarms"], s["healthy"], s["fa_per_10"]) == (1, 2, 5.0)


def test_contexts_replay_the_recording_interval():
    steps = [
        dict(step=s, loss=2.0, grad_norm=1.0, lrs=[0.1], probes={"attn_logit/a": 1.0},
             records=[dict(step=s, layer="0", index=0, kind="linear", output_var=1.0, type="Linear"),
                      dict(step=s, layer="1", index=1, kind="norm", output_var=1.0),
                      dict(step=s, layer="2", index=2, kind="linear", output_var=1.0)])
        for s in range(6)
    ]  # fmt: skip
    got = list(bench_evaluate.contexts(steps, every=3))
    assert [c.recorded for c, _ in got] == [True, False, False, True, False, False]
    assert got[1][0].probes == {} and got[3][0].probes == {"attn_logit/a": 1.0}
    assert got[0][0].feeds_norm == frozenset({"0"}) and got[0][0].output_layer == "2"
    assert {r["layer"] for r in got[1][1]} == {"0", "2"} and "type" not in got[1][1][0]  # light records


def test_guard_run_and_table():
    saved = bench_guard.guard_run(dict(setup="mlp_sgd", lr=1.0, seed=100), steps=30)
    assert saved["steps"] == 30 and saved["rescues"] >= 1  # lr 1 explodes within a few steps
    healthy = bench_guard.guard_run(dict(setup="mlp_sgd", lr=0.01, seed=100), steps=30)
    assert healthy["rescues"] == 0 and not healthy["collapsed"]
    runs = [dict(setup="mlp_sgd", collapsed=True), dict(setup="mlp_sgd", collapsed=False)]
    text = bench_guard.guard_table(runs, [saved, healthy], ["mlp_sgd"])
    assert f"| mlp_sgd | {int(not saved['collapsed'])}/1 | 0/1 |" in text


def test_degraded_split_is_relative_to_the_best_healthy_run_of_the_same_setup_and_seed():
    steps = lambda v: [dict(step=i, loss=v) for i in range(20)]  # noqa: E731
    assert bench_evaluate.final_loss(steps(2.0) + [dict(step=20, loss=float("nan"))]) == pytest.approx(2.0)
    runs = [
        dict(setup="a", seed=1, collapsed=False, final_loss=2.0),
        dict(setup="a", seed=1, collapsed=False, final_loss=2.19),  # 9.5 % worse: not degraded
        dict(setup="a", seed=1, collapsed=False, final_loss=2.2),  # 10 % worse: degraded
        dict(setup="a", seed=2, collapsed=False, final_loss=2.2),  # best of its seed
        dict(setup="b", seed=1, collapsed=True, final_loss=9.0),  # collapsed: never degraded
    ]
    assert bench_evaluate.degraded(runs) == [False, False, True, False, False]


def test_the_report_setups_include_the_slow_onset_gpt_and_not_the_pilot_only_ones():
    assert "gpt_slow" in SETUPS and SETUPS["gpt_slow"]["warmup"] >= 200
    assert not set(PILOT_SETUPS) & set(SETUPS) and set(ALL_SETUPS) == set(SETUPS) | set(PILOT_SETUPS)
    assert protocol.configs([320], ["gpt_long"])[0]["setup"] == "gpt_long"  # pilot set-ups run by name


# ------------------------------------------------------------------------------------------ round 4: families
def test_round4_families_build_train_and_have_their_chance_loss():
    import math

    import torch

    from normlab_lab.collapse_bench import families
    from normlab_lab.collapse_bench.setups import FAMILY, HELD_OUT, batches, build, loss_fn

    held = [s for s in SETUPS if FAMILY[s] in HELD_OUT]
    assert {FAMILY[s] for s in held} == set(HELD_OUT) and len(held) == 2 * len(HELD_OUT)  # SGD and AdamW each
    assert {SETUPS[s]["opt"] for s in held} == {"sgd", "adamw_torch"}
    assert FAMILY["mlp_sgd"] == FAMILY["mlp_adamw"] == "mlp" and FAMILY["gpt_slow"] == "gpt"
    for name in [*held, "mlp_reg"]:
        cfg = SETUPS[name]
        model, opt, lr_at, chance = build(name, cfg["lrs"][0], 100)
        x, y = next(batches(cfg["model"], 4, 101))
        loss = loss_fn(name)(model(x), y)
        assert math.isfinite(loss.item()) and chance > 0, name
        loss.backward()
        opt.step()
        assert lr_at(0) == cfg["lrs"][0]
    # a regression's chance loss is the error of the best constant prediction: the targets' variance
    x, y = families.diabetes()
    assert build("mlp_reg", 1e-3, 100)[3] == pytest.approx(float(y.var(unbiased=False)))
    noisy, clean = next(batches("unet", 8, 100))
    assert noisy.shape == clean.shape == (8, 1, 16, 16) and not torch.equal(noisy, clean)
    assert loss_fn("unet_sgd") is loss_fn("unet_adamw") is families.mse and loss_fn("vit_sgd") is not families.mse


def test_collect_takes_a_pilots_rates_and_evaluate_prints_each_family(tmp_path, capsys):
    out = tmp_path / "runs"
    args = ["--out", str(out), "--seeds", "100", "--setups", "mlp_reg,unet_sgd,unet_adamw", "--steps", "4"]
    assert bench("collect", *args, "--workers", "1", "--lrs", "0.001,0.002") == 0
    assert sorted(p.stem for p in out.glob("unet_sgd*.jsonl")) == ["unet_sgd_lr0.001_s100", "unet_sgd_lr0.002_s100"]
    assert len(protocol.configs([100], ["mlp_reg"], [0.5])) == 1
    capsys.readouterr()
    # evaluate reads the set-ups' own grids: collect them too (4 steps each) and print the table per family
    assert bench("collect", *args, "--workers", "1") == 0
    capsys.readouterr()
    assert bench("evaluate", *args) == 0
    text = capsys.readouterr().out
    assert "**family unet**" in text and "**family mlp_reg**" in text and "**unet_sgd**" in text
    assert bench("collect", *args, "--lrs", "0.1,-1") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("normlab-lab collapse-bench: error: --lrs") and len(err.splitlines()) == 1, err
