"""AMP O1's conversion: low-precision twins of the listed ops, with casts at the edges.

Which ops convert (``choose``), in creation order: an ``allow`` op always, an ``infer`` op when
one of its float inputs comes from an op that converted; only float32 ops of the forward and
backward passes, outside ``tf.cond`` / ``tf.while_loop`` bodies (their frames stay float32) and
without ref inputs. The update (clipping, the optimizer) is never touched.

An infer op fed (through infer ops) by a deny op stays float32.

How (``convert``): the chosen ops are cloned once (epl's clone engine) with every float32 type
attribute switched to the low precision, under ``epl_amp/``. Inputs from outside the set get a
cast: a weight (a variable read) gets its own cast for every op that uses it, made just before
that use, so no low-precision copy of a weight lives longer than the op that reads it (nor
persists between steps); any other tensor gets one shared cast. Every consumer outside the set
of a converted op's output -- softmax, the loss, the optimizer, a ``tf.cond`` -- reads a cast
back to float32 instead. The user's original ops stay in the graph, untouched and orphaned: a
fetch of one of them (``logits``) still computes it in float32.
"""
import dataclasses
import logging
from collections import Counter
from typing import Dict, Tuple

import tensorflow.compat.v1 as tf
from tensorflow.core.framework import types_pb2

from epl import _tf_compat as compat
from epl.amp.lists import kind as list_kind
from epl.passes.clone import clone_ops, rewire

log = logging.getLogger("epl")
PREFIX = "epl_amp"


@dataclasses.dataclass(frozen=True)
class Conversion:
  """What ``convert`` did: counts by op type, and the float32 tensor that now stands for each
  output of a converted op (its twin's output cast back)."""
  counts: Dict[str, int]
  twins: Dict[str, str]                  # converted op name -> its low-precision twin's name
  substitutes: Dict[tf.Tensor, tf.Tensor]
  weight_casts: Tuple[str, ...]          # names of the per-use casts of weights

  @property
  def total(self):
    return sum(self.counts.values())


def _is_weight(tensor):
  """A variable read: ``ReadVariableOp`` or the ``Identity`` of a ref variable."""
  op = tensor.op
  return op.type == "ReadVariableOp" or (
      op.type == "Identity" and bool(op.inputs) and op.inputs[0].dtype._is_ref_dtype)  # pylint: disable=protected-access


def _float_inputs(op):
  return [t for t in op.inputs if t.dtype == tf.float32]


def _convertible(op, phase):
  if phase.get(op) not in ("forward", "backward") or compat.in_control_flow(op):
    return False
  if any(t.dtype._is_ref_dtype for t in op.inputs):  # pylint: disable=protected-access
    return False
  has_float = any(t.dtype == tf.float32 for t in list(op.inputs) + list(op.outputs))
  others = any(t.dtype.is_floating and t.dtype != tf.float32
               for t in list(op.inputs) + list(op.outputs))
  return has_float and not others


def choose(ops, phase, debug=False):
  """The ops to convert, in creation order (``ops`` must be in creation order).

  An infer op that reads (through other infer ops) the output of a deny op stays float32: the
  layer norm's ``(h - mean) * rsqrt(var)`` and softmax's gradient ``g - sum(g * softmax)``
  subtract nearly equal numbers, which float16 would turn into noise.
  """
  chosen = []
  members, denied = set(), set()
  for op in ops:
    kind = list_kind(op.type)
    if kind == "deny":
      denied.add(op)
      continue
    if kind not in ("allow", "infer"):
      continue
    floats = _float_inputs(op)
    if kind == "infer" and any(t.op in denied for t in floats):
      denied.add(op)
      continue
    if not _convertible(op, phase):
      if debug and kind == "allow":
        log.info("amp: keeps %s (%s) in float32: %s", op.name, op.type,
                 "inside control flow" if compat.in_control_flow(op) else
                 "in the update" if phase.get(op) == "apply" else "not a float32 op")
      continue
    if kind == "allow" or any(t.op in members for t in floats):
      chosen.append(op)
      members.add(op)
  return chosen


def _switch_types(low):
  low_enum = low.as_datatype_enum

  def edit(op, node):
    for attr in node.attr.values():
      if attr.type == types_pb2.DT_FLOAT:
        attr.type = low_enum
      if attr.HasField("list") and types_pb2.DT_FLOAT in attr.list.type:
        kinds = [low_enum if t == types_pb2.DT_FLOAT else t for t in attr.list.type]
        del attr.list.type[:]
        attr.list.type.extend(kinds)
  return edit


