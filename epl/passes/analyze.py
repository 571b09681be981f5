"""Step analysis: which ops every model copy owns, which stay shared, which run once per step.

Expects: the plan's op -> (TaskGraph, phase). Adds nothing to the graph; raises PlanError
when a trainable variable is updated in the step without a gradient epl can synchronise;
returns a ``StepAnalysis``.

A model copy is what its TaskGraph owns -- every forward, backward and apply op, whatever
feeds it: an iterator, a fed placeholder of any shape, in-graph random or constant data --
except:

* shared machinery: stateful ops without inputs (iterators, queues, readers, lookup tables),
  the input pipeline built on them (datasets, ``MakeIterator``, enqueue ops), variable
  initialisers and checkpoint ops, plus whatever only feeds them or only follows them. Each
  copy pulls its own batch from the shared pipeline (its own ``get_next`` / dequeue);
* shared variables (``global_step``): one per job;
* singletons, run once per step after every copy: ops that write a shared variable
  (``global_step += 1``) and grouping ops no per-copy op waits for (``train_op``).

Variables among the copy's ops are mirrored: each copy has its own, copy 0 keeps the user's
(names and checkpoints unchanged). Placeholders are cloned too: the runtime splits a fed batch
over the copies' placeholders (``batch_placeholders``: rank >= 1) or feeds every copy the same
value (scalars).
"""
import dataclasses
from typing import FrozenSet, Tuple

import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl.errors import PlanError
from epl.op_tables import (ASSIGN_OPS, DATA_SOURCE_OPS, PLACEHOLDER_OPS, READ_OPS,
                                  SHARED_SINK_OPS, VARIABLE_OPS, is_host_op, mutates,
                                  pinned_to_host)
from epl.passes.slots import TrainEnds, written


@dataclasses.dataclass(frozen=True)
class StepAnalysis:
  cloned: Tuple[tf.Operation, ...]       # ops every extra copy clones, in creation order
  mirrored: Tuple[tf.Operation, ...]     # variable ops with one copy per model copy
  singletons: Tuple[tf.Operation, ...]   # step ops that run once and wait for all copies
  sources: Tuple[tf.Operation, ...]      # data-source ops (cloned per copy)
  batch_placeholders: Tuple[tf.Operation, ...]  # fed batches split over the copies
  cloned_set: FrozenSet[tf.Operation] = frozenset()
  pinned: FrozenSet[tf.Operation] = frozenset()   # cloned ops the user put on the host CPU
  # cloned ops of TaskGraphs that run in only some copies of a replica (split: once;
  # replicated on fewer devices than the widest: every plan.stride-th copy)
  split_ops: FrozenSet[tf.Operation] = frozenset()
  # the ends of each train op (what nothing follows downstream of the user's updates): the
  # step ``writes_after_reads`` orders is what they depend on once every pass has run
  train_ends: Tuple[FrozenSet[tf.Operation], ...] = ()
                                                    # per replica (its first copy)

  def __str__(self):
    return "StepAnalysis(%d cloned ops, %d mirrored variables, %d singletons, %d sources)" % (
        len(self.cloned), len(self.mirrored), len(self.singletons), len(self.sources))


def analyze(ctx):
  """Runs the pass; see the module docstring."""
  ops = sorted(ctx.owner, key=compat.op_id)
  shared = {ctx.graph.get_operation_by_name(n) for n in ctx.plan.shared_variables}
  machinery = shared_machinery(ops, ctx.graph)
  candidates = [op for op in ops if op not in machinery and op not in shared]
  singletons = _singletons(candidates, shared, machinery)
  cloned = [op for op in candidates if op not in singletons]
  cloned_set = frozenset(cloned)
  result = StepAnalysis(
      tuple(cloned),
      tuple(sorted((op for op in cloned if op.type in VARIABLE_OPS), key=lambda o: o.name)),
      tuple(sorted(singletons, key=lambda o: o.name)),
      tuple(op for op in cloned if op.type in DATA_SOURCE_OPS),
      tuple(op for op in cloned if _is_batch_placeholder(op)),
      cloned_set, frozenset(op for op in cloned if pinned_to_host(op)),
      frozenset(op for op in cloned if ctx.plan.stride(ctx.owner[op]) > 1),
      _train_ends(cloned, ctx.phase))
  _check_gradients(ctx.graph, result, ctx.plan)
  return result


def _train_ends(cloned, phase):
  ends_of = TrainEnds()
  return tuple(dict.fromkeys(ends_of(op) for op in cloned
                             if phase.get(op) == "apply" and written(op) is not None))


def _is_batch_placeholder(op):
  if op.type not in PLACEHOLDER_OPS:
    return False
  shape = op.outputs[0].shape
  return (shape.rank is None or shape.rank >= 1) and not _picked(op.outputs[0])


