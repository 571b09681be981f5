"""Plan-time facts of split TaskGraphs: the part each op runs on, the tensors that cross
between replicated and split TaskGraphs, and the ops that read a split value whole (no rule
covers them: the gather fallback).

Parts: an op the split rules built for shard i (``Recorder.shard_intervals``) or a variable's
part i (``Recorder.shard_ops``) runs on the TaskGraph's i-th device; a gradient or optimizer op
follows the op it is colocated with (epl forces ``colocate_gradients_with_ops``; optimizers
colocate slots and updates with their variable), failing that its first input that has a part;
everything else (the rules' combining ops, the loss mean) runs on the first device.
"""
import bisect
import os

from epl import _tf_compat as compat
from epl.errors import PlanError
from epl.op_tables import (DATA_SOURCE_OPS, PLACEHOLDER_OPS, RANDOM_OPS, READ_OPS,
                           VARIABLE_OPS)
from epl.plan.placement import bridge
from epl.plan.gather import Gather
from epl.plan.plan import Crossing
from epl.sharding.rules import SUPPORTED

# variables epl adds that every TaskGraph reads and that hold one value in every copy (the
# dynamic loss scale: each copy updates it from the same synchronised gradients)
SHARED_PREFIXES = ("epl_amp/",)


class _Intervals:
  """Sorted, non-overlapping (first, last, value) rank intervals."""

  def __init__(self, intervals):
    self._items = sorted(intervals)
    self._starts = [iv[0] for iv in self._items]

  def __contains__(self, rank):
    return self.get(rank) is not None

  def get(self, rank):
    i = bisect.bisect_right(self._starts, rank) - 1
    if i >= 0 and self._items[i][0] <= rank <= self._items[i][1]:
      return self._items[i][2] if len(self._items[i]) > 2 else True
    return None


def _colocated_with(op):
  for group in op.colocation_groups():
    name = group.decode() if isinstance(group, bytes) else group
    if name.startswith("loc:@") and name[5:] != op.name:
      yield name[5:]


def assign_parts(ops, rank, owner, phase, recorder, split_tgs):
  """{op name: part} for the ops of split TaskGraphs whose part is not 0."""
  shard_of = _Intervals(recorder.shard_intervals)
  parts = {}                    # every op with a known part, part 0 included
  for op in ops:                                   # creation order: targets come first
    if owner.get(op) not in split_tgs:
      continue
    part = recorder.shard_ops.get(op.name)
    if part is None:
      part = shard_of.get(rank[op])
    if part is None:
      # an op sits with the op TF colocates it with (a variable part's read; an AddN of
      # the parts' gradients with the first part): TF's placer would move a group whose
      # members disagree
      part = next((parts[n] for n in _colocated_with(op) if n in parts), None)
    if part is None and phase[op] != "forward":
      # else a gradient op sits with its first input that has a part
      part = next((parts[t.op.name] for t in op.inputs if t.op.name in parts), None)
    if part is not None:
      parts[op.name] = part
  return {name: part for name, part in parts.items() if part}


def gathers(ops, rank, owner, phase, recorder, split_tgs, specs, step):
  """The forward ops of split TaskGraphs that read a split value whole -- no rule covers them
  (``Recorder.fallbacks`` says why): they run on the parts' concatenation, on the first part's
  device, and their gradient goes back through it (the gather fallback)."""
  wholes = recorder.sharded
  built_by_rule = _Intervals([(a, b, True) for a, b in recorder.rule_intervals])
  found = []
  for op in ops:
    if owner.get(op) not in split_tgs or phase[op] != "forward" or rank[op] in built_by_rule:
      continue
    read = next((t for t in op.inputs if t in wholes), None)
    if read is not None:
      found.append((op, read))
  if not found:
    return ()
  with_gradient = {name for op in ops if phase[op] != "forward"
                   for name in _colocated_with(op)}
  return tuple(Gather(
      op=op.name, op_type=op.type, tensor=t.name, taskgraph=specs[owner[op]].name,
      bytes=_bytes(t), in_step=op in step, backward=op in step and t.op.name in with_gradient,
      reason=recorder.fallbacks.get(op.name, "no split rule for %s" % op.type),
      location=user_location(op)) for op, t in found)


