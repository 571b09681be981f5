"""Memory-efficient automatic mixed precision (``amp.level: "O1"``).

A transformation of the user's graph that runs before planning (like ``auto.auto_parallel``'s
stage cut): every op it builds is registered as the twin of a user op, so the plan gives it
that op's TaskGraph and phase and every pass (replicas, micro-batches, pipeline schedule,
gradient synchronisation, recomputation) treats it as part of the model.

  epl.amp.lists    the allow / infer / deny table
  epl.amp.convert  low-precision twins of the chosen ops, casts at the edges (weights cast per
                   use: no float16 variable and no low-precision weight copy that outlives its
                   use)
  epl.amp.scaling  loss scaling for float16: fixed or dynamic, with the update skipped on a
                   step whose gradients hold inf/nan

``amp.dtype`` float16 (the default) or bfloat16 (same range as float32: no loss scaling).
"""
import dataclasses
import logging
from typing import Optional

import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl.amp.convert import Conversion, convert
from epl.amp.scaling import LossScaling, add_loss_scaling
from epl.plan.attribution import attribute_ops

log = logging.getLogger("epl")


@dataclasses.dataclass(frozen=True)
class Amp:
  dtype: str
  conversion: Conversion
  scaling: Optional[LossScaling]

  def __str__(self):
    counts = ", ".join("%s %d" % kv for kv in sorted(self.conversion.counts.items()))
    if self.scaling is None:
      scale = "no loss scaling"
    elif self.scaling.dynamic:
      scale = "dynamic loss scale, %d update op(s) skipped on inf/nan" % len(self.scaling.gated)
    else:
      scale = "loss scale %g" % self.scaling.fixed
    return "amp O1: %d op(s) in %s (%s); %s" % (self.conversion.total, self.dtype,
                                                 counts or "none", scale)


def apply_amp(graph, recorder, config):
  """Runs AMP O1 on ``graph`` when ``amp.level`` asks for it; returns an Amp, or None.

  Raises:
    PlanError: float16 loss scaling of gradients not computed from a loss with tf.gradients.
  """
  if config.amp.level != "O1":
    return None
  low = tf.float16 if config.amp.dtype == "float16" else tf.bfloat16
  _, phase = attribute_ops(graph, recorder, graph.version)
  ops = sorted(phase, key=compat.op_id)
  with compat.unfinalized(graph):
    conversion = convert(graph, ops, phase, recorder, low, config.amp.debug_log)
    scaling = None
    if low == tf.float16:
      scaling = add_loss_scaling(graph, recorder, phase, config.amp.loss_scale)
  result = Amp(low.name, conversion, scaling)
  log.info("%s", result)
  return result
