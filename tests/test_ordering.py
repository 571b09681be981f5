"""The one ordering invariant (epl/passes/ordering.py: every write of a variable in a training
step after every read of it in the step) and the race amplifier (``testing.race_delay_ms``,
epl/passes/race_delay.py).

Issue #48's minimal form: two ``replicate(1)`` stages with GPT-2's layer norm on 4 devices
(the pipeline replicated twice), ZeRO v1 / v2, 1, 2 and 4 micro-batches, the step written
three ways -- ``tf.gradients`` + ``apply_gradients`` without a global step (where a copy's
weight copy, or v2's one update, ran before a later micro-batch's input gradient read the
weight: 8e-3 to 4e-2 off, a different amount in each run), ``compute_gradients`` and
``minimize`` -- on ref and resource variables, the session opened before the model. The epl
runs take the race amplifier, so an edge the invariant left out fails here every time; the
local reference is race-free (``epl.testing.race_free_step``).
"""
import contextlib

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
import epl.passes
from epl.passes.ordering import verify
from epl.testing import race_free_step
from tests.real_scripts import gpt2_lm
from tests.real_scripts.harness import close
from tests.split_models import load_whole, whole_values

STYLES = ("tf.gradients", "compute_gradients", "minimize")
DELAY = 20                      # ms: the amplifier's delay of an unordered read


def _train(build, config=None, initial=None, feeds=(), scopes=None):
  """Builds ``build(scope)`` (-> (train_op, loss, {name: placeholder})) in a fresh graph with
  the session opened first, under epl with ``config`` (a dict; stage i's scope
  ``scopes(i)``) or locally (race-free steps), loads ``initial`` (whole values: split
  variables too) and runs a step per feed dict. Returns (losses, variables, initial, epl's
  ParallelGraph or None)."""
  graph = tf.Graph()
  with graph.as_default():
    tf.set_random_seed(1)
    if config is not None:
      epl.init(epl.Config(config))
    scope = scopes if config is not None else (lambda i: contextlib.nullcontext())
    with tf.Session() as sess:
      train_op, loss, placeholders = build(scope)
      variables = tf.global_variables()
      sess.run(tf.global_variables_initializer())
      if initial is not None:
        load_whole(sess, variables, initial)
      start = whole_values(sess, variables)
      losses = []
      for values in feeds:
        feed = {placeholders[k]: v for k, v in values.items()}
        losses.append(race_free_step(sess, train_op, feed, loss) if config is None else
                      sess.run([loss, train_op], feed)[0])
      return (losses, whole_values(sess, variables), start,
              epl.Graph.get() if config is not None else None)


def _step(loss, optimizer, style):
  """The train op, written the way ``style`` names."""
  opt = tf.train.GradientDescentOptimizer(0.5) if optimizer == "sgd" else \
      tf.train.AdamOptimizer(0.01)           # Adam's default epsilon
  tvars = tf.trainable_variables()
  if style == "tf.gradients":                # no global step, as published trainers
    return opt.apply_gradients(zip(tf.gradients(loss, tvars), tvars))
  step = tf.train.get_or_create_global_step()
  if style == "compute_gradients":
    return opt.apply_gradients(opt.compute_gradients(loss, tvars), global_step=step)
  return opt.minimize(loss, global_step=step)


def _two_stages(style, optimizer="sgd", resource=False):
  def build(scope):
    with tf.variable_scope("", use_resource=resource):
      x = tf.placeholder(tf.float32, [None, 16], name="x")
      y = tf.placeholder(tf.int64, [None], name="y")
      with scope(0):
        h = tf.layers.dense(x, 16, tf.nn.relu, name="d0")
        h = tf.layers.dense(gpt2_lm.norm(h, "ln0"), 16, tf.nn.relu, name="d1")
      with scope(1):
        h = tf.layers.dense(gpt2_lm.norm(h, "ln1"), 16, tf.nn.relu, name="d2")
        loss = tf.losses.sparse_softmax_cross_entropy(y, tf.layers.dense(h, 10, name="d3"))
      return _step(loss, optimizer, style), loss, {"x": x, "y": y}
  return build


