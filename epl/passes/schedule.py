"""Schedule pass: turn the plan's pipeline schedule into control dependencies.

Expects: the micro-batch clones and ``plan.schedule`` (per stage, actions like ``F3``: forward
ops of that stage for micro-batch 3, ``B3``: its backward ops). For every copy and stage, the
stage's actions run in the schedule's order: a NoOp marks the end of each action and the
first ops of the next action wait for it. With one stage this is gradient accumulation:
micro-batches run one after another (PreferBackward: F0 B0 F1 B1 ...), so activations of one
micro-batch are alive at a time. Returns ``Schedule``: {(copy, stage): [(action, ops)]} for
tests and the timeline tool.
"""
import dataclasses
from typing import List, Mapping, Tuple

import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl.passes.micro_batch import compute_ops


@dataclasses.dataclass(frozen=True)
class Schedule:
  placed: Mapping[Tuple[int, int], List[Tuple[str, list]]]


def schedule(ctx):
  """Runs the pass; see the module docstring."""
  plan = ctx.plan
  if plan.num_micro_batch == 1:
    return Schedule({})
  clones = ctx.clones()
  by_action = {}
  for op in compute_ops(ctx.result("analyze"), ctx.phase):
    kind = "F" if ctx.phase.get(op) == "forward" else "B"
    by_action.setdefault((ctx.owner[op], kind), []).append(op)
  placed = {}
  with ctx.graph.as_default(), tf.name_scope(None), tf.control_dependencies(None):
    for c in range(ctx.worker.num_copies):
      for s, actions_of_stage in enumerate(plan.schedule):
        previous_done = None
        actions = []
        for action in actions_of_stage:
          kind, m = action[0], int(action[1:])
          ops = [clones.op(c, op, m) for op in by_action.get((s, kind), ())]
          ops = [op for op in ops if op is not None]
          if not ops:
            continue
          members = set(ops)
          if previous_done is not None:
            for op in ops:
              if not any(i.op in members for i in op.inputs) and \
                  not any(x in members for x in op.control_inputs):
                compat.add_control_inputs(op, [previous_done])
          with tf.device(ctx.worker.device_of(c, s)):
            previous_done = tf.group(*ops, name="epl_schedule/c%d_s%d_%s" % (c, s, action))
          actions.append((action, ops))
        placed[(c, s)] = actions
  return Schedule(placed)