def convert(graph, ops, phase, recorder, low, debug=False):
  """Converts the chosen ops of ``ops`` (creation order) to ``low``; returns a Conversion.

  Registers every op it builds in ``recorder.twins`` (TaskGraph and phase of the op it was
  built for) and points ``recorder.gradients`` / ``grads_and_vars`` at the float32 tensors.
  """
  chosen = choose(ops, phase, debug)
  if not chosen:
    return Conversion({}, {}, {}, ())
  members = set(chosen)
  twins = recorder.twins
  with graph.as_default(), tf.name_scope(None), tf.control_dependencies(None):
    input_map, per_use = _input_casts(chosen, members, low, twins)
    clones = clone_ops(graph, chosen, PREFIX, lambda op: op.device, input_map,
                       edit=_switch_types(low))
    weight_casts = _weight_casts(per_use, clones, input_map, low, twins)
    substitutes = {}
    for op in chosen:
      twin = clones[op.name]
      twins[twin.name] = op.name
      for out, new in zip(op.outputs, twin.outputs):
        if out.dtype != tf.float32:
          continue
        outside = [c for c in out.consumers() if c not in members]
        if not outside:
          continue
        substitutes[out] = _back(new, op, twins)
        rewire(out, substitutes[out], outside)
      for user in list(compat.control_outputs(op)):
        compat.replace_control_inputs(user, {op: twin})
  _repoint_gradients(graph, recorder, chosen, clones, substitutes, twins)
  counts = dict(Counter(op.type for op in chosen))
  if debug:
    for op in chosen:
      log.info("amp: %s (%s) runs in %s as %s", op.name, op.type, low.name,
               clones[op.name].name)
  return Conversion(counts, {op.name: clones[op.name].name for op in chosen}, substitutes,
                    tuple(weight_casts))


def _input_casts(chosen, members, low, twins):
  """({float32 input from outside the chosen ops: its cast to ``low``}, [(op, input index,
  weight)] of the weights they read)."""
  input_map, per_use = {}, []
  for op in chosen:
    for index, t in enumerate(op.inputs):
      if t.dtype != tf.float32 or t.op in members:
        continue
      if _is_weight(t):
        per_use.append((op, index, t))
      if t not in input_map:
        with tf.device(op.device):
          cast = tf.cast(t, low, name="%s/cast/%s_%d" % (PREFIX, t.op.name, t.value_index))
        twins[cast.op.name] = (op if _is_weight(t) else t.op).name
        input_map[t] = cast
  return input_map, per_use


def _weight_casts(per_use, clones, input_map, low, twins):
  """A weight gets one cast per use, made just before it (the first use keeps the shared
  one); returns the casts' names."""
  names, first_use = [], {}
  for op, index, t in per_use:
    twin = clones[op.name]
    if t not in first_use:
      first_use[t] = op
      names.append(input_map[t].op.name)
      continue
    with tf.device(op.device):
      cast = tf.cast(t, low, name="%s/cast/%s_%d" % (PREFIX, t.op.name, t.value_index))
    twins[cast.op.name] = op.name
    names.append(cast.op.name)
    compat.update_input(twin, index, cast)
  return names


def _back(low_tensor, op, twins):
  with tf.device(op.device):
    cast = tf.cast(low_tensor, tf.float32, name="%s/float32/%s_%d" % (
        PREFIX, op.name, low_tensor.value_index))
  twins[cast.op.name] = op.name
  return cast


def _repoint_gradients(graph, recorder, chosen, clones, substitutes, twins):
  """Raw gradients that a converted op computes become their float32 casts."""
  members = set(chosen)

  def fp32(t):
    if t is None or t.op not in members or t.dtype != tf.float32:
      return t
    if t not in substitutes:
      substitutes[t] = _back(clones[t.op.name].outputs[t.value_index], t.op, twins)
    return substitutes[t]

  def grad(g):
    if isinstance(g, tf.IndexedSlices):
      values = fp32(g.values)
      return g if values is g.values else tf.IndexedSlices(values, g.indices, g.dense_shape)
    return fp32(g)

  with graph.as_default(), tf.name_scope(None), tf.control_dependencies(None):
    recorder.gradients[:] = [(grad(g), v) for g, v in recorder.gradients]
    recorder.grads_and_vars[:] = [(grad(g), v) for g, v in recorder.grads_and_vars]
