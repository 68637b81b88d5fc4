"""The monitor's constructor (a handful of arguments), its schedule, its recording options and its sinks."""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import idle, step_without_update
from torch import nn

from normlab.monitor import RecordOptions, RecordSchedule, VarianceMonitor
from normlab.monitor.rules import Event, Rule


def _net() -> nn.Module:
    torch.manual_seed(100)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3))


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _train(mon: VarianceMonitor, model: nn.Module, steps: int) -> None:
    """Train with the monitor's optimizer: its own step records."""
    opt = mon.optimizer
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(101))
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


class EveryStep(Rule):
    """Warns on every recorded step (a sink test needs events)."""

    name = "every_step"
    needs_loss = False

    def check(self, ctx, records):
        return Event(self.name, "warning", ctx.step, "tick", records[0]["layer"], "output_var", 1.0)


def test_the_constructor_has_a_handful_of_arguments_with_the_names_callers_use():
    params = list(inspect.signature(VarianceMonitor).parameters)
    assert params == ["model", "every", "rules", "probes", "optimizer", "recording"]


@pytest.mark.parametrize(
    ("schedule", "steps"),
    [
        (RecordSchedule(every=5), [0, 5, 10, 15]),
        (RecordSchedule(every=10, dense_steps=4), [0, 1, 2, 3, 10]),
        (RecordSchedule(every=7, dense_steps=9, dense_every=3), [0, 3, 6, 7, 14]),
        (RecordSchedule(every=1), list(range(16))),
    ],
)
def test_a_schedule_records_exactly_its_due_steps(schedule, steps):
    assert [s for s in range(16) if schedule.is_due(s)] == steps
    model = _net()
    mon = VarianceMonitor(model, every=schedule, rules=[], optimizer=_sgd(model))
    _train(mon, model, 16)
    assert sorted({r["step"] for r in mon.records}) == steps
    assert mon.every == schedule.every and mon.state_dict()["dense"] == [schedule.dense_steps, schedule.dense_every]


def test_an_int_every_is_the_plain_schedule_and_its_state_loads_in_a_schedule_monitor():
    model = _net()
    plain = VarianceMonitor(model, every=3, rules=[], optimizer=_sgd(model))
    assert plain.schedule == RecordSchedule(3)
    _train(plain, model, 4)
    twin = VarianceMonitor(_net(), every=RecordSchedule(3, 0, 1), rules=[])
    twin.load_state_dict(plain.state_dict())
    assert twin.current_step == 4
    dense = VarianceMonitor(_net(), every=RecordSchedule(3, dense_steps=5), rules=[])
    with pytest.raises(ValueError, match="dense_steps=0, dense_every=1, this monitor uses every=3, dense_steps=5"):
        dense.load_state_dict(plain.state_dict())


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: RecordSchedule(every=0), ValueError, "RecordSchedule: every must be an int >= 1, got 0"),
        (lambda: RecordSchedule(dense_steps=-1), ValueError, "RecordSchedule: dense_steps must be an int >= 0"),
        (lambda: RecordSchedule(dense_every=1.5), ValueError, "RecordSchedule: dense_every must be an int >= 1"),
        (lambda: RecordOptions(include_norm="yes"), ValueError, "RecordOptions: include_norm must be True or False"),
        (lambda: RecordOptions(record_eval=1), ValueError, "RecordOptions: record_eval must be True or False"),
        (lambda: VarianceMonitor(_net(), every="10"), ValueError, "every must be an int >= 1 or a RecordSchedule"),
        (lambda: VarianceMonitor(_net(), recording={"include_norm": False}), TypeError, "recording must be None or"),
        (lambda: VarianceMonitor(_net(), every=10, dense_steps=5), TypeError, "dense_steps"),
        (lambda: VarianceMonitor(_net()).add_sink(42), TypeError, "sink must be a callable"),
    ],
)
def test_a_wrong_option_fails_in_one_line_naming_it(make, error, message):
    with pytest.raises(error, match=message) as info:
        make()
    assert "\n" not in str(info.value)


def test_recording_options_choose_the_layers_and_the_forwards():
    model = _net()
    no_norm = VarianceMonitor(model, every=1, rules=[], recording=RecordOptions(include_norm=False))
    assert [kind for _, _, kind in no_norm.layers] == ["linear", "linear"]
    no_norm.close()
    model.eval()
    for record_eval, expected in ((False, set()), (True, {"0", "1", "3"})):
        mon = VarianceMonitor(
            model, every=1, rules=[], recording=RecordOptions(record_eval=record_eval), optimizer=idle(model)
        )
        model(torch.randn(4, 4))
        step_without_update(mon)
        mon.close()
        assert {r["layer"] for r in mon.records if "output_var" in r} == expected


class Board:
    """A sink object: what the monitor sends, and whether it was closed."""

    def __init__(self):
        self.records, self.updates, self.events, self.closed = [], [], [], False

    def write_records(self, records, mean_updates):
        self.records.append([dict(r) for r in records])
        self.updates.append(dict(mean_updates))

    def write_event(self, event):
        self.events.append(event)

    def close(self):
        self.closed = True


def test_sinks_get_every_recorded_step_and_every_kept_event_until_removed():
    model = _net()
    mon = VarianceMonitor(model, every=2, rules=[EveryStep()], optimizer=_sgd(model))
    board, called = Board(), []
    mon.add_sink(board)
    handle = mon.add_sink(called.append)
    _train(mon, model, 5)
    assert [[r["step"] for r in step][0] for step in board.records] == [0, 2, 4]
    assert [r for step in board.records for r in step] == mon.records  # exactly the records kept
    assert set(board.updates[0]) == {"0", "3"} and board.updates[0]["0"].shape == (8,)  # per-filter mean updates
    assert board.events == called == mon.events  # each rule's first event, once
    handle.remove()
    assert list(mon.sinks.values()) == [board]
    mon.close()
    assert board.closed


def test_a_sink_added_after_an_event_gets_only_later_ones_and_a_restored_event_is_not_resent():
    model = _net()
    mon = VarianceMonitor(model, every=1, rules=[EveryStep()], optimizer=_sgd(model))
    _train(mon, model, 2)
    late = []
    mon.add_sink(late.append)
    _train(mon, model, 2)
    assert late == [] and len(mon.events) == 1  # the rule's first event came before the sink
    again = VarianceMonitor(_net(), every=1, rules=[EveryStep()])
    again.add_sink(lambda e: pytest.fail("a restored event was sent again"))
    again.load_state_dict(mon.state_dict())
    assert again.events == mon.events


def test_setting_the_step_keeps_the_hooks_in_step_with_the_schedule():
    model = _net()
    mon = VarianceMonitor(model, every=5, rules=[])
    assert mon._handles  # step 0 records
    mon.current_step = 3
    assert not mon._handles and not mon.is_recording  # nothing recorded, no light rule: no hooks
    mon.current_step = 5
    assert mon._handles and mon.is_recording
