"""The monitor's rules: small stateful classes that read a step's records and scalars and raise
:class:`~normlab.monitor.rules.base.Event` s (docs/monitor.md, "Rules")."""

from normlab.monitor.rules.base import Event, Rule, StepContext
from normlab.monitor.rules.practitioners import GradNormZScoreRule, LossSpikeRule, NonFiniteRule
from normlab.monitor.rules.replay import check_rules, replay

__all__ = [
    "Event",
    "Rule",
    "StepContext",
    "LossSpikeRule",
    "GradNormZScoreRule",
    "NonFiniteRule",
    "check_rules",
    "replay",
]
