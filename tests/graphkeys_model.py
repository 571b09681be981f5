"""The model of the GraphKeys tests (tests/test_graphkeys.py and its workers): every kind of
``epl.GraphKeys`` collection on one tensor each, fetched in one training step.

The batch is fed (``x``, ``y`` of shape [None, ...]), so the pieces the copies and
micro-batches take are known: the fed rows cut in order. Each collection holds its own
identity of the per-piece loss (a scalar) or of the per-example losses (batch-major).
"""
import numpy as np
import tensorflow.compat.v1 as tf

import epl
from epl.testing.values import load_values, read_values

KINDS = ("GLOBAL_MEAN_OBJECTS", "GLOBAL_SUM_OBJECTS", "GLOBAL_CONCAT_OBJECTS",
         "LOCAL_MEAN_OBJECTS", "LOCAL_SUM_OBJECTS", "LOCAL_CONCAT_OBJECTS")
FEATURES, CLASSES, ROWS = 6, 3, 4          # rows per piece (copy x micro-batch)


def data(pieces, seed=0):
  rng = np.random.RandomState(seed)
  return (rng.randn(pieces * ROWS, FEATURES).astype(np.float32),
          rng.randint(0, CLASSES, pieces * ROWS).astype(np.int64))


def build(stages=None):
  """``stages``: None (local), 1 (data parallel) or 2 (a 2-stage pipeline)."""
  def scope(i):
    if stages is None:
      return _Null()
    return epl.replicate(1, name="stage_%d" % min(i, stages - 1))
  x = tf.placeholder(tf.float32, [None, FEATURES], name="x")
  y = tf.placeholder(tf.int64, [None], name="y")
  with scope(0):
    h = tf.layers.dense(x, 8, activation=tf.nn.tanh, name="d0")
  with scope(1):
    logits = tf.layers.dense(h, CLASSES, name="d1")
    per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
    loss = tf.reduce_mean(per_example)
    fetched = {}
    for kind in KINDS:
      source = per_example if "CONCAT" in kind else loss
      fetched[kind] = tf.identity(source, name=kind.lower())
      if stages is not None:
        epl.add_to_collection(fetched[kind], getattr(epl.GraphKeys, kind))
  train = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
  return x, y, train, fetched


class _Null:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


def expected(per_piece_losses, per_example, kind):
  """What fetching ``kind`` returns, from the local run's values for the pieces merged."""
  if "CONCAT" in kind:
    return np.concatenate(per_example)
  if "SUM" in kind:
    return np.sum(per_piece_losses)
  return np.mean(per_piece_losses)


def local_values(initial, x, y, pieces):
  """(per-piece loss, per-piece per-example losses) of the local model on ``pieces`` equal
  pieces of the rows, at the ``initial`` weights."""
  g = tf.Graph()
  with g.as_default():
    tx, ty, _, fetched = build(None)
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      load_values(sess, tf.global_variables(), lambda v: initial[v.op.name])
      out = [sess.run([fetched["LOCAL_MEAN_OBJECTS"], fetched["LOCAL_CONCAT_OBJECTS"]],
                      {tx: px, ty: py})
             for px, py in zip(np.split(x, pieces), np.split(y, pieces))]
  return [o[0] for o in out], [o[1] for o in out]


def initial_values(seed=1):
  g = tf.Graph()
  with g.as_default():
    tf.set_random_seed(seed)
    build(None)
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      return read_values(sess, tf.global_variables())


VOTE_KINDS = ("GLOBAL_SUM_OBJECTS", "GLOBAL_MEAN_OBJECTS", "GLOBAL_CONCAT_OBJECTS",
              "LOCAL_SUM_OBJECTS")


def fetch_under_epl(config, stages, initial, x, y, vote=1.0):
  """Builds the model under epl, loads ``initial``, runs one training step on the fed rows,
  and returns {kind: value}; then, in a run with no train op (copy 0 only), fetches a fed
  ``vote`` ([vote], outside every replicate scope, as a stop vote is) collected under each of
  VOTE_KINDS, returned as {"vote_" + kind: value}."""
  g = tf.Graph()
  with g.as_default():
    epl.init(config)
    tx, ty, train, fetched = build(stages)
    ballot = tf.placeholder(tf.float32, [1], name="ballot")
    votes = {}
    for kind in VOTE_KINDS:
      votes["vote_" + kind] = tf.identity(ballot, name="vote_" + kind.lower())
      epl.add_to_collection(votes["vote_" + kind], getattr(epl.GraphKeys, kind))
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      load_values(sess, [v for v in tf.global_variables() if v.op.name in initial],
                  lambda v: initial[v.op.name])
      values = sess.run([train, fetched], {tx: x, ty: y})[1]
      values.update(sess.run(votes, {ballot: [vote]}))
  return values


def expected_vote(kind, mine, every):
  """What the copy-0 run returns for a vote of ``kind``: this client's ``mine`` for LOCAL_*,
  merged over ``every`` client's vote for GLOBAL_*."""
  if kind.startswith("LOCAL"):
    return np.array([mine])
  if "CONCAT" in kind:
    return np.array(every)
  return np.array([np.sum(every) if "SUM" in kind else np.mean(every)])
