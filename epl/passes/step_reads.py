"""step_reads: reads of a shared variable (``global_step``) see one value in every copy and
micro-batch, whatever order TF picks. (That every write of a variable runs after the step's
reads of it is the one ordering invariant, enforced after every pass: passes/ordering.py.)

Expects: ``analyze`` (the singletons: writers of shared variables, ``global_step += 1``),
``replicate`` and ``micro_batch`` (every clone made).
Adds: for a shared variable the step writes once (``Assign``, ``AssignAdd``, ``AssignSub`` or
their resource forms), every read of it in every copy and micro-batch that the write neither
depends on nor comes after now takes the value the write writes (for an ``Assign`` its input;
for ``AssignAdd`` a copy of the variable taken before it, plus the increment). Reads the
write depends on (TF's optimizers: the learning rate feeds the update that
``global_step += 1`` waits for) keep the value from before the step; reads after it, the new
one. Nothing waits for the write, so a run without it (evaluation) never runs it.

Why: published BERT writes ``global_step.assign(global_step + 1)`` in a ``tf.group`` with
its update, and nothing orders its learning-rate schedule's reads of ``global_step`` against
that assign. A ref variable's read (``global_step/read``, an Identity) aliases the variable's
buffer, so a consumer sees whatever the buffer holds when it runs: in the local run the
schedule mostly runs after the assign (the learning rate of step 0 is that of step 1): 37 of
40 fresh local runs here, the other 3 read before it in a later step -- the local run is
itself racy; epl picks the usual order in every run. Under epl each copy and micro-batch has
its own read on its own device, where TF copies the value whenever the transfer happens to
run: some copies used one learning rate, some the other, differently in every run.
"""
import dataclasses
from typing import Mapping

import tensorflow.compat.v1 as tf
from tensorflow.python.ops import gen_array_ops

from epl import _tf_compat as compat
from epl.op_tables import READ_OPS, mutates
from epl.passes.slots import TrainEnds, written

_CHECKS = frozenset({"IsVariableInitialized", "VarIsInitializedOp"})
_SET = frozenset({"Assign", "AssignVariableOp"})
_ADD = {"AssignAdd": 1.0, "AssignAddVariableOp": 1.0, "AssignSub": -1.0,
        "AssignSubVariableOp": -1.0}


@dataclasses.dataclass(frozen=True)
class StepReads:
  written: Mapping[str, tf.Tensor]     # shared variable op name -> the value its write writes
  rewired: int                         # reads now taking it

  def __str__(self):
    return "StepReads(%d shared variable(s), %d read(s) take the step's written value)" % (
        len(self.written), self.rewired)


def step_reads(ctx):
  """Runs the pass; see the module docstring."""
  analysis = ctx.result("analyze")
  clones = ctx.clones()
  apply_ops = [op for op in analysis.cloned if ctx.phase.get(op) == "apply"]
  updates = [[u for u in (clones.op(c, op) for op in apply_ops) if u is not None]
             for c in range(clones.num_copies)]
  step = []

  def in_step(op):
    # the step's own computation: what the updates need (not evaluation-only ops, savers or
    # the replica sync, which read variables outside the step), per train op; walked only
    # when a shared variable has a read to place (1.2 s on a 131k-op pipeline graph)
    if not step:
      steps = _steps(updates, clones, analysis)
      # every update of one train op maps to the same set: union each distinct set once
      step.append(set().union(*{id(s): s for s in steps.values()}.values()))
    return op in step[0]

  writers = {}
  for op in analysis.singletons:
    var = written(op)
    if var is not None and var.name in ctx.plan.shared_variables:
      writers.setdefault(var, []).append(op)
  values, rewired = {}, 0
  for var, ops in sorted(writers.items(), key=lambda kv: kv[0].name):
    if len(ops) != 1 or (ops[0].type not in _SET and ops[0].type not in _ADD):
      continue
    write = ops[0]
    before, after = _walk(ops, upstream=True), _walk(ops, upstream=False)
    uses = [(op, i) for op, i in _uses(var, set(ops))
            if op not in before and op not in after and in_step(op)]
    if not uses:
      continue
    value = write.inputs[1] if write.type in _SET else _incremented(ctx.graph, var, write)
    for op, i in uses:
      compat.update_input(op, i, value)
      rewired += 1
    values[var.name] = value
  return StepReads(values, rewired)


def _steps(updates, clones, analysis):
  """{update op (one that writes a variable): the ops of its train op's step}: what the ends
  downstream of the update (its train op) depend on, with every micro-batch's clone of those
  ops -- the updates take only micro-batch 0's gradients until gradient_sync accumulates them,
  and a later micro-batch's input gradient that reads a weight is upstream of no update of
  that weight (tf.gradients does not gate an op's gradients together, as compute_gradients
  does). One walk per train op: asked for every op of apply_gradients (constants, casts with
  ends of their own), it walked the graph hundreds of times (27 s of a 30 s rewrite)."""
  ends_of, by_ends, out = TrainEnds(), {}, {}
  for per_copy in updates:
    for op in per_copy:
      if written(op) is None:     # not an update (a constant, a cast of apply_gradients)
        continue
      ends = ends_of(op)
      if ends not in by_ends:
        step = _walk(ends, upstream=True)
        later = [clones.op(c, x, m) for x in analysis.cloned for c in range(clones.num_copies)
                 if clones.op(c, x) in step for m in range(1, clones.num_micro_batch)]
        by_ends[ends] = step | _walk([x for x in later if x is not None], upstream=True)
      out[op] = by_ends[ends]
  return out


def _incremented(graph, var, write):
  """The value ``write`` (an AssignAdd / AssignSub) leaves in ``var``: a copy of the variable
  taken before it, plus (minus) its increment."""
  handle, delta = write.inputs[0], write.inputs[1]
  with compat.unfinalized(graph), graph.as_default(), tf.name_scope(None), \
      tf.control_dependencies(None), tf.colocate_with(var):
    if handle.dtype == tf.resource:
      before = tf.raw_ops.ReadVariableOp(resource=handle, dtype=delta.dtype,
                                         name="epl_shared_read/" + var.name)
    else:
      before = gen_array_ops.deep_copy(handle, name="epl_shared_read/" + var.name)
    value = before + delta if _ADD[write.type] > 0 else before - delta
  compat.add_control_inputs(write, [before.op])
  return value


def _uses(var, writers):
  """(op, input index) of every op that takes the value of ``var``: through a read op
  (Identity of a ref variable, ReadVariableOp of a resource one), or a ref input directly
  (a resource read that takes the handle, ResourceGather, is ordered, never rewired)."""
  out = []
  for consumer in var.outputs[0].consumers():
    if consumer in writers or consumer.type in _CHECKS:
      continue
    if consumer.type in READ_OPS:
      out.extend((c, i) for c in consumer.outputs[0].consumers()
                 for i, t in enumerate(c.inputs) if t is consumer.outputs[0])
    elif not mutates(consumer) and var.outputs[0].dtype != tf.resource:
      out.extend((consumer, i) for i, t in enumerate(consumer.inputs) if t is var.outputs[0])
  return out


def _walk(ops, upstream):
  """Every op ``ops`` depend on (``upstream``) or that runs after them, ``ops`` included."""
  seen, work = set(), list(ops)
  while work:
    op = work.pop()
    if op in seen:
      continue
    seen.add(op)
    if upstream:
      work.extend(t.op for t in op.inputs)
      work.extend(op.control_inputs)
    else:
      work.extend(c for t in op.outputs for c in t.consumers())
      work.extend(compat.control_outputs(op))
  return seen
