"""The model of the feature-combination matrix (tests/test_combinations.py): a small
classifier whose layout and Config keys follow a set of features, and its epl Config.

Stages (``layout``): one, or two with ``pipeline`` / ``mixed`` (stage 0 replicated on 2
devices, stage 1 on 1). ``split``: the last stage is ``epl.split(2)`` (a third one with
``mixed``) -- a row-parallel dense after a column-parallel one and a column-parallel
classifier. Every layout runs 2 model replicas (data parallel), on one worker or, with
``dp_workers``, one per worker.
"""
import contextlib
import dataclasses
import itertools

import numpy as np
import tensorflow.compat.v1 as tf

import epl

FEATURES = ("dp_workers", "pipeline", "split", "zero_v1", "zero_v2", "offload", "amp",
            "checkpointing", "apply_groups", "mixed")
NAMES = {"dp_workers": "DP across workers", "pipeline": "pipeline + micro-batches",
         "split": "split (TP)", "zero_v1": "ZeRO v1", "zero_v2": "ZeRO v2",
         "offload": "offload", "amp": "AMP O1", "checkpointing": "gradient checkpointing",
         "apply_groups": "num_apply_group", "mixed": "stages of different replica counts"}
KEYS = {"pipeline": {"pipeline.num_micro_batch": 2}, "zero_v1": {"zero.level": "v1"},
        "zero_v2": {"zero.level": "v2"}, "offload": {"offload.level": "v0"},
        "amp": {"amp.level": "O1"}, "checkpointing": {"gradient_checkpoint.type": "auto"},
        "apply_groups": {"optimizer.num_apply_group": 2}}
INPUTS, HIDDEN, CLASSES = 8, 16, 4


def layout(features):
  """The stages: ("replicate", device_count) or ("split", 2)."""
  if "mixed" in features:
    out = [("replicate", 2), ("replicate", 1)]
  elif "pipeline" in features:
    out = [("replicate", 1), ("replicate", 1)]
  else:
    out = [("replicate", 1)]
  if "split" in features:
    out = out[:-1] + [("split", 2)] if "mixed" not in features else out + [("split", 2)]
  return out


def replica_devices(features):
  return sum(k for _, k in layout(features))


def config(features, workers=1):
  """The Config dict of ``features`` on ``workers`` workers (2 replicas in all)."""
  out = {"cluster.devices_per_worker": replica_devices(features) * (2 // workers)}
  for f in features:
    out.update(KEYS.get(f, {}))
  return out


def scopes(features, local=False):
  """(i -> the scope of stage i, stage count)."""
  stages = layout(features)

  def scope(i):
    if local:
      return contextlib.nullcontext()
    kind, k = stages[i]
    return epl.split(k, name="split") if kind == "split" else \
        epl.replicate(k, name="stage%d" % i)
  return scope, len(stages)


@dataclasses.dataclass(frozen=True)
class Variant:
  """How the script around the model is written (the axes users vary, issue #48): the step
  (``minimize``; ``compute_gradients`` + ``clip_by_global_norm`` + ``apply_gradients``;
  ``tf.gradients`` + ``apply_gradients`` without a global step), ref or resource variables, SGD or Adam (its
  default epsilon: no weight of this model has a zero true gradient), and whether the
  session is opened before the model is built."""
  step: str = "minimize"
  resource: bool = False
  optimizer: str = "adam"
  session_first: bool = False

  def code(self):
    """A command-line form (``Variant.parse`` reads it back)."""
    return "%s,%d,%s,%d" % (self.step, self.resource, self.optimizer, self.session_first)

  @classmethod
  def parse(cls, text):
    step, resource, optimizer, first = text.split(",")
    return cls(step, bool(int(resource)), optimizer, bool(int(first)))

  def __str__(self):
    return "%s/%s/%s%s" % (self.step, "resource" if self.resource else "ref", self.optimizer,
                           "/session-first" if self.session_first else "")


STEPS_WRITTEN = ("minimize", "compute_gradients", "tf.gradients")
VARIANTS = tuple(Variant(*v) for v in itertools.product(
    STEPS_WRITTEN, (False, True), ("sgd", "adam"), (False, True)))


def variant_for(index):
  """The variant cell ``index`` of the matrix takes in CI: consecutive cells walk the product
  (every value of every axis in every 24 cells; bench/matrix.py runs them all)."""
  return VARIANTS[index % len(VARIANTS)]


def _train_op(loss, variant, features):
  # float16 gradients (AMP) carry ~1e-3 relative noise: Adam's default epsilon (1e-8) turns
  # the noise of a near-zero gradient element into a full step of either sign, so an AMP
  # cell's Adam divides by sqrt(v) + 1e-4 in both runs
  epsilon = 1e-4 if "amp" in features else 1e-8
  opt = tf.train.AdamOptimizer(0.01, epsilon=epsilon) if variant.optimizer == "adam" else \
      tf.train.GradientDescentOptimizer(0.1)
  tvars = tf.trainable_variables()
  if variant.step == "tf.gradients":
    return opt.apply_gradients(zip(tf.gradients(loss, tvars), tvars))
  step = tf.train.get_or_create_global_step()
  if variant.step == "compute_gradients":     # clipped by the global norm, as published
    pairs = opt.compute_gradients(loss, tvars)  # trainers do (0.1: it binds on this model)
    clipped, _ = tf.clip_by_global_norm([g for g, _ in pairs], 0.1)
    return opt.apply_gradients(zip(clipped, tvars), global_step=step)
  return opt.minimize(loss, global_step=step)


def build(features, local=False, variant=Variant()):
  with tf.variable_scope(tf.get_variable_scope(), use_resource=variant.resource):
    return _build(features, local, variant)


def _build(features, local, variant):
  scope, stages = scopes(features, local)
  x = tf.placeholder(tf.float32, [None, INPUTS], name="x")
  y = tf.placeholder(tf.int64, [None], name="y")
  init = lambda s: tf.glorot_uniform_initializer(seed=s)          # noqa: E731
  with scope(0):
    h = tf.layers.dense(x, HIDDEN, tf.tanh, kernel_initializer=init(1), name="d0")
  with scope(min(1, stages - 1)):
    h = tf.layers.dense(h, HIDDEN * 2, tf.tanh, kernel_initializer=init(2), name="d1")
  with scope(stages - 1):
    h = tf.layers.dense(h, HIDDEN, tf.tanh, kernel_initializer=init(3), name="d2")
    logits = tf.layers.dense(h, CLASSES, kernel_initializer=init(4), name="head")
    loss = tf.losses.sparse_softmax_cross_entropy(y, logits)
  return dict(inputs=(x, y), loss=loss, train_op=_train_op(loss, variant, features))


def data(rows, seed=0):
  rng = np.random.RandomState(seed)
  return (rng.randn(rows, INPUTS).astype(np.float32),
          rng.randint(0, CLASSES, rows).astype(np.int64))
