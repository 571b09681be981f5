"""Accumulation: each copy's gradient summed over its micro-batches (gradient_sync's first half).

A running sum, each micro-batch weighted by its share of the fed rows (``row_weights``: one
scalar per copy and micro-batch, taken apart once), divided by M for ``mean``; sparse
gradients (``IndexedSlices``) are concatenated. The copy's update ops are rewired to read the
sum. ``Item`` is what gradient_sync then reduces across copies. With ``plan.accumulate_runs``
(micro-batches as session runs) the sum is over the step's runs instead (run_sums.py).
"""
import dataclasses

import numpy as np
import tensorflow.compat.v1 as tf

from epl.op_tables import variable_shape
from epl.passes.clone import rewire

@dataclasses.dataclass
class Item:
  variable: str
  taskgraph: int
  grad: object                        # the user's tensor (Tensor or IndexedSlices)
  per_copy: list                      # what each copy contributes (accumulated)
  readers: list                       # update ops reading ``grad`` (the user's ops)
  first: list                         # what copy c's readers read now
  copies: list = None                 # the local copies that hold the variable
  part: int = 0                       # its part (device index) in a split TaskGraph

  @property
  def size(self):
    t = self.grad.values if isinstance(self.grad, tf.IndexedSlices) else self.grad
    return int(np.prod(t.shape.as_list())) if t.shape.is_fully_defined() else None



def parts_of(grad):
  return [grad.values, grad.indices] if isinstance(grad, tf.IndexedSlices) else [grad]



def copy_tensor(clones, c, grad, m=0, original=False):
  """``grad`` (a Tensor or IndexedSlices) in copy ``c`` and micro-batch ``m``; ``original``:
  the copy's own ops' (not a stage function call's result)."""
  get = clones.original if original else clones.tensor
  if isinstance(grad, tf.IndexedSlices):
    shape = grad.dense_shape
    if shape is not None and get(c, shape, m) is not None:
      shape = get(c, shape, m)
    return tf.IndexedSlices(get(c, grad.values, m), get(c, grad.indices, m), shape)
  return get(c, grad, m)


def readers_of(grad, update):
  """{tensor: the update ops reading it} for each tensor of a gradient (before rewiring)."""
  return {t: [c for c in t.consumers() if c in update] for t in parts_of(grad)}


def accumulate(ctx, clones, weights, var_op, tg, grad, update, sums=None):
  """Each copy's gradient accumulated over its micro-batches (weighted by fed rows); with
  ``plan.accumulate_runs``, over the step's runs (``sums``: run_sums.RunSums)."""
  if sums is not None:
    return _accumulate_runs(ctx, clones, weights, var_op, tg, grad, update, sums)
  worker, count = ctx.worker, ctx.plan.num_micro_batch
  mean = ctx.plan.communication.reduce_method == "mean"
  part = ctx.plan.part_of(var_op.name) if ctx.plan.is_split(tg) else 0
  copies = [c for c in range(worker.num_copies) if worker.runs(c, tg)]
  stride = ctx.plan.stride(tg)     # > 1: the TaskGraph sees that many copies' rows at once
  per_copy, first = [], []
  calls = clones.calls
  for c in copies:
    with tf.device(worker.device_of(c, tg, part)):
      if calls is not None:       # stage functions: the backward bodies summed dense ones
        first.append(copy_tensor(clones, c, grad, original=True))
        if not isinstance(grad, tf.IndexedSlices):
          total = calls.sums[(c, grad.name)]
          per_copy.append(total / tf.cast(count, total.dtype) if mean else total)
          continue
      parts = [copy_tensor(clones, c, grad, m) for m in range(count)]
      if calls is None:
        first.append(parts[0])
      if weights is not None:
        parts = [_scaled(p, weights.of(c, m, parts_of(p)[0].dtype.base_dtype, stride))
                 for m, p in enumerate(parts)]
      per_copy.append(_sum(parts, count if mean else 1))
  item = Item(var_op.name, tg, grad, per_copy, readers_of(grad, update), first, copies, part)
  if count > 1 or weights is not None:
    rewire_all(clones, item, per_copy)
    item.first = list(per_copy)
  return item