def _picked(tensor):
  """True when the graph only picks elements of ``tensor`` by fixed indices along its first
  axis (``keep[0]``, ``tf.unstack(keep)``, ``tf.gather(keep, 1)``): a vector of settings
  (per-layer keep-probs), not a batch, whatever its length."""
  picks, work = 0, [tensor]
  while work:
    t = work.pop()
    for op in t.consumers():
      if op.type in ("Identity", "StopGradient"):
        work.extend(op.outputs)
        continue
      for i in (i for i, x in enumerate(op.inputs) if x is t):
        if not _picks(op, i):
          return False
        picks += 1
  return picks > 0


def _picks(op, index):
  const = lambda t: t.op.type == "Const"       # noqa: E731
  if op.type == "StridedSlice":
    return index == 0 and bool(op.get_attr("shrink_axis_mask") & 1) and const(op.inputs[1])
  if op.type == "Unpack":
    return op.get_attr("axis") == 0
  if op.type in ("Gather", "GatherV2", "ResourceGather"):
    return index == 0 and const(op.inputs[1]) and (
        op.type == "Gather" or const(op.inputs[2]) and
        int(tf.get_static_value(op.inputs[2])) == 0)
  return False


def _inputs(op):
  return [t.op for t in op.inputs] + list(op.control_inputs)


def _users(op):
  return [c for t in op.outputs for c in t.consumers()] + compat.control_outputs(op)


def _initializer_ops(graph):
  variables = graph.get_collection(tf.GraphKeys.GLOBAL_VARIABLES) + \
      graph.get_collection(tf.GraphKeys.LOCAL_VARIABLES)
  return {v.initializer for v in variables if getattr(v, "initializer", None) is not None}


def _is_sink(op, initializers):
  if op in initializers or op.type in SHARED_SINK_OPS or op.type.startswith(
      ("QueueEnqueue", "QueueClose", "InitializeTable", "LookupTableImport")):
    return True
  if op.type in DATA_SOURCE_OPS or op.type in VARIABLE_OPS:
    return False
  if is_host_op(op):                                # datasets, iterators, MakeIterator
    return True
  return op.op_def.is_stateful and not op.inputs    # queues, readers, tables, mutexes


def shared_machinery(ops, graph):
  """Ops of ``ops`` every copy shares: input-pipeline resources, initialisation and checkpoint
  ops, what only feeds them, and what only follows them (variables don't count as inputs)."""
  initializers = _initializer_ops(graph)
  region = {op for op in ops if _is_sink(op, initializers)}
  for op in reversed(ops):                        # what only feeds the machinery
    if op not in region and op.type not in VARIABLE_OPS and op.type not in DATA_SOURCE_OPS:
      users = _users(op)
      if users and all(u in region for u in users):
        region.add(op)
  for op in ops:                                  # what only follows it (restore's assigns)
    if op in region or op.type in DATA_SOURCE_OPS:
      continue
    sources = [x for x in _inputs(op) if x.type not in VARIABLE_OPS]
    if sources and all(x in region for x in sources):
      region.add(op)
  return region


def _writes(op, variables):
  return op.type in ASSIGN_OPS and op.inputs and op.inputs[0].op in variables


def _singletons(candidates, shared, machinery):
  """Ops that run once per step (and wait for every copy): writers of shared variables,
  grouping ops (NoOps) no per-copy op waits for, and the stateless ops that only feed them --
  TF prunes a control dependency implied through an input, so ``global_step += 1`` under
  ``control_dependencies([update])`` reads a constant that carries the edge to ``update``."""
  found = {op for op in candidates if _writes(op, shared)}
  changed = True
  while changed:
    changed = False
    for op in reversed(candidates):               # users come after their inputs
      if op in found or mutates(op) or op.type in PLACEHOLDER_OPS:
        continue
      users = [u for u in _users(op) if u not in machinery]
      if all(u in found for u in users) and (users or op.type == "NoOp"):
        found.add(op)
        changed = True
  return found


def _check_gradients(graph, analysis, plan):
  """A trainable variable the step writes without a gradient would train differently in
  each copy."""
  with_grad = {g.variable for g in plan.gradients}
  trainable = {v.op: v for v in graph.get_collection(tf.GraphKeys.TRAINABLE_VARIABLES)}
  for var_op in analysis.mirrored:
    if var_op.name in with_grad or var_op not in trainable:
      continue
    writers = [c for t in var_op.outputs for c in t.consumers()
               if c in analysis.cloned_set and c.type not in READ_OPS and
               c.type in ASSIGN_OPS]
    if writers:
      raise PlanError(
          "epl found no gradient for trainable variable %r, which op %r updates in the "
          "training step: epl synchronises the gradients that tf.gradients, "
          "compute_gradients or minimize compute; compute this variable's update from one" % (
              trainable[var_op].name, writers[0].name))
