"""Gradient sync pass: all-reduce every trainable variable's gradient across the copies.

Expects: the clones of the replica and micro-batch passes and the plan's gradients. Adds, per bucket of dense gradients (grouped by TaskGraph and dtype,
at most ``max_splits`` buckets each): a flatten + concat on each copy's device, one collective
all-reduce, and a split back; the optimizer's apply ops of each copy are rewired to read the
reduced gradient. ``IndexedSlices`` gradients are all-gathered (values and indices), or
densified first with ``communication.sparse_as_dense``. Returns a ``SyncReport``: which bucket
carries each variable, so tests can check that every gradient is synchronised exactly once.
"""
import dataclasses
from typing import Dict, List

import numpy as np
import tensorflow.compat.v1 as tf

from epl.errors import PlanError
from epl.passes.clone import rewire


@dataclasses.dataclass(frozen=True)
class SyncReport:
  buckets: List[List[str]]            # variable names per dense bucket
  gathered: List[str]                 # variables whose sparse gradients were all-gathered
  collective_ops: List[tf.Operation]

  def variables(self):
    return [v for b in self.buckets for v in b] + list(self.gathered)


def _apply_readers(grads, phase):
  """{gradient tensor: apply-phase ops reading it}, taken before any rewiring."""
  readers = {}
  for grad in grads:
    parts = [grad.values, grad.indices] if isinstance(grad, tf.IndexedSlices) else [grad]
    for t in parts:
      readers[t] = [c for c in t.consumers() if phase.get(c) == "apply"]
  return readers


def _tensors(graph, gradient):
  """The gradient of a plan ``Gradient`` in the user's graph (a Tensor or IndexedSlices)."""
  get = graph.get_tensor_by_name
  if gradient.sparse:
    values, indices, shape = gradient.applied
    return tf.IndexedSlices(get(values), get(indices), get(shape) if shape else None)
  return get(gradient.applied[0])


def _static_size(t):
  shape = t.shape
  return int(np.prod(shape.as_list())) if shape.is_fully_defined() else None


def _buckets(items, max_splits):
  """Splits items (with .size) into at most max_splits contiguous runs of similar bytes."""
  total = sum(max(1, i["size"] or 1) for i in items)
  target = total / max_splits
  out, current, acc = [], [], 0
  for item in items:
    current.append(item)
    acc += max(1, item["size"] or 1)
    if acc >= target * (len(out) + 1) and len(out) < max_splits - 1:
      out.append(current)
      current = []
  if current:
    out.append(current)
  return out


def gradient_sync(ctx):
  """Runs the pass; see the module docstring."""
  graph, plan = ctx.graph, ctx.plan
  report = SyncReport([], [], [])
  if plan.total_copies == 1 and plan.num_micro_batch == 1:
    return report
  replication, clones = ctx.result("replicate"), ctx.clones()
  pairs = [(_tensors(graph, g), graph.get_operation_by_name(g.variable))
           for g in plan.gradients]
  readers = _apply_readers([grad for grad, _ in pairs], ctx.phase)
  dense: Dict[tuple, list] = {}
  for grad, var_op in pairs:
    if var_op.name not in replication.mirrored:
      raise PlanError(
          "epl cannot synchronise the gradient of variable %r: it is not used by the "
          "replicated training step. Create it inside the model (an epl scope) or leave it "
          "out of the optimizer's var_list." % var_op.outputs[0].name)
    tg = ctx.owner.get(var_op)
    if isinstance(grad, tf.IndexedSlices) and not plan.communication.sparse_as_dense:
      _gather_sparse(ctx, clones, grad, var_op, tg, readers, report)
      continue
    dense.setdefault((tg, grad.dtype.base_dtype), []).append(
        dict(grad=grad, var=var_op, tg=tg, size=_static_size(grad.values if isinstance(
            grad, tf.IndexedSlices) else grad)))
  for (tg, _), items in sorted(dense.items(), key=lambda kv: (kv[0][0], kv[0][1].name)):
    devices = [ctx.worker.device_of(c, tg) for c in range(ctx.worker.num_copies)]
    for bucket in _buckets(items, plan.communication.max_splits):
      _reduce_bucket(ctx, clones, bucket, devices, readers, report)
  return report


