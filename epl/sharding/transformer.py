"""Split rules of a transformer block, Megatron-LM's pattern (see epl.sharding.rules for the
table and epl.sharding.layout for how a weight's cut follows from its use):

* MatMul: column parallel when the input is whole (each part multiplies it by its columns of
  the weight; the output is split along its columns), row parallel when the input is split
  along the contraction axis (each part multiplies its slice by its rows; the partial
  products are summed: one all-reduce). ``transpose_b`` (tied logits ``h @ wte^T``) takes the
  weight's rows as the output's columns.
* BatchMatMul (attention's ``q @ k^T`` and ``w @ v``): per part when both operands are split
  along the same batch axis (the heads); split along a matrix axis (heads folded into the batch
  axis, each head's features split), per part, summed over the contraction axis.
* Transpose: per part, the split axis moves with the permutation.
* Split: a fused projection (Q, K, V side by side) is cut in groups so that every piece is
  split over the parts (epl.sharding.layout); a split along another axis runs per part.
* GatherV2 (embedding lookup): vocabulary parallel -- each part looks up the ids in its rows
  (the others give zeros) and the parts' lookups are summed.
* Reshape between ``[..., h * d]`` and ``[..., h, d]`` (splitting and merging the heads) keeps
  the heads split when every part holds whole heads.
"""
import numpy as np
import tensorflow.compat.v1 as tf

from epl.sharding import layout
from epl.sharding.sharded import NotCovered, part_name, part_sizes, per_part


def matmul(scope, op_type, build, kw, name):
  a, b = kw["a"], kw["b"]
  sa, sb = scope.lookup(a), scope.lookup(b)
  contract_a = 0 if kw.get("transpose_a") else 1
  contract_b, out_b = (1, 0) if kw.get("transpose_b") else (0, 1)
  if sa is not None and sa.axis == contract_a:           # row parallel
    pieces = layout.align(scope, b, contract_b, sa)
    if pieces is not None:
      outs = per_part(scope, sa, lambda i: build(name=part_name(name, i), **dict(
          kw, a=sa.parts[i], b=pieces[i]))[0])
      total = tf.add_n(outs, name=name)
      scope.recorder.reductions.append((scope.taskgraph, "forward", total.op.name))
      return [total]
  if sb is None:
    return None
  if sb.axis != out_b:
    again = layout.remade(scope, b, out_b, part_sizes(b.shape.dims[out_b].value,
                                                        min(scope.n, b.shape.dims[out_b].value)))
    if again is None:
      return None
    kw, sb = dict(kw, b=again), scope.lookup(again)
  outs = per_part(scope, sb, lambda i: build(name=part_name(name, i), **dict(
      kw, b=sb.parts[i]))[0])               # column parallel (a whole: sent to every part)
  if sa is None:                            # a's gradient: the parts' summed
    scope.recorder.reductions.append((scope.taskgraph, "backward", outs[0].op.name))
  remake = layout.replayer(matmul, scope, op_type, build, kw, name,
                           lambda t, axis: out_b if t is kw["b"] and axis == 1 else None)
  return [scope.register(outs, 1, sb.sizes, name, sb.shards, remake)]


def batch_matmul(scope, op_type, build, kw, name):
  x, y = kw["x"], kw["y"]
  lead = scope.lookup(x) or scope.lookup(y)
  rank = max(x.shape.rank or 0, y.shape.rank or 0)
  axis = layout.from_end(lead.parts[0], lead.axis, rank) if lead else None
  if lead is None or x.shape.rank != rank or y.shape.rank != rank:
    return None
  if axis >= rank - 2:
    return _matrix_axes(scope, build, kw, name, rank)
  operands = [_batch_operand(scope, t, axis, lead) for t in (x, y)]
  if any(o is None for o in operands):
    return None
  outs = per_part(scope, lead, lambda i: build(name=part_name(name, i), **dict(
      kw, x=operands[0][i], y=operands[1][i]))[0])
  return [scope.register(outs, axis, lead.sizes, name, lead.shards)]