def _feeds(steps=3, rows=16, seed=0):
  rng = np.random.RandomState(seed)
  return [{"x": rng.randn(rows, 16).astype(np.float32), "y": rng.randint(0, 10, rows)}
          for _ in range(steps)]


def _stages(i):
  return epl.replicate(1, name="stage%d" % i)


def _same(local, build, config, feeds, scopes=_stages):
  dist = _train(build, config, local[2], feeds, scopes=scopes)
  close("loss per step", dist[0], local[0])
  for name, value in local[1].items():
    close("variable %s" % name, dist[1][name], value)
  return dist[3]


# (every level x micro-batch count, 10 runs each: python bench/same_model.py)
@pytest.mark.parametrize("level,micro", [("v1", 1), ("v1", 2), ("v2", 2), ("v1", 4)])
def test_zero_with_replicated_pipeline_stages_trains_the_local_model_whichever_way_the_step_is_written(
    level, micro):
  feeds = _feeds()
  config = {"cluster.devices_per_worker": 4, "pipeline.num_micro_batch": micro,
            "zero.level": level, "testing.race_delay_ms": DELAY}
  for style in STYLES:
    _same(_train(_two_stages(style), feeds=feeds), _two_stages(style), config, feeds)


def test_zero_with_replicated_pipeline_stages_and_adam_on_resource_variables():
  resource = True        # (ref variables with Adam: the matrix's cells, bench/same_model.py)
  feeds = _feeds()
  for style in ("tf.gradients", "minimize"):
    local = _train(_two_stages(style, "adam", resource), feeds=feeds)
    for level in ("v1", "v2"):
      config = {"cluster.devices_per_worker": 4, "pipeline.num_micro_batch": 2,
                "zero.level": level, "testing.race_delay_ms": DELAY}
      _same(local, _two_stages(style, "adam", resource), config, feeds)


# ---- GPT-2 as OpenAI's model.py and the usual fine-tuning trainer write it ------------------
def _gpt2_trainer(scope):
  """model.py's GPT-2 (tests/real_scripts/gpt2_lm.py) with the trainer's step: tf.gradients,
  apply_gradients without a global step, the session opened first (by _train)."""
  context = tf.placeholder(tf.int32, [None, gpt2_lm.CTX + 1], name="context")
  logits = gpt2_lm.model(context[:, :-1], scope)
  with scope(1):
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=context[:, 1:], logits=logits))
  tvars = [v for v in tf.trainable_variables() if "model" in v.name]
  opt = tf.train.AdamOptimizer(0.01, epsilon=1e-5)   # gpt2_lm.build says why not 1e-8
  train_op = opt.apply_gradients(zip(tf.gradients(loss, tvars), tvars))
  return train_op, loss, {"context": context}


@pytest.mark.parametrize("micro,extra", [(4, {"gradient_checkpoint.type": "auto"})],
                         ids=["m4+checkpointing"])       # m2: bench/same_model.py
def test_gpt2_trainer_with_dp_pp_tp_and_zero_trains_the_local_model(micro, extra):
  feeds = [{"context": c} for c in np.split(gpt2_lm.make_data(16 * 2)["context"], 2)]
  local = _train(_gpt2_trainer, feeds=feeds)
  config = dict({"cluster.devices_per_worker": 8, "pipeline.num_micro_batch": micro,
                 "zero.level": "v1", "testing.race_delay_ms": DELAY}, **extra)
  _same(local, _gpt2_trainer, config, feeds, scopes=lambda i: epl.split(2, name="stage%d" % i))


# ---- the invariant, checked and amplified --------------------------------------------------
def _rewritten(build, config, scopes=_stages):
  graph = tf.Graph()
  with graph.as_default():
    epl.init(epl.Config(config))
    build(scopes)
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
    return graph, epl.Graph.get()


