"""The regime warning as a rule (:class:`RegimeRule`): a layer is in the unstable regime, its shift term dominating.

The output variance of a conv/linear layer is the sum of two terms (``stats.variance_terms``)::

    Var[Y] = n E[W^2] Var[X]  +  E^2[X] Var_o[n E[W_o]]
             variance term       shift term

A layer is *in the shift regime* when its shift term exceeds its variance term: the spread of its filter means,
carried by a non-zero input mean (ReLU), dominates what it passes on. :class:`RegimeRule` raises a
warning event when one layer has stayed in the shift regime (its shift term above ``min_ratio`` times its variance
term) for ``window`` consecutive recorded steps.

Exempt layers: a layer whose next watched layer in forward order (the records' ``index``) is a normalization layer
(BN/GN/LN/SwitchableNorm/...): the normalization removes the per-channel offsets before they reach the next conv,
so the shift does no harm there; and the output layer (the last conv/linear in forward order: the classifier, whose
per-class offsets are wanted). Standardized kernels (WS/PWS: ``shift_scale_free`` = 0) have no shift term; for them
the warning is the *PWS case*: the variance term grows above ``pws_factor`` times its first value for ``window``
consecutive steps (a PWS net's collapse is a variance explosion).

Suggested learning rate (shift case, when the learning rate is known): the spread of the filter means is the
initial one plus the drift of the accumulated mean updates, ``n E[W_o](t) = n E[W_o](0) + D_o(t)``, and for SGD
the drift scales with the learning rate. With the drift uncorrelated with the initial means (a random init),
``shift(t) = shift(0) + Var_o[D_o(t)]``, so a run at ``f * lr`` would have had the shift term
``E^2[X] (shift(0) + f^2 (shift(t) - shift(0)))``, at most the variance term ``V`` when::

    f = sqrt((V - E^2[X] shift(0)) / (S - E^2[X] shift(0)))      (S = shift term at the warning; f = sqrt(V / S)
                                                                  when the initial shift is negligible)

and ``suggested_lr = f * lr``: the largest rate that would have kept this layer out of the shift regime up to the
warning step. None when ``E^2[X] shift(0) >= V`` (the initial spread alone dominates: no rate helps).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence

from normlab._checks import check_number, is_number
from normlab.monitor.rules.base import Event, Rule, StepContext

__all__ = ["RegimeRule", "exempt_layers", "layer_learning_rates", "suggested_lr"]

STANDARDIZED = 1e-6  # shift_scale_free below this: a standardized (WS/PWS) kernel, no shift term


def exempt_layers(records: Sequence[Mapping]) -> set[str]:
    """Names of the conv/linear layers the regime test skips: those whose next layer in forward order (``index``)
    is a normalization layer (``kind == "norm"``), and the output layer (the last conv/linear in forward order)."""
    ordered = sorted(records, key=lambda r: r.get("index", 0))
    out = {r["layer"] for r, nxt in zip(ordered, ordered[1:]) if r.get("kind") != "norm" and nxt.get("kind") == "norm"}
    maps = [r for r in ordered if r.get("kind") in ("conv", "linear")]
    if maps:
        out.add(maps[-1]["layer"])
    return out


def suggested_lr(lr: float, shift_term: float, variance_term: float, input_mean_sq: float, first_shift: float):
    """The learning rate that would have kept a layer's shift term below its variance term (module docstring).

    .. math::
        \\text{lr}^* = \\text{lr} \\sqrt{\\frac{V - E^2[X]\\,\\text{shift}(0)}{S - E^2[X]\\,\\text{shift}(0)}}

    Args:
        lr: the learning rate the layer trained with.
        shift_term: ``S = E^2[X] shift(t)`` at the warning step.
        variance_term: ``V = n E[W^2] Var[X]`` at the warning step.
        input_mean_sq: ``E^2[X]`` at the warning step.
        first_shift: ``shift(0) = Var_o[n E[W_o]]`` at the first checked step.

    Returns:
        ``lr^*`` (below ``lr`` when ``S > V``), or None when ``E^2[X] shift(0) >= V`` (the initial spread of the
        filter means alone dominates: no learning rate removes it) or a quantity is not finite.

    Example:
        >>> suggested_lr(0.1, shift_term=4.0, variance_term=1.0, input_mean_sq=1.0, first_shift=0.0)  # sqrt(1/4)
        0.05
        >>> suggested_lr(0.1, shift_term=4.0, variance_term=1.0, input_mean_sq=1.0, first_shift=2.0) is None
        True
    """
    values = (lr, shift_term, variance_term, input_mean_sq, first_shift)
    if not all(is_number(v, finite=True) for v in values):
        return None
    initial = input_mean_sq * first_shift
    if variance_term <= initial or shift_term <= initial:
        return None
    return float(lr * math.sqrt((variance_term - initial) / (shift_term - initial)))


def layer_learning_rates(layers: Sequence, optimizer) -> dict[str, float]:
    """The learning rate of each layer's parameters in ``optimizer`` (the param group of its first parameter found
    there, its own before its submodules'), for the ``(name, module, kind)`` triples of ``VarianceMonitor.layers``;
    layers whose parameters the optimizer does not train are left out.

    Example:
        >>> from torch import nn, optim
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> opt = optim.SGD([{"params": net[0].parameters()}, {"params": net[1].parameters(), "lr": 0.01}], lr=0.1)
        >>> layer_learning_rates([("0", net[0], "linear"), ("1", net[1], "linear")], opt)
        {'0': 0.1, '1': 0.01}
    """
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    out = {}
    for name, module, _kind in layers:
        for param in module.parameters():  # its own first, then its submodules' (parametrizations, wrappers)
            if id(param) in group_of:
                out[name] = float(group_of[id(param)]["lr"])
                break
    return out


def _suggest(layer: str, case: str, lr: float | None = None, new_lr: float | None = None) -> str:
    if case != "shift":
        return (
            f"the standardized conv '{layer}' amplifies its input more and more: lower the learning rate, or put a "
            "normalization layer after it"
        )
    change = f"give '{layer}' a standardized kernel (PWS/WS: zero shift by construction) or put a normalization layer "
    change += "after it"
    if new_lr is not None:
        return (
            f"lower the learning rate to {new_lr:.3g} (from {lr:.3g}: the rate at which this layer's shift would have "
            f"stayed below its variance term so far), or {change}"
        )
    if lr is not None:
        return f"{change} (its initial filter-mean spread alone dominates: a lower learning rate does not remove it)"
    return f"{change}, or lower the learning rate (CollapseGuard lowers it per rescue)"


class RegimeRule(Rule):
    """Warn when a layer stays in the shift regime for ``window`` consecutive recorded steps (module docstring).

    .. math::
        E^2[X]\\,\\mathrm{Var}_o[n E[W_o]] > \\text{min\\_ratio} \\cdot n E[W^2] \\mathrm{Var}[X]

    Skipped layers: those whose next layer in forward order is a normalization layer, and the output layer
    (:func:`~normlab.monitor.rules.regime.exempt_layers`). The event (severity ``"warning"``) names the first layer
    in forward order whose streak reached ``window``; its ``details`` hold ``shift_term``, ``variance_term``,
    ``ratio``, ``case`` (``"shift"`` or ``"pws"``), ``suggestion`` and ``suggested_lr``
    (:func:`~normlab.monitor.rules.regime.suggested_lr`, from ``ctx.layer_lrs``).

    Args:
        window: consecutive recorded steps a layer must stay in the regime (int >= 1).
        min_ratio: a layer is in the regime when its shift term exceeds ``min_ratio`` times its variance term (a
            number >= 1; 1: the shift term merely dominates, the ordinary state of healthy unnormalized nets).
        pws_factor: PWS case: the variance term of a standardized conv over its first value that counts as growing
            (> 1); None for no PWS case.

    Example:
        >>> rule = RegimeRule(window=2, min_ratio=1.0)
        >>> recs = lambda s: [dict(layer="c1", index=0, kind="conv", shift_term=s, variance_term=1.0,
        ...                        shift_scale_free=1.0), dict(layer="fc", index=1, kind="linear")]
        >>> rule.check(StepContext(step=0), recs(2.0)) is None, rule.check(StepContext(step=1), recs(2.0)).layer
        (True, 'c1')
    """

    name = "regime"
    needs_loss = False

    def __init__(self, window: int = 2, min_ratio: float = 10.0, pws_factor: float | None = None) -> None:
        check_number("RegimeRule", "window", window, integer=True, low=1)
        check_number("RegimeRule", "min_ratio", min_ratio, low=1)
        check_number("RegimeRule", "pws_factor", pws_factor, low=1, low_open=True, optional=True)
        self.window = window
        self.min_ratio = float(min_ratio)
        self.pws_factor = None if pws_factor is None else float(pws_factor)
        self.reset()

    def reset(self) -> None:
        self.streak: dict[str, int] = {}  # consecutive checked steps in the regime, per layer
        self.first_variance: dict[str, float] = {}  # variance term at the first check (PWS case)
        self.first_shift: dict[str, float] = {}  # shift Var_o[n E[W_o]] at the first check (suggested_lr)

    def _hot(self, rec: Mapping) -> tuple[str, float] | None:
        """(case, ratio) when the layer is in the regime at this step, else None."""
        st, vt = rec.get("shift_term"), rec.get("variance_term")
        if st is None or vt is None or not (math.isfinite(st) and math.isfinite(vt)):
            return None
        name = rec["layer"]
        v0 = self.first_variance.setdefault(name, vt)
        if rec.get("shift") is not None:
            self.first_shift.setdefault(name, float(rec["shift"]))
        if (rec.get("shift_scale_free") or 0.0) < STANDARDIZED:
            if self.pws_factor is None:
                return None
            ratio = vt / v0 if v0 > 0 else 0.0
            return ("pws", ratio) if ratio > self.pws_factor else None
        return ("shift", st / vt if vt > 0 else math.inf) if st > self.min_ratio * vt else None

    def check(self, ctx: StepContext, records: Sequence[Mapping]) -> Event | None:
        """Check one recorded step; a warning for the first layer in forward order whose streak reached ``window``,
        else None (streaks and first values are updated on the way)."""
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
                found = self._warning(ctx.step, rec, *hot, ctx.layer_lrs.get(name))
        return found

    def _warning(self, step: int, rec: Mapping, case: str, ratio: float, lr: float | None) -> Event:
        name = rec["layer"]
        new_lr = None
        if lr is not None and case == "shift" and name in self.first_shift:
            args = (rec["shift_term"], rec["variance_term"], rec.get("input_mean_sq"), self.first_shift[name])
            new_lr = suggested_lr(lr, *args)
        st, vt = float(rec["shift_term"]), float(rec["variance_term"])
        suggestion = _suggest(name, case, lr, new_lr)
        what = "shift term > variance term" if case == "shift" else "variance term of a standardized conv growing"
        message = (
            f"unstable regime: layer '{name}' {what} (shift {st:.4g}, variance {vt:.4g}, ratio {ratio:.3g}); "
            f"{suggestion}"
        )
        details = {
            "shift_term": st,
            "variance_term": vt,
            "ratio": float(ratio),
            "case": case,
            "suggestion": suggestion,
            "suggested_lr": new_lr,
        }
        quantity = "shift_term" if case == "shift" else "variance_term"
        return Event(self.name, "warning", int(step), message, name, quantity, float(ratio), details)

    def state_dict(self) -> dict:
        """``{"window", "pws_factor", "min_ratio", "streak", "first_variance", "first_shift"}``."""
        return {
            "window": self.window,
            "pws_factor": self.pws_factor,
            "min_ratio": self.min_ratio,
            "streak": dict(self.streak),
            "first_variance": dict(self.first_variance),
            "first_shift": dict(self.first_shift),
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict`; ValueError when it is malformed. A state made with another ``window`` or
        ``min_ratio`` keeps its first values but its streaks start again, with a warning: they counted another
        rule."""
        if not isinstance(state, Mapping) or not {"window", "streak", "first_variance"} <= set(state):
            raise ValueError(f"RegimeRule.load_state_dict: expected a dict from state_dict(), got {state!r:.80}")
        made_with = (state["window"], float(state.get("min_ratio", 1.0)))
        same_rule = made_with == (self.window, self.min_ratio)
        if not same_rule:
            warnings.warn(
                f"RegimeRule.load_state_dict: state was made with window={made_with[0]}, "
                f"min_ratio={made_with[1]:g}; this rule uses window={self.window}, min_ratio={self.min_ratio:g}: "
                "its streaks start again",
                stacklevel=2,
            )
        self.streak = {str(k): int(v) for k, v in state["streak"].items()} if same_rule else {}
        self.first_variance = {str(k): float(v) for k, v in state["first_variance"].items()}
        self.first_shift = {str(k): float(v) for k, v in state.get("first_shift", {}).items()}

    def __repr__(self) -> str:
        return f"RegimeRule(window={self.window}, min_ratio={self.min_ratio:g}, pws_factor={self.pws_factor})"
