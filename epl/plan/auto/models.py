"""The cost models by name (``--cost-model``): the registry above their implementations."""
from epl.plan.auto import dapple, simulate
from epl.plan.auto.errors import PlannerError


def get_model(name):
  """Returns the cost model called ``name``.

  Raises:
    PlannerError: unknown name (the message lists the known ones).
  """
  models = {
      "dapple": lambda: dapple.DappleModel(),
      "dapple-published": lambda: dapple.DappleModel(published=True),
      "simulate": lambda: simulate.SimulateModel(),
  }
  if isinstance(name, str):
    if name not in models:
      raise PlannerError("cost_model=%r; choose one of %s" % (name, ", ".join(models)))
    return models[name]()
  return name                                    # already a model object
