"""How a split value's cut is settled: by its first use.

A variable created in a split scope starts cut the default way (epl.sharding.rules.split_axis).
The first rule that reads it may need it cut another way, as Megatron-LM's layers are:

* a matmul whose input is split along the contraction axis takes its weight by rows (row
  parallel: each part multiplies its slice of the input by its rows; the partial products
  are summed once);
* a gather takes an embedding by rows (vocabulary parallel: each part looks up the ids in its
  rows, the parts' lookups are summed once);
* an elementwise op whose other operands are whole takes a weight whole (a layer norm's scale
  and offset, the bias of a row-parallel dense);
* a ``tf.split`` into g pieces takes a fused projection (GPT-2's ``c_attn``, Q, K and V side by
  side) in g groups, so that each piece is split the same way over the parts.

The variable is then made again that way (epl._tf_compat.split_variables.relayout). A value
the rules built from such variables (the matmul of a column-parallel dense, its bias add, the
reshapes between) that nothing else has read yet is made again the same way: the rules that
built it are run again on the remade inputs (``Sharded.remake``). What cannot be remade is
used as it is -- gathered where the rule needs it whole -- so the cut changes what is sent
between the parts, never the values.
"""
import tensorflow.compat.v1 as tf

from epl.sharding.sharded import part_sizes, slices


def count_uses(scope, keywords, tensors):
  """A rule built its op from ``keywords``: each split value among them has one more use."""
  uses = scope.recorder.uses
  for t in {id(t): t for t in tensors(keywords)}.values():
    if scope.lookup(t) is not None or t in scope.recorder.variables:
      uses[t] = uses.get(t, 0) + 1


def remade(scope, tensor, axis, sizes, shards=None, depth=0):
  """``tensor`` made again cut along ``axis`` into ``sizes`` (part i on shard ``shards[i]``),
  or whole with ``axis`` None; None when it cannot be (something else has read it, or it
  was not built from split variables by rules that can run again). ``depth`` 0: the rule
  asking is reading ``tensor`` now (it has no use yet); deeper links have that one use."""
  if not isinstance(tensor, tf.Tensor) or tensor.consumers() or \
      scope.recorder.uses.get(tensor, 0) != (0 if depth == 0 else 1):
    return None
  again = scope.recorder.variables.get(tensor)
  if again is not None:          # epl._tf_compat.split_variables.relayout of its variable
    made = again(scope, axis, sizes, shards)
  else:
    sharded = scope.lookup(tensor)
    if sharded is None or sharded.remake is None or axis is None:
      return None
    made = sharded.remake(axis, sizes, shards, depth + 1)
  if made is not None:            # an op built later on ``tensor`` reads the new value
    scope.recorder.replaced[tensor] = made
  return made


def align(scope, tensor, axis, like):
  """``tensor``'s parts cut along ``axis`` as ``like`` is cut (its sizes and shards): its own
  parts, per-part slices of a whole value, or it remade; None when it is split otherwise
  and cannot be remade."""
  mine = scope.lookup(tensor)
  if mine is None and tensor not in scope.recorder.variables:
    return slices(scope, tensor, axis, like.sizes, like.shard_of)
  if mine is not None and mine.axis == axis and mine.sizes == like.sizes and \
      mine.shards == like.shards:
    return list(mine.parts)
  again = remade(scope, tensor, axis, like.sizes, like.shards)
  return None if again is None else list(scope.lookup(again).parts)


def whole_weights(scope, keywords, tensors):
  """``keywords`` with every split operand made whole, when each is a split variable nobody
  has used yet and some other operand is a whole tensor of rank >= 1 (a layer norm's
  ``x * g + b``); else None."""
  split = [t for t in tensors(keywords) if scope.lookup(t) is not None]
  whole = [t for t in tensors(keywords) if scope.lookup(t) is None and t.shape.rank != 0]
  if not whole or not all(t in scope.recorder.variables for t in split):
    return None
  out = {}
  for key, value in keywords.items():
    if isinstance(value, tf.Tensor) and value in split:
      value = remade(scope, value, None, None)
      if value is None:
        return None
    out[key] = value
  return out


def grouped(total, shards, groups):
  """(sizes, shards) of ``total`` slices in ``groups`` equal groups, each cut over the shards
  (over as many as it has slices, when fewer): shard i holds the i-th slice of every group."""
  size = total // groups
  one = part_sizes(size, min(shards, size))      # no empty part: fewer shards for a small one
  return one * groups, tuple(range(len(one))) * groups


def replayer(rule, scope, op_type, build, keywords, name, axis_of):
  """``Sharded.remake`` for an output ``rule`` built from ``keywords``: runs ``rule`` again
  on the split operands remade (``axis_of(operand, axis)``: the operand's axis that becomes
  the output's ``axis``; whole operands are cut by the rule as before)."""
  def remake(axis, sizes, shards, depth):
    again = {}
    for key, value in keywords.items():
      if isinstance(value, tf.Tensor) and scope.lookup(value) is not None:
        mine = axis_of(value, axis)
        value = None if mine is None else remade(scope, value, mine, sizes, shards, depth)
        if value is None:
          return None
      again[key] = value
    with tf.name_scope(None if name is None else name.rstrip("/").rsplit("/", 1)[0] + "/"):
      outputs = rule(scope, op_type, build, again, None)  # names taken: TF picks new ones
    return None if outputs is None else outputs[0]
  return remake


def from_end(value, axis, out_rank):
  """The axis of ``value`` that is ``axis`` of a rank-``out_rank`` output, counted from the
  end (elementwise ops, reshapes that keep the trailing axes)."""
  return value.shape.rank + axis - out_rank
