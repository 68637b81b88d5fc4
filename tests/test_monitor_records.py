"""Typed monitor records: one writer, one validated reader, logs of earlier versions, plots from the reader."""

from __future__ import annotations

import json
import math
import typing

import pytest
import torch
from torch import nn

from normlab.monitor import (
    Event,
    VarianceMonitor,
    load_log,
    render_monitor_plots,
    write_monitor_log,
)
from normlab.monitor.records import COUNT_KEYS, LAYER_KEYS, NUMBER_KEYS, LayerRecord, NormRecord, layer_keys
from normlab.monitor.rules import FactorRule, StepContext


def _net():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 5))


def _monitored_run(steps=6, blow_up_at=3, spp=True):
    torch.manual_seed(100)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # the conv feeds its BatchNorm alone: FactorRule tests its output variance only when asked (watch_renormalized)
    mon = VarianceMonitor(model, every=1, rules=[FactorRule(watch_renormalized=True)], optimizer=opt)
    x, y = torch.randn(8, 3, 4, 4), torch.randint(0, 5, (8,))
    for step in range(steps):
        if step == blow_up_at:  # the first conv's kernel x 1e3: its output variance grows 1e6x
            with torch.no_grad():
                model[0].weight.mul_(1e3)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    if spp:
        mon.add_signal_propagation((2, 3, 4, 4))
    return mon


def _null(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def test_round_trip_gives_the_same_records_alarm_and_spp(tmp_path):
    mon = _monitored_run()
    mon.records[1]["output_var"] = float("nan")  # a non-finite value is written and read as null
    mon.records[2]["shift"] = float("inf")
    path = mon.to_jsonl(tmp_path / "monitor.jsonl")
    log = load_log(path)
    assert log.records == [{k: _null(v) for k, v in r.items()} for r in mon.records]
    assert log.records[1]["output_var"] is None and log.records[2]["shift"] is None
    assert mon.alarm is not None and mon.alarm.details["direction"] == "grew" and mon.alarm.layer == "0"
    assert Event.from_dict(log.alarm) == mon.alarm and log.events == mon.events
    assert log.spp["entries"] == mon.spp["entries"] and log.spp["mode"] == mon.spp["mode"]
    records, alarm, spp, events = log
    assert alarm["rule"] == "factor" and spp["event"] == "spp" and records is log.records and events is log.events
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()


def test_the_records_a_monitor_writes_are_the_declared_keys_and_types():
    mon = _monitored_run(spp=False)
    hints = {**typing.get_type_hints(LayerRecord), **typing.get_type_hints(NormRecord)}
    seen = set()
    for rec in mon.records:
        cls = NormRecord if rec["kind"] == "norm" else LayerRecord
        assert set(rec) <= set(typing.get_type_hints(cls)), set(rec) - set(typing.get_type_hints(cls))
        for key, value in rec.items():
            if key in NUMBER_KEYS:
                assert isinstance(value, float), (key, value)
            elif key in COUNT_KEYS or key in ("step", "index"):
                assert isinstance(value, int) and not isinstance(value, bool), (key, value)
            else:
                assert isinstance(value, str) and hints[key] in (str, typing.Literal["conv", "linear", "norm"])
        seen |= set(rec)
    assert seen == set(LAYER_KEYS)  # every declared key is written by a real run (none is stale)


def test_appends_equal_one_write_and_the_count_is_the_lines_written(tmp_path):
    mon = _monitored_run(spp=False)
    whole, parts = tmp_path / "whole.jsonl", tmp_path / "parts.jsonl"
    n = write_monitor_log(whole, mon.records, mon.events)
    half = len(mon.records) // 2
    m = write_monitor_log(parts, mon.records[:half], append=True)
    m += write_monitor_log(parts, mon.records[half:], mon.events, append=True)
    assert n == m == len(mon.records) + len(mon.events) and mon.events
    assert parts.read_text() == whole.read_text()


OLD_LOG = (
    # as the writers before the records module wrote it: no "direction", NaN tokens in the spp event
    '{"step": 0, "layer": "fc", "index": 0, "type": "Linear", "kind": "linear", "output_var": 1.5, "shift": null}\n'
    '{"step": 10, "layer": "fc", "index": 0, "type": "Linear", "kind": "linear", "input_sq": 1e-07}\n'
    '{"event": "alarm", "layer": "fc", "step": 10, "quantity": "input_sq", "value": 1e-07, "initial": 1.0, '
    '"growth": 1e-07, "reason": "fell to 1e-07x < 1/1e+04 of its baseline", "flagged": [{"layer": "fc", '
    '"index": 0, "quantity": "input_sq", "initial": 1.0, "value": 1e-07, "growth": 1e-07, '
    '"reason": "fell to 1e-07x < 1/1e+04 of its baseline"}]}\n'
    '{"event": "spp", "mode": "layers", "input_shape": [2, 4], "entries": [{"name": "fc", "avg_sq_mean": NaN, '
    '"avg_var": 0.5, "residual_var": null}]}\n'
)


def test_an_old_format_log_loads_and_its_alarm_reads_naturally(tmp_path):
    path = tmp_path / "old.jsonl"
    path.write_text(OLD_LOG)
    records, alarm, spp, events = load_log(path)
    assert [r["step"] for r in records] == [0, 10] and records[0]["shift"] is None
    assert spp["entries"][0]["avg_sq_mean"] is None and spp["entries"][0]["avg_var"] == 0.5
    (a,) = events  # the old alarm event, as the event of the rule that raised it (the factor rule's implosion)
    assert (a.rule, a.severity, a.step, a.layer, a.quantity, a.value) == ("factor", "alarm", 10, "fc", "input_sq", 1e-7)
    assert (a.details["baseline"], a.details["ratio"], a.details["direction"]) == (1.0, 1e-07, "shrank")
    assert a.details["flagged"][0]["direction"] == "shrank" and "fell to 1e-07x" in a.message
    assert alarm == a.to_dict() and alarm["step"] == 10 and alarm["layer"] == "fc"
    drawn = render_monitor_plots(path, tmp_path / "plots")  # the plots render from an old log
    again = render_monitor_plots(load_log(path), tmp_path / "again")  # or from the log already read
    assert drawn and [p.name for p in again] == [p.name for p in drawn]


BAD_LINES = [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "is not a JSON object (got list)"),
    ('{"step": "3", "layer": "fc"}', "expected a string 'layer' and an integer 'step'"),
    ('{"step": 3, "layer": "fc", "shift": "big"}', "'shift' must be a number or null, got 'big'"),
    ('{"step": 3, "layer": "fc", "fan_in": 2.5}', "'fan_in' must be an integer"),
    ('{"step": 3, "layer": "fc", "kind": 1}', "'kind' must be a string"),
    ('{"event": "alarm", "layer": "fc", "step": 3}', "needs a string 'layer', an integer 'step' and a string"),
    ('{"event": "rule", "rule": "x", "severity": "fatal", "step": 3}', "a rule event needs a string 'rule'"),
    ('{"event": "rule", "rule": "x", "severity": "alarm", "step": 3, "value": "big"}', "'value' of a rule event"),
    ('{"event": "spp", "entries": [{"name": "a"}]}', "'entries' of an spp event must be objects"),
    ('{"loss": 1.0}', "neither a layer record"),
]


