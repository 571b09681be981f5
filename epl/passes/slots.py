"""Which variable an optimizer's op writes, which trained variable a slot belongs to, and
what an update depends on -- shared by the passes that treat a variable and its optimizer
state as one unit (grouped apply, ZeRO)."""
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


def ancestors(ops, members=None):
  """Every op (of ``members``, default any) that ``ops`` depend on, by data or control
  edges through such ops, ``ops`` included."""
  seen, work = set(), list(ops)
  while work:
    op = work.pop()
    if op in seen or (members is not None and op not in members):
      continue
    seen.add(op)
    work.extend(t.op for t in op.inputs)
    work.extend(op.control_inputs)
  return seen
