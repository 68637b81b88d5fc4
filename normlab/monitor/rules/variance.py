"""Rules on the variance records of conv/linear layers: the growth/implosion factors (:class:`FactorRule`) and the
countdown (:class:`CountdownRule`).

Both raise alarms naming the first flagged layer in forward order. Their events carry, in ``details``, the
quantity's ``baseline``, the ``ratio`` value / baseline, the ``reason`` in words, the ``direction`` (``"grew"``,
``"shrank"`` or ``"non-finite"``) and every (layer, quantity) ``flagged`` at that step
(:class:`~normlab.monitor.records.FlaggedEntry` dicts: ``initial`` is the baseline, ``growth`` the ratio).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from normlab._checks import check_number
from normlab.monitor.records import layer_keys
from normlab.monitor.rules.base import Event, Rule, StepContext

__all__ = ["FactorRule", "CountdownRule", "alarm_message", "renormalized_alone"]

_NON_FINITE = {"reason": "non-finite", "direction": "non-finite"}
# under an adaptive optimizer, the steps whose records the variance rules skip (the first-step transient)
ADAPTIVE_STEPS = 5
# under an adaptive optimizer, the consecutive flagged steps the countdown needs
ADAPTIVE_CONFIRM = 3


def _steps(rule: str, value) -> int:
    return check_number(rule, "adaptive_steps", value, integer=True, low=0)


def renormalized_alone(records: Sequence[Mapping], rtol: float = 1e-4) -> set[str]:
    r"""Names of the conv/linear layers whose output a normalization layer reads alone: the next layer in forward
    order (``index``) is a norm layer (``kind == "norm"``) whose input variance is the layer's output variance
    (relative difference <= ``rtol``).

    A conv followed by its BatchNorm qualifies; the output projection of a pre-LN transformer block does not (the
    next norm reads the residual stream, the projection's output plus the block's input), nor does a layer
    whose records lack the two variances.

    .. math::
        |\mathrm{Var}_{in}(\text{norm}) - \mathrm{Var}_{out}(l)| \le \text{rtol}\, \mathrm{Var}_{out}(l)

    Example:
        >>> recs = [dict(layer="c1", index=0, kind="conv", output_var=2.0),
        ...         dict(layer="bn", index=1, kind="norm", input_var=2.0),
        ...         dict(layer="proj", index=2, kind="linear", output_var=1e-4),
        ...         dict(layer="ln", index=3, kind="norm", input_var=1e-3)]
        >>> sorted(renormalized_alone(recs))
        ['c1']
    """
    ordered = sorted(records, key=lambda r: r.get("index", 0))
    out = set()
    for rec, nxt in zip(ordered, ordered[1:]):
        if rec.get("kind") not in ("conv", "linear") or nxt.get("kind") != "norm":
            continue
        v, w = rec.get("output_var"), nxt.get("input_var")
        if v is None or w is None or not (math.isfinite(v) and math.isfinite(w)):
            continue
        if abs(w - v) <= rtol * abs(v):
            out.add(rec["layer"])
    return out


def alarm_message(layer: str, quantity: str, value: float, baseline: float, reason: str) -> str:
    """The one-line message of a variance alarm.

    Example:
        >>> alarm_message("conv1", "output_var", 500.0, 1.0, "grew 500x > factor 100")
        "layer 'conv1' output_var = 500 (baseline 1, grew 500x > factor 100)"
    """
    return f"layer '{layer}' {quantity} = {value:.4g} (baseline {baseline:.4g}, {reason})"


def _event(rule: str, step: int, top: dict, flagged: list[dict]) -> Event:
    """The alarm naming flag ``top`` among the ``flagged`` ones of this step."""
    details = {
        "baseline": top["initial"],
        "ratio": top["growth"],
        "reason": top["reason"],
        "direction": top["direction"],
        "flagged": flagged,
    }
    message = alarm_message(top["layer"], top["quantity"], top["value"], top["initial"], top["reason"])
    return Event(rule, "alarm", int(step), message, top["layer"], top["quantity"], top["value"], details)


def _factors(name: str, factors, quantities: Sequence[str], low: float, default: float) -> dict[str, float]:
    """{quantity: factor} from a number or a mapping, each a finite number > ``low`` (>= for a floor of 0)."""
    per = dict(factors) if isinstance(factors, Mapping) else {q: factors for q in quantities}
    for q, f in per.items():
        check_number("FactorRule", f"{name} for {q!r}", f, low=low, low_open=low > 0)
    return {q: float(per.get(q, default)) for q in quantities} if quantities else {q: float(f) for q, f in per.items()}


class FactorRule(Rule):
    """Alarm when a layer's watched quantity grows past ``explode_factor`` times its baseline, when a quantity of the
    output layer falls below its baseline divided by ``implode_factor``, or when a watched quantity is non-finite.

    .. math::
        q_l(t) > k_q \\max(b_{l,q}, f_q) \\quad\\text{(growth)}, \\qquad
        q_l(t) < b_{l,q} / m_q \\quad\\text{(implosion)}

    with the baseline ``b`` the maximum of the first ``baseline_records`` finite recorded values of each (layer,
    quantity) and ``f`` the floor ``min_initial``. No growth test runs while a baseline is still being collected
    (non-finite values are always flagged). Checked on recorded steps.

    Exemptions (from the step's context): the output layer (``ctx.output_layer``, the classifier: its logit
    variance and per-class offsets grow as the net becomes confident) gets no growth test unless
    ``watch_output_layer``; a layer whose output a normalization layer renormalizes (``ctx.feeds_norm``) gets no
    growth test of ``shift`` or ``shift_scale_free``; a layer whose output a normalization layer reads alone
    (:func:`~normlab.monitor.rules.variance.renormalized_alone` at the layer's first recorded step: a conv before its
    BatchNorm) gets no growth test of ``output_var`` unless
    ``watch_renormalized``: the norm removes its scale, and the weights before a normalization grow in norm in
    healthy training (their gradient is orthogonal to them); this is judged once, at the first record, so that a
    residual branch that comes to dominate the sum a norm reads is not taken for a lone input later. The implosion
    test, when asked for, runs on the output layer only (``implode_factor={"input_sq": 1e4}``: its input's second
    moment falling 10,000x is a net whose last ReLUs died, or one deflating from an over-scaled start).

    The defaults watch the output variance (1,000x) and the scale-free shift (``shift_scale_free`` = shift /
    (n Var[W]), 100x: the filter means drifting apart relative to the weights' own spread, so that weights growing
    as a whole, which the output variance already shows, do not count twice), with no implosion test: on the
    collapse benchmark's calibration runs the raw ``shift`` and the implosion test raised false alarms on healthy
    unnormalized nets and warned no collapse the other tests missed (docs/defaults.md).

    Args:
        explode_factor: growth factor over the baseline (> 1); a float for every watched quantity or a mapping
            {quantity: factor} (quantities missing from it use 100).
        implode_factor: {quantity: factor} of the implosion test (> 1); the quantity need not be watched. None or
            {} (the default) for no implosion test.
        watch: record keys of the growth and non-finite tests.
        min_initial: floor of the baselines (>= 0), a float or {quantity: floor} (missing ones use 1e-6): a
            quantity with floor f and factor k is flagged only above k * f.
        baseline_records: how many first finite records form each baseline (their maximum); int >= 1.
        watch_output_layer: also apply the growth test to the output layer.
        watch_renormalized: also apply the ``output_var`` growth test to layers a normalization layer reads alone.
        adaptive_steps: under an adaptive optimizer (``ctx.adaptive``: Adam family, Adagrad, RMSprop) the records of
            steps before this one are neither tested nor taken into a baseline (non-finite values still are): the
            optimizer's first steps move every weight by about the learning rate, which grows the output
            variances of a small-init net by orders of magnitude in healthy runs. No effect under SGD (int >= 0).

    Example:
        >>> rule = FactorRule(explode_factor=100.0, min_initial=1e-6)
        >>> rec = lambda v: [{"layer": "conv1", "index": 0, "output_var": v, "shift": 0.01}]
        >>> rule.check(StepContext(step=0), rec(1.0)) is None      # the baseline
        True
        >>> e = rule.check(StepContext(step=10), rec(500.0))
        >>> e.layer, e.quantity, e.details["ratio"], e.details["direction"]
        ('conv1', 'output_var', 500.0, 'grew')
    """

    name = "factor"
    needs_loss = False

    def __init__(
        self,
        explode_factor: float | Mapping[str, float] | None = None,
        implode_factor: Mapping[str, float] | None = None,
        watch: Sequence[str] = ("output_var", "shift_scale_free"),
        min_initial: float | Mapping[str, float] | None = None,
        baseline_records: int = 1,
        watch_output_layer: bool = False,
        adaptive_steps: int = ADAPTIVE_STEPS,
        watch_renormalized: bool = False,
    ) -> None:
        # defaults: the classifier's logit variance grows ~100-200x in healthy training, so output_var needs 1e3;
        # output variance is compared with at least unit variance (the scale He init keeps); a PWS shift is 0
        explode_factor = {"output_var": 1e3, "shift_scale_free": 100.0} if explode_factor is None else explode_factor
        min_initial = {"output_var": 1.0, "shift_scale_free": 1e-6} if min_initial is None else min_initial
        if isinstance(watch, str) or not watch:
            raise ValueError(f"FactorRule: watch must be a sequence of record keys, got {watch!r}")
        self.watch = tuple(watch)
        self.explode_factor = _factors("explode_factor", explode_factor, self.watch, 1.0, 100.0)
        self.implode_factor = _factors("implode_factor", implode_factor or {}, (), 1.0, 1.0)
        self.checked = self.watch + tuple(q for q in self.implode_factor if q not in self.watch)
        self.min_initial = _factors("min_initial", min_initial, self.checked, 0.0, 1e-6)
        check_number("FactorRule", "baseline_records", baseline_records, integer=True, low=1)
        self.baseline_records = baseline_records
        self.watch_output_layer = bool(watch_output_layer)
        self.watch_renormalized = bool(watch_renormalized)
        self.adaptive_steps = _steps("FactorRule", adaptive_steps)
        self.reset()

    def reset(self) -> None:
        self.baselines: dict[tuple[str, str], float] = {}  # baseline (running max while still collecting)
        self.seen: dict[tuple[str, str], int] = {}  # finite values that went into the baseline
        self.alone: dict[str, bool] = {}  # layer -> a norm reads its output alone (judged at its first record)

    def state_dict(self) -> dict:
        """``{"baseline_records", "baselines": [[layer, quantity, baseline, n_seen], ...], "alone": {layer: bool}}``."""
        return {
            "baseline_records": self.baseline_records,
            "baselines": [[layer, q, v, self.seen.get((layer, q), 1)] for (layer, q), v in self.baselines.items()],
            "alone": dict(self.alone),
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict`; ValueError when it is malformed or was made with another baseline window."""
        if not isinstance(state, Mapping) or "baselines" not in state:
            raise ValueError(f"FactorRule.load_state_dict: expected a dict with 'baselines', got {state!r:.80}")
        if state.get("baseline_records", self.baseline_records) != self.baseline_records:
            raise ValueError(
                f"FactorRule.load_state_dict: state was made with baseline_records={state['baseline_records']}, "
                f"this rule uses {self.baseline_records}"
            )
        baselines, seen = {}, {}
        for row in state["baselines"]:
            try:
                layer, q, value, n = row
                baselines[(str(layer), str(q))], seen[(str(layer), str(q))] = float(value), int(n)
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"FactorRule.load_state_dict: bad baseline row {row!r}, expected [layer, quantity, value, n_seen]"
                ) from e
        self.baselines, self.seen = baselines, seen
        self.alone = {str(k): bool(v) for k, v in (state.get("alone") or {}).items()}  # older states: judged anew

    def _judge(self, rec: Mapping, q: str, grow: bool, shrink: bool, settling: bool = False) -> dict | None:
        """The flag of one (layer, quantity) at this step, or None; collects the baseline on the way."""
        value = rec.get(q)
        key = (rec["layer"], q)
        flag = dict(
            layer=rec["layer"], index=rec.get("index", 0), quantity=q, initial=self.baselines.get(key, math.nan)
        )
        if value is None or not math.isfinite(value):
            value = math.nan if value is None else float(value)
            return {**flag, "value": value, "growth": math.inf, "severity": math.inf, **_NON_FINITE}
        if settling:  # an adaptive optimizer's first steps: no baseline, no test
            return None
        n_seen = self.seen.get(key, 0)
        if n_seen < self.baseline_records:  # still collecting the baseline: no test
            self.baselines[key] = max(self.baselines.get(key, -math.inf), float(value))
            self.seen[key] = n_seen + 1
            return None
        base = self.baselines[key]
        ref = max(abs(base), self.min_initial[q])
        factor = self.explode_factor.get(q)
        if grow and value > factor * ref:
            return {
                **flag,
                "value": float(value),
                "growth": value / ref,
                "severity": value / ref / factor,
                "reason": f"grew {value / ref:.3g}x > factor {factor:g}",
                "direction": "grew",
            }
        shrink_by = self.implode_factor.get(q)
        if shrink and base > 0 and value * shrink_by < base:
            ratio = value / base
            return {
                **flag,
                "value": float(value),
                "growth": ratio,
                "severity": math.inf if ratio == 0 else 1 / (ratio * shrink_by),
                "reason": f"fell to {ratio:.3g}x < 1/{shrink_by:g} of its baseline",
                "direction": "shrank",
            }
        return None

    def check(self, ctx: StepContext, records: Sequence[Mapping]) -> Event | None:
        """Check one recorded step: update the baselines, return an alarm for the first flagged layer in forward
        order (the most severe of its flags), or None."""
        output = {ctx.output_layer} if ctx.output_layer is not None else set()
        growth_exempt = set() if self.watch_output_layer else output
        shift_exempt = set(ctx.feeds_norm) - output
        if not self.watch_renormalized:
            alone = renormalized_alone(records)
            for rec in records:
                if rec.get("kind") in ("conv", "linear"):
                    self.alone.setdefault(rec["layer"], rec["layer"] in alone)
        var_exempt = {k for k, v in self.alone.items() if v} - output
        settling = ctx.adaptive and ctx.step < self.adaptive_steps
        flagged = []
        for rec in sorted(records, key=lambda r: r.get("index", 0)):
            for q in self.checked:
                if rec.get(q) is None and q not in rec:
                    continue  # layer does not have this quantity (e.g. norm layers have no shift)
                shrink = q in self.implode_factor and rec["layer"] in output
                if q not in self.explode_factor and not shrink:
                    continue
                grow = q in self.explode_factor and rec["layer"] not in growth_exempt
                grow = grow and not (q in ("shift", "shift_scale_free") and rec["layer"] in shift_exempt)
                grow = grow and not (q == "output_var" and rec["layer"] in var_exempt)
                flag = self._judge(rec, q, grow, shrink, settling)
                if flag is not None:
                    flagged.append(flag)
        if not flagged:
            return None
        first_index = min(f["index"] for f in flagged)
        top = max((f for f in flagged if f["index"] == first_index), key=lambda f: f["severity"])
        for f in flagged:
            f.pop("severity")
        return _event(self.name, ctx.step, top, flagged)

    def __repr__(self) -> str:
        return (
            f"FactorRule(explode_factor={self.explode_factor}, implode_factor={self.implode_factor}, "
            f"watch={self.watch}, min_initial={self.min_initial}, baseline_records={self.baseline_records}, "
            f"watch_output_layer={self.watch_output_layer}, adaptive_steps={self.adaptive_steps}, "
            f"watch_renormalized={self.watch_renormalized})"
        )