def _matrix_axes(scope, build, kw, name, rank):
  """A batched matmul split along a matrix axis (heads folded into the batch axis, each head's
  features split: ``Q_ @ K_^T`` and ``P @ V_``): split along the contraction axis, each part's
  product, summed (one all-reduce); along a row or column axis of one operand (the other
  whole), per part, the output split along it."""
  x, y = kw["x"], kw["y"]
  sx, sy = scope.lookup(x), scope.lookup(y)
  contract_x = rank - 2 if kw.get("adj_x") else rank - 1
  contract_y = rank - 1 if kw.get("adj_y") else rank - 2
  if (sx is not None and sx.axis == contract_x) or (sx is None and sy.axis == contract_y):
    lead = sx or sy
    other = layout.align(scope, y, contract_y, lead) if sx is not None else \
        layout.align(scope, x, contract_x, lead)
    if other is None:
      return None
    xs, ys = (lead.parts, other) if sx is not None else (other, lead.parts)
    outs = per_part(scope, lead, lambda i: build(name=part_name(name, i), **dict(
        kw, x=xs[i], y=ys[i]))[0])
    total = tf.add_n(outs, name=name)
    scope.recorder.reductions.append((scope.taskgraph, "forward", total.op.name))
    return [total]
  if sx is not None and sy is None and sx.axis == 2 * rank - 3 - contract_x:    # x's rows
    out_axis, lead, key = rank - 2, sx, "x"
  elif sy is not None and sx is None and sy.axis == 2 * rank - 3 - contract_y:  # y's columns
    out_axis, lead, key = rank - 1, sy, "y"
  else:
    return None
  outs = per_part(scope, lead, lambda i: build(name=part_name(name, i), **dict(
      kw, **{key: lead.parts[i]}))[0])
  scope.recorder.reductions.append((scope.taskgraph, "backward", outs[0].op.name))
  return [scope.register(outs, out_axis, lead.sizes, name, lead.shards)]


def _batch_operand(scope, tensor, axis, lead):
  if tensor.shape.dims[axis].value == 1 and scope.lookup(tensor) is None:
    return [tensor] * len(lead.parts)        # broadcast along the split axis
  return layout.align(scope, tensor, axis, lead)


def transpose(scope, op_type, build, kw, name):
  sharded = scope.lookup(kw["x"])
  perm = tf.get_static_value(kw["perm"])
  if sharded is None or perm is None:
    return None
  perm = [int(p) for p in np.ravel(perm)]
  outs = per_part(scope, sharded, lambda i: build(name=part_name(name, i), **dict(
      kw, x=sharded.parts[i]))[0])
  return [scope.register(outs, perm.index(sharded.axis), sharded.sizes, name, sharded.shards)]


def split(scope, op_type, build, kw, name):
  value, count = kw["value"], kw["num_split"]
  sharded = scope.lookup(value)
  dim = tf.get_static_value(kw["split_dim"])
  rank = value.shape.rank
  if sharded is None or dim is None or rank is None:
    return None
  if int(dim) % rank != sharded.axis:                    # along another axis: per part
    outs = per_part(scope, sharded, lambda i: build(name=part_name(name, i), **dict(
        kw, value=sharded.parts[i])))
    return [scope.register([o[j] for o in outs], sharded.axis, sharded.sizes,
                           None if j else name, sharded.shards) for j in range(count)]
  if sharded.total % count:
    return None
  if not _aligned(sharded, count):
    sizes, shards = layout.grouped(sharded.total, scope.n, count)
    again = layout.remade(scope, value, sharded.axis, sizes, shards)
    if again is None:
      return None
    sharded = scope.lookup(again)
  per = len(sharded.parts) // count
  return [scope.register(sharded.parts[j * per:(j + 1) * per], sharded.axis,
                         sharded.sizes[j * per:(j + 1) * per], None if j else name,
                         sharded.shards[j * per:(j + 1) * per] if sharded.shards else None)
          for j in range(count)]


