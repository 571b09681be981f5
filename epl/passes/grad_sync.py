"""Gradient sync pass: every copy's update sees the job-wide gradient.

Expects: the clones of the replicate and micro_batch passes, the plan's gradients (the raw
output of ``tf.gradients`` for each variable, and what ``apply_gradients`` was handed) and the
update phase (``apply``: everything the step runs once after the gradients).

For each gradient and copy, the micro-batch gradients are accumulated into one
(accumulate.py: a running sum, each micro-batch weighted by its share of the fed rows,
divided by M for ``mean``).
Then, with ``communication.clip_after_allreduce`` (the default), the accumulated raw
gradients are all-reduced across every copy of the job and every update op that read the raw
gradient -- the user's clipping, a custom optimizer, summaries -- reads the all-reduced one:
the job trains the local model. With ``clip_after_allreduce: False`` (EPL's behaviour) the
update reads the copy's own accumulated gradient and only what ``apply_gradients`` is handed
is all-reduced (each copy clips its own gradient, then they are averaged).

Dense gradients travel fused: per TaskGraph and dtype, at most ``max_splits`` buckets of
similar size, each flattened, concatenated and all-reduced once. ``IndexedSlices`` are
all-gathered (values and indices), or densified first with ``sparse_as_dense``. Returns a
``SyncReport`` (which bucket carries each variable).

Streamed gradients: across workers on the ring, a weight gradient larger than a ring piece
that is one ``MatMul(x, dy, transpose_a=True)`` (a dense layer's kernel) is computed in
blocks of rows, each a piece all-reduced as soon as it is computed (grad_stream.py), instead of
waiting for the whole product: on a link-bound model the sync starts while backprop still
writes the gradient.
"""
import dataclasses
from typing import Dict, List, Tuple

import tensorflow.compat.v1 as tf

from epl.collectives import by_worker
from epl.errors import NotImplementedYetError, PlanError
from epl.passes.accumulate import (Item, Weights, accumulate, copy_tensor, loose_rows, parts_of,
                                   readers_of, rewire_all)
from epl.passes.clone import rewire
from epl.passes.grad_stream import stream, streamable
from epl.passes.run_sums import RunSums
from epl.passes.slots import train_groups


@dataclasses.dataclass(frozen=True)
class SyncReport:
  buckets: List[List[str]]            # variable names per dense bucket
  gathered: List[str]                 # variables whose sparse gradients were all-gathered
  collective_ops: List[tf.Operation]
  # zero.level v1 across workers: (TaskGraph, dtype) -> the op of this worker's reduced chunk
  exchanged: Dict[Tuple[int, str], tf.Operation] = dataclasses.field(default_factory=dict)
  # zero.level v2 across workers whose gradients are all-reduced (_combined): variable -> an
  # op that runs once its all-reduce ran on every local device (what a worker that does not
  # own the variable runs instead of its update)
  reduced: Dict[str, tf.Operation] = dataclasses.field(default_factory=dict)
  streamed: List[str] = dataclasses.field(default_factory=list)   # each also its own bucket
  # graph.micro_batches "runs": the sums over a step's runs (run_sums.RunSums), or None
  sums: object = None

  def variables(self):
    return [v for b in self.buckets for v in b] + list(self.gathered)


def _get(graph, names):
  """A plan gradient's tensors in the user's graph (a Tensor or IndexedSlices)."""
  get = graph.get_tensor_by_name
  if len(names) == 3:
    return tf.IndexedSlices(get(names[0]), get(names[1]), get(names[2]) if names[2] else None)
  return get(names[0])


