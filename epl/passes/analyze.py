"""Step analysis: which ops one model copy must own, and which stay shared.

Expects: the plan's op -> TaskGraph attribution. Adds nothing to the graph; raises PlanError
when a trainable variable is updated without a gradient epl can synchronise; returns a
``StepAnalysis``:

* ``per_copy`` (D): ops downstream of a data source (``get_next``, a batch placeholder) or of
  a stateful random op feeding them, by data edges; constants inside a ``tf.cond`` branch or
  loop body (control edge from the branch pivot) join D; a stateful op or NoOp reached by
  control edges only is a *singleton* (the optimizer's ``finish`` group): it runs once per
  step and waits for every copy — unless D itself waits for it (``tf.tuple``'s group_deps),
  then each copy gets its own. Other pure ops reached by control edges only (the optimizer's
  ``global_step`` increment built under the user's ``control_dependencies(update_ops)``) stay
  shared.
* mirrored variables: variables read or written by D that no singleton writes. Each copy gets
  its own; copy 0 keeps the user's (names and checkpoints unchanged).
* read chains: ops between a mirrored variable and D (``kernel/read``), cloned with it.
* v1 while frames are cloned whole.
"""
import dataclasses
from typing import FrozenSet, Tuple

import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl.errors import PlanError
from epl.passes.op_tables import (DATA_SOURCE_OPS, RANDOM_OPS, READ_OPS, VARIABLE_OPS,
                                  is_host_op, pinned_to_host)


@dataclasses.dataclass(frozen=True)
class StepAnalysis:
  cloned: Tuple[tf.Operation, ...]       # ops every extra copy clones, in creation order
  mirrored: Tuple[tf.Operation, ...]     # variable ops with one copy per model copy
  singletons: Tuple[tf.Operation, ...]   # step ops that run once and wait for all copies
  sources: Tuple[tf.Operation, ...]      # data-source ops (cloned per replica)
  split_placeholders: Tuple[tf.Operation, ...]  # fed batches split over the copies
  cloned_set: FrozenSet[tf.Operation] = frozenset()
  pinned: FrozenSet[tf.Operation] = frozenset()   # cloned ops the user put on the host CPU

  def __str__(self):
    return "StepAnalysis(%d cloned ops, %d mirrored variables, %d singletons, %d sources)" % (
        len(self.cloned), len(self.mirrored), len(self.singletons), len(self.sources))


def _is_batch_placeholder(op):
  if op.type != "Placeholder":
    return False
  shape = op.outputs[0].shape
  return shape.rank is not None and shape.rank >= 1 and shape.dims[0].value is None


def analyze(ctx):
  """Runs the pass; see the module docstring."""
  shared = [ctx.graph.get_operation_by_name(n) for n in ctx.plan.shared_variables]
  result = _analyze(ctx.owner, shared)
  _check_gradients(ctx.graph, result, ctx.plan)
  return result


def _check_gradients(graph, analysis, plan):
  """A trainable variable the step writes without a recorded gradient would diverge."""
  with_grad = {g.variable for g in plan.gradients}
  trainable = {v.op: v for v in graph.get_collection(tf.GraphKeys.TRAINABLE_VARIABLES)}
  for var_op in analysis.mirrored:
    if var_op.name in with_grad or var_op not in trainable:
      continue
    writers = [c for t in var_op.outputs for c in t.consumers()
               if c in analysis.cloned_set and c.type not in READ_OPS]
    if writers:
      raise PlanError(
          "epl found no gradient for trainable variable %r, which op %r updates in the "
          "training step: epl synchronises gradients given to an optimizer's minimize() or "
          "apply_gradients(); use one of those for this variable" % (
              trainable[var_op].name, writers[0].name))


