"""The rule contract of the monitor: what a rule sees (:class:`StepContext` and the step's records), what it says
(:class:`Event`) and what it is (:class:`Rule`).

A rule is one small stateful class. The monitor builds one :class:`StepContext` per checked step and calls
``rule.check(ctx, records)`` on every rule it was given; a rule returns an :class:`Event` when it fires, else None.
Rules with ``every_step = True`` are checked on every optimizer step (on steps that record nothing their
``records`` are the light records of the step: see :attr:`Rule.light_keys`); the others on recorded steps only
(``ctx.recorded``). :func:`normlab.monitor.replay` runs the same rules over a recorded run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = ["Event", "StepContext", "Rule", "SEVERITIES"]

SEVERITIES = ("alarm", "warning")


def _plain(value: Any) -> Any:
    """``value`` as JSON-serialisable plain types (non-finite floats kept: the log writer turns them into null)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return value
    if isinstance(value, float):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


@dataclass(frozen=True)
class Event:
    """What a rule reports when it fires.

    Attributes:
        rule: the name of the rule that fired (``Rule.name``, e.g. ``"countdown"``, ``"loss_spike"``).
        severity: ``"alarm"`` (the run is collapsing: :class:`~normlab.monitor.CollapseGuard` may act on it) or
            ``"warning"`` (informational).
        step: the optimizer step at which it fired.
        message: one line a user can read.
        layer: the module name the event is about, if any.
        quantity: the record key or scalar that fired, if any.
        value: its value at ``step``, if any.
        details: anything else the rule wants to keep (JSON-serialisable).
        rolled_back: the event was raised on steps a :class:`~normlab.monitor.CollapseGuard` rolled back (it is then
            only in the monitor's ``history``, not in its ``events``).

    Example:
        >>> e = Event("countdown", "alarm", 12, "layer 'c1' output variance growing", layer="c1", value=3.0)
        >>> Event.from_dict(e.to_dict()) == e, str(e)
        (True, "collapse warning at step 12: layer 'c1' output variance growing [countdown]")
    """

    rule: str
    severity: str
    step: int
    message: str
    layer: str | None = None
    quantity: str | None = None
    value: float | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
    rolled_back: bool = False

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"Event: severity must be one of {SEVERITIES}, got {self.severity!r}")
        if not isinstance(self.rule, str) or not self.rule:
            raise ValueError(f"Event: rule must be a non-empty string, got {self.rule!r}")

    @property
    def is_alarm(self) -> bool:
        """True for severity ``"alarm"``."""
        return self.severity == "alarm"

    def to_dict(self) -> dict:
        """The event as plain types (the log's ``{"event": "rule", ...}`` entry without ``event``; ``rolled_back``
        only when True)."""
        out = {
            "rule": self.rule,
            "severity": self.severity,
            "step": int(self.step),
            "message": self.message,
            "layer": self.layer,
            "quantity": self.quantity,
            "value": None if self.value is None else float(self.value),
            "details": _plain(dict(self.details)),
        }
        return {**out, "rolled_back": True} if self.rolled_back else out

    @classmethod
    def from_dict(cls, d: Mapping) -> Event:
        """The inverse of :meth:`to_dict` (an ``event`` key is ignored; a null value stays None)."""
        value = d.get("value")
        return cls(
            rule=str(d["rule"]),
            severity=str(d["severity"]),
            step=int(d["step"]),
            message=str(d.get("message", "")),
            layer=d.get("layer"),
            quantity=d.get("quantity"),
            value=None if value is None else float(value),
            details=dict(d.get("details") or {}),
            rolled_back=bool(d.get("rolled_back", False)),
        )

    def __str__(self) -> str:
        what = "collapse warning" if self.severity == "alarm" else "warning"
        gone = " (rolled back)" if self.rolled_back else ""
        return f"{what} at step {self.step}: {self.message} [{self.rule}]{gone}"


