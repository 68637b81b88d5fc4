"""Transformer rules: growth of the probes' scalars (:mod:`normlab.monitor.probes`) on recorded steps.

Each rule watches one probe (every key ``"<probe>/<module>"`` of ``StepContext.probes`` with that prefix) and
raises an event (of the rule's ``severity``) when a value stays above

.. math::
    \\text{threshold} = \\max(\\text{floor},\\; \\text{factor} \\times \\text{baseline})

for ``patience`` consecutive recorded steps, or becomes non-finite. The baseline of each key is the largest value
it takes on the recorded steps before step ``warmup`` (the first ``warmup`` optimizer steps, whatever the recording
interval); the rule is silent until then. A first-step transient of AdamW or SGD (the first updates move every
weight by about the learning rate) then sits inside the baseline instead of tripping the rule, and the floor keeps a
quantity that starts near zero (attention logits at a 0.02-std init) from alarming when it merely grows to a healthy
trained level.

- :class:`AttentionLogitRule`: attention-logit growth (``attn_logit``), the first small-scale-proxy instability of
  Wortsman et al. (2023), "Small-scale proxies for large-scale Transformer training instabilities";
- :class:`OutputLogitRule`: output-logit divergence (``logit_max``), their second;
- :class:`ResidualStreamRule`: growth of the residual stream of a pre-LN transformer (``residual_rms``);
- :class:`NormGainRule`: growth of LayerNorm/RMSNorm gains (``norm_gain``).

Attention-logit and residual-stream growth are warnings by default (such growth also appears in runs that train
on), output-logit divergence and norm-gain growth are alarms.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import ClassVar

from normlab._checks import check_number
from normlab.monitor.rules.base import Event, Rule, StepContext

__all__ = [
    "ProbeGrowthRule",
    "AttentionLogitRule",
    "OutputLogitRule",
    "ResidualStreamRule",
    "NormGainRule",
    "TRANSFORMER_RULES",
]


class ProbeGrowthRule(Rule):
    """Alarm when a probe's value exceeds ``max(floor, factor x baseline)`` for ``patience`` recorded steps.

    Subclasses set ``name`` (the rule), ``probe`` (the key prefix) and their defaults.

    Args:
        factor: growth over the baseline that counts (> 1).
        floor: an absolute level the value must also exceed (>= 0).
        warmup: optimizer steps whose recorded values make the baseline (their maximum), int >= 1.
        patience: consecutive observations above the threshold before the event (int >= 1).
        severity: ``"alarm"`` (a guard may act) or ``"warning"`` (informational).

    Example:
        >>> rule = AttentionLogitRule(factor=10.0, floor=1.0, warmup=10, patience=1)
        >>> ctx = lambda s, v: StepContext(step=s, loss=None, grad_norm=None, lrs=(), skipped=False,
        ...                                layer_order=(), feeds_norm=frozenset(), probes={"attn_logit/a": v})
        >>> rule.check(ctx(0, 0.5), []) is None, rule.check(ctx(10, 4.0), []) is None
        (True, True)
        >>> rule.check(ctx(20, 20.0), []).step
        20
    """

    probe: ClassVar[str] = ""
    every_step: ClassVar[bool] = False
    needs_probes: ClassVar[bool] = True
    needs_loss: ClassVar[bool] = False

    def __init__(
        self, factor: float = 10.0, floor: float = 0.0, warmup: int = 50, patience: int = 1, severity: str = "alarm"
    ) -> None:
        if severity not in ("alarm", "warning"):
            raise ValueError(f"{type(self).__name__}: severity must be 'alarm' or 'warning', got {severity!r}")
        self.severity = severity
        if not factor > 1.0 or not floor >= 0.0:
            raise ValueError(f"{type(self).__name__}: need factor > 1 and floor >= 0, got {factor}, {floor}")
        for arg, value in (("warmup", warmup), ("patience", patience)):
            check_number(type(self).__name__, arg, value, integer=True, low=1)
        self.factor, self.floor, self.warmup, self.patience = factor, floor, warmup, patience
        self.reset()

    def reset(self) -> None:
        """Forget every key's baseline and streak."""
        self.baseline: dict[str, float] = {}
        self.streak: dict[str, int] = {}

    def threshold(self, key: str) -> float:
        """The threshold of ``key`` after the warm-up (its floor when no value was recorded during the warm-up)."""
        return max(self.floor, self.factor * self.baseline.get(key, 0.0))

    def check(self, ctx: StepContext, records: Sequence[Mapping]) -> Event | None:
        """Update every key of this rule's probe; the alarm Event of the first key over its threshold, or None."""
        prefix = self.probe + "/"
        fired = None
        for key, value in ctx.probes.items():
            if not key.startswith(prefix) or value is None:
                continue
            event = self._observe(ctx.step, key, float(value))
            fired = fired or event
        return fired

    def _observe(self, step: int, key: str, value: float) -> Event | None:
        layer = key[len(self.probe) + 1 :]
        if not math.isfinite(value):
            return self._event(step, layer, value, f"{self.probe} of {layer} is {value}", math.inf)
        if step < self.warmup:
            self.baseline[key] = max(self.baseline.get(key, 0.0), value)
            return None
        limit = self.threshold(key)
        self.streak[key] = self.streak.get(key, 0) + 1 if value > limit else 0
        if self.streak[key] < self.patience:
            return None
        base = self.baseline.get(key, 0.0)
        growth = value / base if base > 0 else math.inf
        return self._event(
            step, layer, value, f"{self.probe} of {layer} at {value:.4g}, {growth:.3g}x its baseline", limit
        )

    def _event(self, step: int, layer: str, value: float, text: str, limit: float) -> Event:
        return Event(
            rule=self.name,
            severity=self.severity,
            step=step,
            message=f"{self.name}: {text} (threshold {limit:.4g})",
            layer=layer,
            quantity=self.probe,
            value=value,
            details={"baseline": self.baseline.get(f"{self.probe}/{layer}"), "threshold": limit},
        )

    def state_dict(self) -> dict:
        """Baselines and streaks per key."""
        return {"baseline": dict(self.baseline), "streak": dict(self.streak)}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict`."""
        self.baseline = {k: float(v) for k, v in state.get("baseline", {}).items()}
        self.streak = {k: int(v) for k, v in state.get("streak", {}).items()}


class AttentionLogitRule(ProbeGrowthRule):
    """Attention-logit growth: the largest attention logit (``attn_logit/<module>``) above
    ``max(floor, factor x baseline)``.

    Args:
        factor: default 10.
        floor: default 300.
        warmup, patience: see :class:`ProbeGrowthRule` (defaults 50, 1).
        severity: default ``"warning"``: attention logits that grow this far also appear in runs that train on.

    Example:
        >>> AttentionLogitRule().name
        'attn_logit_growth'
    """

    name = "attn_logit_growth"
    probe = "attn_logit"

    def __init__(
        self, factor: float = 10.0, floor: float = 300.0, warmup: int = 50, patience: int = 1, severity: str = "warning"
    ):
        super().__init__(factor, floor, warmup, patience, severity)


class OutputLogitRule(ProbeGrowthRule):
    """Output-logit divergence: the largest output logit (``logit_max/output``) above
    ``max(floor, factor x baseline)``.

    Args:
        factor: default 10.
        floor: default 50.
        warmup, patience: see :class:`ProbeGrowthRule` (defaults 50, 1).
        severity: default ``"alarm"``.

    Example:
        >>> OutputLogitRule().probe
        'logit_max'
    """

    name = "logit_growth"
    probe = "logit_max"

    def __init__(
        self, factor: float = 10.0, floor: float = 50.0, warmup: int = 50, patience: int = 1, severity: str = "alarm"
    ):
        super().__init__(factor, floor, warmup, patience, severity)


class ResidualStreamRule(ProbeGrowthRule):
    """Residual-stream growth: the rms of a LayerNorm/RMSNorm input (``residual_rms/<norm>``) above
    ``max(floor, factor x baseline)``.

    Args:
        factor: default 30.
        floor: default 100.
        warmup, patience: see :class:`ProbeGrowthRule` (defaults 50, 1).
        severity: default ``"warning"``: as :class:`AttentionLogitRule`.

    Example:
        >>> ResidualStreamRule().probe
        'residual_rms'
    """

    name = "residual_growth"
    probe = "residual_rms"

    def __init__(
        self, factor: float = 30.0, floor: float = 100.0, warmup: int = 50, patience: int = 1, severity: str = "warning"
    ):
        super().__init__(factor, floor, warmup, patience, severity)


class NormGainRule(ProbeGrowthRule):
    """Norm-gain growth: the rms of a LayerNorm/RMSNorm gain (``norm_gain/<norm>``) above
    ``max(floor, factor x baseline)``.

    Args:
        factor: default 10.
        floor: default 5.
        warmup, patience: see :class:`ProbeGrowthRule` (defaults 50, 1).
        severity: default ``"alarm"``.

    Example:
        >>> NormGainRule().probe
        'norm_gain'
    """

    name = "norm_gain_growth"
    probe = "norm_gain"

    def __init__(
        self, factor: float = 10.0, floor: float = 5.0, warmup: int = 50, patience: int = 1, severity: str = "alarm"
    ):
        super().__init__(factor, floor, warmup, patience, severity)


TRANSFORMER_RULES = (AttentionLogitRule, OutputLogitRule, ResidualStreamRule, NormGainRule)
