"""The same model on the programs people actually run (issue: transformers with tf.gradients,
weights read through reshape, sessions opened first, GANs, small fed vectors).

Every epl run is compared with the race-free local run (``epl.testing.race_free_step``: the
step's reads, then its updates) at 1e-5. The first five tests are the reduced programs of the
five faults; then a GPT-2-style language model (tests/real_scripts/gpt2_lm.py) and a GAN
(tests/real_scripts/gan.py) in several layouts, each repeated: a race shows as a run that
differs.
"""
import contextlib
import os

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.testing import race_free_step, step_cut
from epl.testing.values import load_values, read_values
from tests.real_scripts import gan, gpt2_lm
from tests.real_scripts.harness import MODES, Mode, assert_same_training, close, run, steps_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(build, config=None, initial=None, feeds=(), session_first=False, scopes=None):
  """Builds ``build(scope)`` (-> (train_op, loss, {name: placeholder})) in a fresh graph, under
  epl with ``config`` (a dict) or locally, loads ``initial`` and runs one step per feed dict
  of ``feeds`` ({placeholder name: value}); the local run takes each step race-free.
  ``scopes``: i -> the epl scope of stage i (default: none). Returns (losses, variables,
  initial values)."""
  graph = tf.Graph()
  with graph.as_default():
    tf.set_random_seed(1)
    if config is not None:
      epl.init(epl.Config(config))
    scope = LOCAL if config is None else scopes or (lambda i: contextlib.nullcontext())
    session = tf.Session() if session_first else None
    with session or contextlib.nullcontext():
      train_op, loss, placeholders = build(scope)
      variables = tf.global_variables()
      sess = session or tf.Session()
      with contextlib.nullcontext() if session else sess:
        sess.run(tf.global_variables_initializer())
        if initial is not None:
          load_values(sess, variables, lambda v: initial[v.op.name])
        start = read_values(sess, variables)
        losses = []
        for values in feeds:
          feed = {placeholders[k]: v for k, v in values.items()}
          if config is None:
            losses.append(race_free_step(sess, train_op, feed, loss))
          else:
            losses.append(sess.run([loss, train_op], feed)[0])
        return losses, read_values(sess, variables), start


def LOCAL(_):                   # noqa: N802  the local run's stage scopes: none
  return contextlib.nullcontext()


def _same(build, config, feeds, scopes=None, session_first=False, repeats=1):
  local = _train(build, feeds=feeds)
  for _ in range(repeats):
    dist = _train(build, config, local[2], feeds, session_first, scopes)
    close("loss per step", dist[0], local[0])
    for name, value in local[1].items():
      close("variable %s" % name, dist[1][name], value)
  return local


def _stages(i):
  return epl.replicate(1, name="stage%d" % i)


# ---- the five reduced programs ------------------------------------------------------------
def _pipeline_mlp(scope):
  x = tf.placeholder(tf.float32, [None, 16], name="x")
  y = tf.placeholder(tf.int64, [None], name="y")
  with scope(0):
    h = tf.layers.dense(x, 16, tf.nn.relu, name="d0")
    h = tf.layers.dense(h, 16, tf.nn.relu, name="d1")
  with scope(1):
    h = tf.layers.dense(h, 16, tf.nn.relu, name="d2")
    loss = tf.losses.sparse_softmax_cross_entropy(y, tf.layers.dense(h, 10, name="d3"))
  tvars = tf.trainable_variables()
  grads = tf.gradients(loss, tvars)
  train_op = tf.train.GradientDescentOptimizer(1.0).apply_gradients(zip(grads, tvars))
  return train_op, loss, {"x": x, "y": y}


def _mlp_feeds(steps=1, rows=48, seed=0):
  rng = np.random.RandomState(seed)
  return [{"x": rng.randn(rows, 16).astype(np.float32), "y": rng.randint(0, 10, rows)}
          for _ in range(steps)]


