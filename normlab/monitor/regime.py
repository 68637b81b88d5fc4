"""Regime warning: the run is in the unstable regime (docs/monitor.md), long before it collapses.

The output variance of a conv/linear layer is the sum of two terms (``stats.variance_terms``)::

    Var[Y] = n E[W^2] Var[X]  +  E^2[X] Var_o[n E[W_o]]
             variance term       shift term

A layer is *in the shift regime* when its shift term exceeds its variance term: the spread of its filter means,
carried by a non-zero input mean (ReLU), dominates what it passes on. :class:`RegimeDetector` raises a
:class:`RegimeWarning` when one layer has stayed in the shift regime for ``window`` consecutive checked steps.

Exempt layers: a layer whose next watched layer in forward order (the records' ``index``) is a normalization layer
(BN/GN/LN/SwitchableNorm/...): the normalization removes the per-channel offsets before they reach the next conv,
so the shift does no harm there; and the output layer (the last conv/linear in forward order: the classifier, whose
per-class offsets are wanted). Standardized kernels (WS/PWS: ``shift_scale_free`` = 0) have no shift term; for them
the warning is the *PWS case*: the variance term grows above ``pws_factor`` times its first value for ``window``
consecutive steps (a PWS net's collapse is a variance explosion, docs/monitor.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

__all__ = ["RegimeDetector", "RegimeWarning", "exempt_layers"]

STANDARDIZED = 1e-6  # shift_scale_free below this: a standardized (WS/PWS) kernel, no shift term


@dataclass
class RegimeWarning:
    """The run is in the unstable regime (``mon.risk``): which layer, since when, and what to change.

    Attributes:
        step: the first step of the window over which the regime held.
        layer: the module name of the layer.
        shift_term: ``E^2[X] Var_o[n E[W_o]]`` of that layer at ``step``.
        variance_term: ``n E[W^2] Var[X]`` of that layer at ``step``.
        ratio: ``shift_term / variance_term``; for the PWS case the variance term over its first value.
        case: ``"shift"`` (the shift term dominates) or ``"pws"`` (the variance term of a standardized conv grows).
        suggestion: the change the docs justify (a lower learning rate, PWS/WS for the layer, a normalization after
            it).

    Example:
        >>> w = RegimeWarning(step=12, layer="conv3", shift_term=4.0, variance_term=1.0, ratio=4.0, case="shift",
        ...                   suggestion="halve the learning rate")
        >>> str(w).startswith("unstable regime since step 12: layer 'conv3' shift term > variance term")
        True
    """

    step: int
    layer: str
    shift_term: float
    variance_term: float
    ratio: float
    case: str
    suggestion: str

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        what = "shift term > variance term" if self.case == "shift" else "variance term of a standardized conv growing"
        return (
            f"unstable regime since step {self.step}: layer '{self.layer}' {what} (shift {self.shift_term:.4g}, "
            f"variance {self.variance_term:.4g}, ratio {self.ratio:.3g}); {self.suggestion}"
        )


def exempt_layers(records: Iterable[Mapping]) -> set[str]:
    """Names of the conv/linear layers the regime test skips: those whose next layer in forward order (``index``)
    is a normalization layer (``kind == "norm"``), and the output layer (the last conv/linear in forward order)."""
    ordered = sorted(records, key=lambda r: r.get("index", 0))
    out = {r["layer"] for r, nxt in zip(ordered, ordered[1:]) if r.get("kind") != "norm" and nxt.get("kind") == "norm"}
    maps = [r for r in ordered if r.get("kind") in ("conv", "linear")]
    if maps:
        out.add(maps[-1]["layer"])
    return out


def _suggest(layer: str, case: str) -> str:
    if case == "shift":
        return (
            f"give '{layer}' a standardized kernel (PWS/WS: zero shift by construction) or put a normalization "
            "layer after it, or lower the learning rate (CollapseGuard halves it per rescue)"
        )
    return (
        f"the standardized conv '{layer}' amplifies its input more and more: lower the learning rate, or put a "
        "normalization layer after it"
    )


class RegimeDetector:
    """Stateful regime test over per-layer monitor records (see the module docstring).

    Args:
        window: consecutive checked steps a layer must stay in the regime (int >= 1).
        pws_factor: PWS case: variance term over its first value that counts as growing (> 1); None (the
            default) for no PWS case: in the calibration runs healthy PWS nets grew it as much as collapsing ones.

    Measured on MNIST-1D plain1d (docs/monitor.md): no window kept the healthy unnormalized runs (lr 0.05) below
    20 % flagged (window 20, the largest tried: 5 of 8 flagged), so the default is that largest window; it flags
    7 of 16 collapsing unnormalized runs before their collapse and no healthy BN run. Read it as "this layer's shift
    dominates", not as a forecast.

    Example:
        >>> det = RegimeDetector(window=2)
        >>> recs = lambda s: [dict(layer="c1", index=0, kind="conv", shift_term=s, variance_term=1.0,
        ...                        shift_scale_free=1.0), dict(layer="fc", index=1, kind="linear")]
        >>> det.check(0, recs(2.0)) is None, det.check(1, recs(2.0)).layer
        (True, 'c1')
    """

    def __init__(self, window: int = 20, pws_factor: float | None = None) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"RegimeDetector: window must be an int >= 1, got {window!r}")
        if pws_factor is not None and (
            isinstance(pws_factor, bool) or not isinstance(pws_factor, int | float) or not 1 < pws_factor < math.inf
        ):
            raise ValueError(f"RegimeDetector: pws_factor must be None or a finite number > 1, got {pws_factor!r}")
        self.window = window
        self.pws_factor = None if pws_factor is None else float(pws_factor)
        self.streak: dict[str, int] = {}  # consecutive checked steps in the regime, per layer
        self.first_variance: dict[str, float] = {}  # variance term at the first check (PWS case)

    def _hot(self, rec: Mapping) -> tuple[str, float] | None:
        """(case, ratio) when the layer is in the regime at this step, else None."""
        st, vt = rec.get("shift_term"), rec.get("variance_term")
        if st is None or vt is None or not (math.isfinite(st) and math.isfinite(vt)):
            return None
        name = rec["layer"]
        v0 = self.first_variance.setdefault(name, vt)
        if (rec.get("shift_scale_free") or 0.0) < STANDARDIZED:
            if self.pws_factor is None:
                return None
            ratio = vt / v0 if v0 > 0 else 0.0
            return ("pws", ratio) if ratio > self.pws_factor else None
        return ("shift", st / vt if vt > 0 else math.inf) if st > vt else None

    def check(self, step: int, records: Iterable[Mapping]) -> RegimeWarning | None:
        """Check one recorded step; returns a warning for the first layer in forward order whose streak reached
        ``window``, else None (streaks and first values are updated on the way)."""
        records = list(records)
        exempt = exempt_layers(records)
        found = None
        for rec in sorted(records, key=lambda r: r.get("index", 0)):
            if rec.get("kind") not in ("conv", "linear") or rec["layer"] in exempt:
                continue
            hot = self._hot(rec)
            name = rec["layer"]
            self.streak[name] = self.streak.get(name, 0) + 1 if hot else 0
            if hot and found is None and self.streak[name] >= self.window:
                case, ratio = hot
                found = RegimeWarning(
                    step=int(step),
                    layer=name,
                    shift_term=float(rec["shift_term"]),
                    variance_term=float(rec["variance_term"]),
                    ratio=float(ratio),
                    case=case,
                    suggestion=_suggest(name, case),
                )
        return found

    def state_dict(self) -> dict:
        """``{"window", "pws_factor", "streak", "first_variance"}`` as plain Python types."""
        return {
            "window": self.window,
            "pws_factor": self.pws_factor,
            "streak": dict(self.streak),
            "first_variance": dict(self.first_variance),
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict`; ValueError when it is malformed or was made with another window."""
        if not isinstance(state, Mapping) or not {"window", "streak", "first_variance"} <= set(state):
            raise ValueError(f"RegimeDetector.load_state_dict: expected a dict from state_dict(), got {state!r:.80}")
        if state["window"] != self.window:
            raise ValueError(
                f"RegimeDetector.load_state_dict: state was made with window={state['window']}, this "
                f"detector uses {self.window}"
            )
        self.streak = {str(k): int(v) for k, v in state["streak"].items()}
        self.first_variance = {str(k): float(v) for k, v in state["first_variance"].items()}