def _accumulate_runs(ctx, clones, weights, var_op, tg, grad, update, sums):
  """Gradient accumulation over session runs (run_sums.RunSums): each copy's update reads
  its sum over the step's runs."""
  worker, mean = ctx.worker, ctx.plan.communication.reduce_method == "mean"
  copies = [c for c in range(worker.num_copies) if worker.runs(c, tg)]
  shape = variable_shape(var_op)
  per_copy, first, adds, resets, inits = [], [], [], [], []
  name = var_op.name.replace("/", "_")
  for c in copies:
    with tf.device(worker.device_of(c, tg)):
      g = copy_tensor(clones, c, grad)
      first.append(g)
      factor = sums.factor(c, parts_of(g)[0].dtype.base_dtype, weights, mean,
                           ctx.plan.stride(tg))
    summed, add, reset, init = sums.summed(worker.device_of(c, tg), g, factor, shape,
                                           "%s_%d" % (name, c))
    per_copy.append(summed)
    adds += add
    resets += reset
    inits += init
  item = Item(var_op.name, tg, grad, per_copy, readers_of(grad, update), first, copies)
  rewire_all(clones, item, per_copy)
  item.first = list(per_copy)
  sums.record(var_op.name, {r.name for rs in item.readers.values() for r in rs}, adds, resets,
              inits)
  return item


class Weights:
  """The weight of each (copy, micro-batch) piece: ``row_weights`` (index c * M + m) taken
  apart once, each scalar cast once per dtype (sliced per variable, they were a third of this
  pass). A TaskGraph with stride s (a split part, a stage on fewer devices) runs in every
  s-th copy c on the rows of copies c..c+s-1: its weight is theirs averaged
  (``group_weights``)."""

  def __init__(self, row_weights, count):
    self._tensor = row_weights
    self._count = count                     # micro-batches per copy in one run
    self._pieces = {}                       # stride -> scalars
    self._cast = {}

  def of(self, copy, m, dtype, stride=1):
    key = (copy, m, dtype, stride)
    if key not in self._cast:
      if stride not in self._pieces:
        with tf.device(self._tensor.device):
          self._pieces[stride] = tf.unstack(group_weights(self._tensor, stride, self._count))
      piece = self._pieces[stride][(copy // stride) * self._count + m]
      self._cast[key] = piece if piece.dtype == dtype else tf.cast(piece, dtype)
    return self._cast[key]


def group_weights(row_weights, stride, count):
  """``row_weights`` ([copies x M]) of the groups of ``stride`` consecutive copies: their
  mean per micro-batch, [copies / stride x M]."""
  if stride == 1:
    return row_weights
  grouped = tf.reshape(row_weights, [-1, stride, count])
  return tf.reshape(tf.reduce_mean(grouped, axis=1), [-1])


def _scaled(grad, weight):
  if isinstance(grad, tf.IndexedSlices):
    return tf.IndexedSlices(grad.values * weight, grad.indices, grad.dense_shape)
  return grad * weight


def loose_rows(t):
  """``t`` with an unknown first dimension: rows gathered from several micro-batches or
  copies differ in number from what the user's ops were built for (static shapes)."""
  return tf.placeholder_with_default(t, [None] + t.shape.as_list()[1:])


def _sum(parts, divide_by):
  if isinstance(parts[0], tf.IndexedSlices):
    if len(parts) == 1:
      values, indices = parts[0].values, parts[0].indices
    else:
      values = loose_rows(tf.concat([p.values for p in parts], axis=0))
      indices = loose_rows(tf.concat([p.indices for p in parts], axis=0))
    if divide_by > 1:
      values = values / tf.cast(divide_by, values.dtype)
    return tf.IndexedSlices(values, indices, parts[0].dense_shape)
  # a running sum: each micro-batch's gradient is freed as soon as it is added (add_n would
  # keep all M of them alive until the last one arrives)
  total = parts[0]
  for part in parts[1:]:
    total = total + part
  return total / tf.cast(divide_by, total.dtype) if divide_by > 1 else total


def rewire_all(clones, item, new):
  """Makes copy c's update ops that read ``item.first[c]`` read ``new[c]``."""
  for c, old, value in zip(item.copies, item.first, new):
    for part_old, part_new, original in zip(parts_of(old), parts_of(value), parts_of(item.grad)):
      users = [clones.op(c, u) for u in item.readers[original]]
      rewire(part_old, part_new, [u for u in users if u is not None])


# ---- across copies ------------------------------------------------------------------------