def gradient_sync(ctx):
  """Runs the pass; see the module docstring."""
  graph, plan = ctx.graph, ctx.plan
  report = SyncReport([], [], [])
  if plan.total_copies == 1 and plan.micro_batches == 1:
    return report
  replication, clones = ctx.result("replicate"), ctx.clones()
  update = {op for op, phase in ctx.phase.items() if phase == "apply"}
  after_allreduce = plan.communication.clip_after_allreduce
  missing = [g.variable for g in plan.gradients if not g.applied]
  if not after_allreduce and missing:
    raise NotImplementedYetError(
        "communication.clip_after_allreduce=False all-reduces the gradients handed to "
        "apply_gradients, but the optimizer of %s overrides apply_gradients, so epl cannot see "
        "them; keep the default (True), which trains the local model" % ", ".join(
            repr(v) for v in missing[:3]))
  raw_items, applied_items = [], []
  with graph.as_default(), tf.name_scope(None), tf.control_dependencies(None), \
      tf.name_scope("epl_grad_sync"):
    weights = Weights(replication.row_weights, plan.num_micro_batch) \
        if replication.row_weights is not None else None
    sums = RunSums(graph, ctx.worker.host, plan.accumulate_runs) \
        if plan.accumulate_runs > 1 else None
    for g in plan.gradients:
      var_op = graph.get_operation_by_name(g.variable)
      if var_op.name not in replication.mirrored:
        raise PlanError(
            "epl cannot synchronise the gradient of variable %r: it is not part of the "
            "replicated model (it is shared, like global_step). Leave it out of the "
            "optimizer's var_list." % var_op.outputs[0].name)
      tg = ctx.owner[var_op]
      grad = _get(graph, g.tensors)
      item = accumulate(ctx, clones, weights, var_op, tg, grad, update, sums)
      if after_allreduce or not g.applied or g.applied == g.tensors:
        raw_items.append(item)
        continue
      rewire_all(clones, item, item.per_copy)             # the copy's own gradient
      applied = _get(graph, g.applied)
      applied_items.append(Item(g.variable, tg, applied, [
          copy_tensor(clones, c, applied) for c in item.copies],
          readers_of(applied, update), [copy_tensor(clones, c, applied)
                                      for c in item.copies], item.copies, item.part))
    if plan.total_copies > 1:
      _reduce(ctx, raw_items + applied_items, report)
    if sums is not None:
      sums.gate_updates(ctx, clones)
  return dataclasses.replace(report, sums=sums) if sums is not None else report


def _reduce(ctx, items, report):
  dense, plan = {}, ctx.plan
  # zero.level v1: each gradient is summed where its owner is, the only copy whose update
  # reads it -- inside one worker on the owner's device, across workers by a reduce-scatter
  # (v2 across workers too: the owner's is the only copy that holds the variable)
  across_v2 = plan.memory.zero.partitions_weights and len(plan.clients) > 1
  owners = ctx.result("owners").owners if plan.memory.zero.partitions_gradients or across_v2 \
      else {}
  scatter = bool(owners) and len(plan.clients) > 1
  if scatter and _combined(items):
    # a value computed from several variables' gradients (clip_by_global_norm's norm) needs
    # every gradient reduced on every worker: all-reduce them (the slots stay partitioned;
    # v2: each weight too, and report.reduced tells the zero pass what the others run)
    owners, scatter = {}, False
  train = _train_ops(ctx, items)
  for item in items:
    if isinstance(item.grad, tf.IndexedSlices) and not plan.communication.sparse_as_dense:
      _gather_sparse(ctx, item, report)
      continue
    dtype = (item.grad.values if isinstance(item.grad, tf.IndexedSlices) else item.grad).dtype
    # a bucket holds one train op's gradients: a GAN's generator step must not compute (and
    # need the feeds of) the discriminator's (ZeRO's reduce-scatter: one per stage and dtype)
    dense.setdefault((0 if scatter else train[item.variable], item.taskgraph, item.part, dtype.base_dtype.name,
                      -1 if scatter else owners.get(item.variable, -1)), []).append(item)
  ready = _readiness(ctx.graph)
  for (_, tg, part, _, owner), group in sorted(dense.items()):
    if len(plan.group_of(tg, part)) == 1:
      continue                         # one replica of a split TaskGraph: nothing to reduce
    if scatter:
      _scatter_to_owners(ctx, tg, part, group, owners, report)
      continue
    members, start = [item.variable for item in group], len(report.collective_ops)
    group = sorted(group, key=lambda item: ready[parts_of(item.grad)[0].op])
    if owner < 0:
      streamed = [item for item in group if streamable(ctx, tg, part, item)]
      chain = []                       # their blocks in readiness order share one limit
      for item in streamed:
        rewire_all(ctx.clones(), item, stream(ctx, tg, part, item, report.collective_ops, chain))
        report.buckets.append([item.variable])
        report.streamed.append(item.variable)
      group = [item for item in group if item not in streamed]
    for i, bucket in enumerate(_buckets(group, plan.communication.max_splits)):
      _reduce_bucket(ctx, tg, part, bucket, report, i % plan.communication.num_communicators,
                     root=None if owner < 0 else owner)
    if across_v2:
      _mark_reduced(ctx.graph, report, members, report.collective_ops[start:])


