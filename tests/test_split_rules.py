"""One test per split rule (epl.sharding.rules.RULES): an op applied to a split dense layer's
output gives the local value and the local gradients."""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from tests import split_models as sm

CLASSES, ROWS = 10, 6


def _weights(shape, seed):
  return tf.constant(np.random.RandomState(seed).randn(*shape).astype(np.float32))


def _reduce(t, seed=11):
  """A scalar that depends on every element of ``t`` differently."""
  t = tf.cast(t, tf.float32)
  return tf.reduce_sum(t * _weights(t.shape.as_list()[1:], seed))


# name -> fn(logits [ROWS, CLASSES] (split), labels [ROWS]) -> scalar to minimise
CASES = {
    "relu + bias add": lambda z, y: _reduce(tf.nn.relu(z)),
    "gelu (erf, mul, add)": lambda z, y: _reduce(0.5 * z * (1.0 + tf.math.erf(z / 1.4142135))),
    "tanh, sigmoid, square, sub": lambda z, y: _reduce(tf.tanh(z) - tf.square(tf.sigmoid(z))),
    "broadcast operand sliced": lambda z, y: _reduce(z * _weights([CLASSES], 3) + 1.0),
    "cast and comparison": lambda z, y: _reduce(tf.where(z > 0.1, z, -z)),
    "reshape keeping the split axis": lambda z, y: _reduce(tf.reshape(z, [-1, 2, CLASSES])),
    "shape": lambda z, y: _reduce(z) * tf.cast(tf.reduce_prod(tf.shape(z)), tf.float32) / (
        ROWS * CLASSES),
    "reduce_sum over the split axis": lambda z, y: _reduce(tf.reduce_sum(z, axis=1,
                                                                         keepdims=True)),
    "reduce_mean over the batch": lambda z, y: _reduce(tf.reduce_mean(tf.square(z), axis=0,
                                                                      keepdims=True)),
    "reduce_max over everything": lambda z, y: tf.reduce_max(z) + tf.reduce_min(z),
    "reduce_mean over everything": lambda z, y: tf.reduce_mean(tf.exp(z)),
    "softmax": lambda z, y: _reduce(tf.nn.softmax(z)),
    "log_softmax": lambda z, y: _reduce(tf.nn.log_softmax(z)),
    "sparse softmax cross-entropy": lambda z, y: tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=z)),
    "softmax cross-entropy (one-hot)": lambda z, y: tf.reduce_mean(
        tf.nn.softmax_cross_entropy_with_logits_v2(labels=tf.one_hot(y, CLASSES), logits=z)),
    "argmax and accuracy": lambda z, y: _reduce(z) + tf.reduce_mean(
        tf.cast(tf.equal(tf.argmax(z, axis=1), y), tf.float32)),
    "two split layers": lambda z, y: _reduce(tf.layers.dense(
        tf.nn.relu(z), CLASSES, kernel_initializer=sm._init(6), name="second")),
}


def _build(fn, trunk, head):
  x = tf.placeholder(tf.float32, [None, 5], name="x")
  y = tf.placeholder(tf.int64, [None], name="y")
  with trunk():
    h = tf.layers.dense(x, 8, activation=tf.nn.tanh, kernel_initializer=sm._init(1))
  with head():
    z = tf.layers.dense(h, CLASSES, kernel_initializer=sm._init(2),
                        bias_initializer=tf.random_normal_initializer(seed=3))
    out = fn(z, y)
  train = tf.train.GradientDescentOptimizer(0.5).minimize(out)
  return dict(inputs=(x, y), loss=out, train_op=train)


@pytest.mark.parametrize("case", sorted(CASES))
def test_split_rule_matches_the_local_op(case):
  rng = np.random.RandomState(0)
  data = (rng.randn(2 * ROWS, 5).astype(np.float32), rng.randint(0, CLASSES, 2 * ROWS))
  fn = CASES[case]
  local = sm.train(lambda: _build(fn, *sm.local_scopes()), data, 2, ROWS, eval_rows=4)
  trunk, head = sm.scopes(2, 2)
  run = sm.train(lambda: _build(fn, trunk, head), data, 2, ROWS,
                 config=epl.Config({"cluster.devices_per_worker": 2,
                                    "cluster.colocate_split_and_replicate": True}),
                 initial=local.initial, eval_rows=4)
  for got, want in zip(run.fetched, local.fetched):
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(run.evaluated["loss"], local.evaluated["loss"], rtol=1e-5,
                             atol=1e-5)
  for name, value in local.variables.items():
    np.testing.assert_allclose(run.variables[name], value, rtol=1e-5, atol=1e-5,
                               err_msg=name)
