"""Schedule pass: turn a pipeline schedule (epl.plan.schedule) into control dependencies.

Expects: micro-batch clones (``replication.micro``) and the op -> (TaskGraph, phase) maps.
For every copy and stage, the stage's actions (``F<m>``: forward ops of that stage for
micro-batch m, ``B<m>``: its backward ops) run in the schedule's order: a NoOp marks the end
of each action and the first ops of the next action wait for it. With one stage this is
gradient accumulation: micro-batches run one after another (PreferBackward: F0 B0 F1 B1 ...),
so activations of one micro-batch are alive at a time. Returns {(copy, stage): [(action, ops)]}
for tests and the timeline tool.
"""
import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl.passes.micro_batch import compute_ops
from epl.plan.schedule import make_schedule


def apply_schedule(graph, plan, analysis, owner, phase, replication):
  """Runs the pass; see the module docstring."""
  if plan.num_micro_batch == 1:
    return {}
  stages = len(plan.taskgraphs)
  schedule = make_schedule(plan.pipeline_strategy, stages, plan.num_micro_batch)
  compute = compute_ops(analysis, phase)
  by_action = {}
  for op in compute:
    kind = "F" if phase.get(op) == "forward" else "B"
    by_action.setdefault((owner[op], kind), []).append(op)
  placed = {}
  with graph.as_default(), tf.name_scope(None), tf.control_dependencies(None):
    for c in range(plan.num_copies):
      for s in range(stages):
        previous_done = None
        actions = []
        for action in schedule[s]:
          ops = [replication.op(c, op, action.micro_batch)
                 for op in by_action.get((s, action.kind), ())]
          ops = [op for op in ops if op is not None]
          if not ops:
            continue
          members = set(ops)
          if previous_done is not None:
            for op in ops:
              if not any(i.op in members for i in op.inputs) and \
                  not any(x in members for x in op.control_inputs):
                compat.add_control_inputs(op, [previous_done])
          with tf.device(plan.device_of(c, s)):
            previous_done = tf.group(*ops, name="epl_schedule/c%d_s%d_%s" % (c, s, action))
          actions.append((str(action), ops))
        placed[(c, s)] = actions
  return placed
