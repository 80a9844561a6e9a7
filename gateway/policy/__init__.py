"""Pure eviction planning: no I/O, no logging, no globals."""

from gateway.policy.plan import STAGES, Limits, Plan, PlanRules, plan

__all__ = ["STAGES", "Limits", "Plan", "PlanRules", "plan"]
