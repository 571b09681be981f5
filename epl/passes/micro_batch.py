"""Micro-batch clone pass: each model copy runs its forward + backward once per micro-batch.

Expects: the ``replicate`` result and ``pipeline.num_micro_batch`` M > 1 in the plan.
Adds, for every copy c and micro-batch m >= 1, a clone of the copy's compute ops (forward and
backward phases; not the apply ops, not the variables) under ``EPL_MB_<m>_R_<c>/``: it reads
its own batch (its own ``get_next``, or its own placeholders, which the runtime feeds with its
piece of a fed batch) and copy c's variables. With k > 1 copies per replica the replica's
first copy pulls micro-batch m's batch and cuts it k ways, and copy j takes piece j; a copy
clones only the TaskGraphs it runs (``plan.stride``).
Singletons wait for every micro-batch. Returns ``MicroBatches``; gradient accumulation is done
by the gradient sync pass, the order of micro-batches by the schedule pass.
"""
import dataclasses
import logging
from typing import Dict, Mapping, Optional

import tensorflow.compat.v1 as tf

from epl.errors import NotImplementedYetError
from epl.passes.clone import Cloner, wait_for_clones
from epl.op_tables import VARIABLE_OPS
from epl.passes.replicate import device_function
from epl.passes.recompute import Recomputed, check_apart, on_template
from epl.passes.stage_functions import StageCalls, build as build_stage_functions, survey

log = logging.getLogger("epl")


@dataclasses.dataclass(frozen=True)
class MicroBatches:
  clones: Mapping[tuple, Dict[str, tf.Operation]]   # (copy, m >= 1) -> {original name: op}
  calls: Optional[StageCalls] = None   # micro-batches as stage functions
  fallback: str = ""                 # why stage functions were asked for and not built
  recomputed: Optional[Recomputed] = None   # stage functions' gradient checkpointing

  def __str__(self):
    if self.calls is not None:
      return "MicroBatches(as %s)" % self.calls
    return "MicroBatches(%d clones%s)" % (
        len(self.clones), "; not stage functions: " + self.fallback if self.fallback else "")


def compute_ops(analysis, phase):
  """The ops one micro-batch of a copy runs: the copy's ops minus apply ops and variables."""
  return [op for op in analysis.cloned
          if phase.get(op) != "apply" and op.type not in VARIABLE_OPS]


def needed_for_gradients(ctx, compute):
  """The compute ops the step's gradients depend on (in order). A forward op they do not
  need -- a metric, predictions, a summary -- must not join an action: its schedule edge
  would make every step run it (and demand its feeds)."""
  get = ctx.graph.get_tensor_by_name
  work = [get(n).op for g in ctx.plan.gradients for n in g.tensors if n]
  members, needed = set(compute), set()
  while work:
    op = work.pop()
    if op in needed or op not in members:
      continue
    needed.add(op)
    work.extend(t.op for t in op.inputs)
    work.extend(op.control_inputs)
  return [op for op in compute if op in needed]


def _stage_functions(ctx, compute):
  """``MicroBatches`` as stage functions, or why they cannot hold this step (nothing built).
  Gradient checkpointing rebuilds the user's backward first (``recompute.on_template``): the
  backward bodies then recompute their segments, the forward calls hand on checkpoints."""
  found = survey(ctx, compute, set(needed_for_gradients(ctx, compute)))
  if isinstance(found, str):
    return found
  if not ctx.plan.memory.gradient_checkpoint:
    calls = build_stage_functions(ctx, found)
    return MicroBatches(calls.outside, calls)
  done, added, pairs = on_template(ctx)
  compute = compute + list(added)
  found = survey(ctx, compute, set(needed_for_gradients(ctx, compute)), added)
  if isinstance(found, str):       # the user's ops are rebuilt already: clones cannot follow
    raise NotImplementedYetError(
        "gradient checkpointing as stage functions: %s; set graph.micro_batches to 'clones'"
        % found)
  check = check_apart(ctx, pairs)         # before the calls take over the user's ops
  calls = build_stage_functions(ctx, found)
  return MicroBatches(calls.outside, calls,
                      recomputed=dataclasses.replace(done, check_op=check))


def micro_batch(ctx):
  """Runs the pass; see the module docstring."""
  count = ctx.plan.num_micro_batch
  if count == 1:
    return MicroBatches({})
  analysis = ctx.result("analyze")
  fallback = ""
  if ctx.plan.stage_functions:
    built = _stage_functions(ctx, compute_ops(analysis, ctx.phase))
    if not isinstance(built, str):
      return built
    if ctx.plan.stage_functions == "required":
      raise NotImplementedYetError(
          "graph.micro_batches 'functions' cannot build this step: %s; use 'auto' (functions "
          "where they apply, clones otherwise) or 'clones'" % built)
    log.info("micro-batches as clones, not stage functions: %s", built)
    fallback = built
  clones = ctx.clones()
  compute = compute_ops(analysis, ctx.phase)
  compute_set = set(compute)
  rest = [op for op in analysis.cloned if op not in compute_set]
  splits = ctx.result("replicate").source_splits
  sources = set(analysis.sources)
  out = {}
  for c in range(ctx.worker.num_copies):
    # the copy's own non-compute ops (variables, apply ops) are shared by its micro-batches
    own = {} if c == 0 else {t: clones.tensor(c, t) for op in rest for t in op.outputs
                             if clones.op(c, op) is not None}
    j = ctx.worker.copies[c].shard
    ops = [op for op in compute if op not in analysis.split_ops or
           j % ctx.plan.stride(ctx.owner[op]) == 0]          # only the TaskGraphs it runs
    if splits and j == 0:    # a replica's first copy pulls its batch and cuts it k ways
      ops = ops + [split for split, _ in splits]
    elif splits:
      ops = [op for op in ops if op not in sources]
    cloner = Cloner(ctx.graph, ops, device_function(ctx, c), ctx.nodes)
    for m in range(1, count):
      input_map = dict(own)
      if splits and j:                       # the others take their piece of that batch
        for split, _ in splits:
          input_map[split.outputs[0]] = out[(c - j, m)][split.name].outputs[j]
      out[(c, m)] = cloner.clone("EPL_MB_%d_R_%d" % (m, c), input_map)
  wait_for_clones(analysis.singletons, list(out.values()), compute_set)
  return MicroBatches(out, fallback=fallback)