@pytest.mark.parametrize("micro", [2, 4])
def test_pipeline_micro_batches_with_explicit_tf_gradients_train_the_local_model(micro):
  """``tf.gradients`` does not gate an op's gradients together (compute_gradients does): a
  later micro-batch's input gradient of d2 reads d2's kernel and is upstream of no update of
  d2; d2's update ran first, and stage 0 trained on gradients through the new kernel."""
  _same(_pipeline_mlp, {"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": micro},
        _mlp_feeds(2), scopes=_stages)


def _late_reader(scope):
  del scope
  x = tf.placeholder(tf.float32, [None, 64], name="x")
  v = tf.get_variable("v", [64, 64])
  w = tf.get_variable("w", [1, 64, 64])
  rw = tf.reshape(w, [64, 64])
  h = tf.matmul(x, v)
  slow = h
  for _ in range(200):                       # a late reader of rw
    slow = tf.tanh(slow * 1.01)
  loss = tf.reduce_mean(tf.square(tf.matmul(h, rw))) + \
      tf.reduce_mean(tf.square(tf.matmul(slow, tf.stop_gradient(rw))))
  grads = tf.gradients(loss, [v, w])
  train_op = tf.train.GradientDescentOptimizer(1.0).apply_gradients(zip(grads, [v, w]))
  return train_op, loss, {"x": x}


def test_a_weight_read_through_reshape_is_updated_after_every_read_of_it():
  """GPT-2's conv1d reads every weight as tf.reshape(w, [-1, nf]): the Reshape hands the
  variable's buffer on, so the op that really reads it (here a matmul after 200 tanh) must
  run before the update; it differed by up to 2e-4, from run to run."""
  rng = np.random.RandomState(0)
  feeds = [{"x": rng.randn(256, 64).astype(np.float32)}]
  config = {"cluster.devices_per_worker": 2}
  local = _train(_late_reader, feeds=feeds)
  for _ in range(3):
    graph = tf.Graph()
    with graph.as_default():
      tf.set_random_seed(1)
      epl.init(epl.Config(config))
      epl.set_default_strategy(epl.replicate(1))
      train_op, _, placeholders = _late_reader(None)
      variables = tf.global_variables()
      with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        load_values(sess, variables, lambda v: local[2][v.op.name])
        sess.run(train_op, {placeholders["x"]: feeds[0]["x"]})
        out = read_values(sess, variables)
      ordering = epl.Graph.get().results["writes_after_reads"]
    for name, value in local[1].items():
      close("variable %s" % name, out[name], value)
    assert ordering.edges > 0


def test_the_late_reader_is_what_the_update_waits_for():
  """Structure: copy 0's update of ``w`` waits for the matmul reading ``tf.stop_gradient(
  tf.reshape(w))`` (through two aliasing ops), in every copy."""
  graph = tf.Graph()
  with graph.as_default():
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    epl.set_default_strategy(epl.replicate(1))
    train_op, _, placeholders = _late_reader(None)
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(train_op, {placeholders["x"]: np.ones([4, 64], np.float32)})
    updates = [op for op in graph.get_operations() if op.type == "ApplyGradientDescent" and
               "update_w" in op.name]
    assert len(updates) == 2
    for update in updates:
      prefix = update.name.split("GradientDescent")[0]
      late = [op for op in update.control_inputs if op.type == "MatMul" and
              any(t.op.type == "StopGradient" for t in op.inputs)]
      # the forward matmul and its input gradient both read it
      assert len(late) == 2 and all(op.name.startswith(prefix) for op in late), (
          update.name, [op.name for op in update.control_inputs])


def _session_first_model(scope):
  x = tf.placeholder(tf.float32, [None, 8], name="x")
  y = tf.placeholder(tf.int64, [None], name="y")
  with scope(0):
    h = tf.layers.dense(x, 8, tf.nn.relu)
  with scope(1):
    loss = tf.losses.sparse_softmax_cross_entropy(y, tf.layers.dense(h, 4))
  train_op = tf.train.AdamOptimizer(0.01).minimize(
      loss, global_step=tf.train.get_or_create_global_step())
  return train_op, loss, {"x": x, "y": y}


