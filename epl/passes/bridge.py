"""Bridge pass: connect each model replica's split TaskGraphs to its copies of the replicated
ones.

Expects: the ``replicate`` clones and the plan's crossings (``epl.plan.split``). A split
TaskGraph runs once per model replica (in the replica's first copy) on the whole replica's
batch, while a replicated TaskGraph runs in each of the replica's k copies on 1/k of it.
For every crossing and local replica:

* into the split TaskGraph (``gather``): a batch-major value is the concatenation of the k
  copies' rows, built on each consuming device (an all-gather over TF's send/recv), or for
  an iterator's output the replica's batch before ``replicate`` split it; any other
  value is copy 0's (the copies hold equal weights), or for a gradient the sum of the copies';
* out of it (``scatter``): copy j reads its own rows of a batch-major value, sliced on the
  producing device (only those rows travel), or the whole value otherwise.

Gradients crossing back are scaled so that the job trains the local model: with
``gradients_reduce_method: mean`` the copies' gradients are averaged, so a copy's share of a
batch-major gradient is multiplied by k and a gradient gathered from the copies is divided by
k; with ``sum`` the whole-value gradient each copy reads is divided by k. With one copy per
replica nothing is inserted (TF's send/recv moves the tensors). The gathers, sums and row
cuts come from ``epl.collectives`` (``gather_rows``, ``reduce_to``, ``rows_of``). Returns
``Bridges``.
"""
import dataclasses
from typing import List, Tuple

import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat


@dataclasses.dataclass(frozen=True)
class Bridges:
  built: List[Tuple[str, str, tf.Tensor]]   # (crossing kind, user's tensor name, new tensor)

  def count(self, kind):
    return sum(1 for k, _, _ in self.built if k == kind)


def _scale(plan, crossing, k):
  if not crossing.backward:
    return 1.0
  mean = plan.communication.reduce_method == "mean"
  if crossing.gather:
    return 1.0 / k if mean else 1.0
  if crossing.batch_major:
    return float(k) if mean else 1.0
  return 1.0 if mean else 1.0 / k


def _scaled(t, factor):
  return t if factor == 1.0 else t * tf.cast(factor, t.dtype)


def _retarget(consumer, old, new):
  """Makes ``consumer`` read ``new`` wherever it reads one of the tensors ``old``."""
  for i, inp in enumerate(consumer.inputs):
    if inp in old:
      compat.update_input(consumer, i, new)


def bridge(ctx):
  """Runs the pass; see the module docstring."""
  plan, worker, graph, coll = ctx.plan, ctx.worker, ctx.graph, ctx.collectives
  k = plan.shards
  if not plan.crossings or k == 1:
    return Bridges([])
  analysis, clones = ctx.result("analyze"), ctx.clones()
  cloned, sources = analysis.cloned_set, set(analysis.sources)
  leads = [c for c in range(worker.num_copies) if worker.copies[c].shard == 0]
  crossings = [x for x in plan.crossings
               if graph.get_tensor_by_name(x.tensor).op in cloned and
               graph.get_operation_by_name(x.consumer) in cloned]
  built, cache = [], {}
  with graph.as_default(), tf.name_scope(None), tf.control_dependencies(None), \
      tf.name_scope("epl_bridge"):
    rows = {lead: _rows(clones, graph, crossings, lead, k) for lead in leads}
    for x in crossings:
      tensor = graph.get_tensor_by_name(x.tensor)
      consumer = graph.get_operation_by_name(x.consumer)
      factor = _scale(plan, x, k)
      for lead in leads:
        members = list(range(lead, lead + k))
        values = [clones.tensor(c, tensor) for c in members]
        if x.gather and tensor.op in sources:
          # an iterator's batch: the replica's first copy pulls the whole replica batch and
          # splits it k ways (``replicate``); the split part reads the unsplit batch
          user = clones.op(lead, consumer)
          whole = values[0]
          _retarget(user, {i for i in user.inputs
                           if i.op.type == "Split" and i.op.inputs[1] is whole}, whole)
          built.append(("gather", x.tensor, whole))
          continue
        if x.gather:
          user = clones.op(lead, consumer)
          key = (x.tensor, lead, user.device, factor)
          if key not in cache:
            if x.batch_major:
              new = coll.gather_rows(values, user.device)
            else:
              new = coll.reduce_to(values, user.device) if x.backward else values[0]
            with tf.device(user.device):
              cache[key] = _scaled(new, factor)
            built.append(("gather", x.tensor, cache[key]))
          _retarget(user, {values[0]}, cache[key])
          continue
        source = values[0]                   # the split part runs in the replica's first copy
        for j, c in enumerate(members):
          user = clones.op(c, consumer)
          key = (x.tensor, c, factor)
          if key not in cache:
            piece = coll.rows_of(source, rows[lead], j, k) if x.batch_major else source
            with tf.device(source.device):
              cache[key] = _scaled(piece, factor)
            built.append(("scatter", x.tensor, cache[key]))
          _retarget(user, {tensor, source}, cache[key])
  return Bridges(built)


def _rows(clones, graph, crossings, lead, k):
  """The row count of each copy of the replica: from the first batch-major tensor gathered
  into a split TaskGraph (None: the copies split the rows evenly)."""
  first = next((x for x in crossings if x.gather and x.batch_major and not x.backward), None)
  if first is None:
    return None
  tensor = graph.get_tensor_by_name(first.tensor)
  counts = []
  for c in range(lead, lead + k):
    value = clones.tensor(c, tensor)
    with tf.device(value.device):
      counts.append(tf.shape(value)[0])
  return counts
