"""Split rules of the array ops published transformer code applies to split values.

Each acts per part when it leaves the split axis alone, and says why not otherwise (the op then
runs on the whole value: the gather fallback, listed in the plan):

* Pack / Unpack (``tf.stack`` of a key/value cache, ``tf.unstack``) along another axis;
* ConcatV2 along another axis (a cache's ``tf.concat([past, k], axis=-2)``, a whole operand
  sliced to the parts), or along the split axis when every operand is split (the parts side by
  side);
* StridedSlice and Slice that take the split axis whole (``logits[:, :-1]``,
  ``logits[:, -1, :]``, ``x[..., tf.newaxis]``, BERT's ``tf.slice(table, [0, 0], [seq, -1])``);
* ExpandDims, Squeeze, Tile (multiple 1 along the split axis), Pad / PadV2 / MirrorPad (no
  padding along it);
* TopKV2 (sampling's ``tf.nn.top_k`` over split logits): each part's top k (its indices
  offset), then the top k of those; along another axis per part;
* L2Loss (weight decay on a split weight): the parts' sums added.

Arguments come in the forms TF1 code passes them: Python lists mixing ints, numpy ints, TF
``Dimension``s and tensors, negative axes, ``-1`` sizes; what is not static is not covered.
"""
import numpy as np
import tensorflow.compat.v1 as tf

from epl.sharding import layout
from epl.sharding.sharded import NotCovered, cut, part_name, per_part


# ---- argument forms --------------------------------------------------------------------------
def static_int(value):
  """An int from a Python / numpy int, a ``Dimension`` or a static 0-d tensor; else None."""
  if isinstance(value, tf.Dimension):
    return value.value
  if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
    return int(value)
  if isinstance(value, (tf.Tensor, np.ndarray)):
    found = tf.get_static_value(value) if isinstance(value, tf.Tensor) else value
    if found is not None and np.ndim(found) == 0:
      return int(found)
  return None


def static_ints(value):
  """A list with an int or None per entry of a 1-d value (a list mixing ints, Dimensions and
  tensors, a numpy array, a tensor built from those); None when its length is not known."""
  if isinstance(value, (list, tuple)):
    return [static_int(v) for v in value]
  if isinstance(value, np.ndarray):
    return [int(v) for v in np.ravel(value)] if value.ndim == 1 else None
  if isinstance(value, tf.Tensor):
    if value.shape.rank != 1:
      return None
    found = tf.get_static_value(value, partial=True)
    if found is None:
      if value.shape.dims[0].value is None:
        return None
      return [None] * value.shape.dims[0].value
    return [None if v is None else int(v) for v in found]
  return None


def _normal(axis, rank):
  return None if axis is None or not -rank <= axis < rank else axis % rank


def _first(scope, values):
  return next((scope.lookup(v) for v in values if scope.lookup(v) is not None), None)


def _operands(scope, values, first):
  """Each of ``values`` cut like ``first`` (per part), or None."""
  out = []
  for value in values:
    pieces = cut(scope, value, first)
    if pieces is None and scope.lookup(value) is not None:
      pieces = layout.align(scope, value, scope.lookup(value).axis, first) if \
          scope.lookup(value).axis == first.axis else None
    if pieces is None:
      return None
    out.append(pieces)
  return out


def _per_part(scope, sharded, build, kw, name, **replace):
  """``build`` run per part with ``replace[key][i]`` for part i (its single output)."""
  return per_part(scope, sharded, lambda i: build(name=part_name(name, i), **dict(
      kw, **{k: v[i] for k, v in replace.items()}))[0])


# ---- rules -----------------------------------------------------------------------------------
def pack(scope, op_type, build, kw, name):
  values = list(kw["values"])
  first = _first(scope, values)
  rank = first.parts[0].shape.rank
  axis = static_int(kw.get("axis", 0))
  if rank is None or axis is None or not -rank - 1 <= axis <= rank:
    return None
  axis %= rank + 1
  operands = _operands(scope, values, first)
  if operands is None:
    raise NotCovered("the stacked values are split in different ways")
  outs = _per_part(scope, first, build, kw, name,
                   values=[[o[i] for o in operands] for i in range(len(first.parts))])
  return [scope.register(outs, first.axis + (axis <= first.axis), first.sizes, name,
                         first.shards)]


def unpack(scope, op_type, build, kw, name):
  sharded = scope.lookup(kw["value"])
  rank = sharded.parts[0].shape.rank
  axis = _normal(static_int(kw.get("axis", 0)), rank or 0)
  if axis is None:
    return None
  if axis == sharded.axis:
    raise NotCovered("unstacking along the split axis")
  outs = per_part(scope, sharded, lambda i: build(name=part_name(name, i), **dict(
      kw, value=sharded.parts[i])))
  out_axis = sharded.axis - (axis < sharded.axis)
  return [scope.register([o[j] for o in outs], out_axis, sharded.sizes,
                         None if j else name, sharded.shards) for j in range(len(outs[0]))]


