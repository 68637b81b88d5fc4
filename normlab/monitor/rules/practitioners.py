"""The detectors practitioners use today, as rules: a loss spike, a gradient-norm z-score, a non-finite check.

They read scalars of the step (``ctx.loss``, ``ctx.grad_norm``, ``ctx.skipped``), so they are checked on every step
and need the loss passed to the monitor: ``mon.observe_loss(loss)`` before ``optimizer.step()``.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence

from normlab._checks import check_number
from normlab.monitor.rules.base import Event, Rule, StepContext

__all__ = ["LossSpikeRule", "GradNormZScoreRule", "NonFiniteRule"]


def _positive(owner: str, name: str, value, low: float = 0.0) -> float:
    return float(check_number(owner, name, value, low=low, low_open=True))


def _count(owner: str, name: str, value, low: int = 1) -> int:
    return check_number(owner, name, value, integer=True, low=low)


class LossSpikeRule(Rule):
    """Alarm when the training loss exceeds ``factor`` times a statistic of its recent values.

    .. math::
        \\ell_t > \\text{factor} \\cdot S(\\ell_{t-w}, \\dots, \\ell_{t-1})

    with ``S`` the maximum, mean or median of the last ``window`` finite losses (at least ``min_history`` of them),
    for ``patience`` consecutive steps. The defaults are Megatron-LM's spiky-loss check (``check_for_spiky_loss``:
    a loss 10x the largest recent loss, its ``SPIKY_LOSS_FACTOR``); LLM Foundry's ``KillLossSpike`` callback is
    ``LossSpikeRule(factor=2.0, statistic="mean", patience=4)`` (twice the running mean of a window of at least 100
    losses, four outliers in a row). A spike does not enter the window.

    Args:
        factor: the multiple of the statistic that counts as a spike (> 1).
        window: how many recent losses the statistic reads (int >= 1).
        statistic: ``"max"``, ``"mean"`` or ``"median"``.
        patience: consecutive spiking steps before the alarm (int >= 1).
        min_history: losses needed before the first test (int >= 1, at most ``window``).

    Example:
        >>> rule = LossSpikeRule(factor=2.0, statistic="mean", min_history=3)
        >>> [rule.check(StepContext(step=s, loss=v, recorded=False), []) for s, v in enumerate([1.0, 1.1, 0.9])]
        [None, None, None]
        >>> rule.check(StepContext(step=3, loss=2.5, recorded=False), []).value
        2.5
    """

    name = "loss_spike"
    every_step = True

    def __init__(
        self,
        factor: float = 10.0,
        window: int = 100,
        statistic: str = "max",
        patience: int = 1,
        min_history: int = 10,
    ) -> None:
        self.factor = _positive("LossSpikeRule", "factor", factor, 1.0)
        self.window = _count("LossSpikeRule", "window", window)
        if statistic not in ("max", "mean", "median"):
            raise ValueError(f"LossSpikeRule: statistic must be 'max', 'mean' or 'median', got {statistic!r}")
        self.statistic = statistic
        self.patience = _count("LossSpikeRule", "patience", patience)
        self.min_history = _count("LossSpikeRule", "min_history", min_history)
        if self.min_history > self.window:
            raise ValueError(f"LossSpikeRule: min_history ({min_history}) must be at most window ({window})")
        self.reset()

    def reset(self) -> None:
        self.recent: deque[float] = deque(maxlen=self.window)
        self.streak = 0

    def _reference(self) -> float:
        if self.statistic == "max":
            return max(self.recent)
        if self.statistic == "mean":
            return sum(self.recent) / len(self.recent)
        return statistics.median(self.recent)

    def check(self, ctx: StepContext, records: Sequence[Mapping]) -> Event | None:
        loss = ctx.loss
        if loss is None or not math.isfinite(loss):
            return None  # NonFiniteRule's case
        if len(self.recent) < self.min_history:
            self.recent.append(float(loss))
            return None
        ref = self._reference()
        if ref <= 0 or loss <= self.factor * ref:
            self.streak = 0
            self.recent.append(float(loss))
            return None
        self.streak += 1
        if self.streak < self.patience:
            return None
        message = f"loss {loss:.4g} > {self.factor:g} x the {self.statistic} of the last {len(self.recent)} ({ref:.4g})"
        details = {"reference": ref, "statistic": self.statistic, "factor": self.factor, "streak": self.streak}
        return Event(self.name, "alarm", ctx.step, message, quantity="loss", value=float(loss), details=details)

    def state_dict(self) -> dict:
        return {"recent": list(self.recent), "streak": self.streak}

    def load_state_dict(self, state: Mapping) -> None:
        super().load_state_dict(state)
        self.recent = deque((float(v) for v in state.get("recent", [])), maxlen=self.window)
        self.streak = int(state.get("streak", 0))

    def __repr__(self) -> str:
        return (
            f"LossSpikeRule(factor={self.factor:g}, window={self.window}, statistic={self.statistic!r}, "
            f"patience={self.patience}, min_history={self.min_history})"
        )


class GradNormZScoreRule(Rule):
    """Alarm when the global gradient norm's z-score against its exponential moving statistics exceeds
    ``z_threshold`` (ZClip, Kumar et al. 2025).

    .. math::
        z_t = \\frac{g_t - \\mu_{t-1}}{\\sigma_{t-1}}, \\qquad
        \\mu_t = \\alpha \\mu_{t-1} + (1 - \\alpha) g_t, \\qquad
        \\sigma^2_t = \\alpha \\sigma^2_{t-1} + (1 - \\alpha) (g_t - \\mu_t)^2

    The first ``warmup`` norms start the statistics (their mean and variance); a spike enters them clipped to
    ``mu + z_threshold * sigma``, as ZClip does, so that one spike does not hide the next. Defaults: ZClip's
    (``alpha`` 0.97, ``z_threshold`` 2.5, ``warmup`` 25 steps).

    Args:
        z_threshold: the z-score that counts as a spike (> 0).
        alpha: the EMA's decay, in (0, 1).
        warmup: norms collected before the first test (int >= 2).
        patience: consecutive spiking steps before the alarm (int >= 1).

    Example:
        >>> rule = GradNormZScoreRule(warmup=4)
        >>> ctx = lambda s, g: StepContext(step=s, grad_norm=g, recorded=False)
        >>> [rule.check(ctx(s, g), []) for s, g in enumerate([1.0, 1.1, 0.9, 1.0, 1.05])]
        [None, None, None, None, None]
        >>> rule.check(ctx(5, 10.0), []).quantity
        'grad_norm'
    """

    name = "grad_norm_zscore"
    needs_loss = False
    every_step = True
    needs_grad_norm = True

    def __init__(self, z_threshold: float = 2.5, alpha: float = 0.97, warmup: int = 25, patience: int = 1) -> None:
        self.z_threshold = _positive("GradNormZScoreRule", "z_threshold", z_threshold)
        self.alpha = float(
            check_number("GradNormZScoreRule", "alpha", alpha, low=0, high=1, low_open=True, high_open=True)
        )
        self.warmup = _count("GradNormZScoreRule", "warmup", warmup, 2)
        self.patience = _count("GradNormZScoreRule", "patience", patience)
        self.reset()

    def reset(self) -> None:
        self.first: list[float] = []
        self.mean: float | None = None
        self.var: float | None = None
        self.streak = 0

    def _update(self, g: float) -> None:
        self.mean = self.alpha * self.mean + (1 - self.alpha) * g
        self.var = self.alpha * self.var + (1 - self.alpha) * (g - self.mean) ** 2

    def check(self, ctx: StepContext, records: Sequence[Mapping]) -> Event | None:
        g = ctx.grad_norm
        if g is None or not math.isfinite(g) or ctx.skipped:
            return None  # NonFiniteRule's case (a skipped step's norm is the overflow's)
        if self.mean is None:
            self.first.append(float(g))
            if len(self.first) == self.warmup:
                self.mean = sum(self.first) / len(self.first)
                self.var = sum((v - self.mean) ** 2 for v in self.first) / len(self.first)
                self.first = []
            return None
        std = math.sqrt(self.var)
        z = (g - self.mean) / std if std > 0 else (math.inf if g > self.mean else 0.0)
        if z <= self.z_threshold:
            self.streak = 0
            self._update(float(g))
            return None
        self.streak += 1
        mean = self.mean
        self._update(mean + self.z_threshold * std)
        if self.streak < self.patience:
            return None
        message = f"gradient norm {g:.4g} at z = {z:.3g} > {self.z_threshold:g} (EMA mean {mean:.4g}, std {std:.4g})"
        details = {"z": z, "ema_mean": mean, "ema_std": std, "streak": self.streak}
        return Event(self.name, "alarm", ctx.step, message, quantity="grad_norm", value=float(g), details=details)

    def state_dict(self) -> dict:
        return {"first": list(self.first), "mean": self.mean, "var": self.var, "streak": self.streak}

    def load_state_dict(self, state: Mapping) -> None:
        super().load_state_dict(state)
        self.first = [float(v) for v in state.get("first", [])]
        self.mean = None if state.get("mean") is None else float(state["mean"])
        self.var = None if state.get("var") is None else float(state["var"])
        self.streak = int(state.get("streak", 0))

    def __repr__(self) -> str:
        return (
            f"GradNormZScoreRule(z_threshold={self.z_threshold:g}, alpha={self.alpha:g}, warmup={self.warmup}, "
            f"patience={self.patience})"
        )


class NonFiniteRule(Rule):
    """Alarm on a non-finite training loss or gradient norm (TorchTitan's check), or on ``max_skips`` optimizer
    steps in a row that a GradScaler skipped (inf/nan gradients in float16).

    A GradScaler skips a few steps on its own while it lowers a too-large initial scale (2^16 halves to a scale that
    fits in at most ~10 skips), so single skips are no alarm.

    Args:
        max_skips: consecutive skipped steps that raise the alarm (int >= 1), or None for no skip test.
        grad_norm: also test the gradient norm (the monitor then measures it on every step: one host
            synchronisation per step).

    Example:
        >>> rule = NonFiniteRule()
        >>> rule.check(StepContext(step=4, loss=float("nan"), recorded=False), []).message
        'non-finite training loss (nan)'
    """

    name = "non_finite"
    every_step = True

    def __init__(self, max_skips: int | None = 10, grad_norm: bool = True) -> None:
        self.max_skips = None if max_skips is None else _count("NonFiniteRule", "max_skips", max_skips)
        self.needs_grad_norm = bool(grad_norm)
        self.reset()

    def reset(self) -> None:
        self.skips = 0

    def check(self, ctx: StepContext, records: Sequence[Mapping]) -> Event | None:
        self.skips = self.skips + 1 if ctx.skipped else 0
        if ctx.loss is not None and not math.isfinite(ctx.loss):
            return Event(
                self.name,
                "alarm",
                ctx.step,
                f"non-finite training loss ({ctx.loss})",
                quantity="loss",
                value=float(ctx.loss),
            )
        g = ctx.grad_norm
        if self.needs_grad_norm and g is not None and not math.isfinite(g) and not ctx.skipped:
            return Event(
                self.name, "alarm", ctx.step, f"non-finite gradient norm ({g})", quantity="grad_norm", value=float(g)
            )
        if self.max_skips is not None and self.skips >= self.max_skips:
            message = f"{self.skips} optimizer steps in a row skipped by the GradScaler (inf/nan gradients)"
            return Event(self.name, "alarm", ctx.step, message, quantity="skipped_steps", value=float(self.skips))
        return None

    def state_dict(self) -> dict:
        return {"skips": self.skips}

    def load_state_dict(self, state: Mapping) -> None:
        super().load_state_dict(state)
        self.skips = int(state.get("skips", 0))

    def __repr__(self) -> str:
        return f"NonFiniteRule(max_skips={self.max_skips}, grad_norm={self.needs_grad_norm})"
