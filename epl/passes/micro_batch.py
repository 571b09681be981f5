"""Micro-batch clone pass: each model copy runs its forward + backward once per micro-batch.

Expects: the ``Replication`` of the replica pass and ``pipeline.num_micro_batch`` M > 1.
Adds, for every copy c and micro-batch m >= 1, a clone of the copy's compute ops (forward and
backward phases; not the apply ops, not the variables) under ``EPL_MB_<m>_R_<c>/``: it reads
its own batch (its own ``get_next``, or its piece of a fed batch) and copy c's variables.
Singletons wait for every micro-batch. Fills ``replication.micro``; gradient accumulation is
done by the gradient sync pass, the order of micro-batches by the schedule pass.
"""
from epl import _tf_compat as compat
from epl.passes.clone import clone_ops
from epl.passes.op_tables import VARIABLE_OPS
from epl.passes.replicate import device_function, pinned_to_host


def compute_ops(analysis, phase):
  """The ops one micro-batch of a copy runs: the copy's ops minus apply ops and variables."""
  return [op for op in analysis.cloned
          if phase.get(op) != "apply" and op.type not in VARIABLE_OPS]


def micro_batches(graph, plan, analysis, owner, phase, replication, node_cache):
  """Runs the pass; see the module docstring."""
  count = plan.num_micro_batch
  if count == 1:
    return
  compute = compute_ops(analysis, phase)
  compute_set = set(compute)
  rest = [op for op in analysis.cloned if op not in compute_set]
  pinned = frozenset(op for op in analysis.cloned if pinned_to_host(op))
  for c in range(plan.num_copies):
    # the copy's own non-compute ops (variables, apply ops) are shared by its micro-batches
    own = {} if c == 0 else {t: replication.tensor(c, t) for op in rest for t in op.outputs}
    for m in range(1, count):
      input_map = dict(own)
      input_map.update(replication.piece_maps.get((c, m), {}))
      replication.micro[(c, m)] = clone_ops(
          graph, compute, "EPL_MB_%d_R_%d" % (m, c), device_function(plan, owner, c, pinned),
          input_map, node_cache)
  for s in analysis.singletons:
    extra = [clones[x.name] for x in s.control_inputs if x in compute_set
             for clones in replication.micro.values() if x.name in clones]
    compat.add_control_inputs(s, extra)
