"""AMP loss scaling (float16): gradients of ``loss x S``, divided by ``S`` before the user's
clipping and the optimizer see them.

The scaling multiplies the seed of every ``tf.gradients`` call (its default ``grad_ys``, the
ones the backward pass starts from) by ``S``, and each raw gradient by ``1/S`` where the user's
code reads it. epl's gradient synchronisation all-reduces (and accumulates) the raw gradients,
so the unscaled ones every copy sees are the same.

``amp.loss_scale`` a number: ``S`` is that constant; nothing is skipped.
``amp.loss_scale: "dynamic"``: ``S`` is a variable (``epl_amp/loss_scale``, saved in
checkpoints) starting at 2^15. Each training step checks the unscaled gradients:
  * any inf/nan: the update is skipped -- every variable write of the update (weights,
    optimizer slots, ``global_step``) waits on a gate that is a dead tensor on such a step, so
    TensorFlow runs none of them nor anything after them -- and ``S`` halves (not below 1);
  * 2000 good steps in a row: ``S`` doubles.
The scale's own update runs in every step the update is fetched in.
"""
import dataclasses
import re
from typing import Optional, Tuple

import tensorflow.compat.v1 as tf
from tensorflow.python.ops import control_flow_ops, resource_variable_ops

from epl import _tf_compat as compat
from epl.errors import PlanError
from epl.op_tables import ASSIGN_OPS

INITIAL_SCALE = 2.0 ** 15
GROWTH_INTERVAL = 2000
PREFIX = "epl_amp"
_SEED = re.compile(r"(^|/)grad_ys_\d+$")
_WRITERS = ("Apply", "ResourceApply", "SparseApply", "ResourceSparseApply", "Scatter",
            "ResourceScatter")


@dataclasses.dataclass(frozen=True)
class LossScaling:
  dynamic: bool
  fixed: Optional[float]              # the constant scale (not dynamic)
  scale: Optional[str]                # the scale variable's name (dynamic)
  good_steps: Optional[str]           # its counter of good steps in a row
  seeds: Tuple[str, ...]              # the grad_ys ops multiplied by the scale
  gated: Tuple[str, ...]              # update ops skipped on a step with inf/nan


def _writes_variable(op):
  return (op.type in ASSIGN_OPS or op.type.startswith(_WRITERS) or
          any(arg.is_ref for arg in op.op_def.input_arg))


def _new_ops(graph, since):
  return graph.get_operations()[since:]


def _twin_all(graph, since, twins, original):
  for op in _new_ops(graph, since):
    twins.setdefault(op.name, original.name)


def _seeds(graph, phase):
  return [op for op in graph.get_operations()
          if phase.get(op) == "backward" and _SEED.search(op.name) and
          op.outputs and op.outputs[0].dtype == tf.float32]


def add_loss_scaling(graph, recorder, phase, loss_scale):
  """Scales the seeds and unscales the raw gradients; gates the update when dynamic."""
  seeds = _seeds(graph, phase)
  grads = [(g, v) for g, v in recorder.gradients
           if (g.values if isinstance(g, tf.IndexedSlices) else g).dtype == tf.float32]
  if not grads:
    return None
  if not seeds:
    raise PlanError(
        "amp.loss_scale: the gradients were not computed from a loss by tf.gradients / "
        "compute_gradients with their default grad_ys, so epl cannot scale the loss; pass no "
        "grad_ys, or use amp.dtype 'bfloat16' (no loss scaling)")
  twins = recorder.twins
  dynamic = loss_scale == "dynamic"
  anchor = grads[0][1]                 # the first trained variable: scale lives beside it
  with graph.as_default(), tf.name_scope(None), tf.control_dependencies(None):
    since = len(graph.get_operations())
    if dynamic:
      scale_var = resource_variable_ops.ResourceVariable(
          INITIAL_SCALE, trainable=False, name=PREFIX + "/loss_scale", dtype=tf.float32)
      good_var = resource_variable_ops.ResourceVariable(
          0, trainable=False, name=PREFIX + "/good_steps", dtype=tf.int64)
      _twin_all(graph, since, twins, anchor)
      _add_to_init_groups(graph, [scale_var.initializer, good_var.initializer])
      scale = scale_var.read_value
      inverse = lambda: tf.math.reciprocal(scale_var.read_value(), name=PREFIX + "/inverse")
    else:
      scale = lambda: tf.constant(float(loss_scale))
      inverse = lambda: tf.constant(1.0 / float(loss_scale), name=PREFIX + "/inverse")
    _scale_seeds(graph, seeds, scale, twins)
    unscaled = _unscale(grads, inverse(), phase)
    if not dynamic:
      return LossScaling(False, float(loss_scale), None, None,
                         tuple(s.name for s in seeds), ())
    gate, update = _dynamic_update(scale_var, good_var, unscaled)
  gated = _gate_updates(graph, phase, [gate.op, update])
  return LossScaling(True, None, scale_var.op.name, good_var.op.name,
                     tuple(s.name for s in seeds), tuple(sorted(op.name for op in gated)))


