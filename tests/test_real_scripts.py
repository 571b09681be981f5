"""Real TF1 training scripts, unchanged but for the epl lines, locally and under epl.

Each script is written the way its kind is published (tests/real_scripts/); each runs under
data parallelism on 2 devices, a 2-stage pipeline with 2 and 4 micro-batches, and gradient
accumulation over 4 micro-batches, and must train the model the local script trains -- or,
where the semantics differ by design (batch-norm statistics in training mode), do what the
user guide documents.
"""
import functools

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from tests.real_scripts import bert_like, bn_cnn, rnn_tagger, synthetic_bench
from tests.real_scripts.harness import MODES, assert_same_training, close, run, steps_of

STEPS = 3


@functools.lru_cache(maxsize=None)
def _local(name, rows, last=None, frozen_bn=False):
  script = SCRIPTS[name]
  data = _data(name, rows, last)
  return run(script, rows, data, steps_of(rows, STEPS, last), feed=_feed(name, frozen_bn),
             after=AFTER.get(name))


def _data(name, rows, last=None):
  return SCRIPTS[name].make_data(rows * STEPS + (last or 0))


def _feed(name, frozen_bn=False):
  if name != "bn_cnn":
    return None
  return lambda t: {t["is_training"]: not frozen_bn}


SCRIPTS = {"bert": bert_like, "bn_cnn": bn_cnn, "tagger": rnn_tagger}
HELD_OUT = bn_cnn.make_data(7, seed=5)
SENTENCE = [3, 7, 11, 2, 9]
AFTER = {
    "bn_cnn": lambda sess, t: bn_cnn.evaluate(sess, t, HELD_OUT, 4),
    "tagger": lambda sess, t: rnn_tagger.predict(sess, t, SENTENCE),
}


def _epl(name, mode, batch, last=None, frozen_bn=False):
  m = MODES[mode]
  rows = m.pieces * batch
  local = _local(name, rows, last, frozen_bn)
  dist = run(SCRIPTS[name], batch, _data(name, rows, last), steps_of(rows, STEPS, last),
             mode=m, initial=local.initial, feed=_feed(name, frozen_bn),
             after=AFTER.get(name))
  return local, dist


@pytest.mark.parametrize("mode", sorted(MODES))
def test_bert_classifier_with_adam_weight_decay_and_clipping(mode):
  # fixed-size placeholders [batch, seq]: one copy's micro-batch; the step feeds them all
  local, dist = _epl("bert", mode, batch=2)
  assert_same_training(local, dist)
  assert any(n.endswith("/adam_m") for n in dist.variables)       # the custom optimizer
  assert dist.variables["global_step"] == STEPS                      # its manual increment


@pytest.mark.parametrize("mode", sorted(MODES))
def test_batch_norm_cnn_with_frozen_batch_norm_trains_the_local_model(mode):
  # is_training=False: both tf.conds are built and one branch of each is dead every step
  local, dist = _epl("bn_cnn", mode, batch=3, frozen_bn=True)
  assert_same_training(local, dist)
  assert dist.after[0] == pytest.approx(local.after[0])              # held-out accuracy
  np.testing.assert_array_equal(dist.after[1], local.after[1])       # all 7 predictions


@pytest.mark.parametrize("mode", sorted(MODES))
def test_batch_norm_cnn_in_training_mode_keeps_statistics_per_copy(mode):
  local, dist = _epl("bn_cnn", mode, batch=3)
  assert all(np.isfinite(dist.losses))
  pg = dist.parallel
  mean = "bn1/moving_mean"
  assert not np.allclose(dist.variables[mean], dist.initial[mean])   # copy 0 updated them
  # the evaluation loop scores every held-out row with copy 0's (the checkpointed) weights
  accuracy, predictions = dist.after
  assert predictions.shape == (7,)
  if pg.num_copies > 1:
    copies = pg.replication.mirrored[mean]
    assert len(copies) == pg.num_copies        # each copy keeps statistics of its own batches


@pytest.mark.parametrize("devices,micro", [(2, 1), (1, 4), (2, 2)])
def test_batch_norm_statistics_are_each_copys_own_batches(devices, micro):
  # The user guide's rule, measured: in training mode each copy's moving statistics follow
  # its own rows, micro-batch after micro-batch (copy-major pieces of the fed batch).
  import epl
  rows_per_piece, momentum = 3, 0.9
  with tf.Graph().as_default():
    epl.init(epl.Config({"cluster.devices_per_worker": devices,
                         "pipeline.num_micro_batch": micro}))
    epl.set_default_strategy(epl.replicate(1))
    x = tf.placeholder(tf.float32, [None, 4], name="x")
    y = tf.placeholder(tf.int64, [None], name="y")
    is_training = tf.placeholder_with_default(True, [], name="is_training")
    h = tf.layers.batch_normalization(x, momentum=momentum, training=is_training, name="bn")
    loss = tf.losses.sparse_softmax_cross_entropy(y, tf.layers.dense(h, 3))
    with tf.control_dependencies(tf.get_collection(tf.GraphKeys.UPDATE_OPS)):
      train_op = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    pieces = devices * micro
    rng = np.random.RandomState(1)
    data = rng.randn(pieces * rows_per_piece, 4).astype(np.float32) * 3 + \
        np.arange(pieces * rows_per_piece, dtype=np.float32)[:, None]
    labels = rng.randint(0, 3, len(data))
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(train_op, {x: data, y: labels})
      copies = epl.Graph.get().replication.mirrored["bn/moving_mean"]
      assert len(copies) == devices
      for c, variable in enumerate(copies):
        expected = np.zeros(4)
        for m in range(micro):
          piece = data[(c * micro + m) * rows_per_piece:(c * micro + m + 1) * rows_per_piece]
          expected = momentum * expected + (1 - momentum) * piece.mean(0)
        close("copy %d's moving mean" % c, sess.run(variable.outputs[0]), expected)
      # a fetch (and a checkpoint) sees copy 0's statistics
      close("fetched moving mean", sess.run("bn/moving_mean:0"),
            sess.run(copies[0].outputs[0]))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_dynamic_rnn_tagger_with_a_last_partial_batch_and_one_sentence_prediction(mode):
  pieces = MODES[mode].pieces
  last = pieces + pieces // 2 if pieces > 1 else 3       # does not split evenly
  local, dist = _epl("tagger", mode, batch=2, last=last)
  assert_same_training(local, dist)
  np.testing.assert_array_equal(dist.after, local.after)
  assert dist.after.shape == (len(SENTENCE),)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_synthetic_input_benchmark_each_copy_draws_its_own_batch(mode):
  m = MODES[mode]
  batch = 2
  dist = run(synthetic_bench, batch, {}, [slice(0, 0)] * STEPS, mode=m,
             extra=("images", "labels"))
  # a training run's batch-major fetch returns every copy's rows, in batch order
  images = [f["images"] for f in dist.fetched]
  assert images[0].shape == (m.pieces * batch, 8, 8, 3)
  per_piece = images[0].reshape(m.pieces, batch, -1)
  assert len({p.tobytes() for p in per_piece}) == m.pieces           # all different
  # replaying exactly those rows in the local script trains the same model
  data = {k: np.concatenate([f[k] for f in dist.fetched]) for k in ("images", "labels")}
  local = run(synthetic_bench, m.pieces * batch, data,
              steps_of(m.pieces * batch, STEPS), initial=dist.initial)
  assert_same_training(local, dist)
