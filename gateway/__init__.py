"""memgate: a memory-aware reverse proxy for LLM APIs."""

__version__ = "0.1.0"  # before the imports: the CLI (imported by them) reads it

from gateway.config.rules import load_rules
from gateway.config.schema import Rules
from gateway.decide.chat import decide
from gateway.decide.decision import Decision
from gateway.policy import Limits, Plan, PlanRules, plan
from gateway.proxy.app import create_app

__all__ = [
    "Decision",
    "Limits",
    "Plan",
    "PlanRules",
    "Rules",
    "create_app",
    "decide",
    "load_rules",
    "plan",
]
