"""The parallel plan: what to build, independent of how passes build it."""
from epl.plan.plan import ParallelPlan, TaskGraphPlan  # noqa: F401