def _copy_grad(clones, c, grad, method="mean"):
  """Copy c's gradient: with micro-batches, accumulated over them (mean or sum)."""
  count = clones.num_micro_batch
  if count > 1:
    parts = [_one_grad(clones, c, grad, m) for m in range(count)]
    if isinstance(grad, tf.IndexedSlices):
      values = tf.concat([p.values for p in parts], axis=0)
      if method == "mean":
        values = values / tf.cast(count, values.dtype)
      return tf.IndexedSlices(values, tf.concat([p.indices for p in parts], axis=0),
                              parts[0].dense_shape)
    # a running sum: each micro-batch's gradient is freed as soon as it is added (add_n
    # would keep all M of them alive until the last one arrives)
    total = parts[0]
    for part in parts[1:]:
      total = total + part
    return total / tf.cast(count, total.dtype) if method == "mean" else total
  return _one_grad(clones, c, grad, 0)


def _one_grad(clones, c, grad, m):
  if isinstance(grad, tf.IndexedSlices):
    shape = grad.dense_shape
    if shape is not None and clones.tensor(c, shape, m) is not None:
      shape = clones.tensor(c, shape, m)
    return tf.IndexedSlices(clones.tensor(c, grad.values, m),
                            clones.tensor(c, grad.indices, m), shape)
  return clones.tensor(c, grad, m)


def _reduce_bucket(ctx, clones, bucket, devices, readers, report):
  n, method = ctx.worker.num_copies, ctx.plan.communication.reduce_method
  flats, per_copy = [], []
  with ctx.graph.as_default(), tf.name_scope(None), tf.control_dependencies(None), \
      tf.name_scope("epl_grad_sync"):
    for c in range(n):
      grads = [_copy_grad(clones, c, item["grad"], method) for item in bucket]
      with tf.device(devices[c]):
        dense = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                 for g in grads]
        flats.append(tf.concat([tf.reshape(g, [-1]) for g in dense], axis=0)
                     if len(dense) > 1 else tf.reshape(dense[0], [-1]))
      per_copy.append((grads, dense))
    reduced = ctx.collectives.all_reduce(flats, devices, method,
                                         group=ctx.plan.group_of(bucket[0]["tg"]))
    report.collective_ops.extend(r.op for r in reduced)
    for c in range(n):
      grads, dense = per_copy[c]
      with tf.device(devices[c]):
        sizes = [tf.size(g) if item["size"] is None else item["size"]
                 for g, item in zip(dense, bucket)]
        pieces = tf.split(reduced[c], sizes) if len(dense) > 1 else [reduced[c]]
        for g, d, piece, item in zip(grads, dense, pieces, bucket):
          new = tf.reshape(piece, tf.shape(d) if not d.shape.is_fully_defined() else d.shape)
          original = item["grad"]
          first = _one_grad(clones, c, original, 0)    # what the apply ops read now
          if isinstance(original, tf.IndexedSlices):
            _rewire_sparse_as_dense(clones, c, original, first, new, readers)
          else:
            rewire(first, new, _copy_consumers(clones, c, original, readers))
  report.buckets.append([item["var"].name for item in bucket])


def _copy_consumers(clones, c, original, readers):
  """The apply ops of copy ``c`` that read ``original``'s copy."""
  return [clones.op(c, op) for op in readers[original]]


def _rewire_sparse_as_dense(clones, c, original, g, dense_new, readers):
  rows = tf.shape(dense_new, out_type=g.indices.dtype)[0]
  rewire(g.values, dense_new, _copy_consumers(clones, c, original.values, readers))
  rewire(g.indices, tf.range(rows), _copy_consumers(clones, c, original.indices, readers))


def _gather_sparse(ctx, clones, grad, var_op, tg, readers, report):
  n, plan = ctx.worker.num_copies, ctx.plan
  method = plan.communication.reduce_method
  devices = [ctx.worker.device_of(c, tg) for c in range(n)]
  with ctx.graph.as_default(), tf.name_scope(None), tf.control_dependencies(None), \
      tf.name_scope("epl_grad_sync"):
    firsts = [_one_grad(clones, c, grad, 0) for c in range(n)]
    accumulated = []
    for c in range(n):
      with tf.device(devices[c]):
        accumulated.append(_copy_grad(clones, c, grad, method))
    values = [a.values for a in accumulated]
    indices = [a.indices for a in accumulated]
    gathered_values = ctx.collectives.all_gather(values, devices, group=plan.group_of(tg))
    gathered_indices = ctx.collectives.all_gather(indices, devices, group=plan.group_of(tg))
    report.collective_ops.extend(t.op for t in gathered_values + gathered_indices)
    for c in range(n):
      with tf.device(devices[c]):
        new_values = gathered_values[c]
        if method == "mean":
          new_values = new_values / tf.cast(plan.total_copies, new_values.dtype)
      rewire(firsts[c].values, new_values, _copy_consumers(clones, c, grad.values, readers))
      rewire(firsts[c].indices, gathered_indices[c],
             _copy_consumers(clones, c, grad.indices, readers))
  report.gathered.append(var_op.name)
