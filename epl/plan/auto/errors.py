"""The planner's one error type.

``PlannerError`` is an ``epl.errors.PlanError``, so callers that catch epl's plan errors catch
the planner's too. ``epl.errors`` imports nothing heavy: the planner stays free of TensorFlow.
"""
from epl.errors import PlanError


class PlannerError(PlanError, ValueError):
  """The profile, the devices or the limits given to the planner cannot be planned."""
