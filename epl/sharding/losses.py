"""Split rules over a softmax axis: softmax, cross-entropy and argmax of sharded logits.

Each combines per-shard reductions (max, sum of exps, the label's logit, the argmax) into the
result; the whole logits are never gathered (see epl.sharding.rules for the table).
"""
import tensorflow.compat.v1 as tf

from epl.sharding.sharded import cut, part_name, per_part


def _global_max(scope, sharded, axis):
  maxes = per_part(scope, sharded, lambda i: tf.reduce_max(sharded.parts[i], axis=axis,
                                                            keepdims=True))
  return tf.stop_gradient(tf.reduce_max(tf.stack(maxes), axis=0))


def softmax(scope, op_type, build, kw, name):
  sharded = scope.lookup(kw["logits"])
  axis = sharded.parts[0].shape.rank - 1
  if sharded.axis != axis:       # over a whole axis (attention's keys, the heads split)
    outs = per_part(scope, sharded, lambda i: build(logits=sharded.parts[i],
                                                    name=part_name(name, i))[0])
    return [scope.register(outs, sharded.axis, sharded.sizes, name, sharded.shards)]
  top = _global_max(scope, sharded, axis)
  exps = per_part(scope, sharded, lambda i: tf.exp(sharded.parts[i] - top))
  sums = per_part(scope, sharded, lambda i: tf.reduce_sum(exps[i], axis=axis, keepdims=True))
  total = tf.add_n(sums)
  if op_type == "Softmax":
    outs = per_part(scope, sharded, lambda i: exps[i] / total)
  else:
    log_total = tf.log(total) + top
    outs = per_part(scope, sharded, lambda i: sharded.parts[i] - log_total)
  return [scope.register(outs, axis, sharded.sizes, name)]


def _log_sum_exp(scope, sharded, axis):
  top = _global_max(scope, sharded, axis)
  sums = per_part(scope, sharded, lambda i: tf.reduce_sum(
      tf.exp(sharded.parts[i] - top), axis=axis))
  return tf.log(tf.add_n(sums)) + tf.squeeze(top, axis)


def sparse_xent(scope, op_type, build, kw, name):
  """(loss, no backprop output): per-example softmax cross-entropy of sharded logits."""
  logits, labels = kw["features"], kw["labels"]
  sharded = scope.lookup(logits)
  axis = logits.shape.rank - 1 if logits.shape.rank else None
  if sharded is None or sharded.axis != axis or scope.lookup(labels) is not None:
    return None

  def pick(i):
    part, lo, size = sharded.parts[i], sharded.offsets[i], sharded.sizes[i]
    local = tf.cast(labels, tf.int64) - lo
    inside = tf.logical_and(local >= 0, local < size)
    picked = tf.gather(part, tf.where(inside, local, tf.zeros_like(local)),
                       batch_dims=axis, axis=axis)
    return tf.where(inside, picked, tf.zeros_like(picked))
  picks = per_part(scope, sharded, pick)
  loss = _log_sum_exp(scope, sharded, axis) - tf.add_n(picks)
  return [tf.identity(loss, name=name), None]


def dense_xent(scope, op_type, build, kw, name):
  logits, labels = kw["features"], kw["labels"]
  sharded = scope.lookup(logits)
  axis = logits.shape.rank - 1 if logits.shape.rank else None
  if sharded is None or sharded.axis != axis:
    return None
  pieces = cut(scope, labels, sharded)
  if pieces is None:
    return None
  lse = _log_sum_exp(scope, sharded, axis)
  dots = per_part(scope, sharded, lambda i: tf.reduce_sum(pieces[i] * sharded.parts[i], axis))
  sums = per_part(scope, sharded, lambda i: tf.reduce_sum(pieces[i], axis))
  loss = tf.add_n(sums) * lse - tf.add_n(dots)
  return [tf.identity(loss, name=name), None]


def argmax(scope, op_type, build, kw, name):
  sharded = scope.lookup(kw["input"])
  rank = sharded.parts[0].shape.rank
  dim = tf.get_static_value(kw["dimension"])
  if dim is None or rank is None or int(dim) % rank != sharded.axis:
    return None
  out_type = kw.get("output_type") or tf.int64
  values = per_part(scope, sharded, lambda i: tf.reduce_max(sharded.parts[i],
                                                             axis=sharded.axis))
  indices = per_part(scope, sharded, lambda i: tf.argmax(
      sharded.parts[i], axis=sharded.axis, output_type=out_type) + tf.cast(
          sharded.offsets[i], out_type))
  best = tf.argmax(tf.stack(values), axis=0, output_type=tf.int32)    # the first maximum
  stacked = tf.stack(indices, axis=-1)
  return [tf.gather(stacked, best, batch_dims=rank - 1, axis=rank - 1, name=name)]