def _small_feeds(steps=3, rows=16):
  rng = np.random.RandomState(2)
  return [{"x": rng.randn(rows, 8).astype(np.float32), "y": rng.randint(0, 4, rows)}
          for _ in range(steps)]


@pytest.mark.parametrize("layout", ["default strategy", "pipeline with micro-batches"])
def test_a_session_opened_before_the_model_is_built_trains_the_local_model(layout):
  """``with tf.Session() as sess:`` first, the model built inside it (GPT-2 fine-tuning,
  DCGAN): the session gets the settings the Config decides, the rewrite waits for the first
  run (it raised ZeroDivisionError planning the empty graph)."""
  if layout == "default strategy":
    config, scopes = {"cluster.devices_per_worker": 2}, None

    def build(scope):
      if scope is not LOCAL:
        epl.set_default_strategy(epl.replicate(1))
      return _session_first_model(scope)
  else:
    config, scopes = {"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": 2}, _stages
    build = _session_first_model
  _same(build, config, _small_feeds(), scopes=scopes, session_first=True)


def test_an_optimizer_built_after_the_first_run_is_refused():
  graph = tf.Graph()
  with graph.as_default():
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    epl.set_default_strategy(epl.replicate(1))
    _, loss, placeholders = _session_first_model(lambda i: contextlib.nullcontext())
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      with pytest.raises(epl.errors.RuntimeStateError, match="after the graph's first "
                         "Session.run.*Build every train op before the first session.run"):
        tf.train.GradientDescentOptimizer(0.1).minimize(loss)


def test_two_train_ops_with_their_own_feeds_never_share_a_gradient_bucket():
  """A GAN's generator step feeds only noise: a bucket fusing its gradients with the
  discriminator's made it demand the real images."""
  graph = tf.Graph()
  with graph.as_default():
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    epl.set_default_strategy(epl.replicate(1))
    t = gan.build(lambda i: contextlib.nullcontext())
    real, noise = gan.make_data(8)
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(t["d_train"], {t["real"]: real, t["z"]: noise, t["is_training"]: True})
      sess.run(t["g_train"], {t["z"]: noise, t["is_training"]: True})
    buckets = epl.Graph.get().results["gradient_sync"].buckets
  for bucket in buckets:
    assert len({name.split("/")[0] for name in bucket}) == 1, buckets


def _keep_probs(scope):
  del scope
  x = tf.placeholder(tf.float32, [None, 8], name="x")
  y = tf.placeholder(tf.int64, [None], name="y")
  keep = tf.placeholder(tf.float32, [None], name="keep")
  h = tf.nn.dropout(tf.layers.dense(x, 8, tf.nn.relu), rate=1 - keep[0])
  h = tf.nn.dropout(tf.layers.dense(h, 8, tf.nn.relu), rate=1 - keep[1])
  loss = tf.losses.sparse_softmax_cross_entropy(y, tf.layers.dense(h, 4))
  train_op = tf.train.GradientDescentOptimizer(0.5).minimize(loss)
  return train_op, loss, {"x": x, "y": y, "keep": keep}


def test_a_fed_vector_the_graph_indexes_goes_whole_to_every_copy():
  """Per-layer keep-probs fed as [1.0, 1.0] to a [None] placeholder with a 16-row batch: 2
  divides 16, so the length rule cut it like the batch (slice index 1 out of bounds inside
  EPL_REPLICA_1). The graph only picks its elements: it is not a batch."""
  feeds = [dict(f, keep=np.ones([2], np.float32)) for f in _small_feeds()]
  local = _train(_keep_probs, feeds=feeds)
  graph = tf.Graph()
  with graph.as_default():
    tf.set_random_seed(1)
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    epl.set_default_strategy(epl.replicate(1))
    train_op, loss, p = _keep_probs(None)
    variables = tf.global_variables()
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      load_values(sess, variables, lambda v: local[2][v.op.name])
      losses = [sess.run([loss, train_op], {p[k]: v for k, v in f.items()})[0] for f in feeds]
      out = read_values(sess, variables)
    assert "keep" not in [op.name for op in epl.Graph.get().analysis.batch_placeholders]
  close("loss per step", losses, local[0])
  for name, value in local[1].items():
    close("variable %s" % name, out[name], value)


