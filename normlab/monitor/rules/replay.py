"""Run rules over a step: the one place that decides which rule is checked when, used by the live monitor and by
:func:`replay` (offline, over a recorded run), so both give the same events on the same data."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableSet, Sequence

from normlab.monitor.rules.base import Event, Rule, StepContext

__all__ = ["check_rules", "replay", "context_from_records"]


def context_from_records(
    step: int, records: Sequence[Mapping], layer_order: Sequence[str] | None = None, **fields
) -> StepContext:
    """The :class:`~normlab.monitor.StepContext` of a step from its per-layer records, as the monitor builds it: the
    output layer (the last conv/linear layer in forward order, ``index``, among those that ran) and the layers a
    normalization layer renormalizes (whose next layer in forward order is a norm layer; the output layer excluded).

    Args:
        step: the step.
        records: the step's per-layer records (``layer``, ``index``, ``kind``).
        layer_order: the layers that ran in a recorded forward, in order (None: every record's layer ran).
        **fields: the other :class:`~normlab.monitor.StepContext` fields (``loss``, ``grad_norm``, ``lrs``, ...).

    Example:
        >>> recs = [dict(layer="c1", index=0, kind="conv"), dict(layer="bn", index=1, kind="norm"),
        ...         dict(layer="fc", index=2, kind="linear")]
        >>> ctx = context_from_records(5, recs, loss=1.5)
        >>> ctx.output_layer, sorted(ctx.feeds_norm), ctx.loss
        ('fc', ['c1'], 1.5)
    """
    from normlab.monitor.rules.regime import exempt_layers

    ran = [r for r in records if r.get("kind") != "norm" and (layer_order is None or r["layer"] in layer_order)]
    output_layer = max(ran, key=lambda r: r.get("index", 0))["layer"] if ran else None
    feeds_norm = frozenset(exempt_layers(records) - {output_layer})
    order = tuple(layer_order) if layer_order is not None else tuple(r["layer"] for r in records)
    return StepContext(step=step, layer_order=order, feeds_norm=feeds_norm, output_layer=output_layer, **fields)


def check_rules(
    rules: Sequence[Rule], ctx: StepContext, records: Sequence[Mapping], fired: MutableSet[str] | None = None
) -> list[Event]:
    """Check every rule due at this step, in order, and return the events they raise.

    A rule is due when it is checked on every step (``every_step``) or the step recorded (``ctx.recorded``). Every
    due rule is checked (its state advances) even after it fired; with ``fired`` (a set of rule names, updated in
    place) only the first event of each rule is returned.

    Args:
        rules: the rules, in the order their events are wanted.
        ctx: this step's context.
        records: this step's per-layer records (full records when ``ctx.recorded``, else light records or none).
        fired: names of the rules that already fired (None: return every event).

    Returns:
        the events of this step, in rule order.
    """
    events = []
    for rule in rules:
        if not (rule.every_step or ctx.recorded):
            continue
        event = rule.check(ctx, records)
        if event is None:
            continue
        if fired is not None:
            if event.rule in fired:
                continue
            fired.add(event.rule)
        events.append(event)
    return events


def replay(
    rules: Sequence[Rule], contexts_and_records: Iterable[tuple[StepContext, Sequence[Mapping]]], once: bool = True
) -> list[Event]:
    """The events that ``rules`` raise over a recorded run, step by step, as the live monitor raises them.

    Args:
        rules: the rules (fresh, or restored with ``load_state_dict``); their state advances.
        contexts_and_records: ``(ctx, records)`` per step, in step order (records: the step's per-layer records,
            an empty sequence on a step that recorded nothing).
        once: keep only the first event of each rule (the monitor's behaviour); False: every event.

    Returns:
        the events, in step order (rule order within a step).

    Example:
        >>> from normlab.monitor.rules import NonFiniteRule
        >>> steps = [(StepContext(step=s, loss=v, recorded=False), []) for s, v in enumerate([2.0, 1.5, float("nan")])]
        >>> [(e.rule, e.step) for e in replay([NonFiniteRule()], steps)]
        [('non_finite', 2)]
    """
    fired: set[str] | None = set() if once else None
    events: list[Event] = []
    for ctx, records in contexts_and_records:
        events.extend(check_rules(rules, ctx, records, fired))
    return events