def _analyze(owner, global_step_ops):
  """Returns the StepAnalysis of the ops in ``owner`` (op -> TaskGraph)."""
  in_scope = owner.keys()
  sources = [op for op in owner if op.type in DATA_SOURCE_OPS]
  placeholders = [op for op in owner if _is_batch_placeholder(op)]
  d = set()
  singletons = set()

  def close(roots):
    work = [r for r in roots if r not in d]
    d.update(work)
    while work:
      op = work.pop()
      for t in op.outputs:
        for c in t.consumers():
          if c not in d and c in in_scope:
            d.add(c)
            singletons.discard(c)
            work.append(c)
      for c in compat.control_outputs(op):
        if c in d or c not in in_scope:
          continue
        if c.type == "NoOp" or c.op_def.is_stateful:
          singletons.add(c)
        elif _is_pivot(op):            # a constant inside a cond branch / loop body
          d.add(c)
          work.append(c)

  close(sources + placeholders)
  _clone_inner_singletons(d, singletons, close)
  # Per-copy state feeding D without depending on data: random ops (dropout with a static
  # shape), stacks and tensor arrays of v1 while-loop gradients. Variables are handled below;
  # iterators and queues feeding the data sources stay shared.
  feeds_source = {i.op for s in sources for i in s.inputs}
  seen, work, randoms = set(), [i.op for op in d for i in op.inputs if i.op not in d], []
  while work:
    op = work.pop()
    if op in seen or op in d or op not in in_scope or op.type in VARIABLE_OPS:
      continue
    seen.add(op)
    if (op.type in RANDOM_OPS or op.op_def.is_stateful) and op.type not in READ_OPS and \
        op not in feeds_source and not is_host_op(op):
      randoms.append(op)
    work.extend(i.op for i in op.inputs)
  close(randoms)
  _close_frames(d, in_scope, close)
  _clone_inner_singletons(d, singletons, close)
  singletons -= d

  # Variables D reads or writes (through read chains of non-D ops); state writers D waits
  # for (Adam's sparse ``m.assign(m * beta1)``) belong to every copy too: repeat until stable.
  while True:
    memo = {}
    mirrored = _mirrored_variables(d, singletons, in_scope, memo, global_step_ops)
    writers = _state_writers(d | singletons, mirrored, in_scope, d)
    if not writers:
      break
    close(writers)
    _close_frames(d, in_scope, close)
    singletons -= d
  chains = {op for op, found in memo.items()
            if found & mirrored and op.type not in VARIABLE_OPS}
  cloned = (d - set(placeholders)) | chains | mirrored
  order = sorted(cloned, key=compat.op_id)
  return StepAnalysis(tuple(order), tuple(sorted(mirrored, key=lambda o: o.name)),
                      tuple(sorted(singletons, key=lambda o: o.name)),
                      tuple(s for s in order if s.type in DATA_SOURCE_OPS),
                      tuple(placeholders), frozenset(cloned),
                      frozenset(op for op in cloned if pinned_to_host(op)))


def _close_frames(d, in_scope, close):
  """Adds every op of a v1 while frame that has an op in D (frames are cloned whole)."""
  enters = [op for op in in_scope if op.type in ("Enter", "RefEnter")]
  if not enters:
    return
  frames = {}
  for op in enters:
    frames.setdefault(op.get_attr("frame_name"), []).append(op)
  changed = True
  while changed:
    changed = False
    for name, frame_enters in frames.items():
      members = _frame_members(frame_enters)
      if members & d and not members <= d:
        close([m for m in members if m in in_scope])
        d.update(m for m in members if m in in_scope)
        changed = True


def _frame_members(enters):
  members, work = set(), [(e, 0) for e in enters]
  while work:
    op, depth = work.pop()
    if op in members:
      continue
    members.add(op)
    if op.type == "Exit" and depth == 0:
      continue
    nxt = depth - 1 if op.type == "Exit" else depth
    for t in op.outputs:
      for c in t.consumers():
        work.append((c, nxt + 1 if c.type in ("Enter", "RefEnter") else nxt))
    for c in compat.control_outputs(op):
      work.append((c, nxt + 1 if c.type in ("Enter", "RefEnter") else nxt))
  return members


def _is_pivot(op):
  """The Identity(Switch) that gates a v1 cond branch or loop body."""
  return op.type == "Identity" and op.inputs and op.inputs[0].op.type in ("Switch", "RefSwitch")


def _clone_inner_singletons(d, singletons, close):
  """A control-only op that D itself waits for (``tf.tuple``'s group_deps inside the backward
  pass) is part of each copy's step, not a singleton: sharing it would make one copy's (or
  micro-batch's) backward wait for every other's."""
  while True:
    inner = [s for s in singletons if any(c in d for c in compat.control_outputs(s)) or
             any(c in d for t in s.outputs for c in t.consumers())]
    if not inner:
      return
    for s in inner:
      singletons.discard(s)
    close(inner)


def _mirrored_variables(d, singletons, in_scope, memo, global_step_ops):
  """Variables read by D through chains of pure non-D ops, minus those singletons write."""
  def variables_behind(op):
    if op in memo:
      return memo[op]
    memo[op] = frozenset()                       # cycle guard
    if op.type in VARIABLE_OPS:
      found = frozenset([op])
    elif op in d or op not in in_scope or op.op_def.is_stateful or not op.inputs:
      found = frozenset()
    else:
      found = frozenset().union(*(variables_behind(i.op) for i in op.inputs))
    memo[op] = found
    return found

  candidates = set()
  for op in d:
    for i in op.inputs:
      if i.op not in d:
        candidates |= variables_behind(i.op)
  written_by_singleton = {i.op for s in singletons for i in s.inputs if i.op in candidates}
  return candidates - written_by_singleton - set(global_step_ops)


def _state_writers(step, mirrored, in_scope, d):
  """Non-D ops that the step (D and singletons) waits for and that write a mirrored variable
  (by ref or handle): Adam's ``beta1_power.assign(...)`` in the optimizer's finish group."""
  found, seen = [], set()
  work = [x for op in step for x in list(op.control_inputs) + [i.op for i in op.inputs]]
  while work:
    op = work.pop()
    if op in seen or op in d or op not in in_scope or op.type in VARIABLE_OPS:
      continue
    seen.add(op)
    if op.type not in READ_OPS and op.inputs and op.inputs[0].op in mirrored and (
        op.op_def.is_stateful or op.inputs[0].dtype.base_dtype != op.inputs[0].dtype):
      found.append(op)
    work.extend(op.control_inputs)
    work.extend(i.op for i in op.inputs)
  return found
