"""Collapse early warning: the countdown (:class:`CountdownDetector`) and the factor rules (:class:`CollapseDetector`).

The countdown fires when the output variance of a hidden layer (not the output layer, not a layer renormalized
downstream) grows faster than ``growth`` per step, optionally above a ``level`` or on a gradient-norm jump, or on any
non-finite value; its thresholds and what they achieve are in docs/monitor.md. The factor rules below are kept: in
the calibration runs they raised no false alarm (0 of 47 healthy runs) and add the implosion test (dead ReLUs).

A layer is flagged when one of the watched quantities (default: output variance ``output_var`` and shift of the
average ``shift``) exceeds ``explode_factor`` times its baseline, when a quantity of the implosion test falls below its
baseline divided by its ``implode_factor`` (the monitor's default: the second moment of the classifier's input,
``input_sq``, falling 10,000x: dead ReLUs), or when any watched quantity is non-finite. The alarm names the FIRST
flagged layer in forward order and the step at which it was flagged.

Baseline: the MAXIMUM of the first ``baseline_records`` finite values of each (layer, quantity), floored at
``min_initial``. No growth test runs while a baseline is still being collected (non-finite values are always
flagged). One record (the default) takes the value at step 0, when the shift of a freshly initialised net is at
its smallest: a fast re-arrangement of the filter means during the first steps of a run that then trains well would
then look like a collapse. A window of a few records absorbs such a transient, but the default stays 1: on the plain
net / cnn1d without normalization (He init, digits and mnist1d, ~40 runs) the shift jump within the first 5-20
steps was the collapse itself (nets that then died at chance), and every window of >= 2 records (every=5) hid it,
while no healthy run was flagged by an early shift jump.

The detector's state (baselines, how many values each has seen) is exported by :meth:`CollapseDetector.state_dict`
and restored by :meth:`CollapseDetector.load_state_dict`, so a resumed run raises the same alarms.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

__all__ = ["CollapseAlarm", "CollapseDetector", "CountdownDetector"]


_DIRECTIONS = ("grew", "shrank", "non-finite")


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


_NON_FINITE = {"reason": "non-finite", "direction": "non-finite"}


def _deprecated(old: str, new: str, owner: str) -> None:
    warnings.warn(f"{owner}: {old!r} is deprecated, use {new!r}", DeprecationWarning, stacklevel=3)


@dataclass
class CollapseAlarm:
    """A collapse warning, as :meth:`CollapseDetector.check` and the monitor (``mon.alarm``) report it.

    Attributes:
        layer: the module name of the first flagged layer in forward order.
        step: the recorded step at which it fired.
        quantity: the record key that fired (``"output_var"``, ``"shift"``, ``"input_sq"``, ...).
        value: the quantity's value at that step.
        baseline: what it was measured against: the maximum of its first ``baseline_records`` values (the countdown:
            its first value; the gradient rule: the running median).
        ratio: ``value / baseline``: above 1 when the quantity grew (the growth test divides by the baseline floored
            at ``min_initial``), below 1 when it shrank (the implosion test: 1e-5 is a fall to 1e-5 of the
            baseline), inf when the value is not finite.
        reason: why, in words (``"non-finite"``, ``"grew 500x > factor 100"``, ``"fell to 1e-05x < 1/1e+04 of its
            baseline"``, ...).
        flagged: every (layer, quantity) flagged at that step, as :class:`~normlab.monitor.records.FlaggedEntry`
            dicts (the keys of the log: ``initial`` is the baseline, ``growth`` the ratio).
        direction: ``"grew"``, ``"shrank"`` or ``"non-finite"``.

    ``initial`` and ``growth`` are deprecated read-only aliases of ``baseline`` and ``ratio``. :meth:`to_dict` (the
    log's alarm event and the monitor's ``state_dict``) keeps the keys ``initial`` and ``growth`` so that logs and
    checkpoints stay readable by earlier versions; :meth:`from_dict` reads both.

    Example:
        >>> alarm = CollapseAlarm("conv1", 10, "output_var", 500.0, 1.0, 500.0, "grew 500x > factor 100")
        >>> print(alarm)
        collapse warning at step 10: layer 'conv1' output_var = 500 (baseline 1, grew 500x > factor 100)
        >>> alarm.to_dict()["initial"], CollapseAlarm.from_dict(alarm.to_dict()) == alarm
        (1.0, True)
    """

    layer: str
    step: int
    quantity: str
    value: float
    baseline: float
    ratio: float
    reason: str
    flagged: list[dict] = field(default_factory=list)
    direction: str = "grew"

    def __post_init__(self) -> None:
        if self.direction not in _DIRECTIONS:
            raise ValueError(f"CollapseAlarm: direction must be one of {_DIRECTIONS}, got {self.direction!r}")

    @property
    def initial(self) -> float:
        """Deprecated alias of :attr:`baseline`."""
        _deprecated("CollapseAlarm.initial", "baseline", "CollapseAlarm")
        return self.baseline

    @property
    def growth(self) -> float:
        """Deprecated alias of :attr:`ratio`."""
        _deprecated("CollapseAlarm.growth", "ratio", "CollapseAlarm")
        return self.ratio

    def to_dict(self) -> dict:
        """The alarm as plain types with the log's keys (:class:`~normlab.monitor.records.AlarmEvent` without
        ``event``): ``initial`` = baseline, ``growth`` = ratio."""
        d = asdict(self)
        return {
            **{k: d[k] for k in ("layer", "step", "quantity", "value")},
            "initial": d["baseline"],
            "growth": d["ratio"],
            **{k: d[k] for k in ("reason", "flagged", "direction")},
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> CollapseAlarm:
        """The alarm of :meth:`to_dict` or of a log's alarm event (old or new keys; ``event`` ignored; a missing
        ``direction`` is derived from the value and reason); null numbers become nan (inf for the ratio)."""
        baseline = d["baseline"] if "baseline" in d else d["initial"]
        ratio = d["ratio"] if "ratio" in d else d["growth"]
        return cls(
            layer=d["layer"],
            step=d["step"],
            quantity=d["quantity"],
            value=math.nan if d.get("value") is None else d["value"],
            baseline=math.nan if baseline is None else baseline,
            ratio=math.inf if ratio is None else ratio,
            reason=d["reason"],
            flagged=[dict(f) for f in d.get("flagged", [])],
            direction=d.get("direction") or direction_of(d),
        )

    def __str__(self) -> str:
        return (
            f"collapse warning at step {self.step}: layer '{self.layer}' {self.quantity} = {self.value:.4g} "
            f"(baseline {self.baseline:.4g}, {self.reason})"
        )


def _alarm(step: int, top: dict, flagged: list[dict]) -> CollapseAlarm:
    """The alarm naming flag ``top`` among the ``flagged`` ones of this step."""
    return CollapseAlarm(
        layer=top["layer"],
        step=int(step),
        quantity=top["quantity"],
        value=top["value"],
        baseline=top["initial"],
        ratio=top["growth"],
        reason=top["reason"],
        flagged=flagged,
        direction=top["direction"],
    )


def _factors(name: str, factors, quantities: Sequence[str], low: float, default: float) -> dict[str, float]:
    """{quantity: factor} from a number or a mapping, each a finite number > ``low`` (>= for a floor of 0)."""
    per = dict(factors) if isinstance(factors, Mapping) else {q: factors for q in quantities}
    for q, f in per.items():
        ok = isinstance(f, int | float) and not isinstance(f, bool) and math.isfinite(f)
        if not ok or not (f > low if low > 0 else f >= low):
            bound = f"> {low:g}" if low > 0 else f">= {low:g}"
            raise ValueError(f"CollapseDetector: {name} for {q!r} must be a finite number {bound}, got {f!r}")
    return {q: float(per.get(q, default)) for q in quantities} if quantities else {q: float(f) for q, f in per.items()}


class CollapseDetector:
    """Stateful checker over per-layer records. The arguments are :class:`~normlab.monitor.VarianceMonitor`'s.

    Args:
        explode_factor: growth factor over the baseline that raises the alarm (> 1); a float for every watched
            quantity or a mapping {quantity: factor} (quantities missing from it use 100).
        watch: record keys to watch (the growth test and the non-finite test).
        min_initial: baselines below this are replaced by it (a zero shift, e.g. PWS, must not make
            float round-off look like infinite growth); a float for every quantity or a mapping {quantity: floor}
            (quantities missing from it use 1e-6). A floor is also a minimum absolute level: with floor f and
            factor k a quantity is flagged only above k * f.
        baseline_records: how many first finite records of each (layer, quantity) form its baseline (their
            maximum); int >= 1.
        implode_factor: {quantity: factor} for the *implosion* test: a layer is also flagged when the quantity
            falls below its baseline divided by the factor (e.g. {"input_sq": 1e4}: the second moment of the
            classifier's input when the ReLUs before it died); the quantity need not be in ``watch`` (then
            only the implosion test runs on it). None or {} for no implosion test.
        **deprecated: ``factor``, ``quantities`` and ``shrink_factor``, the deprecated names of ``explode_factor``,
            ``watch`` and ``implode_factor`` (a DeprecationWarning).

    Attributes ``watch``, ``explode_factor``, ``implode_factor`` (both {quantity: factor}), ``min_initial`` and
    ``baselines`` ({(layer, quantity): baseline}, a running maximum while still collecting) hold the settings and
    state; ``quantities``, ``factors``, ``shrink`` and ``initial`` are their deprecated aliases.

    Example:
        >>> detector = CollapseDetector(explode_factor=100.0)
        >>> detector.check(0, [{"layer": "conv1", "index": 0, "output_var": 1.0, "shift": 0.01}])  # the baseline
        >>> alarm = detector.check(10, [{"layer": "conv1", "index": 0, "output_var": 500.0, "shift": 0.02}])
        >>> alarm.layer, alarm.quantity, alarm.ratio, alarm.direction
        ('conv1', 'output_var', 500.0, 'grew')
    """

    def __init__(
        self,
        explode_factor: float | Mapping[str, float] = 100.0,
        watch: Sequence[str] = ("output_var", "shift"),
        min_initial: float | Mapping[str, float] = 1e-6,
        baseline_records: int = 1,
        implode_factor: Mapping[str, float] | None = None,
        **deprecated,
    ) -> None:
        unknown = sorted(set(deprecated) - {"factor", "quantities", "shrink_factor"})
        if unknown:
            raise TypeError(f"CollapseDetector: unexpected keyword argument {unknown[0]!r}")
        if "factor" in deprecated:
            _deprecated("factor", "explode_factor", "CollapseDetector")
            explode_factor = deprecated["factor"]
        if "quantities" in deprecated:
            _deprecated("quantities", "watch", "CollapseDetector")
            watch = deprecated["quantities"]
        if "shrink_factor" in deprecated:
            _deprecated("shrink_factor", "implode_factor", "CollapseDetector")
            implode_factor = deprecated["shrink_factor"]
        if isinstance(watch, str) or not watch:
            raise ValueError(f"CollapseDetector: watch must be a sequence of record keys, got {watch!r}")
        self.watch = tuple(watch)
        self.explode_factor = _factors("explode_factor", explode_factor, self.watch, 1.0, 100.0)
        self.implode_factor = _factors("implode_factor", implode_factor or {}, (), 1.0, 1.0)
        self.checked = self.watch + tuple(q for q in self.implode_factor if q not in self.watch)
        self.min_initial = _factors("min_initial", min_initial, self.checked, 0.0, 1e-6)
        if isinstance(baseline_records, bool) or not isinstance(baseline_records, int) or baseline_records < 1:
            raise ValueError(f"CollapseDetector: baseline_records must be an int >= 1, got {baseline_records!r}")
        self.baseline_records = baseline_records
        self.baselines: dict[tuple[str, str], float] = {}  # baseline (running max while still collecting)
        self.seen: dict[tuple[str, str], int] = {}  # finite values that went into the baseline

    @property
    def quantities(self) -> tuple[str, ...]:
        """Deprecated alias of ``watch``."""
        _deprecated("CollapseDetector.quantities", "watch", "CollapseDetector")
        return self.watch

    @property
    def factors(self) -> dict[str, float]:
        """Deprecated alias of ``explode_factor``."""
        _deprecated("CollapseDetector.factors", "explode_factor", "CollapseDetector")
        return self.explode_factor

    @property
    def shrink(self) -> dict[str, float]:
        """Deprecated alias of ``implode_factor``."""
        _deprecated("CollapseDetector.shrink", "implode_factor", "CollapseDetector")
        return self.implode_factor

    @property
    def initial(self) -> dict[tuple[str, str], float]:
        """Deprecated alias of ``baselines``."""
        _deprecated("CollapseDetector.initial", "baselines", "CollapseDetector")
        return self.baselines

    def state_dict(self) -> dict:
        """Everything that decides future alarms, as plain Python types (``torch.load(weights_only=True)`` safe):
        ``{"baseline_records", "baselines": [[layer, quantity, baseline, n_seen], ...]}``."""
        return {
            "baseline_records": self.baseline_records,
            "baselines": [[layer, q, v, self.seen.get((layer, q), 1)] for (layer, q), v in self.baselines.items()],
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict`; ValueError when it is malformed or was made with another baseline window."""
        if not isinstance(state, Mapping) or "baselines" not in state:
            raise ValueError(f"CollapseDetector.load_state_dict: expected a dict with 'baselines', got {state!r:.80}")
        if state.get("baseline_records", self.baseline_records) != self.baseline_records:
            raise ValueError(
                f"CollapseDetector.load_state_dict: state was made with baseline_records="
                f"{state['baseline_records']}, this detector uses {self.baseline_records}"
            )
        baselines, seen = {}, {}
        for row in state["baselines"]:
            try:
                layer, q, value, n = row
                baselines[(str(layer), str(q))], seen[(str(layer), str(q))] = float(value), int(n)
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"CollapseDetector.load_state_dict: bad baseline row {row!r}, expected [layer, quantity, "
                    f"value, n_seen]"
                ) from e
        self.baselines, self.seen = baselines, seen

    def _judge(self, rec: Mapping, q: str, grow: bool, shrink: bool) -> dict | None:
        """The flag of one (layer, quantity) at this step, or None; collects the baseline on the way."""
        value = rec.get(q)
        key = (rec["layer"], q)
        flag = dict(
            layer=rec["layer"], index=rec.get("index", 0), quantity=q, initial=self.baselines.get(key, math.nan)
        )
        if value is None or not math.isfinite(value):
            value = math.nan if value is None else float(value)
            return {**flag, "value": value, "growth": math.inf, "severity": math.inf, **_NON_FINITE}
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

    def check(
        self,
        step: int,
        records: Iterable[Mapping],
        growth_exempt: Collection[str] = (),
        shrink_layers: Collection[str] | None = None,
        shift_exempt: Collection[str] = (),
    ) -> CollapseAlarm | None:
        """Check one recorded step. ``records`` are dicts with 'layer', 'index' (forward order) and quantities.

        Layers named in ``growth_exempt`` keep their baselines but get no growth test (they are flagged when a
        growth quantity is non-finite); layers in ``shift_exempt`` get no growth test of ``shift`` only (a layer
        whose output is renormalized downstream); implosion tests run on the layers in ``shrink_layers`` (None:
        every layer).
        Updates the baselines (max of the first ``baseline_records`` finite values per layer and quantity) and
        returns an alarm for the first flagged layer in forward order, or None.
        """
        flagged = []
        for rec in sorted(records, key=lambda r: r.get("index", 0)):
            for q in self.checked:
                if rec.get(q) is None and q not in rec:
                    continue  # layer does not have this quantity (e.g. norm layers have no shift)
                shrink = q in self.implode_factor and (shrink_layers is None or rec["layer"] in shrink_layers)
                if q not in self.explode_factor and not shrink:
                    continue
                grow = q in self.explode_factor and rec["layer"] not in growth_exempt
                grow = grow and not (q == "shift" and rec["layer"] in shift_exempt)
                flag = self._judge(rec, q, grow, shrink)
                if flag is not None:
                    flagged.append(flag)
        if not flagged:
            return None
        first_index = min(f["index"] for f in flagged)
        top = max((f for f in flagged if f["index"] == first_index), key=lambda f: f["severity"])
        for f in flagged:
            f.pop("severity")
        return _alarm(step, top, flagged)


