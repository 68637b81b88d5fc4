"""The one number validator: is a value an int or a number, within bounds, and the words for what was expected.

Every layer, rule, schedule and config of normlab checks its numeric arguments here, so ``True`` is never an int,
``nan`` never passes a bound, and a refusal says what was expected in the same words everywhere: ``BatchRenorm2d:
eps must be a finite number > 0, got 0`` (:func:`check_number`); a caller with its own error type or message takes
the expected words from :func:`number_problem`.
"""

from __future__ import annotations

import math

__all__ = ["is_int", "is_number", "number_problem", "check_number"]


def is_int(value) -> bool:
    """``value`` is an ``int`` and not a ``bool``.

    Example:
        >>> is_int(3), is_int(True), is_int(3.0)
        (True, False, False)
    """
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value, finite: bool = False) -> bool:
    """``value`` is an ``int`` or ``float`` and not a ``bool`` (``finite``: and not nan or infinite).

    Example:
        >>> is_number(0.5), is_number(False), is_number(float("inf")), is_number(float("inf"), finite=True)
        (True, False, True, False)
    """
    return isinstance(value, int | float) and not isinstance(value, bool) and (not finite or math.isfinite(value))


def _bounds_text(low, high, low_open: bool, high_open: bool) -> str:
    if low is None and high is None:
        return ""
    if high is None:
        return f" {'>' if low_open else '>='} {low:g}"
    if low is None:
        return f" {'<' if high_open else '<='} {high:g}"
    return f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def number_problem(
    value,
    *,
    integer: bool = False,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    finite: bool = True,
    optional: bool = False,
) -> str | None:
    """None when ``value`` is such a number, else the words for what was expected (``"an int >= 1"``, ``"a finite
    number > 0"``, ``"a number in (0, 1]"``, ``"... or None"``).

    Args:
        value: the value to check.
        integer: an ``int`` is expected (never a ``bool`` or a float).
        low, high: the bounds (None: unbounded on that side); ``low_open``/``high_open`` exclude them.
        finite: nan and infinities are refused (said as "finite" when no upper bound rules them out).
        optional: None is accepted too.

    Example:
        >>> number_problem(0, integer=True, low=1), number_problem(2, integer=True, low=1)
        ('an int >= 1', None)
        >>> number_problem(float("nan"), low=0, low_open=True), number_problem(None, low=0, high=1, optional=True)
        ('a finite number > 0', None)
    """
    if optional and value is None:
        return None
    ok = is_int(value) if integer else is_number(value, finite=finite)
    ok = ok and (low is None or (value > low if low_open else value >= low))
    ok = ok and (high is None or (value < high if high_open else value <= high))
    if ok:
        return None
    kind = "an int" if integer else ("a finite number" if finite and high is None else "a number")
    return kind + _bounds_text(low, high, low_open, high_open) + (" or None" if optional else "")


def check_number(where: str, name: str, value, **bounds):
    """``value`` when :func:`number_problem` accepts it (``bounds``: its keyword arguments); else a one-line
    ``ValueError``: ``"{where}: {name} must be {expected}, got {value!r}"``.

    Example:
        >>> check_number("RecordSchedule", "every", 10, integer=True, low=1)
        10
        >>> check_number("RecordSchedule", "every", 0, integer=True, low=1)
        Traceback (most recent call last):
        ...
        ValueError: RecordSchedule: every must be an int >= 1, got 0
    """
    expected = number_problem(value, **bounds)
    if expected is not None:
        raise ValueError(f"{where}: {name} must be {expected}, got {value!r}")
    return value