def concat(scope, op_type, build, kw, name):
  values = list(kw["values"])
  first = _first(scope, values)
  rank = first.parts[0].shape.rank
  axis = _normal(static_int(kw["axis"]), rank or 0)
  if axis is None:
    return None
  if axis != first.axis:
    operands = _operands(scope, values, first)
    if operands is None:
      raise NotCovered("the concatenated values are split in different ways")
    outs = _per_part(scope, first, build, kw, name,
                     values=[[o[i] for o in operands] for i in range(len(first.parts))])
    return [scope.register(outs, first.axis, first.sizes, name, first.shards)]
  found = [scope.lookup(v) for v in values]
  if any(f is None or f.axis != axis for f in found):
    raise NotCovered("concatenating along the split axis with an operand that is not split "
                     "along it")
  parts = [p for f in found for p in f.parts]
  return [scope.register(parts, axis, [z for f in found for z in f.sizes], name,
                         [f.shard_of(i) for f in found for i in range(len(f.parts))])]


def _slice_map(rank, count, masks):
  """For each input axis of a strided slice with ``count`` spec entries: (its spec entry or
  None when an ellipsis or the implicit tail covers it, its output axis or None when shrunk);
  None for a spec TF would refuse."""
  begin, end, ellipsis, new, shrink = masks
  del begin, end
  consuming = sum(1 for i in range(count) if not (ellipsis >> i) & 1 and not (new >> i) & 1)
  out, out_axis, seen = [], 0, False
  for i in range(count):
    if (ellipsis >> i) & 1:
      if seen:
        return None
      seen = True
      for _ in range(rank - consuming):
        out.append((None, out_axis))
        out_axis += 1
    elif (new >> i) & 1:
      out_axis += 1
    elif (shrink >> i) & 1:
      out.append((i, None))
    else:
      out.append((i, out_axis))
      out_axis += 1
  while len(out) < rank:
    out.append((None, out_axis))
    out_axis += 1
  return out if len(out) == rank else None


def strided_slice(scope, op_type, build, kw, name):
  sharded = scope.lookup(kw["input"])
  rank = sharded.parts[0].shape.rank
  begin, end, strides = (static_ints(kw[k]) for k in ("begin", "end", "strides"))
  if rank is None or begin is None or end is None or strides is None:
    return None
  masks = [int(kw.get(k) or 0) for k in ("begin_mask", "end_mask", "ellipsis_mask",
                                           "new_axis_mask", "shrink_axis_mask")]
  where = _slice_map(rank, len(strides), masks)
  if where is None:
    return None
  entry, out_axis = where[sharded.axis]
  if entry is not None:
    if out_axis is None:
      raise NotCovered("an index along the split axis")
    whole_from = (masks[0] >> entry) & 1 or begin[entry] == 0
    whole_to = (masks[1] >> entry) & 1 or (end[entry] is not None and
                                            end[entry] >= sharded.total)
    if strides[entry] != 1 or not whole_from or not whole_to:
      raise NotCovered("a part of the split axis (begin %s, end %s, stride %s)" % (
          begin[entry], end[entry], strides[entry]))
  outs = _per_part(scope, sharded, build, kw, name, input=sharded.parts)
  return [scope.register(outs, out_axis, sharded.sizes, name, sharded.shards)]


def slice_(scope, op_type, build, kw, name):
  sharded = scope.lookup(kw["input"])
  begin, size = static_ints(kw["begin"]), static_ints(kw["size"])
  axis = sharded.axis
  if begin is None or size is None or len(size) <= axis:
    return None
  if begin[axis] != 0 or size[axis] not in (-1, sharded.total):
    raise NotCovered("a part of the split axis (begin %s, size %s)" % (begin[axis],
                                                                       size[axis]))
  sizes = kw["size"]
  if size[axis] != -1:                      # the whole extent: each part's own (-1)
    given = tf.convert_to_tensor(sizes)
    sizes = tf.where(tf.equal(tf.range(tf.size(given)), axis), -tf.ones_like(given), given)
  outs = per_part(scope, sharded, lambda i: build(name=part_name(name, i), **dict(
      kw, input=sharded.parts[i], size=sizes))[0])
  return [scope.register(outs, axis, sharded.sizes, name, sharded.shards)]


def expand_dims(scope, op_type, build, kw, name):
  sharded = scope.lookup(kw["input"])
  rank = sharded.parts[0].shape.rank
  axis = static_int(kw["dim"])
  if rank is None or axis is None or not -rank - 1 <= axis <= rank:
    return None
  axis %= rank + 1
  outs = _per_part(scope, sharded, build, kw, name, input=sharded.parts)
  return [scope.register(outs, sharded.axis + (axis <= sharded.axis), sharded.sizes, name,
                         sharded.shards)]