def _mark_reduced(graph, report, variables, ops):
  """v2 across workers, all-reduced: one op that waits for ``ops`` (the collectives of
  ``variables``' gradients on this worker's devices) stands for each of them in
  ``report.reduced``."""
  with graph.as_default(), tf.name_scope(None), tf.control_dependencies(None), \
      tf.device(ops[0].device):
    done = tf.group(*ops, name="epl_grad_sync/reduced")
  for v in variables:
    report.reduced[v] = done


def _combined(items):
  """True when an op reads (through data edges) the gradients of two or more variables, like
  a global norm for clipping. Walked from the user's gradient and from what its readers read
  now (the accumulated sum: with stage functions a call's result, which the user's gradient
  no longer reaches)."""
  reached = {}                       # op -> the variable whose gradient reaches it
  for item in items:
    work = [t.op for t in parts_of(item.grad)] + [
        t.op for g in item.per_copy[:1] for t in parts_of(g)]
    while work:
      for out in work.pop().outputs:
        for reader in out.consumers():
          if reached.get(reader) == item.variable:
            continue
          if reader in reached:
            return True
          reached[reader] = item.variable
          work.append(reader)
  return False


def _train_ops(ctx, items):
  """{variable: the index of the train op(s) its gradient feeds} (slots.train_groups)."""
  update = {op for op, phase in ctx.phase.items() if phase == "apply"}
  return train_groups(update, {item.variable: [r for rs in item.readers.values() for r in rs]
                               for item in items})


def _readiness(graph):
  """Op -> its place in the order backprop computes it.

  ``tf.gradients`` creates the gradient ops walking back from the loss, so creation order
  (``Graph.get_operations``) is the order the gradients become ready: the last layer's
  first. Buckets are cut from gradients in this order, so each bucket's all-reduce starts as
  soon as its own layers' backprop is done and overlaps the rest, and no early gradient
  waits for a late one (in variable order a layer's bias would hold the next layer's kernel
  back until the end of backprop)."""
  return {op: i for i, op in enumerate(graph.get_operations())}


def _buckets(items, max_splits):
  """Splits items into at most max_splits contiguous runs of similar bytes: a run ends at
  the multiple of total/max_splits its running sum comes closest to (an item that would
  overshoot that edge by more than the run falls short of it starts the next run)."""
  sizes = [max(1, i.size or 1) for i in items]
  target = sum(sizes) / max_splits
  out, current, acc = [], [], 0
  for item, size in zip(items, sizes):
    edge = target * (len(out) + 1)
    if current and len(out) < max_splits - 1 and acc + size - edge > edge - acc:
      out.append(current)
      current = []
    current.append(item)
    acc += size
    if acc >= target * (len(out) + 1) and len(out) < max_splits - 1:
      out.append(current)
      current = []
  if current:
    out.append(current)
  return out


def _reduce_bucket(ctx, tg, part, bucket, report, channel, root=None):
  worker, plan = ctx.worker, ctx.plan
  copies = bucket[0].copies
  devices = [worker.device_of(c, tg, part) for c in copies]
  if root is not None:          # the owner copy, among those that run the stage
    root = list(copies).index(root)
  flats, dense = [], []
  for c, device in enumerate(devices):
    with tf.device(device):
      grads = [tf.convert_to_tensor(item.per_copy[c]) for item in bucket]
      dense.append(grads)
      flats.append(tf.concat([tf.reshape(g, [-1]) for g in grads], axis=0)
                   if len(grads) > 1 else tf.reshape(grads[0], [-1]))
  comm = plan.communication
  compress = comm.fp16_scale if comm.fp16 and flats[0].dtype == tf.float32 else None
  reduced = ctx.collectives.all_reduce(flats, devices, comm.reduce_method,
                                       group=plan.group_of(tg, part),
                                       clients=plan.clients_of(tg, part), channel=channel,
                                       fp16_scale=compress, root=root)
  report.collective_ops.extend(r.op for r in reduced)
  news = []
  for c, device in enumerate(devices):
    with tf.device(device):
      sizes = [tf.size(g) if item.size is None else item.size
               for g, item in zip(dense[c], bucket)]
      pieces = tf.split(reduced[c], sizes) if len(bucket) > 1 else [reduced[c]]
      news.append([tf.reshape(p, tf.shape(g) if not g.shape.is_fully_defined() else g.shape)
                   for p, g in zip(pieces, dense[c])])
  for i, item in enumerate(bucket):
    if isinstance(item.grad, tf.IndexedSlices):            # sparse_as_dense
      for i_copy, c in enumerate(copies):
        _rewire_sparse_as_dense(ctx.clones(), i_copy, c, item, news[i_copy][i])
    else:
      rewire_all(ctx.clones(), item, [news[c][i] for c in range(len(devices))])
  report.buckets.append([item.variable for item in bucket])


