"""One colour and one place in line per normalization, for every figure that draws norms (the grid report's and any
other), so that a norm reads the same in all of them: ``bn`` is blue in every figure, ``none`` near-black.

:data:`NORM_COLORS` fixes the colour of each norm the runner knows, in :data:`NORM_ORDER`; a variant
(``"pws:gamma=0.01"``) has its own entry or, if it has none, a colour picked from the norm's name (the same in
every figure); an unknown name likewise. :func:`norm_order` sorts names into the fixed order.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

__all__ = ["NORM_COLORS", "NORM_ORDER", "norm_color", "norm_order"]

#: The colour of each norm (matplotlib colour names), in the order figures draw and list them. Close relatives
#: are of one family (``pws`` red, its gamma 1e-2 variant dark red), the unnormalized net near-black.
NORM_COLORS: dict[str, str] = {
    "none": "#222222",
    "bn": "tab:blue",
    "brn": "tab:orange",
    "gn": "tab:green",
    "ln": "tab:olive",
    "in": "tab:brown",
    "sn": "tab:purple",
    "wn": "tab:pink",
    "ws": "tab:cyan",
    "ws+gn": "#0b6e4f",
    "pws": "tab:red",
    "pws:gamma=0.01": "#7f0000",
}
#: The order in which figures and tables list the norms (the order of :data:`NORM_COLORS`).
NORM_ORDER: tuple[str, ...] = tuple(NORM_COLORS)
_SPARE = ("#e6ab02", "#1b9e77", "#7570b3", "#a6761d", "#666666", "#e7298a")  # names without an entry


def norm_color(name: str) -> str:
    """The colour of norm ``name`` (a grid's norm name, variants included), the same in every figure.

    Example::

        >>> norm_color("bn")
        'tab:blue'
        >>> norm_color("gn:groups=8") == norm_color("gn:groups=8")
        True
    """
    if name in NORM_COLORS:
        return NORM_COLORS[name]
    return _SPARE[zlib.crc32(name.encode()) % len(_SPARE)]


def norm_order(names: Iterable[str]) -> list[str]:
    """``names`` in the fixed order of :data:`NORM_ORDER`; names without an entry after them, as given.

    Example::

        >>> norm_order(["pws", "none", "x", "bn"])
        ['none', 'bn', 'pws', 'x']
    """
    names = list(dict.fromkeys(names))
    known = sorted((n for n in names if n in NORM_COLORS), key=NORM_ORDER.index)
    return known + [n for n in names if n not in NORM_COLORS]