class CountdownDetector:
    """The countdown alarm: the collapse is imminent. Fires (a :class:`CollapseAlarm`) at the first checked step
    at which, in some hidden layer (every conv/linear layer but ``exempt`` ones, the output layer by default),

    - ``growth``: the growth rate of the output variance, ``[ln V_l(t) - ln V_l(t')] / (t - t')`` with ``t'`` the
      newest earlier record at least ``span`` steps back, exceeds ``growth``, or
    - ``level``: the output variance over its first recorded value, ``V_l(t) / V_l(t_0)``, exceeds ``level``
      (not tested on standardized kernels, WS/PWS: ``shift_scale_free`` = 0; their output variance grows 1,000x
      and more in healthy training, docs/monitor.md), or
    - ``grad_ratio`` (optional): the gradient norm over the median of its last ``history`` values (at least 5 of
      them) exceeds ``grad_ratio``, or
    - a watched value (output variance of any layer, the gradient norm) is non-finite.

    Thresholds: calibrated on MNIST-1D plain1d, width 0.5, none/BN/PWS at lr 0.05-0.2 and BN at lr 0.01, seeds
    100-107 (docs/monitor.md, ``scripts/collapse_study.py``; chosen on one half of the seeds, reported on the other).
    ``growth=1.0`` was chosen on the odd seeds (on the even seeds: 4 of 11 warnable collapses warned >= 5 steps
    ahead, 2 false alarms in 25 healthy runs); the even seeds chose 0.75 (odd seeds: 10 of 15, 4 false alarms in
    22). ``level`` and ``grad_ratio`` are off by default: no level threshold kept false alarms <= 1 in 10 healthy
    runs (healthy plain nets at lr 0.05 reach 4-13x, healthy PWS nets 1,500-4,000x), and the gradient norm (50x its
    median) warned 3 of 11 / 7 of 15. None switches a rule off.

    Args:
        growth: growth-rate threshold (per step, natural log), > 0, or None.
        level: level threshold (> 1), or None.
        grad_ratio: gradient-norm threshold over its running median (> 1), or None.
        span: minimum step distance of the growth rate (int >= 1).
        history: how many past gradient norms the running median keeps (int >= 5).

    Example:
        >>> det = CountdownDetector(growth=1.0, level=15.0)
        >>> rec = lambda v: [dict(layer="c1", index=0, kind="conv", output_var=v)]
        >>> [det.check(t, rec(v), exempt=()) for t, v in enumerate([1.0, 1.2, 1.1])]
        [None, None, None]
        >>> det.check(3, rec(10.0), exempt=()).quantity
        'output_var_growth'
    """

    def __init__(
        self,
        growth: float | None = 1.0,
        level: float | None = None,
        grad_ratio: float | None = None,
        span: int = 2,
        history: int = 256,
    ) -> None:
        for name, value, low in (("growth", growth, 0.0), ("level", level, 1.0), ("grad_ratio", grad_ratio, 1.0)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or not low < value < math.inf
            ):
                raise ValueError(f"CountdownDetector: {name} must be None or a finite number > {low:g}, got {value!r}")
        for name, value, low in (("span", span, 1), ("history", history, 5)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"CountdownDetector: {name} must be an int >= {low}, got {value!r}")
        self.growth, self.level, self.grad_ratio = growth, level, grad_ratio
        self.span, self.history = span, history
        self.first: dict[str, float] = {}  # V_l at its first record
        self.recent: dict[str, list[list[float]]] = {}  # [[step, V_l], ...], newest last, enough for the span
        self.grad_norms: list[float] = []

    def _layer_flag(self, step: int, rec: Mapping, tested: bool) -> dict | None:
        name, v = rec["layer"], rec.get("output_var")
        flag = dict(layer=name, index=rec.get("index", 0), initial=self.first.get(name, math.nan))
        if v is None:
            return None
        if not math.isfinite(v):
            return {**flag, "quantity": "output_var", "value": float(v), "growth": math.inf, **_NON_FINITE}
        v = float(v)
        self.first.setdefault(name, v)
        past = [p for p in self.recent.get(name, []) if step - p[0] >= self.span]
        self.recent[name] = [p for p in self.recent.get(name, []) if step - p[0] < self.span] + [[step, v]]
        if past:  # keep the newest record at least `span` back, for the next steps' rates
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
            if rate > self.growth:
                return {
                    **flag,
                    "quantity": "output_var_growth",
                    "value": v,
                    "growth": v / v0 if v0 > 0 else math.inf,
                    "reason": f"output variance growing at {rate:.3g}/step > growth {self.growth:g}",
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

    def check(
        self, step: int, records: Iterable[Mapping], exempt: Collection[str] = (), grad_norm: float | None = None
    ) -> CollapseAlarm | None:
        """Check one recorded step (records as for :meth:`CollapseDetector.check`; ``grad_norm``: the gradient norm
        of this step, or None). Layers in ``exempt`` get only the non-finite test. Returns an alarm naming the
        first flagged layer in forward order (the gradient counts as before every layer), or None."""
        flagged = []
        for rec in sorted(records, key=lambda r: r.get("index", 0)):
            if rec.get("kind") in ("conv", "linear"):
                flag = self._layer_flag(step, rec, rec["layer"] not in exempt)
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
        gflag = self._grad_flag(grad_norm)
        if gflag is not None:
            flagged.insert(0, gflag)
        if not flagged:
            return None
        top = min(flagged, key=lambda f: f["index"])
        return _alarm(step, top, flagged)

    def state_dict(self) -> dict:
        """Everything that decides future alarms, as plain Python types."""
        return {
            "span": self.span,
            "first": dict(self.first),
            "recent": {k: [list(p) for p in v] for k, v in self.recent.items()},
            "grad_norms": list(self.grad_norms),
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict`; ValueError when it is malformed or was made with another span."""
        if not isinstance(state, Mapping) or not {"span", "first", "recent", "grad_norms"} <= set(state):
            raise ValueError(f"CountdownDetector.load_state_dict: expected a dict from state_dict(), got {state!r:.80}")
        if state["span"] != self.span:
            raise ValueError(
                f"CountdownDetector.load_state_dict: state was made with span={state['span']}, this "
                f"detector uses {self.span}"
            )
        self.first = {str(k): float(v) for k, v in state["first"].items()}
        self.recent = {str(k): [[int(a), float(b)] for a, b in v] for k, v in state["recent"].items()}
        self.grad_norms = [float(g) for g in state["grad_norms"]]
