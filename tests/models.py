"""Tiny models for parity tests: (x, y, stages) -> scalar loss."""
import functools

import numpy as np
import tensorflow.compat.v1 as tf


def mlp(x, y, stages, width=16):
  with stages(0):
    h = tf.layers.dense(x, width, activation=tf.nn.relu)
    h = tf.layers.dense(h, width, activation=tf.nn.tanh)
    logits = tf.layers.dense(h, 4)
  return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)


# the MLP with a 4 MiB middle kernel: under ZeRO its update takes milliseconds
wide = functools.partial(mlp, width=1024)


def mlp_two_stages(x, y, stages):
  with stages(0):
    h = tf.layers.dense(x, 16, activation=tf.nn.relu)
  with stages(1):
    h = tf.layers.dense(h, 16, activation=tf.nn.tanh)
    logits = tf.layers.dense(h, 4)
    return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)


def convnet(x, y, stages):
  with stages(0):
    img = tf.reshape(x, [-1, 2, 2, 2])
    h = tf.layers.conv2d(img, 4, 2, padding="same", activation=tf.nn.relu)
    h = tf.layers.max_pooling2d(h, 2, 1)
    h = tf.layers.flatten(h)
    logits = tf.layers.dense(h, 4)
  return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)


def bn_dropout(x, y, stages):
  with stages(0):
    h = tf.layers.dense(x, 16)
    h = tf.layers.batch_normalization(h, training=True)
    h = tf.nn.relu(h)
    h = tf.layers.dropout(h, rate=0.3, training=True)
    logits = tf.layers.dense(h, 4)
  return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)


def while_v1(x, y, stages):
  """A tf.while_loop (v1 form under disable_v2_behavior) applying a shared layer 3 times."""
  with stages(0):
    w = tf.get_variable("w_loop", [8, 8], initializer=tf.glorot_uniform_initializer())
    _, h = tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, tf.tanh(tf.matmul(h, w))),
                         [tf.constant(0), x])
    logits = tf.layers.dense(h, 4)
  return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)


def cond_model(x, y, stages):
  with stages(0):
    h = tf.layers.dense(x, 8)
    # the predicate must not depend on the batch (a per-replica batch would flip it)
    gate = tf.get_variable("gate", [], initializer=tf.constant_initializer(0.5))
    h = tf.cond(gate > 0, lambda: tf.nn.relu(h) * gate, lambda: tf.tanh(h) - gate)
    logits = tf.layers.dense(h, 4)
  return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)


def control_flow_two_stages(x, y, stages):
  """Stage 0: a tf.cond on a variable (one branch dead every step); stage 1: a v1 while
  loop -- control flow in both pipeline stages."""
  with stages(0):
    h = tf.layers.dense(x, 8, name="in")
    gate = tf.get_variable("gate", [], initializer=tf.constant_initializer(0.5))
    h = tf.cond(gate > 0, lambda: tf.nn.relu(h) * gate, lambda: tf.tanh(h) - gate)
  with stages(1):
    w = tf.get_variable("w_loop", [8, 8], initializer=tf.glorot_uniform_initializer())
    _, h = tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, tf.tanh(tf.matmul(h, w))),
                         [tf.constant(0), h])
    logits = tf.layers.dense(h, 4, name="out")
  return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)


def embedding(x, y, stages):
  """Sparse (IndexedSlices) gradients through an embedding lookup."""
  with stages(0):
    ids = tf.cast(tf.abs(x[:, :2]) * 3, tf.int32) % 10
    table = tf.get_variable("table", [10, 6], initializer=tf.random_normal_initializer())
    h = tf.reduce_sum(tf.nn.embedding_lookup(table, ids), axis=1)
    logits = tf.layers.dense(h, 4)
  return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)


def regression_data(n, rng=None):
  rng = rng or np.random.RandomState(0)
  return rng.randn(n, 8).astype(np.float32), rng.randint(0, 4, n).astype(np.int64)


def mlp_four_stages(x, y, stages):
  h = x
  for i in range(3):
    with stages(i):
      h = tf.layers.dense(h, 12, activation=tf.nn.tanh, name="stage%d" % i)
  with stages(3):
    logits = tf.layers.dense(h, 4, name="stage3")
    return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)


def _block(h, name):
  """A tiny transformer block: self-attention + feed-forward, each with layer norm."""
  with tf.variable_scope(name):
    q = tf.layers.dense(h, 4, name="q")
    k = tf.layers.dense(h, 4, name="k")
    v = tf.layers.dense(h, 4, name="v")
    att = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / 2.0)
    h = _layer_norm(h + tf.layers.dense(tf.matmul(att, v), 4, name="o"), "ln1")
    f = tf.layers.dense(tf.layers.dense(h, 8, activation=tf.nn.relu, name="f1"), 4, name="f2")
    return _layer_norm(h + f, "ln2")


def _layer_norm(h, name):
  with tf.variable_scope(name):
    mean, var = tf.nn.moments(h, axes=[-1], keep_dims=True)
    gamma = tf.get_variable("gamma", [h.shape[-1]], initializer=tf.ones_initializer())
    beta = tf.get_variable("beta", [h.shape[-1]], initializer=tf.zeros_initializer())
    return (h - mean) * tf.rsqrt(var + 1e-6) * gamma + beta


def transformer_two_stages(x, y, stages):
  with stages(0):
    h = _block(tf.reshape(x, [-1, 2, 4]), "block0")
  with stages(1):
    h = _block(h, "block1")
    logits = tf.layers.dense(tf.reshape(h, [-1, 8]), 4)
    return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)
