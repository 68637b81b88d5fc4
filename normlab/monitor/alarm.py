"""Collapse early warning.

A layer is flagged when one of the watched quantities (default: output variance ``output_var`` and shift of the
average ``shift``) exceeds ``factor`` times its initial value (its first recorded finite value, floored at
``min_initial``), or when any watched quantity is non-finite. The alarm names the FIRST flagged layer in forward
order and the step at which it was flagged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

__all__ = ["CollapseAlarm", "CollapseDetector"]


@dataclass
class CollapseAlarm:
    """What fired: ``layer`` (module name), ``step``, ``quantity`` ("output_var" or "shift"), its ``value`` and
    ``initial`` value, ``growth`` = value / initial (inf when non-finite) and every (layer, quantity) flagged at
    that step in ``flagged``."""

    layer: str
    step: int
    quantity: str
    value: float
    initial: float
    growth: float
    reason: str
    flagged: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return (
            f"collapse warning at step {self.step}: layer '{self.layer}' {self.quantity} = {self.value:.4g} "
            f"(initial {self.initial:.4g}, {self.reason})"
        )


class CollapseDetector:
    """Stateful checker over per-layer records.

    Args:
        factor: growth factor over the initial value that raises the alarm (> 1); a float for every watched
            quantity or a mapping {quantity: factor} (quantities missing from it use 100).
        quantities: record keys to watch.
        min_initial: initial values below this are replaced by it (a zero shift, e.g. PWS, must not make
            float round-off look like infinite growth).
    """

    def __init__(
        self,
        factor: float | Mapping[str, float] = 100.0,
        quantities: Sequence[str] = ("output_var", "shift"),
        min_initial: float = 1e-6,
    ) -> None:
        if isinstance(quantities, str) or not quantities:
            raise ValueError(f"CollapseDetector: quantities must be a sequence of record keys, got {quantities!r}")
        self.quantities = tuple(quantities)
        per = dict(factor) if isinstance(factor, Mapping) else {q: factor for q in self.quantities}
        for q, f in per.items():
            if isinstance(f, bool) or not (isinstance(f, int | float) and f > 1 and math.isfinite(f)):
                raise ValueError(f"CollapseDetector: factor for {q!r} must be a finite number > 1, got {f!r}")
        if min_initial < 0:
            raise ValueError(f"CollapseDetector: min_initial must be >= 0, got {min_initial!r}")
        self.factors = {q: float(per.get(q, 100.0)) for q in self.quantities}
        self.min_initial = float(min_initial)
        self.initial: dict[tuple[str, str], float] = {}

    def check(self, step: int, records: Iterable[Mapping]) -> CollapseAlarm | None:
        """Check one recorded step. ``records`` are dicts with 'layer', 'index' (forward order) and quantities.

        Updates the initial values (first finite value seen per layer and quantity) and returns an alarm for the
        first flagged layer in forward order, or None.
        """
        flagged = []
        for rec in sorted(records, key=lambda r: r.get("index", 0)):
            for q in self.quantities:
                value = rec.get(q)
                if value is None and q not in rec:
                    continue  # layer does not have this quantity (e.g. norm layers have no shift)
                key = (rec["layer"], q)
                if value is None or not math.isfinite(value):
                    init = self.initial.get(key, float("nan"))
                    flagged.append(dict(layer=rec["layer"], index=rec.get("index", 0), quantity=q,
                                        value=float("nan") if value is None else float(value), initial=init,
                                        growth=math.inf, reason="non-finite"))
                    continue
                if key not in self.initial:
                    self.initial[key] = float(value)
                    continue
                init = self.initial[key]
                ref = max(abs(init), self.min_initial)
                if value > self.factors[q] * ref:
                    flagged.append(dict(layer=rec["layer"], index=rec.get("index", 0), quantity=q,
                                        value=float(value), initial=init, growth=value / ref,
                                        reason=f"grew {value / ref:.3g}x > factor {self.factors[q]:g}"))
        if not flagged:
            return None
        first_index = min(f["index"] for f in flagged)
        first = [f for f in flagged if f["index"] == first_index]
        top = max(first, key=lambda f: f["growth"] / self.factors[f["quantity"]])
        return CollapseAlarm(layer=top["layer"], step=int(step), quantity=top["quantity"], value=top["value"],
                             initial=top["initial"], growth=top["growth"], reason=top["reason"], flagged=flagged)