@dataclass
class StepContext:
    """What the monitor knows about one optimizer step besides the per-layer records.

    Attributes:
        step: the optimizer step (the monitor's ``current_step``; step 0 is the first).
        loss: the training loss of the step, if the loop passed it (``mon.observe_loss(loss)`` before ``opt.step()``).
        grad_norm: the global gradient norm before the step, if measured (a rule with ``needs_grad_norm``).
        lrs: the learning rate of each parameter group at this step (a tuple of floats).
        skipped: the optimizer step was skipped (a GradScaler found inf/nan gradients).
        layer_order: the forward order of the layers that ran in a recorded forward (a tuple of names).
        feeds_norm: layers whose output a normalization layer renormalizes before the next conv/linear layer.
        probes: extra per-step scalars from probes, keyed ``"<probe>/<module name>"``.
        recorded: the records are this step's full records (False: light records, or none).
        output_layer: the output layer (the last conv/linear layer in forward order), if known.
        layer_lrs: the learning rate of each monitored layer's parameters, if known.
        adaptive: the optimizer is adaptive (Adam family, Adagrad, RMSprop:
            :func:`~normlab.monitor.optim_step.is_adaptive`): its first steps move every weight by about the learning
            rate, so output variances grow fast at first in healthy runs too (the first-step transient).

    Example:
        >>> StepContext(step=3, loss=2.1).skipped
        False
    """

    step: int
    loss: float | None = None
    grad_norm: float | None = None
    lrs: tuple = ()
    skipped: bool = False
    layer_order: tuple = ()
    feeds_norm: frozenset[str] = frozenset()
    probes: Mapping[str, float] = field(default_factory=dict)
    recorded: bool = True
    output_layer: str | None = None
    layer_lrs: Mapping[str, float] = field(default_factory=dict)
    adaptive: bool = False

    def to_dict(self) -> dict:
        """The context as plain types (non-finite floats kept)."""
        return {
            "step": int(self.step),
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "lrs": list(self.lrs),
            "skipped": self.skipped,
            "layer_order": list(self.layer_order),
            "feeds_norm": sorted(self.feeds_norm),
            "probes": dict(self.probes),
            "recorded": self.recorded,
            "output_layer": self.output_layer,
            "layer_lrs": dict(self.layer_lrs),
            "adaptive": self.adaptive,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> StepContext:
        """The inverse of :meth:`to_dict`; missing keys take their defaults (null numbers stay None)."""
        return cls(
            step=int(d["step"]),
            loss=d.get("loss"),
            grad_norm=d.get("grad_norm"),
            lrs=tuple(float(v) for v in d.get("lrs", ())),
            skipped=bool(d.get("skipped", False)),
            layer_order=tuple(d.get("layer_order", ())),
            feeds_norm=frozenset(d.get("feeds_norm", ())),
            probes={str(k): (math.nan if v is None else float(v)) for k, v in (d.get("probes") or {}).items()},
            recorded=bool(d.get("recorded", True)),
            output_layer=d.get("output_layer"),
            layer_lrs={str(k): float(v) for k, v in (d.get("layer_lrs") or {}).items()},
            adaptive=bool(d.get("adaptive", False)),
        )


class Rule:
    """Base class of the monitor's rules: subclass it, give it a ``name`` and implement :meth:`check`.

    A rule keeps its thresholds in its ``__init__`` signature and its running state (streaks, baselines, EMAs) in
    attributes that :meth:`state_dict` exports and :meth:`load_state_dict` restores exactly, so that a resumed run
    (and a guard's rollback) raises the same events. :meth:`reset` forgets the state.

    Attributes:
        name: the rule's name in events and logs.
        every_step: True: checked on every optimizer step (cheap scalar rules: the loss, the gradient norm);
            False: only on recorded steps (``ctx.recorded``).
        light_keys: record keys the rule needs on steps that record nothing (only ``"output_var"`` is supported):
            the monitor then keeps them on every step (a *light* step) and passes them as ``records``.
        needs_grad_norm: the monitor measures the global gradient norm on every step the rule is checked
            (``ctx.grad_norm``).
        needs_loss: the rule reads ``ctx.loss`` (default True); the monitor reads a loss tensor back to the host
            only when a rule due at the step needs it, so rules that never read it say False.
        needs_probes: the rule reads ``ctx.probes`` (default False): a monitor given such a rule runs the probes
            (:mod:`normlab.monitor.probes`) on its recorded steps unless told otherwise (``probes=False``).

    The default :meth:`state_dict` returns ``{}`` and :meth:`load_state_dict` accepts it: a rule with state
    overrides all three methods. The base class takes no arguments; a subclass's ``__init__`` holds its thresholds.

    Args:

    Example:
        >>> class LossAbove(Rule):
        ...     name, every_step = "loss_above", True
        ...     def __init__(self, limit: float = 10.0):
        ...         self.limit = limit
        ...     def check(self, ctx, records):
        ...         if ctx.loss is not None and ctx.loss > self.limit:
        ...             return Event(self.name, "alarm", ctx.step, f"loss {ctx.loss:.3g} > {self.limit:g}")
        ...         return None
        >>> LossAbove(5.0).check(StepContext(step=7, loss=9.0), []).message
        'loss 9 > 5'
    """

    name: ClassVar[str] = "rule"
    every_step: ClassVar[bool] = False
    light_keys: ClassVar[tuple[str, ...]] = ()
    needs_grad_norm: ClassVar[bool] = False
    needs_loss: ClassVar[bool] = True
    needs_probes: ClassVar[bool] = False

    def check(self, ctx: StepContext, records: Sequence[Mapping]) -> Event | None:
        """Check one step: an :class:`Event` when the rule fires, else None (updating the rule's state)."""
        raise NotImplementedError(f"{type(self).__name__}.check: a Rule subclass must implement check(ctx, records)")

    def state_dict(self) -> dict:
        """The running state as plain Python types (``torch.load(weights_only=True)`` safe)."""
        return {}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict`."""
        if not isinstance(state, Mapping):
            raise ValueError(f"{type(self).__name__}.load_state_dict: expected a dict, got {type(state).__name__}")

    def reset(self) -> None:
        """Forget the running state (as a freshly made rule)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
