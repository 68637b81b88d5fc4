"""Typed monitor records: one writer, one validated reader, the deprecated names, plots from the reader."""

from __future__ import annotations

import json
import math
import typing
import warnings

import pytest
import torch
from torch import nn

from normlab.monitor import (
    CollapseAlarm,
    CollapseDetector,
    VarianceMonitor,
    load_log,
    render_monitor_plots,
    write_monitor_log,
)
from normlab.monitor.records import COUNT_KEYS, LAYER_KEYS, NUMBER_KEYS, LayerRecord, NormRecord, layer_keys


def _net():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 5))


def _monitored_run(steps=6, blow_up_at=3, spp=True):
    torch.manual_seed(100)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = VarianceMonitor(model, every=1, countdown=False, risk=False)
    x, y = torch.randn(8, 3, 4, 4), torch.randint(0, 5, (8,))
    for step in range(steps):
        if step == blow_up_at:  # the first conv's kernel x 1e3: its output variance grows 1e6x
            with torch.no_grad():
                model[0].weight.mul_(1e3)
        nn.functional.cross_entropy(model(x), y).backward()
        mon.step(opt)
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
    assert mon.alarm is not None and mon.alarm.direction == "grew" and mon.alarm.layer == "0"
    assert CollapseAlarm.from_dict(log.alarm) == mon.alarm
    assert log.spp["entries"] == mon.spp["entries"] and log.spp["mode"] == mon.spp["mode"]
    records, alarm, spp = log  # unpacks as the old (records, alarm, spp) tuple
    assert alarm["event"] == "alarm" and spp["event"] == "spp" and records is log.records
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
    n = write_monitor_log(whole, mon.records, mon.alarm)
    half = len(mon.records) // 2
    m = write_monitor_log(parts, mon.records[:half], append=True)
    m += write_monitor_log(parts, mon.records[half:], mon.alarm, append=True)
    assert n == m == len(mon.records) + 1
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
    records, alarm, spp = load_log(path)
    assert [r["step"] for r in records] == [0, 10] and records[0]["shift"] is None
    assert spp["entries"][0]["avg_sq_mean"] is None and spp["entries"][0]["avg_var"] == 0.5
    assert alarm["direction"] == "shrank" and alarm["flagged"][0]["direction"] == "shrank"
    a = CollapseAlarm.from_dict(alarm)
    assert (a.baseline, a.ratio, a.direction) == (1.0, 1e-07, "shrank")
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


def test_deprecated_detector_names_warn_and_do_what_the_new_ones_do():
    new = CollapseDetector(explode_factor=10.0, watch=("shift",), implode_factor={"input_sq": 100.0})
    with pytest.warns(DeprecationWarning) as caught:  # one warning per old name, none left to the warnings summary
        old = CollapseDetector(factor=10.0, quantities=("shift",), shrink_factor={"input_sq": 100.0})
    said = [str(w.message) for w in caught]
    for name, new_name in (("factor", "explode_factor"), ("quantities", "watch"), ("shrink_factor", "implode_factor")):
        assert sum(f"'{name}' is deprecated, use '{new_name}'" in m for m in said) == 1, said
    for det in (new, old):
        assert det.check(0, _recs(1.0)) is None
    a, b = new.check(1, _recs(20.0)), old.check(1, _recs(20.0))
    assert a == b and a.ratio == 20.0
    for name, new_name in (("quantities", "watch"), ("factors", "explode_factor"), ("shrink", "implode_factor")):
        with pytest.warns(DeprecationWarning, match=f"CollapseDetector.{name}' is deprecated, use '{new_name}'"):
            assert getattr(old, name) == getattr(new, new_name)
    with pytest.warns(DeprecationWarning, match="use 'baselines'"):
        assert old.initial == new.baselines == {("a", "shift"): 1.0, ("a", "input_sq"): 1.0}


def test_deprecated_alarm_names_warn_and_the_implosion_reads_as_shrank():
    det = CollapseDetector(explode_factor=10.0, watch=("shift",), implode_factor={"input_sq": 100.0})
    det.check(0, _recs(1.0))
    alarm = det.check(1, [{"layer": "a", "index": 0, "shift": 1.0, "input_sq": 1e-3}])
    assert (alarm.quantity, alarm.baseline, alarm.ratio, alarm.direction) == ("input_sq", 1.0, 1e-3, "shrank")
    with pytest.warns(DeprecationWarning, match="use 'baseline'"):
        assert alarm.initial == 1.0
    with pytest.warns(DeprecationWarning, match="use 'ratio'"):
        assert alarm.growth == 1e-3
    d = alarm.to_dict()  # the file keys of logs and checkpoints stay
    assert list(d) == ["layer", "step", "quantity", "value", "initial", "growth", "reason", "flagged", "direction"]
    assert (d["initial"], d["growth"], d["flagged"][0]["direction"]) == (1.0, 1e-3, "shrank")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new names do not warn
        CollapseDetector(explode_factor=10.0).check(0, _recs(1.0))
        str(alarm)


def test_a_non_finite_alarm_reads_as_non_finite_and_is_null_in_the_log(tmp_path):
    det = CollapseDetector(explode_factor=10.0, watch=("shift",))
    alarm = det.check(0, _recs(float("nan")))
    assert alarm.direction == "non-finite" and alarm.ratio == math.inf
    write_monitor_log(tmp_path / "m.jsonl", [], alarm)
    event = json.loads((tmp_path / "m.jsonl").read_text())
    assert event["value"] is None and event["growth"] is None and event["direction"] == "non-finite"
    back = CollapseAlarm.from_dict(load_log(tmp_path / "m.jsonl").alarm)
    assert back.direction == "non-finite" and math.isnan(back.value) and back.ratio == math.inf


def test_a_checkpoint_state_with_an_old_alarm_restores():
    mon = _monitored_run(spp=False)
    state = mon.state_dict()
    old = {k: v for k, v in state["alarm"].items() if k != "direction"}  # as state_dict wrote it before
    fresh = VarianceMonitor(_net(), every=1, countdown=False, risk=False)
    fresh.load_state_dict({**state, "alarm": old})
    assert fresh.alarm == mon.alarm


def test_layer_keys_refuses_an_unknown_key():
    assert layer_keys("output_var") == ("output_var",)
    with pytest.raises(KeyError, match="'output_variance' is not a key of LayerRecord"):
        layer_keys("output_variance")


def test_the_demo_diagnosis_plots_from_the_reader(tmp_path):
    pytest.importorskip("matplotlib")
    from normlab.runner.experiments.demo.diagnosis import load_records, plot_diagnosis

    run = tmp_path / "run"
    run.mkdir()
    mon = _monitored_run(spp=False)
    mon.to_jsonl(run / "monitor.jsonl")
    (run / "summary.json").write_text(json.dumps({"collapsed": False, "monitor_alarm": None}))
    (run / "loss_trace.json").write_text(json.dumps({"losses": [2.3, 2.2, None, 2.0], "window": 2}))
    records, alarm = load_records(run)
    assert len(records) == len(mon.records) and alarm["layer"] == mon.alarm.layer
    assert plot_diagnosis([("run", run)], tmp_path / "d.png").is_file()
    (run / "monitor.jsonl").write_text('{"step": 0, "layer": 1}\n')
    with pytest.raises(ValueError, match=r"monitor.jsonl:1: expected a string 'layer'"):
        load_records(run)


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
