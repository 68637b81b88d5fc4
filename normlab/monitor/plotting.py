"""The plotting helpers of monitor logs, used by ``normlab monitor`` (``normlab.monitor.plots``) and by any figure
drawn from a monitor log. One line per layer in forward order, log axes that mask non-positive values, the alarm line.

They draw on matplotlib axes they are given and import pyplot only to close a saved figure.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from normlab._files import atomic_savefig

__all__ = ["layer_series", "draw_series", "log_scale", "spans_decades", "mark_alarm", "save_figure"]

Series = dict[str, tuple[list[int], list[float]]]


def layer_series(
    records: Iterable[Mapping[str, Any]],
    key: str,
    max_step: int | None = None,
    keep: Callable[[Mapping[str, Any]], bool] | None = None,
) -> Series:
    """layer -> (steps, values) of ``key`` for the layers whose records have it, in forward order (``index``);
    null (not finite) becomes nan, so the line breaks there.

    Args:
        records: layer records (:mod:`normlab.monitor.records`), e.g. ``load_log(path).records``.
        key: the record key.
        max_step: leave out records after this step (None: every step).
        keep: leave out the records for which it returns False (e.g. values at rounding level).

    Example:
        >>> recs = [{"step": 0, "layer": "b", "index": 1, "shift": 2.0}, {"step": 0, "layer": "a", "index": 0},
        ...         {"step": 1, "layer": "b", "index": 1, "shift": None}]
        >>> layer_series(recs, "shift")
        {'b': ([0, 1], [2.0, nan])}
    """
    order: dict[str, float] = {}
    out: Series = {}
    for r in records:
        if key not in r or (max_step is not None and r["step"] > max_step) or (keep is not None and not keep(r)):
            continue
        name = r["layer"]
        order.setdefault(name, r.get("index", len(order)))
        steps, vals = out.setdefault(name, ([], []))
        steps.append(r["step"])
        vals.append(math.nan if r[key] is None else float(r[key]))
    return {k: out[k] for k in sorted(out, key=lambda n: order[n])}


def draw_series(ax, series: Series, linewidth: float = 1.2) -> None:
    """One line per layer of ``series`` (from :func:`layer_series`), labelled with the layer's name.

    Example:
        >>> import matplotlib; matplotlib.use("Agg")
        >>> import matplotlib.pyplot as plt
        >>> fig, ax = plt.subplots()
        >>> draw_series(ax, {"conv1": ([0, 1], [1.0, 2.0])})
        >>> [line.get_label() for line in ax.lines]
        ['conv1']
        >>> plt.close(fig)
    """
    for name, (steps, vals) in series.items():
        ax.plot(steps, vals, label=name, linewidth=linewidth)


def log_scale(ax, values: Iterable[float | None]) -> bool:
    """Put ``ax``'s y axis on a log scale that masks non-positive values, when any value is finite and positive
    (a log axis of nothing positive would be empty); True when it did.

    Example:
        >>> import matplotlib; matplotlib.use("Agg")
        >>> import matplotlib.pyplot as plt
        >>> fig, ax = plt.subplots()
        >>> log_scale(ax, [0.0, float("nan")]), log_scale(ax, [0.0, 3.0]), ax.get_yscale()
        (False, True, 'log')
        >>> plt.close(fig)
    """
    if any(v is not None and math.isfinite(v) and v > 0 for v in values):
        ax.set_yscale("log", nonpositive="mask")
        return True
    return False


def spans_decades(values: Iterable[float | None]) -> bool:
    """The finite ``values`` are positive and span a factor of 10 or more (a log axis shows them best; on a linear
    one every value but the largest lies flat); False if any is <= 0 or none is finite.

    Example:
        >>> spans_decades([1.0, 1.02, 350.0]), spans_decades([0.98, 1.05]), spans_decades([0.0, 1.0])
        (True, False, False)
    """
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return bool(vals) and min(vals) > 0 and max(vals) >= 10 * min(vals)


def mark_alarm(ax, alarm: Mapping[str, Any] | None, label: str | None = None) -> None:
    """The alarm's step as a red dashed vertical line (nothing without an alarm or a step).

    Args:
        ax: the axes.
        alarm: an alarm event (:class:`~normlab.monitor.records.AlarmEvent`) or any dict with ``step``, or None.
        label: the line's legend label (None: no legend entry).

    Example:
        >>> import matplotlib; matplotlib.use("Agg")
        >>> import matplotlib.pyplot as plt
        >>> fig, ax = plt.subplots()
        >>> mark_alarm(ax, {"step": 12, "layer": "conv1"}); mark_alarm(ax, None)
        >>> [list(line.get_xdata()) for line in ax.lines]
        [[12, 12]]
        >>> plt.close(fig)
    """
    if alarm is not None and alarm.get("step") is not None:
        ax.axvline(alarm["step"], color="r", linestyle="--", linewidth=1.2, label=label or "_nolegend_")


def save_figure(fig, path: str | os.PathLike, dpi: int = 110, rect: tuple[float, ...] | None = None) -> Path:
    """Lay ``fig`` out (``tight_layout``, in ``rect`` if given), save it at ``path`` atomically (a link there is
    replaced, not followed) and close it.

    Example:
        >>> import tempfile, pathlib, matplotlib; matplotlib.use("Agg")
        >>> import matplotlib.pyplot as plt
        >>> fig, ax = plt.subplots()
        >>> save_figure(fig, pathlib.Path(tempfile.mkdtemp()) / "f.png").suffix
        '.png'
    """
    import matplotlib.pyplot as plt

    try:
        fig.tight_layout(**({} if rect is None else {"rect": rect}))
        return atomic_savefig(fig, path, dpi=dpi)
    finally:
        plt.close(fig)