def _scale_seeds(graph, seeds, scale, twins):
  """Every consumer of a gradient seed reads it times ``scale()``."""
  for seed in seeds:
    since = len(graph.get_operations())
    seed_out = seed.outputs[0]
    scaled = tf.multiply(seed_out, scale(), name=PREFIX + "/scaled_" + seed.name.replace(
        "/", "_"))
    for consumer in list(seed_out.consumers()):
      if consumer is not scaled.op:
        _replace_input(consumer, seed_out, scaled)
    _twin_all(graph, since, twins, seed)


def _unscale(grads, inverse, phase):
  """What reads a raw gradient outside the forward and backward reads it times ``inverse``;
  returns the unscaled gradients."""
  unscaled = []
  for g, _ in grads:
    t = g.values if isinstance(g, tf.IndexedSlices) else g
    u = tf.multiply(t, inverse, name=PREFIX + "/unscaled_" + t.op.name.replace("/", "_"))
    for consumer in list(t.consumers()):
      if consumer is not u.op and phase.get(consumer) not in ("forward", "backward"):
        _replace_input(consumer, t, u)
    unscaled.append(u)
  return unscaled


def _dynamic_update(scale_var, good_var, unscaled):
  """(gate, update): the gate is dead when a gradient is not finite; the update halves the
  scale then, and doubles it after GROWTH_INTERVAL finite steps."""
  finite = tf.reduce_all(tf.stack([tf.reduce_all(tf.is_finite(u)) for u in unscaled]),
                         name=PREFIX + "/finite")
  _, alive = control_flow_ops.switch(finite, finite, name=PREFIX + "/gate_switch")
  gate = tf.identity(alive, name=PREFIX + "/gate")
  scale = scale_var.read_value()
  good_next = tf.where(finite, good_var.read_value() + 1, tf.constant(0, tf.int64))
  grow = good_next >= GROWTH_INTERVAL
  new_scale = tf.where(finite, tf.where(grow, scale * 2.0, scale),
                       tf.maximum(scale * 0.5, 1.0))
  update = tf.group(scale_var.assign(new_scale, read_value=False),
                    good_var.assign(tf.where(grow, tf.zeros_like(good_next), good_next),
                                    read_value=False), name=PREFIX + "/update_scale")
  return gate, update


def _gate_updates(graph, phase, controls):
  """Every variable write of the apply phase (not an initializer, not the scale's own) waits
  for ``controls``; returns those ops."""
  initializers = {v.initializer for key in (tf.GraphKeys.GLOBAL_VARIABLES,
                                            tf.GraphKeys.LOCAL_VARIABLES)
                  for v in graph.get_collection(key)}
  gated = [op for op, p in phase.items()
           if p == "apply" and _writes_variable(op) and op not in initializers and
           not op.name.startswith(PREFIX + "/")]
  for op in gated:
    compat.add_control_inputs(op, controls)
  return gated


def _replace_input(consumer, old, new):
  for i, t in enumerate(consumer.inputs):
    if t is old:
      compat.update_input(consumer, i, new)


def _add_to_init_groups(graph, initializers):
  """Adds ``initializers`` to the init ops the user built already
  (``tf.global_variables_initializer()``: a NoOp waiting only on variable initialisers), so a
  plain ``sess.run(init)`` also initialises epl's AMP state."""
  known = {v.initializer for key in (tf.GraphKeys.GLOBAL_VARIABLES, tf.GraphKeys.LOCAL_VARIABLES)
           for v in graph.get_collection(key)} - set(initializers)
  for op in graph.get_operations():
    if op.type == "NoOp" and op.control_inputs and all(
        c in known for c in op.control_inputs):
      compat.add_control_inputs(op, initializers)