@pytest.mark.parametrize("line, message", BAD_LINES)
def test_a_malformed_line_is_refused_naming_file_and_line(tmp_path, line, message):
    path = tmp_path / "monitor.jsonl"
    path.write_text(OLD_LOG.splitlines()[0] + "\n\n" + line + "\n")
    with pytest.raises(ValueError) as info:
        load_log(path)
    text = str(info.value)
    assert text.startswith(f"load_log: {path}:3") and message in text and "\n" not in text


def test_an_event_of_a_newer_version_is_skipped(tmp_path):
    path = tmp_path / "monitor.jsonl"
    path.write_text(OLD_LOG.splitlines()[0] + '\n{"event": "regime", "layer": "fc"}\n')
    assert len(load_log(path).records) == 1


def _recs(v):
    return [{"layer": "a", "index": 0, "output_var": 1.0, "shift": v, "input_sq": 1.0}]


def test_the_implosion_reads_as_shrank_and_its_event_keeps_the_flag_keys():
    rule = FactorRule(explode_factor=10.0, watch=("shift",), implode_factor={"input_sq": 100.0})
    ctx = StepContext(step=0, output_layer="a")
    rule.check(ctx, _recs(1.0))
    alarm = rule.check(
        StepContext(step=1, output_layer="a"), [{"layer": "a", "index": 0, "shift": 1.0, "input_sq": 1e-3}]
    )
    d = alarm.details
    assert (alarm.quantity, d["baseline"], d["ratio"], d["direction"]) == ("input_sq", 1.0, 1e-3, "shrank")
    flag = d["flagged"][0]  # the flag keys of the log (FlaggedEntry): initial = baseline, growth = ratio
    assert (flag["initial"], flag["growth"], flag["direction"]) == (1.0, 1e-3, "shrank")


def test_a_non_finite_alarm_reads_as_non_finite_and_is_null_in_the_log(tmp_path):
    rule = FactorRule(explode_factor=10.0, watch=("shift",))
    alarm = rule.check(StepContext(step=0), _recs(float("nan")))
    assert alarm.details["direction"] == "non-finite" and alarm.details["ratio"] == math.inf
    write_monitor_log(tmp_path / "m.jsonl", [], [alarm])
    event = json.loads((tmp_path / "m.jsonl").read_text())
    assert event["event"] == "rule" and event["value"] is None and event["details"]["ratio"] is None
    back = Event.from_dict(load_log(tmp_path / "m.jsonl").alarm)
    assert back.details["direction"] == "non-finite" and back.value is None


