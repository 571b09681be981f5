"""Gradient clipping under data parallelism, both ways (communication.clip_after_allreduce).

True (the default): the user's clip_by_global_norm sees the all-reduced gradient -- the job
trains the local model. False (EPL's behaviour): each copy clips its own gradient, then the
clipped gradients are averaged -- the reference is written out by hand below.
"""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from tests import models
from epl.testing.values import load_values, read_values

CLIP, STEPS, BATCH = 0.05, 4, 4          # the norm is clipped in every step


def _mlp(x, y):
  h = tf.layers.dense(x, 16, activation=tf.nn.relu, name="d0")
  logits = tf.layers.dense(h, 4, name="d1")
  return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)


def _train(train_fn, data, config=None, initial=None):
  g = tf.Graph()
  with g.as_default():
    tf.set_random_seed(1)
    if config is not None:
      epl.init(config)
      epl.set_default_strategy(epl.replicate(1))
    x = tf.placeholder(tf.float32, [None, 8])
    y = tf.placeholder(tf.int64, [None])
    train, loss, norm = train_fn(x, y)
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      variables = tf.trainable_variables()
      if initial:
        load_values(sess, variables, lambda v: initial[v.op.name])
      start = read_values(sess, variables)
      norms = []
      for s in range(STEPS):
        rows = slice(s * 2 * BATCH, (s + 1) * 2 * BATCH)
        _, n = sess.run([train, norm], {x: data[0][rows], y: data[1][rows]})
        norms.append(n)
      return start, read_values(sess, variables), norms


def _user_script(x, y):
  """compute_gradients -> clip_by_global_norm -> apply_gradients, as scripts write it."""
  loss = _mlp(x, y)
  opt = tf.train.MomentumOptimizer(0.5, 0.9)
  grads, variables = zip(*opt.compute_gradients(loss))
  clipped, norm = tf.clip_by_global_norm(grads, CLIP)
  return opt.apply_gradients(zip(clipped, variables)), loss, norm


def _clip_per_half_then_average(x, y):
  """The local model of clip_after_allreduce=False: two halves, each clipped, averaged."""
  halves = [_mlp(x[:BATCH], y[:BATCH])]
  with tf.variable_scope(tf.get_variable_scope(), reuse=True):
    halves.append(_mlp(x[BATCH:], y[BATCH:]))
  opt = tf.train.MomentumOptimizer(0.5, 0.9)
  variables = tf.trainable_variables()
  clipped = []
  for loss in halves:
    c, norm = tf.clip_by_global_norm(tf.gradients(loss, variables), CLIP)
    clipped.append(c)
  mean = [(a + b) / 2.0 for a, b in zip(*clipped)]
  return opt.apply_gradients(zip(mean, variables)), halves[0], norm


def _scaled_script(x, y):
  """Gradient scaling before the clip, and the norm logged as a summary (BERT-style)."""
  loss = _mlp(x, y)
  opt = tf.train.MomentumOptimizer(0.5, 0.9)
  grads, variables = zip(*opt.compute_gradients(loss))
  grads = [g * 3.0 for g in grads]
  clipped, norm = tf.clip_by_global_norm(grads, CLIP)
  tf.summary.scalar("gradient_norm", norm)
  return opt.apply_gradients(zip(clipped, variables)), loss, norm


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("after", [True, False])
def test_clipping_matches_its_local_reference(after, micro):
  # 2 copies; with micro=2 each copy accumulates 2 micro-batches before the sync (and, with
  # after=False, before its own clip: the copy's gradient is what it clips)
  data = models.regression_data(2 * BATCH * STEPS)
  start, local, local_norms = _train(_user_script if after else _clip_per_half_then_average,
                                     data)
  config = epl.Config({"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": micro,
                       "communication.clip_after_allreduce": after})
  _, dist, dist_norms = _train(_user_script, data, config, initial=start)
  assert min(local_norms) > CLIP                   # clipping is active in every step
  for name, value in local.items():
    np.testing.assert_allclose(dist[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
  if after:                                        # the norm a script logs is the local one
    np.testing.assert_allclose(dist_norms, local_norms, rtol=1e-5)


def test_scaling_and_a_logged_norm_between_the_gradients_and_the_optimizer():
  data = models.regression_data(2 * BATCH * STEPS)
  start, local, local_norms = _train(_scaled_script, data)
  _, dist, dist_norms = _train(_scaled_script, data,
                               epl.Config({"cluster.devices_per_worker": 2}), initial=start)
  for name, value in local.items():
    np.testing.assert_allclose(dist[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
  np.testing.assert_allclose(dist_norms, local_norms, rtol=1e-5)


def test_clipping_per_copy_needs_the_optimizers_own_apply_gradients():
  from tests.real_scripts import bert_like
  with tf.Graph().as_default():
    epl.init(epl.Config({"cluster.devices_per_worker": 2,
                         "communication.clip_after_allreduce": False}))
    epl.set_default_strategy(epl.replicate(1))
    t = bert_like.build(2)
    with pytest.raises(epl.EplError, match=r"communication.clip_after_allreduce=False "
                       r"all-reduces the gradients handed to apply_gradients, but the "
                       r"optimizer of .* overrides apply_gradients.*keep the default \(True\)"):
      with tf.Session() as sess:
        sess.run(t["train_op"])


def test_the_two_ways_train_different_models():
  data = models.regression_data(2 * BATCH * STEPS)
  start, _, _ = _train(_user_script, data)
  runs = [_train(_user_script, data, epl.Config({
      "cluster.devices_per_worker": 2, "communication.clip_after_allreduce": after}),
      initial=start)[1] for after in (True, False)]
  assert max(np.abs(runs[0][n] - runs[1][n]).max() for n in runs[0]) > 1e-4
