"""The model of the feature-combination matrix (tests/test_combinations.py): a small
classifier whose layout and Config keys follow a set of features, and its epl Config.

Stages (``layout``): one, or two with ``pipeline`` / ``mixed`` (stage 0 replicated on 2
devices, stage 1 on 1). ``split``: the last stage is ``epl.split(2)`` (a third one with
``mixed``) -- a row-parallel dense after a column-parallel one and a column-parallel
classifier. Every layout runs 2 model replicas (data parallel), on one worker or, with
``dp_workers``, one per worker.
"""
import contextlib

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


def build(features, local=False):
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
  train = tf.train.AdamOptimizer(0.01).minimize(loss)
  return dict(inputs=(x, y), loss=loss, train_op=train)


def data(rows, seed=0):
  rng = np.random.RandomState(seed)
  return (rng.randn(rows, INPUTS).astype(np.float32),
          rng.randint(0, CLASSES, rows).astype(np.int64))