def squeeze(scope, op_type, build, kw, name):
  sharded = scope.lookup(kw["input"])
  whole = kw["input"].shape
  if whole.rank is None:
    return None
  axes = [static_int(a) for a in (kw.get("squeeze_dims") or [])]
  if any(a is None for a in axes):
    return None
  if axes:
    axes = sorted({a % whole.rank for a in axes})
  else:                             # the whole value's 1s (a part may hold one slice)
    axes = [a for a, d in enumerate(whole.as_list()) if d == 1]
    if len(axes) != sum(1 for d in whole.as_list() if d in (1, None)):
      raise NotCovered("tf.squeeze without axes of a value whose shape is not static")
  if sharded.axis in axes:
    raise NotCovered("squeezing the split axis")
  outs = per_part(scope, sharded, lambda i: build(name=part_name(name, i), **dict(
      kw, input=sharded.parts[i], squeeze_dims=axes))[0])
  return [scope.register(outs, sharded.axis - sum(1 for a in axes if a < sharded.axis),
                         sharded.sizes, name, sharded.shards)]


def tile(scope, op_type, build, kw, name):
  sharded = scope.lookup(kw["input"])
  multiples = static_ints(kw["multiples"])
  if multiples is None or len(multiples) <= sharded.axis:
    return None
  if multiples[sharded.axis] != 1:
    raise NotCovered("tiling along the split axis (multiple %s)" % multiples[sharded.axis])
  outs = _per_part(scope, sharded, build, kw, name, input=sharded.parts)
  return [scope.register(outs, sharded.axis, sharded.sizes, name, sharded.shards)]


def pad(scope, op_type, build, kw, name):
  sharded = scope.lookup(kw["input"])
  if any(scope.lookup(t) is not None for k, t in kw.items() if k != "input"):
    return None
  paddings = tf.get_static_value(tf.convert_to_tensor(kw["paddings"]))
  if paddings is None or np.ndim(paddings) != 2 or len(paddings) <= sharded.axis:
    raise NotCovered("paddings that are not static")
  if any(int(p) for p in paddings[sharded.axis]):
    raise NotCovered("padding along the split axis")
  outs = _per_part(scope, sharded, build, kw, name, input=sharded.parts)
  return [scope.register(outs, sharded.axis, sharded.sizes, name, sharded.shards)]


def top_k(scope, op_type, build, kw, name):
  sharded = scope.lookup(kw["input"])
  rank = sharded.parts[0].shape.rank
  k = static_int(kw["k"])
  if rank is None or k is None or scope.lookup(kw["k"]) is not None:
    return None
  if sharded.axis != rank - 1:                    # rows of another axis: per part
    outs = per_part(scope, sharded, lambda i: build(name=part_name(name, i), **dict(
        kw, input=sharded.parts[i])))
    return [scope.register([o[j] for o in outs], sharded.axis, sharded.sizes,
                           None if j else name, sharded.shards) for j in range(2)]
  if kw.get("sorted") is False:
    raise NotCovered("tf.nn.top_k(sorted=False) over the split axis")
  values, indices = [], []
  for i, (part, size, offset) in enumerate(zip(sharded.parts, sharded.sizes,
                                               sharded.offsets)):
    with scope.shard(sharded.shard_of(i)):
      v, ix = build(name=part_name(name, i), **dict(kw, input=part, k=min(k, size)))
      values.append(v)
      indices.append(ix + tf.cast(offset, ix.dtype))
  # the parts' candidates in the whole value's order: among equal values the lower index
  # comes first, as TF's own top_k orders them
  best_values, at = build(name=name, **dict(kw, input=tf.concat(values, -1), k=k))
  best = tf.gather(tf.concat(indices, -1), at, axis=rank - 1, batch_dims=rank - 1)
  return [best_values, best]


def l2_loss(scope, op_type, build, kw, name):
  sharded = scope.lookup(kw["t"])
  outs = _per_part(scope, sharded, build, kw, name, t=sharded.parts)
  return [tf.add_n(outs, name=name)]


RULES = {"Pack": pack, "Unpack": unpack, "ConcatV2": concat, "StridedSlice": strided_slice,
         "Slice": slice_, "ExpandDims": expand_dims, "Squeeze": squeeze, "Tile": tile,
         "Pad": pad, "PadV2": pad, "MirrorPad": pad, "TopKV2": top_k, "L2Loss": l2_loss}

SUPPORTED = ("tf.stack / tf.unstack / tf.concat along an axis that is not split (a key/value "
             "cache), tf.concat of split values along it",
             "slices taking the split axis whole (x[:, :-1], x[:, -1, :], tf.slice(.., [0, 0], "
             "[n, -1]))", "tf.expand_dims / tf.squeeze / tf.tile / tf.pad",
             "tf.nn.top_k (sampling)", "tf.nn.l2_loss")
