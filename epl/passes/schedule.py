"""Schedule pass: turn the plan's pipeline schedule into control dependencies.

Expects: the micro-batch clones and ``plan.schedule`` (per stage, actions like ``F3``: forward
ops of that stage for micro-batch 3, ``B3``: its backward ops). For every copy and stage, the
stage's actions run in the schedule's order: a NoOp marks the end of each action and the
first ops of the next action wait for it (the NoOp waits for the action's last ops only: the
ones no other op of the action reads). With one stage this is gradient accumulation:
micro-batches run one after another (PreferBackward: F0 B0 F1 B1 ...), so activations of one
micro-batch are alive at a time. Returns ``Schedule``: {(copy, stage): [(action, ops)]} for
tests and the timeline tool.

Only ops outside ``tf.cond`` branches and while-loop frames take part in the ordering (the
branch's Merge and the loop's Exit stand for them): a control edge from an untaken branch
would make the next micro-batch dead ("Retval does not have value"), and one into a loop body
crosses frames.
"""
import dataclasses
from typing import List, Mapping, Tuple

import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl.passes.micro_batch import compute_ops, needed_for_gradients


@dataclasses.dataclass(frozen=True)
class Schedule:
  placed: Mapping[Tuple[int, int], List[Tuple[str, list]]]

  def __str__(self):
    return "Schedule(%d stage copies, %d actions)" % (
        len(self.placed), sum(len(v) for v in self.placed.values()))


def _downstream_of_switches(ops):
  """Ops that may be dead in a step: what a Switch output feeds, up to the Merge (the cond's
  pivots ``switch_t`` / ``switch_f`` are built outside its context, and one is always dead)."""
  found = set()
  work = [c for op in ops if op.type in ("Switch", "RefSwitch")
          for t in op.outputs for c in t.consumers()]
  while work:
    op = work.pop()
    if op in found or op.type in ("Merge", "RefMerge"):
      continue
    found.add(op)
    work.extend(c for t in op.outputs for c in t.consumers())
    work.extend(compat.control_outputs(op))
  return found


def _sinks(ops):
  """The ops of ``ops`` that no other op of ``ops`` reads or waits for: when they are done,
  every op of ``ops`` is (a NoOp waiting for all of them had thousands of control inputs, and
  building it grew faster than the graph)."""
  members = set(ops)
  return [op for op in ops
          if not any(c in members for t in op.outputs for c in t.consumers()) and
          not any(c in members for c in compat.control_outputs(op))]


def schedule(ctx):
  """Runs the pass; see the module docstring."""
  plan = ctx.plan
  if plan.num_micro_batch == 1:
    return Schedule({})
  micro = ctx.result("micro_batch")
  if micro.calls is not None:     # stage functions: the calls are chained as they are made
    placed = {}
    for (c, s, action), call in micro.calls.calls.items():
      placed.setdefault((c, s), []).append((action, [call]))
    order = {(s, a): i for s, actions in enumerate(plan.schedule) for i, a in enumerate(actions)}
    return Schedule({k: sorted(v, key=lambda x: order[(k[1], x[0])]) for k, v in placed.items()})
  clones = ctx.clones()
  compute = needed_for_gradients(ctx, compute_ops(ctx.result("analyze"), ctx.phase))
  by_action = {}
  for op in compute:
    kind = "F" if ctx.phase.get(op) == "forward" else "B"
    by_action.setdefault((ctx.owner[op], kind), []).append(op)
  maybe_dead = _downstream_of_switches(compute)
  outside = {op for op in compute if not compat.in_control_flow(op) and op not in maybe_dead}
  placed = {}
  with ctx.graph.as_default(), tf.name_scope(None), tf.control_dependencies(None):
    for c in range(ctx.worker.num_copies):
      for s, actions_of_stage in enumerate(plan.schedule):
        previous_done = None
        actions = []
        for action in actions_of_stage:
          kind, m = action[0], int(action[1:])
          pairs = [(clones.op(c, op, m), op in outside) for op in by_action.get((s, kind), ())]
          pairs = [(op, top) for op, top in pairs if op is not None]
          top_level = [op for op, top in pairs if top]
          if not top_level:
            continue
          members = {op for op, _ in pairs}
          if previous_done is not None:
            for op in top_level:
              if not any(i.op in members for i in op.inputs) and \
                  not any(x in members for x in op.control_inputs):
                compat.add_control_inputs(op, [previous_done])
          with tf.device(ctx.worker.device_of(c, s)):
            previous_done = tf.group(*_sinks(top_level),
                                     name="epl_schedule/c%d_s%d_%s" % (c, s, action))
          actions.append((action, [op for op, _ in pairs]))
        placed[(c, s)] = actions
  return Schedule(placed)