def refuse_gathers(found):
  """split.gather_fallback "refuse": a PlanError naming every gather the training step runs."""
  in_step = [g for g in found if g.in_step]
  if in_step:
    raise PlanError(
        "split.gather_fallback is \"refuse\" and the training step reads %d split value(s) "
        "whole:\n%s\nEach such op runs on the parts concatenated on the first part's device "
        "(correct, but the whole value is sent there%s). Write it with ops epl splits "
        "(%s), or set split.gather_fallback to \"allow\" to run it gathered (the plan lists "
        "each gather)" % (
            len(in_step), "\n".join("  %s: %s" % (g.taskgraph, g) for g in in_step),
            " and its gradient back" if any(g.backward for g in in_step) else "",
            "; ".join(SUPPORTED)))


def training_step(ops, phase):
  """The ops the training step runs: the gradients' and updates' ancestors."""
  seen, work = set(), [op for op in ops if phase.get(op, "forward") != "forward"]
  while work:
    op = work.pop()
    if op in seen:
      continue
    seen.add(op)
    work.extend(t.op for t in op.inputs)
    work.extend(op.control_inputs)
  return seen


def _bytes(tensor):
  shape = tensor.shape
  if not shape.is_fully_defined():
    return -1
  return int(shape.num_elements()) * tensor.dtype.size


def user_location(op):
  """file:line of the user's code that built ``op`` (the last frame outside TF and epl)."""
  skip = (os.sep + "tensorflow" + os.sep, os.sep + "tf_keras" + os.sep, os.sep + "keras" + os.sep,
          os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)
  for frame in reversed(list(op.traceback or ())):
    name = os.path.abspath(frame.filename)
    if not any(s in name for s in skip):
      return "%s:%d" % (os.path.basename(name), frame.lineno)
  return "<unknown>"


def _batch_inputs(ops):
  out = []
  for op in ops:
    if op.type in DATA_SOURCE_OPS or op.type in RANDOM_OPS or op.type in PLACEHOLDER_OPS:
      out.extend(t for t in op.outputs if t.shape.rank)
  return out


def batch_major(tensor, batch_inputs, within):
  """True when ``tensor``'s first dimension is the batch dimension of an input it comes from
  (an iterator's batch, a fed placeholder, a synthetic random batch)."""
  if not tensor.shape.rank:
    return False
  dim = tensor.shape.dims[0].value
  upstream, seen, work = set(), set(), [tensor.op]
  while work:
    op = work.pop()
    if op in seen or op not in within:
      continue
    seen.add(op)
    upstream.update(op.outputs)
    work.extend(i.op for i in op.inputs)
  return any(b in upstream and b.shape.dims[0].value == dim for b in batch_inputs)


def _exchange_axis(tensor, consumer, exchange_axes):
  """The batch axis of a value the MoE all-to-all exchanges (``Recorder.exchange_axes``): its
  producer or consumer is an exchange op, or (a gradient) is colocated with one; else None."""
  for op in (tensor.op, consumer):
    for name in [op.name] + list(_colocated_with(op)):
      if name in exchange_axes:
        return exchange_axes[name]
  return None