def test_a_checkpoint_state_restores_the_events():
    mon = _monitored_run(spp=False)
    state = mon.state_dict()
    fresh = VarianceMonitor(_net(), every=1, rules=[FactorRule()])
    fresh.load_state_dict(state)
    assert fresh.alarm == mon.alarm and fresh.events == mon.events
    with pytest.raises(ValueError, match="with 'every', 'current_step' and 'rules'"):
        fresh.load_state_dict({k: v for k, v in state.items() if k != "rules"})  # e.g. an earlier version's state


def test_layer_keys_refuses_an_unknown_key():
    assert layer_keys("output_var") == ("output_var",)
    with pytest.raises(KeyError, match="'output_variance' is not a key of LayerRecord"):
        layer_keys("output_variance")


@pytest.mark.parametrize(
    "text, what",
    [
        (json.dumps({"config": {"norm": "bn"}, "final_test_acc": 0.9}, indent=2), "an object with keys config"),
        ('{"epoch": 1, "step": 10, "train_loss": 2.0}\n', "an object with keys epoch, step, train_loss"),
        ("[1, 2, 3]", "a list"),
    ],
)
def test_valid_json_that_is_not_a_monitor_log_is_named_with_what_was_expected(tmp_path, text, what, capsys):
    """A run's summary.json (pretty-printed) or metrics.jsonl given to `normlab monitor`: not 'invalid JSON'."""
    from normlab.cli import main

    path = tmp_path / "summary.json"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        load_log(path)
    said = str(info.value)
    assert f"is JSON ({what}" in said and "not a monitor log" in said and "not valid JSON" not in said
    assert "expected a monitor log: JSONL, one object per line" in said and "\n" not in said
    assert main(["monitor", str(path), "--out", str(tmp_path / "plots")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a monitor log" in err and "monitor.jsonl" in err
    assert not (tmp_path / "plots").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(6, 3, 3, 3), (5, 7), (4, 1), (3, 2, 5)])
def test_weight_stats_equal_the_stats_functions(shape, dtype):
    """The monitor computes the weight statistics from the per-filter moments (m_o, v_o) of all filters (what a
    sharded weight's ranks can assemble): the per-filter quantities are the values of the pure functions of
    normlab.monitor.stats exactly; those over all entries follow from them (E[W^2] = mean_o(v_o + m_o^2),
    Var[W] = mean_o v_o + Var_o m_o) and equal the direct ones up to rounding (a constant filter and a non-finite
    kernel included)."""
    from normlab.monitor import stats
    from normlab.monitor.hooks import weight_stats

    g = torch.Generator().manual_seed(100)
    rel = 1e-5 if dtype == torch.float32 else 1e-12
    for case in ("random", "constant_filter", "nan"):
        w = (torch.randn(shape, generator=g) * 0.3 + 0.1).to(dtype)
        if case == "constant_filter":
            w[0] = 0.5
        if case == "nan":
            w.view(-1)[1] = float("nan")
        after = w - 0.01 * torch.randn(shape, generator=g).to(dtype)
        mu = stats.filter_mean_update(w, after)
        got = weight_stats(w, after)
        vo, wf = stats.weight_variance(w), stats.filters(w)
        exact = {
            "weight_var": vo.mean(),
            "weight_var_min": vo.min(),
            "weight_var_max": vo.max(),
            "shift": stats.shift_of_average(w),
            "mean_update_mean": mu.mean(),
            "mean_update_std": mu.std(unbiased=False),
            "mean_update_absmax": mu.abs().max(),
        }
        close = {
            "weight_sq_mean": wf.square().mean(),
            "weight_norm": wf.norm(),
            "shift_scale_free": stats.shift_scale_free(w),
        }
        for key, value in exact.items():
            assert got[key] == float(value) or (math.isnan(got[key]) and math.isnan(float(value))), (case, key)
        for key, value in close.items():
            assert got[key] == pytest.approx(float(value), rel=rel, abs=1e-30, nan_ok=True), (case, key)
        assert got["constant_filters"] == int((vo == 0).sum())
        if "update_ratio_mean" in got:
            ratio = stats.weight_variance(after) / torch.where(vo != 0, vo, torch.ones_like(vo))
            summary = stats.masked_summary(ratio, vo != 0).double().tolist()
            got_summary = [got[k] for k in ("update_ratio_mean", "update_ratio_min", "update_ratio_max")]
            assert got_summary == summary or all(math.isnan(a) and math.isnan(b) for a, b in zip(got_summary, summary))