def test_a_fed_vector_cut_like_the_batch_is_named_in_the_error():
  """A settings vector the graph uses otherwise than by fixed indices is still cut when its
  length divides the batch's rows; TF's error then points inside epl's copies, so epl adds
  which fed values it cut and the fix."""
  graph = tf.Graph()
  with graph.as_default():
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    epl.set_default_strategy(epl.replicate(1))
    x = tf.placeholder(tf.float32, [None, 8], name="x")
    keep = tf.placeholder(tf.float32, [None], name="keep")
    scaled = keep * 1.0
    h = tf.layers.dense(x, 8) * scaled[1]
    train_op = tf.train.GradientDescentOptimizer(0.5).minimize(tf.reduce_mean(h))
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match=r"(?s)'keep' \(2 rows -> 1/1\).*tf.placeholder\(tf.float32, "
                               r"\[2\]\)"):
        sess.run(train_op, {x: np.ones([16, 8]), keep: [1.0, 1.0]})


# ---- the reference itself ------------------------------------------------------------------
def test_the_race_free_step_computes_every_update_input_before_any_update():
  graph = tf.Graph()
  with graph.as_default():
    train_op, _, _ = _late_reader(None)
    cut = step_cut(train_op)
    names = [t.name for t in cut]
    # the two gradients and the learning rate; nothing computed after an update
    assert len(names) == 3 and all("gradients" in n or "learning_rate" in n
                                   for n in names), names


# ---- a GPT-2-style language model ----------------------------------------------------------
LM_STEPS = 3
LM_MODES = {
    "dp2": MODES["dp2"],
    "pipeline2_m4": MODES["pipeline2_m4"],
    "pipeline2 x dp2_m4": Mode(4, 4, 2),
}


def _lm(mode, grads, batch=2, repeats=3):
  m = LM_MODES[mode]
  rows = m.pieces * batch
  data = gpt2_lm.make_data(rows * LM_STEPS)
  local = run(gpt2_lm, rows, data, steps_of(rows, LM_STEPS), race_free=True,
              build=dict(grads=grads))
  for _ in range(repeats):
    dist = run(gpt2_lm, batch, data, steps_of(rows, LM_STEPS), mode=m, initial=local.initial,
               build=dict(grads=grads))
    assert_same_training(local, dist)
  return local, dist


@pytest.mark.parametrize("mode", sorted(LM_MODES))
def test_gpt2_style_lm_with_tf_gradients_clipping_and_tied_embeddings(mode):
  """conv1d weights [1, nx, nf] read through reshape, layer norm, residuals crossing the stage
  boundary, causal attention, wte tied to the logits (read by both stages: its gradient is
  summed from both), Adam with tf.gradients + clip_by_global_norm + apply_gradients."""
  _, dist = _lm(mode, "tf.gradients")
  if mode != "dp2":
    plan = dist.parallel.plan
    owner = plan.op_index["model/wte"][0]
    readers = {plan.op_index[op.name][0] for op in
               dist.parallel.graph.get_operation_by_name("model/wte/read").outputs[0].consumers()
               if op.name in plan.op_index}
    assert owner == 0 and readers == {0, 1}, readers     # the weight is read in both stages


# the two other ways to write the step, on the pipeline (every way on every layout of the
# matrix model: tests/test_combinations.py; GPT-2 on DP 2 with tf.gradients above)
@pytest.mark.parametrize("grads", ["minimize", "compute_gradients"])
def test_gpt2_style_lm_trained_with_minimize_or_compute_gradients(grads):
  _lm("pipeline2_m4", grads)