def crossings(ops, owner, phase, kinds, specs, placements, exchange_axes):
  """Every tensor that flows between a replicated and a split TaskGraph, or between
  replicated TaskGraphs with different device counts, in the forward or backward pass (the update reads every copy's synchronised values as they are), labelled
  with the collective epl.plan.placement.TRANSITIONS names for it."""
  within = set(ops)
  inputs = _batch_inputs(ops)
  out = []
  for op in ops:
    dst = owner.get(op)
    if phase[op] == "apply":       # the update reads the synchronised values of every copy
      continue
    for t in op.inputs:
      src = owner.get(t.op)
      if src is None or dst is None or src == dst or phase[t.op] == "apply" or (
          kinds[src] == kinds[dst] and
          (kinds[src] == "split" or placements[src].devices == placements[dst].devices)):
        continue
      variable = t.op if t.op.type in VARIABLE_OPS else (
          t.op.inputs[0].op if t.op.type in READ_OPS and t.op.inputs and
          t.op.inputs[0].op.type in VARIABLE_OPS else None)
      if variable is not None and variable.name.startswith(SHARED_PREFIXES):
        continue                       # every copy holds the same value: read it where it is
      if variable is not None:
        raise PlanError(
            "variable %r of TaskGraph %r is read by op %r of TaskGraph %r: a %s TaskGraph "
            "cannot use a %s TaskGraph's variables; create the variable in the TaskGraph "
            "that uses it" % (variable.name, specs[src].name, op.name, specs[dst].name,
                              kinds[dst], kinds[src]))
      backward = phase[t.op] != "forward"
      axis = _exchange_axis(t, op, exchange_axes)
      layout = "rows" if axis is None else "experts"
      # a gradient goes back through the adjoint of the forward bridge
      carrier = bridge(placements[dst], placements[src], layout).backward if backward else \
          bridge(placements[src], placements[dst], layout).forward
      gather = kinds[dst] == "split" or (
          kinds[src] == "replicate" and placements[dst].devices < placements[src].devices)
      major = axis is not None or batch_major(t, inputs, within)
      if gather and major and not backward and axis is None:
        _refuse_fixed_rows(t, op, specs[src].name, specs[dst].name,
                           placements[src].devices if kinds[dst] == "split" else
                           placements[src].devices // max(1, placements[dst].devices))
      out.append(Crossing(tensor=t.name, consumer=op.name, source=src, destination=dst,
                          gather=gather,
                          batch_major=major,
                          backward=backward, axis=axis or 0, collective=carrier))
  return tuple(out)


def _refuse_fixed_rows(tensor, consumer, source, destination, copies):
  """A batch that enters a TaskGraph from ``copies`` > 1 copies arrives as their rows
  concatenated: an op built for one copy's static batch size cannot read it."""
  rows = tensor.shape.dims[0].value if tensor.shape.rank else None
  if copies > 1 and rows is not None:
    raise PlanError(
        "%r (batch rows fixed at %d) of TaskGraph %r is read by %r of TaskGraph %r, which runs "
        "once for %d copies of %r and reads their rows concatenated (%d rows): an op built for "
        "%d rows cannot take them. Build the model from placeholders or an iterator with an "
        "unknown batch dimension ([None, ...]) and shapes taken from tf.shape, or give %r as "
        "few devices as %r" % (tensor.name, rows, source, consumer.name, destination, copies,
                               source, copies * rows, rows, source, destination))


def move_inputs_to_copies(ops, owner, kinds, counts):
  """Data sources and fed batches created in a split TaskGraph, or in a replicated one with
  fewer devices (``counts``: device_count per replicated TaskGraph) than the widest, belong to
  the first widest replicated TaskGraph: every copy reads its own batch, and the others read
  the rows of the copies they serve."""
  widest = max(counts.values(), default=0)
  replicated = [t for t, k in sorted(kinds.items()) if k == "replicate" and counts[t] == widest]
  if not replicated:
    return
  for op in ops:
    t = owner.get(op)
    narrow = kinds.get(t) == "split" or (kinds.get(t) == "replicate" and counts[t] < widest)
    if narrow and (
        op.type in DATA_SOURCE_OPS or
        (op.type in PLACEHOLDER_OPS and op.outputs[0].shape.rank != 0)):
      owner[op] = replicated[0]


def op_ranks(graph, upto):
  ops = sorted(graph.get_operations(), key=compat.op_id)[:upto]
  return ops, {op: i + 1 for i, op in enumerate(ops)}