def _without_ordering(monkeypatch):
  monkeypatch.setattr(epl.passes, "PASSES", tuple(
      p for p in epl.passes.PASSES if p.__name__ != "writes_after_reads"))


def test_verify_names_each_read_a_write_does_not_wait_for(monkeypatch):
  config = {"cluster.devices_per_worker": 4, "pipeline.num_micro_batch": 2, "zero.level": "v1",
            "graph.micro_batches": "clones"}
  graph, pg = _rewritten(_two_stages("tf.gradients"), config)
  assert verify(graph, pg.results["analyze"].train_ends) == []
  ordering = pg.results["writes_after_reads"]
  assert ordering.edges > 0 and ordering.writes["zero"] > 0, ordering   # ZeRO's weight copies
  assert "zero" in str(ordering)
  _without_ordering(monkeypatch)
  graph, pg = _rewritten(_two_stages("tf.gradients"), config)
  pairs = verify(graph, pg.results["analyze"].train_ends)
  # a later micro-batch's input gradient of d2 reads d2's kernel; ZeRO's copy of the owner's
  # updated kernel (or the owner's update) did not wait for it
  assert any(r.startswith("EPL_MB_1_") and "d2/MatMul_grad/MatMul" in r and "d2/kernel" in w
             for r, w in pairs), pairs


@pytest.mark.parametrize("case", ["zero", "beta_powers"])
def test_the_amplifier_turns_a_missing_edge_into_a_failure_every_time(monkeypatch, case):
  """Without the ordering pass (the historical races, all at once), every amplified run
  trains another model; with it, the same amplified runs train the local one."""
  if case == "zero":                 # #48: ZeRO, replicated stages, explicit tf.gradients
    build, feeds = _two_stages("tf.gradients"), _feeds(steps=1)
    config = {"cluster.devices_per_worker": 4, "pipeline.num_micro_batch": 2,
              "zero.level": "v1", "graph.micro_batches": "clones"}
    scopes = _stages
  else:                              # a 1:2 pipeline with Adam: copy 1's reads of copy 0's
    build, feeds = _two_stages("minimize", "adam"), _feeds(steps=2)   # beta powers
    config = {"cluster.devices_per_worker": 3, "pipeline.num_micro_batch": 1}
    scopes = lambda i: epl.replicate(1 + i, name="stage%d" % i)       # noqa: E731
  local = _train(build, feeds=feeds)
  amplified = dict(config, **{"testing.race_delay_ms": DELAY})
  pg = _same(local, build, amplified, feeds, scopes)
  assert pg.results["race_delay"].reads > 0, pg.results["race_delay"]
  _without_ordering(monkeypatch)
  for _ in range(3):
    with pytest.raises(AssertionError, match="differs"):
      _same(local, build, amplified, feeds, scopes)


def test_stage_functions_order_a_stages_reads_before_its_writes_by_construction(monkeypatch):
  """#48's race as stage functions: a call hands on its results only when its whole body ran,
  so every read of a stage's weights (the later micro-batch's input gradient of d2 too) is
  done before the last call's sums exist -- before any write of them. verify() still names
  the calls (they read the weights; it does not follow the data edges), and without the
  ordering pass the amplified runs train the local model."""
  build, feeds = _two_stages("tf.gradients"), _feeds(steps=1)
  config = {"cluster.devices_per_worker": 4, "pipeline.num_micro_batch": 2, "zero.level": "v1",
            "graph.micro_batches": "functions"}
  _without_ordering(monkeypatch)
  graph, pg = _rewritten(build, config)
  assert pg.results["micro_batch"].calls is not None
  pairs = verify(graph, pg.results["analyze"].train_ends)
  assert any(r.startswith("epl_stage_") and "d2/kernel" in w for r, w in pairs), pairs
  local = _train(build, feeds=feeds)
  for _ in range(2):
    _same(local, build, dict(config, **{"testing.race_delay_ms": DELAY}), feeds)