# ---- a GAN ---------------------------------------------------------------------------------
GAN_MODES = {"dp2": MODES["dp2"], "pipeline2_m1": Mode(2, 1, 2)}


def _run_gan(mode, local=False, initial=None, steps=3, batch=8):
  """Alternate discriminator (real images + noise) and generator (noise only) steps, under epl
  in ``mode`` or (``local``) the local script on the same rows, race-free. Batch norm runs in
  training mode, but on its moving statistics under DP (its statistics in training mode are
  per copy by design: user guide)."""
  m = GAN_MODES[mode]
  rows = batch * m.pieces
  training = m.stages > 1
  real, noise = gan.make_data(rows * steps * 2)
  graph = tf.Graph()
  with graph.as_default():
    tf.set_random_seed(5)
    scope = lambda i: contextlib.nullcontext()        # noqa: E731
    if not local:
      epl.init(m.config())
      if m.stages == 1:
        epl.set_default_strategy(epl.replicate(1))
      else:
        scope = _stages
    t = gan.build(scope)
    variables = tf.global_variables()
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      if initial is not None:
        load_values(sess, variables, lambda v: initial[v.op.name])
      start = read_values(sess, variables)
      losses = []
      for s in range(steps):
        d_rows = slice(2 * s * rows, (2 * s + 1) * rows)
        g_rows = slice((2 * s + 1) * rows, (2 * s + 2) * rows)
        d_feed = {t["real"]: real[d_rows], t["z"]: noise[d_rows], t["is_training"]: training}
        g_feed = {t["z"]: noise[g_rows], t["is_training"]: training}
        for loss, train, feed in ((t["d_loss"], t["d_train"], d_feed),
                                  (t["g_loss"], t["g_train"], g_feed)):
          if local:
            losses.append(race_free_step(sess, train, feed, loss))
          else:
            losses.append(sess.run([loss, train], feed)[0])
      return losses, read_values(sess, variables), start


@pytest.mark.parametrize("mode", sorted(GAN_MODES))
def test_gan_with_two_optimizers_their_own_feeds_and_batch_norm(mode):
  """dp2: batch norm on its moving statistics; pipeline2_m1: the generator and the
  discriminator in two stages, batch norm in training mode on the whole batch. The generator
  step feeds no real images."""
  local = _run_gan(mode, local=True)
  for _ in range(3):
    dist = _run_gan(mode, initial=local[2])
    close("loss per step", dist[0], local[0])
    for name, value in local[1].items():
      close("variable %s" % name, dist[1][name], value)


def test_gpt2_style_lm_on_two_workers(tmp_path):
  """2 workers x 1 device under epl-launch: each worker feeds its half of every step."""
  from tests.test_multiworker import launch
  workers, batch = 2, 4
  rows = workers * batch
  data = gpt2_lm.make_data(rows * LM_STEPS)
  local = run(gpt2_lm, rows, data, steps_of(rows, LM_STEPS), race_free=True)
  np.savez(tmp_path / "data.npz", **data)
  np.savez(tmp_path / "initial.npz", **local.initial)
  worker = os.path.join(ROOT, "tests", "workers", "script_worker.py")
  for repeat in range(3):                 # a race shows as a run that differs
    out = launch(["--num_workers", str(workers), "--gpu_per_worker", "1", "--log_dir",
                  str(tmp_path / "logs"), worker, str(tmp_path), "gpt2_lm", str(LM_STEPS),
                  str(batch)])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = [dict(np.load(tmp_path / ("worker_%d.npz" % w))) for w in range(workers)]
    close("run %d: loss per step" % repeat,
          np.mean([r["__losses__"] for r in results], axis=0), local.losses)
    for w, r in enumerate(results):
      for name, value in local.variables.items():
        close("run %d, worker %d: variable %s" % (repeat, w, name), r[name], value)
