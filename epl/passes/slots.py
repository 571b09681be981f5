"""Which variable an optimizer's op writes, and which trained variable a slot belongs to --
shared by the passes that treat a variable and its optimizer state as one unit (grouped
apply, ZeRO)."""
from epl.op_tables import VARIABLE_OPS, mutates


def written(op):
  """The variable op ``op`` writes (an update, an assign), or None."""
  if not mutates(op):
    return None
  for t in op.inputs:
    if t.op.type in VARIABLE_OPS:
      return t.op
  return None


def owner_of(name, trained):
  """The trained variable (name) that variable ``name`` belongs to: itself, or the variable
  whose optimizer slot it is (``<var>/Momentum``, ``<var>/adam_m``), else None."""
  best = None
  for var in trained:
    if name == var or name.startswith(var + "/"):
      if best is None or len(var) > len(best):
        best = var
  return best


def slots(variable_names, trained):
  """{slot variable name: its trained variable} among ``variable_names``."""
  out = {}
  for name in variable_names:
    owner = owner_of(name, trained)
    if owner is not None and owner != name:
      out[name] = owner
  return out
