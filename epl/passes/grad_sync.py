"""Gradient sync pass: all-reduce every trainable variable's gradient across the copies.

Expects: the ``Replication`` of the replica pass and the (gradient, variable) pairs that
``apply_gradients`` saw. Adds, per bucket of dense gradients (grouped by TaskGraph and dtype,
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


@dataclasses.dataclass
class SyncReport:
  buckets: List[List[str]]            # variable names per dense bucket
  gathered: List[str]                 # variables whose sparse gradients were all-gathered
  collective_ops: List[tf.Operation]

  def variables(self):
    return [v for b in self.buckets for v in b] + list(self.gathered)


def _apply_readers(grads_and_vars, phase):
  """{gradient tensor: apply-phase ops reading it}, taken before any rewiring."""
  readers = {}
  for grad, _ in grads_and_vars:
    if grad is None:
      continue
    parts = [grad.values, grad.indices] if isinstance(grad, tf.IndexedSlices) else [grad]
    for t in parts:
      readers[t] = [c for c in t.consumers() if phase.get(c) == "apply"]
  return readers


def _rewire(consumers, old, new):
  from epl import _tf_compat as compat
  for consumer in consumers:
    for i, inp in enumerate(consumer.inputs):
      if inp is old:
        compat.update_input(consumer, i, new)


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


def gradient_sync(graph, plan, replication, grads_and_vars, owner, phase, collectives):
  """Runs the pass; see the module docstring."""
  report = SyncReport([], [], [])
  if plan.total_copies == 1 and plan.num_micro_batch == 1:
    return report
  readers = _apply_readers(grads_and_vars, phase)
  dense: Dict[tuple, list] = {}
  seen = set()
  for grad, var in grads_and_vars:
    if grad is None:
      continue
    var_op = var.op
    if var_op.name in seen:
      continue
    seen.add(var_op.name)
    if var_op.name not in replication.mirrored:
      raise PlanError(
          "epl cannot synchronise the gradient of variable %r: it is not used by the "
          "replicated training step. Create it inside the model (an epl scope) or leave it "
          "out of the optimizer's var_list." % var.name)
    tg = owner.get(var_op)
    if isinstance(grad, tf.IndexedSlices) and not plan.sparse_as_dense:
      _gather_sparse(graph, plan, replication, grad, var_op, tg, readers, collectives,
                     report)
      continue
    dense.setdefault((tg, grad.dtype.base_dtype), []).append(
        dict(grad=grad, var=var_op, tg=tg, size=_static_size(grad.values if isinstance(
            grad, tf.IndexedSlices) else grad)))
  for (tg, _), items in sorted(dense.items(), key=lambda kv: (kv[0][0], kv[0][1].name)):
    devices = [plan.device_of(c, tg) for c in range(plan.num_copies)]
    for bucket in _buckets(items, plan.max_splits):
      _reduce_bucket(graph, plan, replication, bucket, devices, readers, collectives, report)
  return report


def _copy_grad(replication, c, grad, method="mean"):
  """Copy c's gradient: with micro-batches, accumulated over them (mean or sum)."""
  count = replication.num_micro_batch
  if count > 1:
    parts = [_one_grad(replication, c, grad, m) for m in range(count)]
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
  return _one_grad(replication, c, grad, 0)


def _one_grad(replication, c, grad, m):
  if isinstance(grad, tf.IndexedSlices):
    shape = grad.dense_shape
    if shape is not None and replication.tensor(c, shape, m) is not None:
      shape = replication.tensor(c, shape, m)
    return tf.IndexedSlices(replication.tensor(c, grad.values, m),
                            replication.tensor(c, grad.indices, m), shape)
  return replication.tensor(c, grad, m)


def _reduce_bucket(graph, plan, replication, bucket, devices, readers, collectives, report):
  n = plan.num_copies
  flats, per_copy = [], []
  with graph.as_default(), tf.name_scope(None), tf.control_dependencies(None), \
      tf.name_scope("epl_grad_sync"):
    for c in range(n):
      grads = [_copy_grad(replication, c, item["grad"], plan.reduce_method) for item in bucket]
      with tf.device(devices[c]):
        dense = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                 for g in grads]
        flats.append(tf.concat([tf.reshape(g, [-1]) for g in dense], axis=0)
                     if len(dense) > 1 else tf.reshape(dense[0], [-1]))
      per_copy.append((grads, dense))
    reduced = collectives.all_reduce(flats, devices, plan.reduce_method,
                                     group=plan.group_of(bucket[0]["tg"]))
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
          first = _one_grad(replication, c, original, 0)    # what the apply ops read now
          if isinstance(original, tf.IndexedSlices):
            _rewire_sparse_as_dense(replication, c, original, first, new, readers)
          else:
            _rewire(_copy_consumers(replication, c, original, readers), first, new)
  report.buckets.append([item["var"].name for item in bucket])


def _copy_consumers(replication, c, original, readers):
  """The apply ops of copy ``c`` that read ``original``'s copy."""
  return [replication.op(c, op) for op in readers[original]]


def _rewire_sparse_as_dense(replication, c, original, g, dense_new, readers):
  rows = tf.shape(dense_new, out_type=g.indices.dtype)[0]
  _rewire(_copy_consumers(replication, c, original.values, readers), g.values, dense_new)
  _rewire(_copy_consumers(replication, c, original.indices, readers), g.indices,
          tf.range(rows))


def _gather_sparse(graph, plan, replication, grad, var_op, tg, readers, collectives,
                     report):
  n = plan.num_copies
  devices = [plan.device_of(c, tg) for c in range(n)]
  with graph.as_default(), tf.name_scope(None), tf.control_dependencies(None), \
      tf.name_scope("epl_grad_sync"):
    firsts = [_one_grad(replication, c, grad, 0) for c in range(n)]
    accumulated = []
    for c in range(n):
      with tf.device(devices[c]):
        accumulated.append(_copy_grad(replication, c, grad, plan.reduce_method))
    values = [a.values for a in accumulated]
    indices = [a.indices for a in accumulated]
    gathered_values = collectives.all_gather(values, devices, group=plan.group_of(tg))
    gathered_indices = collectives.all_gather(indices, devices, group=plan.group_of(tg))
    report.collective_ops.extend(t.op for t in gathered_values + gathered_indices)
    for c in range(n):
      with tf.device(devices[c]):
        new_values = gathered_values[c]
        if plan.reduce_method == "mean":
          new_values = new_values / tf.cast(plan.total_copies, new_values.dtype)
      _rewire(_copy_consumers(replication, c, grad.values, readers), firsts[c].values,
              new_values)
      _rewire(_copy_consumers(replication, c, grad.indices, readers), firsts[c].indices,
              gathered_indices[c])
  report.gathered.append(var_op.name)
