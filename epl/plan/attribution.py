"""Which TaskGraph and phase every op of the user's graph belongs to.

Phases:
  * ``backward``: ops created inside ``tf.gradients`` / ``compute_gradients``;
  * ``apply`` (the update, run once per step): ops created inside ``apply_gradients``, and
    every op downstream of a variable's raw gradient that is not needed to compute one --
    the user's clipping, a custom optimizer that overrides ``apply_gradients`` (BERT's
    AdamWeightDecay), gradient summaries, ``global_step`` bookkeeping -- plus the variables
    only such ops use (optimizer state);
  * ``forward``: the rest.

TaskGraph (EPL's rule):
  1. forward ops: ``Recorder.taskgraph_of`` (the scope they were created in, or the default /
     most recent one);
  2. backward and apply ops: the TaskGraph of the op they are colocated with (epl forces
     ``colocate_gradients_with_ops=True``; optimizers colocate slots with their variable);
     failing that, of their first input (data, then control) that has one; failing that, of
     their first consumer that has one; failing that, the last TaskGraph;
  3. an optimizer-state variable (used by apply ops only): the TaskGraph of its first user.
An op a transform built for another (``Recorder.twins``: epl.amp's float16 twin of a matmul,
a cast before it) takes that op's TaskGraph and phase.
"""
import bisect

from epl import _tf_compat as compat
from epl.op_tables import VARIABLE_OPS

_READS = ("Identity", "ReadVariableOp")


def _phase_of_ids(recorder):
  """Returns a function op rank -> phase from the recorded (possibly nested) intervals."""
  intervals = sorted(recorder.phase_intervals, key=lambda iv: (iv[0], -iv[1]))
  if not intervals:
    return lambda op_id: "forward"
  starts = [iv[0] for iv in intervals]

  def phase(op_id):
    # The innermost interval containing op_id: scan back from the last start <= op_id.
    i = bisect.bisect_right(starts, op_id) - 1
    while i >= 0:
      first, last, name = intervals[i]
      if first <= op_id <= last:
        return name
      i -= 1
    return "forward"
  return phase


def gradient_tensors(grad):
  """The tensors of a gradient (a Tensor or IndexedSlices)."""
  if hasattr(grad, "indices"):
    return [t for t in (grad.values, grad.indices) if t is not None]
  return [grad]


def _inputs(op):
  return [t.op for t in op.inputs] + list(op.control_inputs)


def _users(op):
  return [c for t in op.outputs for c in t.consumers()] + compat.control_outputs(op)


def _closure(seeds, step, within):
  found, work = set(), [s for s in seeds if s in within]
  while work:
    op = work.pop()
    if op in found:
      continue
    found.add(op)
    work.extend(x for x in step(op) if x in within and x not in found)
  return found


def _mark_update_region(ops, phase, recorder):
  """Sets phase "apply" on the update: everything downstream of the raw gradients (and of
  the apply intervals) that computing the gradients does not need, and everything that only
  feeds it (a learning-rate schedule, ``beta * m``, optimizer state variables)."""
  within = set(ops)
  grads = {t.op for g, _ in recorder.gradients for t in gradient_tensors(g)} & within
  needed = _closure(grads, _inputs, within)
  seeds = [c for g in grads for c in _users(g)] + [op for op in ops if phase[op] == "apply"]
  update = _closure(seeds, _users, within) - needed
  for op in reversed(ops):                     # users come after their inputs
    if op in update or op in needed:
      continue
    users = [u for u in _users(op) if not _initializes(u, op)]
    if users and all(u in update for u in users):
      update.add(op)
  for op in update:
    phase[op] = "apply"


def _initializes(user, var_op):
  """True for a variable's own initializer or initialization check (not a use in the step)."""
  return (user.type in ("Assign", "AssignVariableOp") and user.name == var_op.name + "/Assign"
          or user.type in ("VarIsInitializedOp", "IsVariableInitialized"))


def attribute_ops(graph, recorder, upto_version):
  """Returns ({op: taskgraph index}, {op: phase}) for the first ``upto_version`` ops.

  The recorder speaks in ``graph.version`` (the op count when an event happened); the i-th
  op created has rank i, so ranks compare with recorded versions whatever ids TF assigns.
  """
  ops = sorted(graph.get_operations(), key=compat.op_id)[:upto_version]
  rank = {op: i + 1 for i, op in enumerate(ops)}
  if recorder.retired:
    gone = retired(graph, recorder.retired)
    ops = [op for op in ops if op not in gone]
  phase_fn = _phase_of_ids(recorder)
  phase = {op: phase_fn(rank[op]) for op in ops}
  by_name = {op.name: op for op in ops}
  twins = {op: by_name[recorder.twins[op.name]] for op in ops if op.name in recorder.twins}
  for op, original in twins.items():
    phase[op] = phase[original]
  _mark_update_region(ops, phase, recorder)
  for op, original in twins.items():
    phase[op] = phase[original]
  owner = {}
  for op in ops:
    if phase[op] == "forward":
      owner[op] = owner.get(twins[op]) if op in twins else recorder.taskgraph_of(rank[op])
  pending = [op for op in ops if op not in owner]
  for op in pending:        # ops are in creation order, so inputs are usually decided first
    if op in twins:         # built after its original, so that one is decided
      owner[op] = owner.get(twins[op])
      continue
    owner[op] = _from_colocation(op, by_name, owner)
    if owner[op] is None and op.type not in VARIABLE_OPS:
      owner[op] = next((owner[x] for x in _inputs(op) if owner.get(x) is not None), None)
  last = len(recorder.specs) - 1
  for op in pending:
    if owner[op] is None:
      users = [u for r in _users(op) for u in ([r] + _users(r) if r.type in _READS else [r])]
      owner[op] = next((owner[c] for c in users
                        if owner.get(c) is not None and phase.get(c) == "apply"),
                       next((owner[c] for c in users if owner.get(c) is not None), last))
  return owner, phase


def retired(graph, names):
  """The ops a split variable's relayout left unread (epl._tf_compat.split_variables): its
  first parts and every op that reads them, directly or through others."""
  return compat.downstream([graph.get_operation_by_name(n) for n in names])


def _from_colocation(op, by_name, owner):
  for group in op.colocation_groups():
    name = group.decode()[len("loc:@"):] if isinstance(group, bytes) else group[5:]
    target = by_name.get(name)
    if target is not None and target is not op and owner.get(target) is not None:
      return owner[target]
  return None