def _aligned(sharded, count):
  """True when each of ``count`` equal pieces is a run of parts on distinct shards."""
  if len(sharded.parts) % count:
    return False
  per = len(sharded.parts) // count
  piece = sharded.total // count
  for j in range(count):
    run = range(j * per, (j + 1) * per)
    if sum(sharded.sizes[i] for i in run) != piece or \
        len({sharded.shard_of(i) for i in run}) != per:
      return False
  return True


def gather(scope, op_type, build, kw, name):
  params, indices = kw["params"], kw["indices"]
  sharded = scope.lookup(params)
  axis = tf.get_static_value(kw["axis"])
  if sharded is None or axis is None or kw.get("batch_dims") or \
      scope.lookup(indices) is not None:
    return None
  axis = int(axis) % params.shape.rank
  if sharded.axis != axis:
    rows = params.shape.dims[axis].value
    again = layout.remade(scope, params, axis, part_sizes(rows, min(scope.n, rows)))
    if again is None:                       # another axis, settled: per part
      outs = per_part(scope, sharded, lambda i: build(name=part_name(name, i), **dict(
          kw, params=sharded.parts[i]))[0])
      out_axis = sharded.axis + (indices.shape.rank - 1 if sharded.axis > axis else 0)
      return [scope.register(outs, out_axis, sharded.sizes, name, sharded.shards)]
    sharded = scope.lookup(again)

  def lookup(i):                            # vocabulary parallel
    local = tf.cast(indices, tf.int64) - sharded.offsets[i]
    inside = tf.logical_and(local >= 0, local < sharded.sizes[i])
    found = build(name=part_name(name, i), **dict(
        kw, params=sharded.parts[i], indices=tf.where(inside, local, tf.zeros_like(local))))[0]
    mask = tf.cast(inside, found.dtype)
    for _ in range(params.shape.rank - 1):
      mask = tf.expand_dims(mask, -1)
    return found * mask
  total = tf.add_n(per_part(scope, sharded, lookup), name=name)
  scope.recorder.reductions.append((scope.taskgraph, "forward", total.op.name))
  return [total]


def reshape_heads(scope, build, sharded, shape, rank, name):
  """``[..., h * d]`` <-> ``[..., h, d]`` with whole heads in every part, or None."""
  target = tf.get_static_value(shape, partial=True)
  source = sharded.parts[0].shape.rank
  if target is None or len(target) != rank:
    return None
  inner = sharded.parts[0].shape.dims[-1].value
  heads = target[-2] is not None and target[-1] is not None and target[-1] > 0 and \
      int(target[-2]) * int(target[-1]) == sharded.total
  if sharded.axis == source - 1 and rank == source + 1 and heads and \
      any(s % int(target[-1]) for s in sharded.sizes):
    raise NotCovered(
        "a value split over %d parts into %d heads of %d: every part must hold whole heads; "
        "give epl.split a device_count that divides %d (or use a multiple of it as the "
        "number of heads)" % (len(set(sharded.shards or range(len(sharded.parts)))),
                              int(target[-2]), int(target[-1]), int(target[-2])))
  if sharded.axis == source - 1 and rank == source + 1 and target[-1] is not None and \
      target[-1] > 0 and all(s % int(target[-1]) == 0 for s in sharded.sizes):
    d = int(target[-1])
    if target[-2] is not None and int(target[-2]) * d != sharded.total:
      return None
    sizes = [s // d for s in sharded.sizes]
    tails = [[s, d] for s in sizes]
    axis = rank - 2
  elif sharded.axis == source - 2 and rank == source - 1 and inner is not None and \
      target[-1] is not None and int(target[-1]) == sharded.total * inner:
    sizes = [s * inner for s in sharded.sizes]
    tails = [[s] for s in sizes]
    axis = rank - 1
  else:
    return None
  keep = rank - len(tails[0])
  outs = per_part(scope, sharded, lambda i: build(
      tensor=sharded.parts[i], name=part_name(name, i),
      shape=tf.concat([shape[:keep], tf.constant(tails[i], shape.dtype)], 0))[0])
  return [scope.register(outs, axis, sizes, name, sharded.shards)]