def _scatter_to_owners(ctx, tg, part, items, owners, report):
  """zero.level v1 across workers: one reduce-scatter of the (TaskGraph, dtype) gradients,
  laid out by owner worker (each worker's chunk: the gradients its copies own, padded to the
  longest chunk); each owner copy's update reads its gradients from this worker's chunk."""
  worker, plan = ctx.worker, ctx.plan
  group, clients = plan.group_of(tg, part), plan.clients_of(tg, part)
  order = [w for w, _ in by_worker(group, clients)]
  job = plan.copies
  local = {k: sum(1 for other in job[:k] if other.client == job[k].client)
           for k in range(len(job))}
  unknown = [i.variable for i in items if i.size is None]
  if unknown:
    raise NotImplementedYetError(
        "zero.level v1 across workers needs gradients of static shape; %s has none" %
        unknown[0])
  mine = {w: [i for i in items if job[owners[i.variable]].client == w] for w in order}
  length = max(sum(i.size for i in owned) for owned in mine.values())
  copies = items[0].copies
  devices = [worker.device_of(c, tg, part) for c in copies]
  flats = []
  for c, device in enumerate(devices):
    with tf.device(device):
      chunks = []
      for w in order:
        flat = [tf.reshape(tf.convert_to_tensor(i.per_copy[c]), [-1]) for i in mine[w]]
        pad = length - sum(i.size for i in mine[w])
        if pad:
          flat.append(tf.zeros([pad], items[0].per_copy[c].dtype))
        chunks.extend(flat)
      flats.append(tf.concat(chunks, axis=0))
  comm = plan.communication
  compress = comm.fp16_scale if comm.fp16 and flats[0].dtype == tf.float32 else None
  reduced = ctx.collectives.reduce_scatter(flats, devices, comm.reduce_method, group,
                                           clients, fp16_scale=compress)
  report.collective_ops.append(reduced.op)
  report.exchanged[(tg, flats[0].dtype.base_dtype.name)] = reduced.op
  owned = mine[worker.index]
  if owned:
    with tf.device(reduced.device):
      pieces = tf.split(reduced, [i.size for i in owned] + [length - sum(
          i.size for i in owned)])[:len(owned)]
    for item, piece in zip(owned, pieces):
      # v2: copy 0's update (moved to the owner's device by the zero pass) is the one
      index = 0 if plan.memory.zero.partitions_weights else \
          copies.index(local[owners[item.variable]])
      new = list(item.first)
      new[index] = tf.reshape(piece, item.first[index].shape)
      rewire_all(ctx.clones(), item, new)
  report.buckets.append([item.variable for item in items])


def _rewire_sparse_as_dense(clones, index, c, item, dense_new):
  old = item.first[index]
  users = {k: [u for u in (clones.op(c, x) for x in v) if u is not None]
           for k, v in item.readers.items()}
  with tf.device(dense_new.device):
    rows = tf.range(tf.shape(dense_new, out_type=old.indices.dtype)[0])
  rewire(old.values, dense_new, users[item.grad.values])
  rewire(old.indices, rows, users[item.grad.indices])


def _gather_sparse(ctx, item, report):
  worker, plan = ctx.worker, ctx.plan
  devices = [worker.device_of(c, item.taskgraph, item.part) for c in item.copies]
  group = plan.group_of(item.taskgraph, item.part)
  if len(group) == 1:
    return
  clients = plan.clients_of(item.taskgraph, item.part)
  values = ctx.collectives.all_gather([g.values for g in item.per_copy], devices, group=group,
                                      clients=clients)
  indices = ctx.collectives.all_gather([g.indices for g in item.per_copy], devices, group=group,
                                       clients=clients)
  report.collective_ops.extend(t.op for t in values + indices)
  news = []
  for c, device in enumerate(devices):
    with tf.device(device):
      v = loose_rows(values[c])
      if plan.communication.reduce_method == "mean":
        v = v / tf.cast(len(group), v.dtype)
      news.append(tf.IndexedSlices(v, loose_rows(indices[c]), item.per_copy[c].dense_shape))
  rewire_all(ctx.clones(), item, news)
  report.gathered.append(item.variable)
