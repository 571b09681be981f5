"""Which TaskGraph and phase every op of the user's graph belongs to.

Attribution rule (which TaskGraph an op joins):
  1. forward ops (created outside gradient and optimizer calls): ``Recorder.taskgraph_of``;
  2. backward ops (created inside ``tf.gradients``/``compute_gradients``) and apply ops
     (created inside ``apply_gradients``): the TaskGraph of the op they are colocated with
     (epl forces ``colocate_gradients_with_ops=True``; optimizers colocate updates with their
     variable); failing that, the TaskGraph of their first input (data, then control) that
     has one; failing that, of their first consumer (data, then control) that has one;
     failing that, the last TaskGraph.
"""
import bisect

from epl import _tf_compat as compat


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


def attribute_ops(graph, recorder, upto_version):
  """Returns ({op: taskgraph index}, {op: phase}) for the first ``upto_version`` ops.

  The recorder speaks in ``graph.version`` (the op count when an event happened); the i-th
  op created has rank i, so ranks compare with recorded versions whatever ids TF assigns.
  """
  ops = sorted(graph.get_operations(), key=compat.op_id)[:upto_version]
  rank = {op: i + 1 for i, op in enumerate(ops)}
  phase_fn = _phase_of_ids(recorder)
  phase = {op: phase_fn(rank[op]) for op in ops}
  owner = {}
  for op in ops:
    if phase[op] == "forward":
      owner[op] = recorder.taskgraph_of(rank[op])
  by_name = {op.name: op for op in ops}
  pending = [op for op in ops if op not in owner]
  for op in pending:        # ops are in creation order, so inputs are usually decided first
    owner[op] = _from_colocation(op, by_name, owner)
    if owner[op] is None:
      sources = [t.op for t in op.inputs] + list(op.control_inputs)
      owner[op] = next((owner[x] for x in sources if owner.get(x) is not None), None)
  last = len(recorder.specs) - 1
  for op in pending:
    if owner[op] is None:
      users = [c for t in op.outputs for c in t.consumers()] + compat.control_outputs(op)
      owner[op] = next((owner[c] for c in users if owner.get(c) is not None), last)
  return owner, phase


def _from_colocation(op, by_name, owner):
  for group in op.colocation_groups():
    name = group.decode()[len("loc:@"):] if isinstance(group, bytes) else group[5:]
    target = by_name.get(name)
    if target is not None and target is not op and owner.get(target) is not None:
      return owner[target]
  return None
