"""The monitor's rules: small stateful classes that read a step's records and scalars and raise
:class:`~normlab.monitor.Event` s (docs/monitor.md).

- :class:`FactorRule`, :class:`CountdownRule` (``normlab.monitor.rules.variance``): layer variances growing
  past a factor of their baseline, or at a rate that foretells a collapse;
- :class:`RegimeRule` (``normlab.monitor.rules.regime``): a layer's shift term dominating its variance term;
- :class:`LossSpikeRule`, :class:`GradNormZScoreRule`, :class:`NonFiniteRule`
  (``normlab.monitor.rules.practitioners``): the checks practitioners use today;
- :class:`~normlab.monitor.rules.transformer.AttentionLogitRule`,
  :class:`~normlab.monitor.rules.transformer.OutputLogitRule`,
  :class:`~normlab.monitor.rules.transformer.ResidualStreamRule`,
  :class:`~normlab.monitor.rules.transformer.NormGainRule` (``normlab.monitor.rules.transformer``): growth of the
  probes' values (:mod:`normlab.monitor.probes`); a monitor given one of them runs the probes on its recorded steps.

A new rule is a subclass of :class:`~normlab.monitor.Rule`; :func:`~normlab.monitor.replay` runs rules over a
recorded run.
"""

from normlab.monitor.rules.base import Event, Rule, StepContext
from normlab.monitor.rules.practitioners import GradNormZScoreRule, LossSpikeRule, NonFiniteRule
from normlab.monitor.rules.regime import RegimeRule
from normlab.monitor.rules.replay import check_rules, context_from_records, replay
from normlab.monitor.rules.transformer import (
    TRANSFORMER_RULES,
    AttentionLogitRule,
    NormGainRule,
    OutputLogitRule,
    ProbeGrowthRule,
    ResidualStreamRule,
)
from normlab.monitor.rules.variance import CountdownRule, FactorRule


def DEFAULT_RULES() -> list[Rule]:  # noqa: N802 - a constant-like factory, named as the contract fixes it
    """Fresh instances of the monitor's default rules, in the order their events are kept: the growth factors, the
    countdown. The regime warning (:class:`~normlab.monitor.rules.RegimeRule`) is not among them: on the collapse
    benchmark it warned no collapse and flagged healthy runs (docs/defaults.md); add it to ``rules`` to have it.

    Example:
        >>> [type(rule).__name__ for rule in DEFAULT_RULES()]
        ['FactorRule', 'CountdownRule']
    """
    return [FactorRule(), CountdownRule()]


__all__ = [
    "DEFAULT_RULES",
    "Event",
    "Rule",
    "StepContext",
    "FactorRule",
    "CountdownRule",
    "RegimeRule",
    "LossSpikeRule",
    "GradNormZScoreRule",
    "NonFiniteRule",
    "ProbeGrowthRule",
    "AttentionLogitRule",
    "OutputLogitRule",
    "ResidualStreamRule",
    "NormGainRule",
    "TRANSFORMER_RULES",
    "check_rules",
    "context_from_records",
    "replay",
]
