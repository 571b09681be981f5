"""Sharded values: what ``epl.split`` rules hand each other.

A rule that produces a value split over the scope's shards (a column-parallel dense layer's
logits, an expert layer's activations) returns an ordinary tensor -- the concatenation of the
parts -- and registers a ``Sharded`` for it. The next rule looks the tensor up and works on the
parts, so the concatenation never runs unless something outside the rules (a fetch, another
TaskGraph) reads the whole value.
"""
import contextlib
import dataclasses
import threading
from typing import Tuple

import tensorflow.compat.v1 as tf


@dataclasses.dataclass(frozen=True)
class Sharded:
  """``parts[i]`` (on shard ``shards[i]``, default i) holds ``sizes[i]`` consecutive slices
  of the whole along ``axis`` (non-negative), in order. A value grouped for a later
  ``tf.split`` (a fused Q/K/V projection) has several parts per shard.

  ``remake(sizes, shards)``: the same value cut another way along ``axis``, built again
  from its weights (epl.sharding.layout), or None when it cannot be."""
  parts: Tuple[tf.Tensor, ...]
  axis: int
  sizes: Tuple[int, ...]
  taskgraph: int = None           # index of the split TaskGraph whose rules made it
  shards: Tuple[int, ...] = None
  remake: object = None

  def shard_of(self, i):
    return self.shards[i] if self.shards else i

  @property
  def offsets(self):
    out, total = [], 0
    for size in self.sizes:
      out.append(total)
      total += size
    return tuple(out)

  @property
  def total(self):
    return sum(self.sizes)


def part_sizes(total, shards):
  """How ``total`` slices split over ``shards`` (the first ones take the remainder), as
  ``tf.fixed_size_partitioner`` splits a variable."""
  return tuple(total // shards + (1 if i < total % shards else 0) for i in range(shards))


def parts_of_variable(var):
  """The parts of a partitioned variable (its list), or None for an ordinary one."""
  if hasattr(var, "_get_variable_list"):
    return list(var._get_variable_list())  # pylint: disable=protected-access
  return None


def variable_axis(var):
  """The axis a PartitionedVariable is split along."""
  parts = parts_of_variable(var)
  full = var.get_shape().as_list()
  for axis, dim in enumerate(full):
    if parts and parts[0].get_shape().as_list()[axis] != dim:
      return axis
  return 0


class NotCovered(Exception):
  """Raised by a rule for arguments it does not cover, with the reason (the op is then built
  on the whole values: the gather fallback, listed in the plan)."""


_active = threading.local()


class SplitScope:
  """The open split scope: its shard count and where its rules record what they build."""

  def __init__(self, shards, recorder, taskgraph=None, rank_of=None):
    self.n = shards
    self.recorder = recorder
    self.taskgraph = taskgraph      # the split TaskGraph's index
    self.rank_of = rank_of          # op -> its creation rank (the recorder's positions)

  @contextlib.contextmanager
  def shard(self, index):
    """Ops built inside belong to shard ``index`` (placed on the scope's index-th device)."""
    first = self.recorder.graph.version + 1
    yield
    self.recorder.add_shard_interval(first, self.recorder.graph.version, index)

  def lookup(self, tensor):
    return self.recorder.sharded.get(tensor) if isinstance(tensor, tf.Tensor) else None

  def register(self, parts, axis, sizes, name=None, shards=None, remake=None):
    """The whole value of ``parts`` (their concatenation) as a sharded tensor: the
    concatenation only runs if something outside the rules (a fetch, another TaskGraph)
    reads the whole value."""
    whole = tf.concat(list(parts), axis=axis, name=name or "epl_sharded")
    shards = tuple(shards) if shards and tuple(shards) != tuple(range(len(parts))) else None
    self.recorder.sharded[whole] = Sharded(tuple(parts), axis, tuple(sizes), self.taskgraph,
                                           shards, remake)
    return whole


def in_rule():
  """True while a rule builds its ops (they are built as usual)."""
  return getattr(_active, "depth", 0) > 0


def enter_rule():
  _active.depth = getattr(_active, "depth", 0) + 1


def exit_rule():
  _active.depth -= 1


# ---- cutting values like a sharded one ----------------------------------------------------
def part_name(name, i):
  """The name of part i of an op named ``name`` (a name ending in "/" is a full scope name,
  as ``tf.matmul`` passes it)."""
  if not name:
    return None
  if name.endswith("/"):
    return "%s_part%d/" % (name[:-1], i)
  return "%s_part%d" % (name, i)


def axis_from_end(sharded):
  return sharded.axis - sharded.parts[0].shape.rank


def cut(scope, tensor, sharded):
  """``tensor`` cut like ``sharded`` (its axis counted from the end): its own parts if it is
  sharded the same way, per-shard slices if it has that axis whole, itself (broadcast) if it
  lacks the axis or has size 1 there; None when it cannot be cut."""
  if not isinstance(tensor, tf.Tensor):
    return [tensor] * len(sharded.parts)
  mine = scope.lookup(tensor)
  from_end = axis_from_end(sharded)
  if mine is not None:
    if mine.sizes == sharded.sizes and axis_from_end(mine) == from_end and \
        mine.shards == sharded.shards:
      return list(mine.parts)
    return None
  rank = tensor.shape.rank
  if rank is None:
    return None
  if rank < -from_end:
    return [tensor] * len(sharded.parts)
  dim = tensor.shape.dims[rank + from_end].value
  if dim == 1:
    return [tensor] * len(sharded.parts)
  if dim is not None and dim != sharded.total:       # unknown: sliced (a mismatch fails loudly)
    return None
  return slices(scope, tensor, rank + from_end, sharded.sizes, sharded.shard_of)


def slices(scope, tensor, axis, sizes, shard_of=lambda i: i):
  """Per-shard slices of a whole tensor along ``axis``, each cut on its shard's device (the
  whole value is sent to every shard, like an all-gather; its gradient comes back per shard)."""
  out, offset = [], 0
  for i, size in enumerate(sizes):
    with scope.shard(shard_of(i)):
      begin = [0] * tensor.shape.rank
      begin[axis] = offset
      extent = [-1] * tensor.shape.rank
      extent[axis] = size
      out.append(tf.slice(tensor, begin, extent))
    offset += size
  return out


def per_part(scope, sharded, fn):
  outs = []
  for i in range(len(sharded.parts)):
    with scope.shard(sharded.shard_of(i)):
      outs.append(fn(i))
  return outs
