"""The monitor log (``monitor.jsonl``): its one writer and its one reader.

:func:`write_monitor_log` writes :mod:`~normlab.monitor.records` as strict JSON lines (non-finite values as null):
the layer records, then the rules' events (``{"event": "rule", ...}``, :class:`~normlab.monitor.Event`), then
the spp event. It replaces the file atomically (a link at the target is
replaced, not followed) or, with ``append=True``, appends (refusing a link): ``VarianceMonitor.to_jsonl``, the
trainer (one append per epoch) and the Lightning callback all write through it.

:func:`load_log` reads a log back, validated: every line a JSON object, layer records with a string ``layer``, an
integer ``step`` and numbers (or null) under the number keys, well-formed events; the first bad line is refused in one
line naming ``file:line``. Logs of earlier versions load: ``NaN``/``Infinity`` tokens read as null, and their alarm
event (``{"event": "alarm", ...}``, one per log, written before the rules existed) becomes an
:class:`~normlab.monitor.Event` of the rule that raised it (``"countdown"`` for the quantities only the
countdown reads, ``"factor"`` otherwise), its ``initial``/``growth`` the event's ``baseline``/``ratio`` details (a
missing ``direction`` derived from its value and reason). Lines of events this version does not know are skipped,
so a newer log still loads.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from normlab._checks import is_int, is_number
from normlab._files import append_bytes, atomic_write
from normlab.monitor.records import (
    ALARM_EVENT,
    COUNT_KEYS,
    NUMBER_KEYS,
    RULE_EVENT,
    SPP_EVENT,
    LayerRecord,
    NormRecord,
    SppEvent,
    finite_or_null,
)
from normlab.monitor.rules.base import SEVERITIES, Event
from normlab.monitor.rules.variance import alarm_message

__all__ = ["MonitorLog", "write_monitor_log", "load_log", "monitor_lines", "legacy_alarm_event", "direction_of"]

_COUNTDOWN_QUANTITIES = ("output_var_growth", "output_var_level", "grad_norm")


def direction_of(d: Mapping) -> str:
    """``"grew"``, ``"shrank"`` or ``"non-finite"``: the direction of an alarm or flag dict of an older log (written
    before the key ``direction`` existed), from its value and reason.

    Example:
        >>> direction_of({"value": 1e-6, "reason": "fell to 1e-06x < 1/1e+04 of its baseline"})
        'shrank'
    """
    value = d.get("value")
    if value is None or not math.isfinite(value) or str(d.get("reason", "")).startswith("non-finite"):
        return "non-finite"
    return "shrank" if str(d.get("reason", "")).startswith("fell") else "grew"


def legacy_alarm_event(d: Mapping) -> Event:
    """The :class:`~normlab.monitor.Event` of an alarm event written before the rules existed
    (:class:`~normlab.monitor.records.AlarmEvent`: ``layer``, ``step``, ``quantity``, ``value``, ``initial``,
    ``growth``, ``reason``, ``flagged``, ``direction``; the summary's ``monitor_alarm`` has the first five).

    Example:
        >>> e = legacy_alarm_event({"layer": "c1", "step": 4, "quantity": "output_var_growth", "value": 9.0,
        ...                         "initial": 1.0, "growth": 9.0, "reason": "output variance growing"})
        >>> e.rule, e.severity, e.details["baseline"], e.details["direction"]
        ('countdown', 'alarm', 1.0, 'grew')
    """
    quantity = str(d.get("quantity"))
    baseline, value = d.get("initial", d.get("baseline")), d.get("value")
    reason = str(d.get("reason", ""))
    details = {
        "baseline": baseline,
        "ratio": d.get("growth", d.get("ratio")),
        "reason": reason,
        "direction": d.get("direction") or direction_of(d),
        "flagged": [dict(f) for f in d.get("flagged", [])],
    }
    shown = [math.nan if v is None else float(v) for v in (value, baseline)]
    message = alarm_message(str(d.get("layer")), quantity, *shown, reason)
    rule = "countdown" if quantity in _COUNTDOWN_QUANTITIES else "factor"
    return Event(rule, "alarm", int(d["step"]), message, d.get("layer"), quantity, value, details)


def _as_event(e) -> Event:
    """An Event from an Event, its dict, or a legacy alarm dict."""
    if isinstance(e, Event):
        return e
    return Event.from_dict(e) if "rule" in e and "severity" in e else legacy_alarm_event(e)


class MonitorLog(NamedTuple):
    """What :func:`load_log` returns; unpacks as ``records, alarm, spp, events``.

    Attributes:
        records: the layer records (:class:`~normlab.monitor.records.LayerRecord`,
            :class:`~normlab.monitor.records.NormRecord`) in file order.
        alarm: the first event of severity ``"alarm"`` as a dict (:meth:`~normlab.monitor.Event.to_dict`:
            ``rule``, ``step``, ``layer``, ``quantity``, ``value``, ``message``, ``details``), or None.
        spp: the signal-propagation event (:class:`~normlab.monitor.records.SppEvent`), or None.
        events: every event, as :class:`~normlab.monitor.Event` s in file order (an older log's alarm
            converted by :func:`legacy_alarm_event`).

    Example:
        >>> records, alarm, spp, events = MonitorLog([], None, None, [])
        >>> records, alarm, spp, events
        ([], None, None, [])
    """

    records: list[LayerRecord | NormRecord]
    alarm: dict | None
    spp: SppEvent | None
    events: list[Event]


def monitor_lines(
    records: Iterable[Mapping[str, Any]],
    events: Iterable[Event | Mapping[str, Any]] = (),
    spp: Mapping[str, Any] | None = None,
) -> list[str]:
    """The log lines (without newlines) of ``records``, events and spp data: strict JSON, non-finite as null.

    Example:
        >>> monitor_lines([{"step": 0, "layer": "fc", "index": 0, "type": "Linear", "kind": "linear",
        ...                 "output_var": float("nan")}])
        ['{"step": 0, "layer": "fc", "index": 0, "type": "Linear", "kind": "linear", "output_var": null}']
    """
    lines = [json.dumps(finite_or_null(dict(r)), allow_nan=False) for r in records]
    if events is None or isinstance(events, Event | Mapping):
        events = () if events is None else (events,)
    for event in events:
        body = _as_event(event).to_dict()
        lines.append(json.dumps(finite_or_null({"event": RULE_EVENT, **body}), allow_nan=False))
    if spp is not None:
        body = {k: v for k, v in spp.items() if k != "event"}
        lines.append(json.dumps(finite_or_null({"event": SPP_EVENT, **body}), allow_nan=False))
    return lines


def write_monitor_log(
    path: str | os.PathLike,
    records: Iterable[Mapping[str, Any]],
    events: Iterable[Event | Mapping[str, Any]] | Event | Mapping[str, Any] | None = (),
    spp: Mapping[str, Any] | None = None,
    append: bool = False,
) -> int:
    """Write (or append to) a monitor log; returns the number of lines written.

    Args:
        path: the log file; its directory is created if missing.
        records: layer records (:class:`~normlab.monitor.records.LayerRecord` / ``NormRecord`` dicts).
        events: the rules' :class:`~normlab.monitor.Event` s (or their dicts; one event alone, or an alarm
            dict of an older log, is accepted too), written after the records.
        spp: :func:`~normlab.monitor.signal_propagation` data, written as the spp event last.
        append: append to ``path`` (refusing a link there) instead of replacing it atomically.

    Example:
        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "monitor.jsonl"
        >>> rec = {"step": 0, "layer": "fc", "index": 0, "type": "Linear", "kind": "linear", "output_var": 2.0}
        >>> write_monitor_log(path, [rec]), write_monitor_log(path, [{**rec, "step": 1}], append=True)
        (1, 1)
        >>> [r["step"] for r in load_log(path).records]
        [0, 1]
    """
    text = "".join(line + "\n" for line in monitor_lines(records, events, spp))
    data = text.encode("utf-8")
    if append:
        append_bytes(path, data)
    else:
        atomic_write(path, lambda f: f.write(data))
    return text.count("\n")


def _check_record(obj: dict) -> str | None:
    """What is wrong with a layer record, or None."""
    if not isinstance(obj["layer"], str) or not is_int(obj["step"]):
        return f"expected a string 'layer' and an integer 'step', got {obj['layer']!r} and {obj['step']!r}"
    if not (obj.get("index") is None or is_number(obj["index"])):
        return f"'index' must be a number, got {obj['index']!r}"
    for key in ("type", "kind"):
        if key in obj and not isinstance(obj[key], str):
            return f"{key!r} must be a string, got {obj[key]!r}"
    for key in NUMBER_KEYS:
        if key in obj and not (obj[key] is None or is_number(obj[key])):
            return f"{key!r} must be a number or null, got {obj[key]!r}"
    for key in COUNT_KEYS:
        if key in obj and not (obj[key] is None or is_int(obj[key])):
            return f"{key!r} must be an integer, got {obj[key]!r}"
    return None


def _check_alarm(obj: dict) -> str | None:
    """What is wrong with an alarm event, or None; adds ``direction`` to an old one."""
    if not (isinstance(obj.get("layer"), str) and is_int(obj.get("step")) and isinstance(obj.get("quantity"), str)):
        return "an alarm event needs a string 'layer', an integer 'step' and a string 'quantity'"
    if any(not (obj.get(k) is None or is_number(obj[k])) for k in ("value", "initial", "growth")):
        return "'value', 'initial' and 'growth' of an alarm event must be numbers or null"
    flagged = obj.setdefault("flagged", [])
    if not isinstance(flagged, list) or not all(isinstance(f, dict) for f in flagged):
        return "'flagged' of an alarm event must be a list of objects"
    for entry in (obj, *flagged):
        entry.setdefault("direction", direction_of(entry))
    return None


def _check_event(obj: dict) -> str | None:
    """What is wrong with a rule event, or None."""
    ok = isinstance(obj.get("rule"), str) and obj.get("severity") in SEVERITIES and is_int(obj.get("step"))
    if not ok:
        return f"a rule event needs a string 'rule', a severity in {SEVERITIES} and an integer 'step'"
    if not (obj.get("value") is None or is_number(obj["value"])) or not isinstance(obj.get("details", {}), dict):
        return "'value' of a rule event must be a number or null and 'details' an object"
    return None


def _check_spp(obj: dict) -> str | None:
    """What is wrong with a signal-propagation event, or None."""
    entries = obj.get("entries", [])
    ok = isinstance(entries, list) and all(
        isinstance(e, dict)
        and isinstance(e.get("name"), str)
        and all(e.get(k) is None or is_number(e[k]) for k in ("avg_sq_mean", "avg_var", "residual_var"))
        and "avg_sq_mean" in e
        and "avg_var" in e
        for e in entries
    )
    return None if ok else "'entries' of an spp event must be objects with a name, avg_sq_mean and avg_var"


def _null(token: str) -> None:
    """``NaN``/``Infinity`` tokens of older logs read as null."""
    return None


def _parse(line: str, where: str) -> dict:
    try:
        obj = json.loads(line, parse_constant=_null)
    except json.JSONDecodeError as e:
        raise ValueError(f"load_log: {where} is not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"load_log: {where} is not a JSON object (got {type(obj).__name__})")
    return obj


EXPECTED = (
    "expected a monitor log: JSONL, one object per line, each a layer record (with 'step' and 'layer') or an "
    "event, as VarianceMonitor.to_jsonl and `normlab train --monitor-every N` (OUT/monitor.jsonl) write"
)


def _refuse_other_json(path: Path) -> None:
    """A JSON document that is not a monitor log (a run's summary.json, results.json, ...): say what it is and what
    was expected, instead of a parse error about its first line."""
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline()
            if first.strip() and _is_record_or_event(first):
                return
            f.seek(0)
            obj = json.load(f, parse_constant=_null)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return  # not one JSON document: the line-by-line reader names the bad line
    what = (
        f"an object with keys {', '.join(list(obj)[:4])}{', ...' if len(obj) > 4 else ''}"
        if isinstance(obj, dict)
        else f"a {type(obj).__name__}"
    )
    raise ValueError(f"load_log: {path} is JSON ({what}) but not a monitor log; {EXPECTED}")


def _is_record_or_event(line: str) -> bool:
    try:
        obj = json.loads(line, parse_constant=_null)
    except json.JSONDecodeError:
        return False
    return isinstance(obj, dict) and ("event" in obj or ("layer" in obj and "step" in obj))


def load_log(path: str | os.PathLike) -> MonitorLog:
    """Read a monitor log -> :class:`~normlab.monitor.log.MonitorLog` ``(records, alarm, spp, events)``, validated
    line by line.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ValueError: the first bad line, named ``file:line``: not a JSON object, a layer record with values of the
            wrong type, a malformed rule, alarm or spp event, or an object that is neither a record nor an event.

    Example:
        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "monitor.jsonl"
        >>> _ = path.write_text('{"step": 0, "layer": "fc", "output_var": NaN}\\n{"step": "0", "layer": "fc"}\\n')
        >>> load_log(path)
        Traceback (most recent call last):
        ...
        ValueError: load_log: ...monitor.jsonl:2: expected a string 'layer' and an integer 'step', got 'fc' and '0'
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_log: monitor log {path} does not exist or is not a file")
    _refuse_other_json(path)
    records, events, spp = [], [], None
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            obj = _parse(line, where)
            event = obj.get("event")
            if event == RULE_EVENT:
                problem = _check_event(obj)
                if problem is None:
                    events.append(Event.from_dict(obj))
            elif event == ALARM_EVENT:  # an older log's one alarm
                problem = _check_alarm(obj)
                if problem is None:
                    events.append(legacy_alarm_event(obj))
            elif event == SPP_EVENT:
                problem, spp = _check_spp(obj), obj
            elif event is not None:
                continue  # an event of a newer version
            elif "layer" in obj and "step" in obj:
                problem = _check_record(obj)
                records.append(obj)
            else:
                problem = f"neither a layer record (with 'layer' and 'step') nor an event; {EXPECTED}"
            if problem is not None:
                raise ValueError(f"load_log: {where}: {problem}")
    alarm = next((e.to_dict() for e in events if e.severity == "alarm"), None)
    return MonitorLog(records, alarm, spp, events)
