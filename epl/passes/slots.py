"""Which variable an optimizer's op writes, which trained variable a slot belongs to, and
what an update depends on -- shared by the passes that treat a variable and its optimizer
state as one unit (grouped apply, ZeRO)."""
from epl import _tf_compat as compat
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


class TrainEnds:
  """Which train op an update belongs to: the ends (ops nothing follows) reached downstream
  of an op by data or control edges, inside ``members`` when given -- a train op, or the
  ``tf.group`` of several. Two updates with other ends belong to train ops that run in
  different steps (a GAN's two optimizers). Memoised over the ops asked for. An edge back to
  an op still being walked (a ``tf.while_loop``'s NextIteration -> Merge, or any cycle) adds
  nothing: the walk ends on every graph."""

  def __init__(self, members=None):
    self._members = members
    self._ends = {}

  def _next(self, op):
    outs = [c for t in op.outputs for c in t.consumers()] + compat.control_outputs(op)
    return [c for c in outs if self._members is None or c in self._members]

  def __call__(self, op):
    stack, walking = [op], {}             # the ops of the current path: what follows each
    while stack:
      top = stack[-1]
      if top in self._ends:
        stack.pop()
        continue
      if top not in walking:                # first visit: walk what follows it
        walking[top] = nexts = self._next(top)
        stack.extend(n for n in nexts if n not in self._ends and n not in walking)
        continue
      stack.pop()                           # every op after it is done (or on the path)
      nexts = walking.pop(top)
      self._ends[top] = frozenset({top}) if not nexts else frozenset().union(
          *(self._ends[n] for n in nexts if n in self._ends))
    return self._ends[op]


def train_groups(update, readers):
  """{name: index}: names whose ``readers`` (ops of the ``update`` phase) reach the same ends
  get one index -- their values are needed by the same train op(s); indices follow the ends'
  creation order."""
  ends_of = TrainEnds(update)
  keys = {name: frozenset().union(*(ends_of(r) for r in ops)) if ops else frozenset()
          for name, ops in readers.items()}
  order = sorted(set(keys.values()), key=lambda k: min((compat.op_id(o) for o in k),
                                                       default=-1))
  index = {k: i for i, k in enumerate(order)}
  return {name: index[k] for name, k in keys.items()}
