"""Gradient accumulation as session runs (graph.micro_batches): one model copy per device in
the graph, each step R runs, the update in the last -- the same model as the local script and
as micro-batch clones, a graph that does not grow with R, one fetch signature per step."""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.errors import NotImplementedYetError
from tests import models
from epl.testing.values import load_values, read_values

STEPS = 4


def _model(x, y, bn):
  h = tf.layers.dense(x, 16, activation=tf.nn.relu, name="d0")
  if bn:                   # statistics of each micro-batch: not the local model's, the clones'
    h = tf.layers.batch_normalization(h, training=True, name="bn")
  logits = tf.layers.dense(h, 4, name="d1")
  return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits), logits


def _train(rows, config=None, initial=None, bad_step=None, spy=None, bn=False):
  """Trains the model STEPS steps on ``rows`` rows each (fed to [None] placeholders); returns
  start values, end values, per-step (loss, logits), the ops in the graph."""
  data = models.regression_data(rows * STEPS, np.random.RandomState(3))
  g = tf.Graph()
  with g.as_default():
    tf.set_random_seed(1)
    if config is not None:
      epl.init(epl.Config(config))
      epl.set_default_strategy(epl.replicate(1))
    x = tf.placeholder(tf.float32, [None, 8])
    y = tf.placeholder(tf.int64, [None])
    checked = tf.debugging.assert_non_negative(y)    # a bad batch fails inside the step
    with tf.control_dependencies([checked]):
      loss, logits = _model(tf.identity(x), y, bn)
    with tf.control_dependencies(tf.get_collection(tf.GraphKeys.UPDATE_OPS)):
      train = tf.train.AdamOptimizer(0.01).minimize(loss)
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      variables = tf.global_variables()
      if initial:
        load_values(sess, variables, lambda v: initial[v.op.name])
      start = read_values(sess, variables)
      if spy is not None:
        spy(sess)
      out = []
      for s in range(STEPS):
        feed = {x: data[0][s * rows:(s + 1) * rows], y: data[1][s * rows:(s + 1) * rows]}
        if s == bad_step:
          feed[y] = np.where(np.arange(rows) == rows - 1, -1, feed[y])   # in the last run
          with pytest.raises(tf.errors.InvalidArgumentError):
            sess.run([train, loss], feed)
          continue
        _, l, p = sess.run([train, loss, logits], feed)
        out.append((l, p))
      return start, read_values(sess, variables), out, len(g.get_operations())


def _config(devices, micro, how):
  return {"cluster.devices_per_worker": devices, "pipeline.num_micro_batch": micro,
          "graph.micro_batches": how}


@pytest.mark.parametrize("devices, rows, bn", [(1, 8, False), (2, 16, False), (2, 13, False),
                                              (2, 16, True)])
