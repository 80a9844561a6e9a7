"""Pure eviction planning: no I/O, no logging, no globals."""

from gateway.policy.plan import Plan, plan
from gateway.policy.plan_rules import Limits, PlanRules
from gateway.policy.stages import STAGES

__all__ = ["STAGES", "Limits", "Plan", "PlanRules", "plan"]
