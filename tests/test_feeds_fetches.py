"""What a run feeds and fetches under epl (docs/user_guide.md, "Feeds and fetches")."""
import time

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.testing.values import load_values, read_values
from tests import models


def _graph(config, fixed=None):
  g = tf.Graph()
  with g.as_default():
    tf.set_random_seed(2)
    if config is not None:
      epl.init(config)
      epl.set_default_strategy(epl.replicate(1))
    x = tf.placeholder(tf.float32, [fixed, 8], name="x")
    y = tf.placeholder(tf.int64, [fixed], name="y")
    logits = tf.layers.dense(tf.layers.dense(x, 16, activation=tf.nn.relu), 4)
    per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
    loss = tf.reduce_mean(per_example)
    predictions = tf.argmax(logits, 1)
    step = tf.train.get_or_create_global_step()
    train = tf.train.GradientDescentOptimizer(0.5).minimize(loss, global_step=step)
  return g, dict(x=x, y=y, loss=loss, per_example=per_example, predictions=predictions,
                 train=train, step=step, logits=logits)


def _session(g, t, initial=None):
  with g.as_default():
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    if initial:
      load_values(sess, tf.global_variables(), lambda v: initial[v.op.name])
    return sess, {v.op.name: v for v in tf.global_variables()}


def _pair(devices=2, fixed=None, local_fixed=None, micro=1):
  cfg = epl.Config({"cluster.devices_per_worker": devices, "pipeline.num_micro_batch": micro})
  lg, lt = _graph(None, local_fixed)
  ls, lv = _session(lg, lt)
  initial = read_values(ls, lv.values())
  dg, dt = _graph(cfg, fixed)
  ds, dv = _session(dg, dt, initial)
  return (ls, lt, lv), (ds, dt, dv)


@pytest.mark.parametrize("devices,micro", [(2, 1), (1, 4), (2, 2)])
def test_a_training_run_returns_every_row_of_batch_major_fetches(devices, micro):
  (ls, lt, _), (ds, dt, _) = _pair(devices, micro=micro)
  x, y = models.regression_data(8)          # every copy's and micro-batch's rows, in order
  local = ls.run([lt["predictions"], lt["per_example"], lt["loss"]],
                 {lt["x"]: x, lt["y"]: y})
  dist = ds.run([dt["predictions"], dt["per_example"], dt["loss"], dt["train"]],
                {dt["x"]: x, dt["y"]: y})
  np.testing.assert_array_equal(dist[0], local[0])        # 8 rows in, 8 predictions out
  np.testing.assert_allclose(dist[1], local[1], rtol=1e-5)
  assert dist[2] == pytest.approx(local[2], rel=1e-5)      # scalar float: the mean
  assert ds.run(dt["step"]) == 1                           # an int: copy 0's (one step)


def test_an_uneven_last_batch_trains_like_the_local_script():
  (ls, lt, lv), (ds, dt, dv) = _pair(micro=2)              # 2 copies x 2 micro-batches
  x, y = models.regression_data(7)                         # 2 + 2 + 2 + 1 rows
  for sess, t in ((ls, lt), (ds, dt)):
    sess.run(t["train"], {t["x"]: x, t["y"]: y})
  for name in lv:
    np.testing.assert_allclose(ds.run(dv[name]), ls.run(lv[name]), rtol=1e-5, atol=1e-6,
                               err_msg=name)


def test_evaluation_takes_any_batch_size_and_scores_every_row():
  (ls, lt, _), (ds, dt, _) = _pair()
  for rows in (1, 3, 5):
    x, y = models.regression_data(rows)
    local = ls.run([lt["predictions"], lt["loss"]], {lt["x"]: x, lt["y"]: y})
    dist = ds.run([dt["predictions"], dt["loss"]], {dt["x"]: x, dt["y"]: y})
    np.testing.assert_array_equal(dist[0], local[0])
    assert dist[1] == pytest.approx(local[1], rel=1e-6)


@pytest.mark.parametrize("micro", [1, 2])
def test_a_fixed_size_placeholder_is_one_copys_batch(micro):
  rows = 2 * micro * 3
  (ls, lt, lv), (ds, dt, dv) = _pair(fixed=3, local_fixed=rows, micro=micro)
  x, y = models.regression_data(rows)                      # 2 copies x micro x 3 rows
  for sess, t in ((ls, lt), (ds, dt)):
    sess.run(t["train"], {t["x"]: x, t["y"]: y})
  for name in lv:
    np.testing.assert_allclose(ds.run(dv[name]), ls.run(lv[name]), rtol=1e-5, atol=1e-6)
  # evaluating one copy's batch works; a training step needs every copy's rows
  assert ds.run(dt["predictions"], {dt["x"]: x[:3]}).shape == (3,)
  with pytest.raises(epl.EplError, match=r"the batch fed to 'x' has 4 rows; 'x' takes 3 rows "
                     r"per model copy, and a training run feeds this worker's 2 model copies x "
                     r"%d micro-batch\(es\): feed %d rows \(or 3 for a run that updates "
                     r"nothing\)" % (micro, rows)):
    ds.run(dt["train"], {dt["x"]: np.ones([4, 8]), dt["y"]: np.ones([4], np.int64)})


def test_a_monitored_session_over_a_dataset_adds_no_op_after_its_first_step():
  """MonitoredSession hands the fetches to Session.run in a dict (with its hooks'): epl's
  step report built a new op for them on every run, the session's graph grew, and TF
  compiled the whole graph again each step (seconds per step on a pipeline)."""
  g = tf.Graph()
  with g.as_default():
    epl.init(epl.Config({"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": 2,
                         "log.progress_secs": 1}))
    rng = np.random.RandomState(0)
    data = tf.data.Dataset.from_tensor_slices(
        (rng.randn(64, 8).astype(np.float32), rng.randint(0, 4, 64))).batch(8).repeat()
    x, y = tf.data.make_one_shot_iterator(data).get_next()
    with epl.replicate(1, name="s0"):
      h = tf.layers.dense(x, 16, activation=tf.nn.relu)
    with epl.replicate(1, name="s1"):
      loss = tf.losses.sparse_softmax_cross_entropy(y, tf.layers.dense(h, 4))
    train = tf.train.AdamOptimizer(0.01).minimize(
        loss, global_step=tf.train.get_or_create_global_step())
    counts = []
    with tf.train.MonitoredTrainingSession() as sess:
      for _ in range(4):
        time.sleep(1.05)                        # a progress report is due every step
        sess.run([loss, train])
        counts.append(len(g.get_operations()))
    assert counts[1] == counts[2] == counts[3], counts
