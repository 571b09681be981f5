"""Split rules of ``tf.reshape`` (see epl.sharding.rules for the table): per part when the split
axis stays the last (the flattened outer axes of a dense layer's input), when a value split by
rows loses its leading 1s (GPT-2's ``[1, nx, nf]`` weight), when the heads are split or merged
(``[..., h * d] <-> [..., h, d]``, every part holding whole heads), and when only the axes from
the split one on are regrouped into the target's trailing axes (BERT's ``[B*S, h*d] <-> [B, S, h,
d]``).
"""
import numpy as np
import tensorflow.compat.v1 as tf

from epl.sharding import layout, transformer
from epl.sharding.sharded import NotCovered, axis_from_end, part_name, per_part


def _folded(t):
  """The value of a small integer tensor that TF's constant folding in Python misses
  (``tf.stack([tf.rank(x) - 1])``), or None."""
  value = tf.get_static_value(t)
  if value is not None:
    return value
  if t.op.type == "Pack":
    items = [_folded(i) for i in t.op.inputs]
    return None if any(i is None for i in items) else np.stack(items)
  if t.op.type in ("Sub", "AddV2", "Add"):
    a, b = (_folded(i) for i in t.op.inputs)
    if a is None or b is None:
      return None
    return a - b if t.op.type == "Sub" else a + b
  return None


def _last_dim(scope, shape):
  """The static last entry of a shape tensor, or None. Knows TF's "flatten the outer
  dimensions" idioms: concat([[-1], slice(tf.shape(x), [rank - 1], [1])]),
  stack([-1, tf.shape(x)[rank - 1]]) and tensordot's (tf.layers.dense on a rank-3 input)
  stack([.., reduce_prod(gather(tf.shape(x), [rank - 1]))])."""
  value = tf.get_static_value(shape, partial=True)
  if value is not None and len(value) and value[-1] is not None:
    return int(value[-1])
  if shape.op.type not in ("ConcatV2", "Pack"):
    return None
  last = shape.op.inputs[-2 if shape.op.type == "ConcatV2" else -1]
  value = tf.get_static_value(last, partial=True)
  if value is not None and np.ndim(value) and len(value) and value[-1] is not None:
    return int(value[-1])
  if last.op.type == "Prod" and last.op.inputs[0].op.type == "GatherV2":
    gathered = last.op.inputs[0].op
    of = scope.recorder.sharded_shapes.get(gathered.inputs[0])
    index = _folded(gathered.inputs[1])
    rank = of.parts[0].shape.rank if of is not None else None
    if rank and index is not None and [int(i) % rank for i in np.ravel(index)] == [
        rank - 1] and of.axis == rank - 1:
      return of.total
    return None
  of = scope.recorder.sharded_shapes.get(last.op.inputs[0]) if last.op.type in (
      "Slice", "StridedSlice") else None
  begin = _folded(last.op.inputs[1]) if of is not None else None
  rank = of.parts[0].shape.rank if of is not None else None
  if begin is not None and rank is not None and int(np.ravel(begin)[0]) % rank == rank - 1 \
      and of.axis == rank - 1:
    return of.total
  return None


def reshape(scope, op_type, build, kw, name):
  tensor, shape = kw["tensor"], kw["shape"]
  sharded = scope.lookup(tensor)
  shape = tf.convert_to_tensor(shape)
  if sharded is None or shape.shape.rank != 1 or shape.shape.dims[0].value is None:
    return None
  rank = shape.shape.dims[0].value
  remake = layout.replayer(reshape, scope, op_type, build, kw, name,
                           lambda t, axis: layout.from_end(t, axis, rank))
  if axis_from_end(sharded) == -1 and _last_dim(scope, shape) == sharded.total:
    outs = per_part(scope, sharded, lambda i: build(
        tensor=sharded.parts[i], name=part_name(name, i),
        shape=tf.concat([shape[:-1], tf.constant([sharded.sizes[i]], shape.dtype)], 0))[0])
    return [scope.register(outs, rank - 1, sharded.sizes, name, sharded.shards, remake)]
  if _squeezes_leading(sharded, shape, rank):   # [1, nx, nf] by rows -> [nx, nf]
    outs = per_part(scope, sharded, lambda i: build(
        tensor=sharded.parts[i], name=part_name(name, i), shape=shape)[0])
    return [scope.register(outs, 0, sharded.sizes, name, sharded.shards, remake)]
  heads = transformer.reshape_heads(scope, build, sharded, shape, rank, name)
  if heads is not None:
    return heads
  return _trailing_block(scope, build, sharded, shape, rank, name)


def _trailing_block(scope, build, sharded, shape, rank, name):
  """A reshape that only regroups the axes from the split one on (static after it) into a
  static suffix of the target, every part holding whole rows of the suffix's first axis:
  BERT's ``[B*S, h*d] <-> [B, S, h, d]``; per part, split along that first axis."""
  dims = sharded.parts[0].shape.as_list() if sharded.parts[0].shape.rank else None
  target = tf.get_static_value(shape, partial=True)
  if dims is None or target is None or len(target) != rank or \
      any(d is None for d in dims[sharded.axis + 1:]):
    return None
  inner = int(np.prod(dims[sharded.axis + 1:], dtype=np.int64))
  block, product, k = sharded.total * inner, 1, rank
  while k > 0 and product < block:
    k -= 1
    if target[k] is None or target[k] < 1:
      return None
    product *= int(target[k])
  if product != block or k == rank:
    return None
  row = block // int(target[k])              # elements of one slice of the target's axis k
  if any(o * inner % row or z * inner % row for o, z in zip(sharded.offsets, sharded.sizes)):
    raise NotCovered("a part would hold a partial slice of the reshaped axis %d (%s per "
                     "slice; parts of %s)" % (k, row, list(sharded.sizes)))
  sizes = [z * inner // row for z in sharded.sizes]
  tail = [int(t) for t in target[k + 1:]]
  outs = per_part(scope, sharded, lambda i: build(
      tensor=sharded.parts[i], name=part_name(name, i),
      shape=tf.concat([shape[:k], tf.constant([sizes[i]] + tail, shape.dtype)], 0))[0])
  return [scope.register(outs, k, sizes, name, sharded.shards)]


def _squeezes_leading(sharded, shape, rank):
  """True for a reshape of a value split along an axis with only 1s before it into
  ``[-1, <the dims after it>]``."""
  dims = sharded.parts[0].shape.as_list() if sharded.parts[0].shape.rank else None
  target = tf.get_static_value(shape, partial=True)
  if dims is None or target is None or sharded.axis == 0:
    return False
  after = dims[sharded.axis + 1:]
  return all(d == 1 for d in dims[:sharded.axis]) and rank == len(after) + 1 and \
      target[0] == -1 and [None if t is None else int(t) for t in target[1:]] == after