def test_runs_train_the_local_model_and_fetch_what_clones_fetch(devices, rows, bn):
  # 13 rows over 2 copies x 4 micro-batches: pieces of 2 and 1 rows, weighted by their rows;
  # with batch norm (training mode) both train on each micro-batch's statistics
  start, local, local_out, _ = _train(rows, bn=bn)
  results = {how: _train(rows, _config(devices, 4, how), start, bn=bn)
             for how in ("runs", "clones")}
  (_, runs, runs_out, _), (_, clones, clones_out, _) = results["runs"], results["clones"]
  for name, value in local.items():
    np.testing.assert_allclose(runs[name], clones[name], rtol=1e-5, atol=1e-6, err_msg=name)
    if not bn:
      np.testing.assert_allclose(runs[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
  for (l, p), (cl, cp), (ll, lp) in zip(runs_out, clones_out, local_out):
    np.testing.assert_allclose(l, cl, rtol=1e-5)                  # the mean over pieces
    np.testing.assert_allclose(p, cp, rtol=1e-5, atol=1e-6)       # every row, in order
    assert p.shape == (rows, 4)
    if not bn:
      np.testing.assert_allclose(l, ll, rtol=1e-5)
      np.testing.assert_allclose(p, lp, rtol=1e-5, atol=1e-6)


def test_the_graph_does_not_grow_with_the_micro_batches():
  ops = {how: _train(16, _config(2, 4, how))[3] for how in ("runs", "clones")}
  one = _train(16, _config(2, 1, "auto"))[3]
  assert ops["runs"] < one * 1.3 < ops["clones"] / 2, (ops, one)


def test_a_step_is_one_fetch_signature():
  signatures = []

  def spy(sess):
    tf_run = sess._do_run

    def run(handle, targets, fetches, *args):
      signatures.append((tuple(sorted(str(t) for t in targets)),
                         tuple(sorted(str(f) for f in fetches))))
      return tf_run(handle, targets, fetches, *args)
    sess._do_run = run
  _train(16, _config(2, 4, "runs"), spy=spy)
  # STEPS x (3 accumulate runs + 1 update run), all alike: TF compiles the step once
  steps = signatures[:4 * STEPS]
  assert len(set(steps)) == 1 and "epl_accumulate" in str(steps[0]), set(steps)


def test_a_run_adds_its_weighted_gradient_in_place():
  # mean and row weights: each run's gradient times its factor is added by one fused kernel
  # into the sum, not multiplied into a gradient-sized tensor first (docs/benchmarks.md)
  seen = {}

  def spy(sess):
    ops = [op for op in sess.graph.get_operations() if op.name.startswith("epl_grad_sync/")]
    seen["adds"] = [op for op in ops if op.type == "ResourceApplyGradientDescent"]
    seen["other"] = [op for op in ops if op.type in ("AssignAddVariableOp", "Mul") and
                     op.inputs[0].shape.num_elements() not in (None, 1) and
                     "/epl_all_reduce" not in op.name]     # (the mean over copies: last run)
  _train(13, _config(2, 4, "runs"), spy=spy)
  assert len(seen["adds"]) == 4 * 2, seen["adds"]          # 4 variables x 2 copies
  assert not seen["other"], seen["other"]


def test_a_step_that_fails_between_its_runs_leaves_no_partial_sum():
  # the failing step's last run is rejected after its earlier runs added to the sums: the
  # next step must start from zero sums (the local step failed whole: nothing updated)
  start, local, _, _ = _train(16, bad_step=1)
  _, end, _, _ = _train(16, _config(2, 4, "runs"), start, bad_step=1)
  for name, value in local.items():
    np.testing.assert_allclose(end[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_runs_refused_where_they_do_not_apply():
  g = tf.Graph()
  with g.as_default():
    epl.init(epl.Config({"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": 2,
                         "graph.micro_batches": "runs"}))
    x = tf.placeholder(tf.float32, [None, 8])
    y = tf.placeholder(tf.int64, [None])
    loss = models.mlp_two_stages(x, y, lambda i: epl.replicate(1, name="stage_%d" % i))
    train = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    with pytest.raises(NotImplementedYetError, match="graph.micro_batches 'runs'.*2 stages"):
      with tf.Session() as sess:
        sess.run(train, {x: np.zeros([4, 8]), y: np.zeros([4])})


def test_runs_refused_for_a_sparse_gradient_clipped_by_the_global_norm():
  """A norm over the local IndexedSlices counts a row once per lookup; the runs' summed rows
  give another norm: auto keeps clones (tests/test_resource_variables.py, GPT-2), runs is an
  error naming the variable."""
  g = tf.Graph()
  with g.as_default():
    epl.init(epl.Config(_config(1, 2, "runs")))
    epl.set_default_strategy(epl.replicate(1))
    x = tf.placeholder(tf.int64, [None, 3])
    table = tf.get_variable("table", [40, 8])
    loss = tf.reduce_sum(tf.nn.embedding_lookup(table, x))
    grads, _ = tf.clip_by_global_norm(tf.gradients(loss, [table]), 1.0)
    train = tf.train.GradientDescentOptimizer(0.1).apply_gradients(zip(grads, [table]))
    with pytest.raises(NotImplementedYetError, match="graph.micro_batches 'runs'.*'table' has "
                       "a sparse gradient .*clip_by_global_norm.*use 'auto'"):
      with tf.Session() as sess:
        sess.run(train, {x: np.zeros([4, 3])})


def _steps(config, initial, seed, model, batches):
  """Trains ``model()`` -> (placeholders, loss, train) one step per feed of ``batches`` (tuples
  for the placeholders), from ``initial`` values if given; returns start values, end values
  and the losses."""
  g = tf.Graph()
  with g.as_default():
    tf.set_random_seed(seed)
    if config:
      epl.init(epl.Config(config))
      epl.set_default_strategy(epl.replicate(1))
    placeholders, loss, train = model()
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      if initial:
        load_values(sess, tf.global_variables(), lambda v: initial[v.op.name])
      start = read_values(sess, tf.global_variables())
      losses = [sess.run([train, loss], dict(zip(placeholders, batch)))[1] for batch in batches]
      return start, read_values(sess, tf.global_variables()), losses


def _embedding_step(config, initial, optimizer):
  rng = np.random.RandomState(5)
  ids, labels = rng.randint(0, 30, [4, 16, 3]), rng.randint(0, 4, [4, 16])

  def model():
    x = tf.placeholder(tf.int64, [None, 3])
    y = tf.placeholder(tf.int64, [None])
    table = tf.get_variable("table", [40, 8])        # rows 30..39 never touched
    h = tf.reduce_mean(tf.nn.embedding_lookup(table, x), axis=1)
    loss = tf.losses.sparse_softmax_cross_entropy(y, tf.layers.dense(h, 4, name="out"))
    opt = {"momentum": tf.train.MomentumOptimizer(0.5, 0.9),
           "adam": tf.train.AdamOptimizer(0.05)}[optimizer]
    return (x, y), loss, opt.minimize(loss)
  return _steps(config, initial, 2, model, list(zip(ids, labels)))


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_sparse_gradients_stay_sparse_over_the_runs(optimizer):
  # Momentum's sparse update moves only the rows the step's batch touched: the sum over the
  # runs must be the union of their rows, not a dense gradient
  start, local, local_losses = _embedding_step(None, None, optimizer)
  _, end, losses = _embedding_step(_config(2, 4, "runs"), start, optimizer)
  np.testing.assert_allclose(losses, local_losses, rtol=1e-5)
  for name, value in local.items():
    np.testing.assert_allclose(end[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def _float64_steps(config, initial):
  """A float64 regression (its gradients, factors and sums float64) on 13 rows a step."""
  rng = np.random.RandomState(7)
  xs, ys = rng.randn(3, 13, 5), rng.randn(3, 13, 1)

  def model():
    x = tf.placeholder(tf.float64, [None, 5])
    y = tf.placeholder(tf.float64, [None, 1])
    w = tf.get_variable("w", [5, 1], tf.float64)
    b = tf.get_variable("b", [1], tf.float64, initializer=tf.zeros_initializer())
    loss = tf.reduce_mean(tf.square(tf.matmul(tf.tanh(x), w) + b - y))
    return (x, y), loss, tf.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
  return _steps(config, initial, 3, model, list(zip(xs, ys)))


@pytest.mark.parametrize("how", ["runs", "clones"])
def test_float64_gradients_are_summed_in_their_dtype(how):
  # 13 rows over 2 copies x 4 micro-batches: uneven pieces, each weighted by its rows -- row
  # weights, sums and fetched means in float64 (float32 weights lost ~4e-8 of each)
  start, local, local_losses = _float64_steps(None, None)
  _, end, losses = _float64_steps(_config(2, 4, how), start)
  np.testing.assert_allclose(losses, local_losses, rtol=1e-12)
  for name, value in local.items():
    assert end[name].dtype == np.float64
    np.testing.assert_allclose(end[name], value, rtol=1e-12, atol=1e-13, err_msg=name)
