"""memgate: a memory-aware reverse proxy for LLM APIs."""

__version__ = "0.1.0"  # before the imports: the CLI (imported by them) reads it

from .app import create_app
from .chat import Decision, decide
from .policy import Limits, Plan, PlanRules, plan
from .rules import Rules, load_rules

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
