"""The rule contract (normlab.monitor.rules.base) and replay: events round trip, rules are due when they should be,
replay keeps each rule's first event."""

from __future__ import annotations

import math

import pytest

from normlab.monitor.rules import Event, NonFiniteRule, Rule, StepContext, check_rules, replay


class _Above(Rule):
    name = "above"

    def __init__(self, limit: float = 1.0) -> None:
        self.limit, self.seen = limit, 0

    def check(self, ctx, records):
        self.seen += 1
        hot = [r for r in records if r.get("output_var", 0.0) > self.limit]
        if hot:
            return Event(self.name, "alarm", ctx.step, "too big", layer=hot[0]["layer"], value=hot[0]["output_var"])
        return None


def test_event_round_trips_and_checks_its_severity():
    e = Event("x", "warning", 3, "msg", layer="l", quantity="q", value=math.inf, details={"a": (1, 2), "b": {"c": 1}})
    back = Event.from_dict(e.to_dict())
    assert back.details == {"a": [1, 2], "b": {"c": 1}} and back.value == math.inf and not back.is_alarm
    assert Event.from_dict({**e.to_dict(), "event": "rule"}).rule == "x"
    with pytest.raises(ValueError, match="severity must be one of"):
        Event("x", "fatal", 0, "m")


def test_step_context_round_trips():
    ctx = StepContext(
        step=2,
        loss=1.5,
        grad_norm=0.3,
        lrs=(0.1,),
        skipped=True,
        layer_order=("a", "b"),
        feeds_norm=frozenset({"a"}),
        probes={"p/a": 2.0},
        recorded=False,
        output_layer="b",
        layer_lrs={"a": 0.1},
    )
    assert StepContext.from_dict(ctx.to_dict()) == ctx


def test_a_recorded_step_rule_is_not_checked_on_unrecorded_steps_and_fires_once_per_rule():
    rule = _Above()
    run = [
        (StepContext(step=s, recorded=s % 2 == 0), [{"layer": "c", "output_var": v}])
        for s, v in enumerate([0.5, 5.0, 0.5, 5.0, 5.0])
    ]
    events = replay([rule], run)
    assert [(e.step, e.layer) for e in events] == [(4, "c")]  # step 1 and 3 are not recorded steps
    assert rule.seen == 3
    assert [e.step for e in replay([_Above()], run, once=False)] == [4]
    fired: set[str] = set()
    assert check_rules([_Above()], StepContext(step=0), [{"layer": "c", "output_var": 2.0}], fired)
    assert not check_rules([_Above()], StepContext(step=1), [{"layer": "c", "output_var": 2.0}], fired)


def test_the_base_rule_must_be_subclassed():
    with pytest.raises(NotImplementedError, match="must implement check"):
        Rule().check(StepContext(step=0), [])
    assert Rule().state_dict() == {}
    with pytest.raises(ValueError, match="expected a dict"):
        Rule().load_state_dict([1])


def test_replay_of_a_scalar_rule_sees_every_step():
    steps = [(StepContext(step=s, loss=v, recorded=False), []) for s, v in enumerate([1.0, math.nan, math.nan])]
    assert [e.step for e in replay([NonFiniteRule()], steps)] == [1]
    assert [e.step for e in replay([NonFiniteRule()], steps, once=False)] == [1, 2]