class CountdownRule(Rule):
    """The countdown alarm: the collapse is imminent. Fires at the first checked step at which, in some hidden layer
    (every conv/linear layer but the output layer and those a normalization layer renormalizes),

    - ``growth``: the growth rate of the output variance, ``[ln V_l(t) - ln V_l(t')] / (t - t')`` with ``t'`` the
      newest earlier value at least ``span`` steps back, exceeds the layer's threshold (``growth``; with ``spread``,
      scaled by the layer's own recent rates) while, with ``new_high``, ``V_l(t)`` is above every earlier value
      the rule kept for the layer, or
    - ``level``: the output variance over its first value, ``V_l(t) / V_l(t_0)``, exceeds ``level`` (not tested on
      standardized kernels, WS/PWS: ``shift_scale_free`` = 0), or
    - ``grad_ratio``: the gradient norm over the median of its last ``history`` values (at least 5) exceeds it, or
    - a watched value (the output variance of any layer, the gradient norm) is non-finite.

    .. math::
        \\frac{\\ln V_l(t) - \\ln V_l(t')}{t - t'} > \\text{growth}

    With ``every_step`` (the default) it is checked on every optimizer step: on a step that records nothing the
    monitor keeps only each conv/linear layer's output variance (a light step); False: recorded steps only.
    ``level`` and ``grad_ratio`` are off by default (None).

    Args:
        growth: growth-rate threshold (per step, natural log), > 0, or None.
        level: level threshold (> 1), or None.
        grad_ratio: gradient-norm threshold over its running median (> 1), or None.
        span: minimum step distance of the growth rate (int >= 1).
        history: how many past gradient norms the running median keeps (int >= 5).
        every_step: check on every optimizer step (True) or on recorded steps only.
        adaptive_steps: under an adaptive optimizer (``ctx.adaptive``) the output variances of steps before this one
            are neither tested nor kept as first or past values (non-finite values still are flagged): the first
            value and the growth rates start after the optimizer's first-step transient. No effect under SGD
            (int >= 0).
        adaptive_confirm: under an adaptive optimizer, a layer's growth or level flag raises the alarm only when the
            layer stays flagged on this many consecutive checked steps (non-finite values alarm at once). An
            adaptive optimizer moves each weight by at most about the learning rate per step, so a surge of the
            output variance after a few large updates decays (its rate falls like 1/t), while a runaway persists.
            No effect under SGD (int >= 1; 1: no confirmation).
        confirm: the same confirmation under any other optimizer (int >= 1; 1: none, the default).
        new_high: a growth flag needs the output variance above the layer's running maximum (every value kept since
            its first): a runaway makes new highs, while a layer recovering from a dip (its variance fallen 1,000x
            after an over-scaled start, then growing back fast) does not until it passes its old level.
        spread: None, or scale each layer's threshold by its own recent rates: ``max(growth, spread * m_l)`` with
            ``m_l`` the median absolute growth rate of the layer's last ``spread_window`` checked steps (once it
            has 5): a layer whose variance swings by e per step in healthy training (small batches) needs a larger
            rate to alarm. Off by default: it changed no alarm on the collapse benchmark's calibration runs.
        spread_window: the rates the spread's median reads (int >= 5).

    The defaults (``growth`` 1.0, ``new_high``) were calibrated on the collapse study and the collapse benchmark
    (docs/defaults.md).

    Example:
        >>> rule = CountdownRule(growth=1.0, level=15.0)
        >>> rec = lambda v: [dict(layer="c1", index=0, kind="conv", output_var=v)]
        >>> [rule.check(StepContext(step=t), rec(v)) for t, v in enumerate([1.0, 1.2, 1.1])]
        [None, None, None]
        >>> rule.check(StepContext(step=3), rec(10.0)).quantity
        'output_var_growth'
    """

    name = "countdown"
    needs_loss = False
    every_step = True
    light_keys = ("output_var",)

    def __init__(
        self,
        growth: float | None = 1.0,
        level: float | None = None,
        grad_ratio: float | None = None,
        span: int = 2,
        history: int = 256,
        every_step: bool = True,
        adaptive_steps: int = ADAPTIVE_STEPS,
        adaptive_confirm: int = ADAPTIVE_CONFIRM,
        confirm: int = 1,
        new_high: bool = True,
        spread: float | None = None,
        spread_window: int = 50,
    ) -> None:
        reals = (
            ("growth", growth, 0.0),
            ("level", level, 1.0),
            ("grad_ratio", grad_ratio, 1.0),
            ("spread", spread, 0.0),
        )
        for name, value, low in reals:
            check_number("CountdownRule", name, value, low=low, low_open=True, optional=True)
        ints = (("span", span, 1), ("history", history, 5), ("adaptive_confirm", adaptive_confirm, 1),
                ("confirm", confirm, 1), ("spread_window", spread_window, 5))  # fmt: skip
        for name, value, low in ints:
            check_number("CountdownRule", name, value, integer=True, low=low)
        self.growth, self.level, self.grad_ratio = growth, level, grad_ratio
        self.span, self.history = span, history
        self.every_step = bool(every_step)
        self.light_keys = ("output_var",) if self.every_step else ()
        self.needs_grad_norm = grad_ratio is not None
        self.adaptive_steps = _steps("CountdownRule", adaptive_steps)
        self.adaptive_confirm = adaptive_confirm
        self.confirm, self.spread, self.spread_window = confirm, spread, spread_window
        self.new_high = bool(new_high)
        self.reset()

    def reset(self) -> None:
        self.first: dict[str, float] = {}  # V_l at its first value
        self.recent: dict[str, list[list[float]]] = {}  # [[step, V_l], ...], newest last, enough for the span
        self.grad_norms: list[float] = []
        self.streak: dict[str, int] = {}  # layer -> consecutive checked steps flagged (confirmation)
        self.rates: dict[str, list[float]] = {}  # layer -> its last `spread_window` growth rates (the spread)
        self.high: dict[str, float] = {}  # layer -> the largest V_l kept before this step

    def threshold(self, layer: str) -> float | None:
        """The growth-rate threshold of ``layer`` now: ``growth``, or with ``spread`` the larger of ``growth`` and
        ``spread`` times the median absolute growth rate of the layer's last ``spread_window`` checked steps (once
        it has 5).

        .. math::
            a_l = \\max\\big(\\text{growth},\\ \\text{spread} \\cdot \\mathrm{median}_{s}\\,|r_l(s)|\\big)
        """
        if self.growth is None or self.spread is None or len(self.rates.get(layer, ())) < 5:
            return self.growth
        mags = sorted(abs(r) for r in self.rates[layer])
        n = len(mags)
        med = mags[n // 2] if n % 2 else (mags[n // 2 - 1] + mags[n // 2]) / 2
        return max(self.growth, self.spread * med)

    def _layer_flag(self, step: int, rec: Mapping, tested: bool, settling: bool = False) -> dict | None:
        name, v = rec["layer"], rec.get("output_var")
        flag = dict(layer=name, index=rec.get("index", 0), initial=self.first.get(name, math.nan))
        if v is None:
            return None
        if not math.isfinite(v):
            return {**flag, "quantity": "output_var", "value": float(v), "growth": math.inf, **_NON_FINITE}
        if settling:  # an adaptive optimizer's first steps: neither a first nor a past value
            return None
        v = float(v)
        self.first.setdefault(name, v)
        high = self.high.get(name, -math.inf)
        self.high[name] = max(high, v)
        past = [p for p in self.recent.get(name, []) if step - p[0] >= self.span]
        self.recent[name] = [p for p in self.recent.get(name, []) if step - p[0] < self.span] + [[step, v]]
        if past:  # keep the newest value at least `span` back, for the next steps' rates
            self.recent[name].insert(0, past[-1])
        if not tested:
            return None
        v0 = self.first[name]
        standardized = (rec.get("shift_scale_free") if rec.get("shift_scale_free") is not None else 1.0) < 1e-6
        if self.level is not None and not standardized and v0 > 0 and v / v0 > self.level:
            return {
                **flag,
                "quantity": "output_var_level",
                "value": v,
                "growth": v / v0,
                "reason": f"output variance {v / v0:.3g}x its first value > level {self.level:g}",
                "direction": "grew",
            }
        if self.growth is not None and past and past[-1][1] > 0 and v > 0:
            t0, p = past[-1]
            rate = (math.log(v) - math.log(p)) / (step - t0)
            limit = self.threshold(name)
            self.rates[name] = (self.rates.get(name, []) + [rate])[-self.spread_window :]
            if rate > limit and not (self.new_high and v <= high):
                return {
                    **flag,
                    "quantity": "output_var_growth",
                    "value": v,
                    "growth": v / v0 if v0 > 0 else math.inf,
                    "reason": f"output variance growing at {rate:.3g}/step > growth {limit:.3g}",
                    "direction": "grew",
                }
        return None

    def _grad_flag(self, grad_norm: float | None) -> dict | None:
        if grad_norm is None:
            return None
        flag = dict(layer="(gradient)", index=-1, quantity="grad_norm", value=float(grad_norm))
        if not math.isfinite(grad_norm):
            return {
                **flag,
                "initial": math.nan,
                "growth": math.inf,
                **_NON_FINITE,
                "reason": "non-finite gradient norm",
            }
        past = sorted(self.grad_norms)
        self.grad_norms = (self.grad_norms + [float(grad_norm)])[-self.history :]
        if self.grad_ratio is None or len(past) < 5:
            return None
        med = past[len(past) // 2] if len(past) % 2 else (past[len(past) // 2 - 1] + past[len(past) // 2]) / 2
        if med > 0 and grad_norm / med > self.grad_ratio:
            return {
                **flag,
                "initial": med,
                "growth": grad_norm / med,
                "reason": f"gradient norm {grad_norm / med:.3g}x its running median > {self.grad_ratio:g}",
                "direction": "grew",
            }
        return None

    def check(self, ctx: StepContext, records: Sequence[Mapping]) -> Event | None:
        """Check one step (full or light records): an alarm naming the first flagged layer in forward order (the
        gradient counts as before every layer), or None."""
        exempt = set(ctx.feeds_norm) | ({ctx.output_layer} if ctx.output_layer is not None else set())
        settling = ctx.adaptive and ctx.step < self.adaptive_steps
        need = self.adaptive_confirm if ctx.adaptive else self.confirm
        flagged = []
        for rec in sorted(records, key=lambda r: r.get("index", 0)):
            if rec.get("kind") in ("conv", "linear"):
                flag = self._layer_flag(ctx.step, rec, rec["layer"] not in exempt, settling)
                if need > 1 and flag is not None and flag["direction"] != "non-finite":
                    self.streak[rec["layer"]] = self.streak.get(rec["layer"], 0) + 1
                    if self.streak[rec["layer"]] < need:
                        flag = None  # not confirmed yet
                else:
                    self.streak.pop(rec["layer"], None)
            elif rec.get("output_var") is not None and not math.isfinite(rec["output_var"]):
                flag = dict(
                    layer=rec["layer"],
                    index=rec.get("index", 0),
                    quantity="output_var",
                    initial=math.nan,
                    value=float(rec["output_var"]),
                    growth=math.inf,
                    **_NON_FINITE,
                )
            else:
                flag = None
            if flag is not None:
                flagged.append(flag)
        gflag = self._grad_flag(ctx.grad_norm)
        if gflag is not None:
            flagged.insert(0, gflag)
        if not flagged:
            return None
        top = min(flagged, key=lambda f: f["index"])
        return _event(self.name, ctx.step, top, flagged)

    def state_dict(self) -> dict:
        """``{"span", "first", "recent", "grad_norms", "streak", "high", "rates"}`` as plain Python types."""
        return {
            "span": self.span,
            "first": dict(self.first),
            "recent": {k: [list(p) for p in v] for k, v in self.recent.items()},
            "grad_norms": list(self.grad_norms),
            "streak": dict(self.streak),
            "high": dict(self.high),
            "rates": {k: list(v) for k, v in self.rates.items()},
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict`; ValueError when it is malformed or was made with another span."""
        if not isinstance(state, Mapping) or not {"span", "first", "recent", "grad_norms"} <= set(state):
            raise ValueError(f"CountdownRule.load_state_dict: expected a dict from state_dict(), got {state!r:.80}")
        if state["span"] != self.span:
            raise ValueError(
                f"CountdownRule.load_state_dict: state was made with span={state['span']}, this rule uses {self.span}"
            )
        self.first = {str(k): float(v) for k, v in state["first"].items()}
        self.recent = {str(k): [[int(a), float(b)] for a, b in v] for k, v in state["recent"].items()}
        self.grad_norms = [float(g) for g in state["grad_norms"]]
        self.streak = {str(k): int(v) for k, v in (state.get("streak") or {}).items()}  # older states: none
        self.high = {str(k): float(v) for k, v in state["high"].items()}
        self.rates = {str(k): [float(r) for r in v] for k, v in state["rates"].items()}

    def __repr__(self) -> str:
        return (
            f"CountdownRule(growth={self.growth}, level={self.level}, grad_ratio={self.grad_ratio}, span={self.span}, "
            f"history={self.history}, every_step={self.every_step}, adaptive_steps={self.adaptive_steps}, "
            f"adaptive_confirm={self.adaptive_confirm}, confirm={self.confirm}, new_high={self.new_high}, "
            f"spread={self.spread}, spread_window={self.spread_window})"
        )


layer_keys("output_var", "shift", "input_sq", "shift_scale_free")  # record keys these rules read
