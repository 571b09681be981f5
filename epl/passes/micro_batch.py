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
from typing import Dict, Mapping

import tensorflow.compat.v1 as tf

from epl.passes.clone import Cloner, wait_for_clones
from epl.op_tables import VARIABLE_OPS
from epl.passes.replicate import device_function


@dataclasses.dataclass(frozen=True)
class MicroBatches:
  clones: Mapping[tuple, Dict[str, tf.Operation]]   # (copy, m >= 1) -> {original name: op}


def compute_ops(analysis, phase):
  """The ops one micro-batch of a copy runs: the copy's ops minus apply ops and variables."""
  return [op for op in analysis.cloned
          if phase.get(op) != "apply" and op.type not in VARIABLE_OPS]


def micro_batch(ctx):
  """Runs the pass; see the module docstring."""
  count = ctx.plan.num_micro_batch
  if count == 1:
    return MicroBatches({})
  analysis = ctx.result("analyze")
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
  return MicroBatches(out)
