"""epl.profiler: a TF model profiled per layer, in the format epl-plan reads."""
import dataclasses

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.plan.auto.profile import Profile

BATCH, WIDTH, FEATURES = 64, 128, 32


def _model():
  x = tf.placeholder(tf.float32, [BATCH, FEATURES], name="x")
  y = tf.placeholder(tf.int64, [BATCH], name="y")
  with tf.variable_scope("embed"):
    h = tf.layers.dense(x, WIDTH, activation=tf.nn.relu)
  for i in range(3):
    with tf.variable_scope("layer_%d" % i):
      h = h + tf.layers.dense(tf.layers.dense(h, 4 * WIDTH, activation=tf.nn.relu), WIDTH)
  with tf.variable_scope("head"):
    loss = tf.losses.sparse_softmax_cross_entropy(y, tf.layers.dense(h, 10))
  train = tf.train.MomentumOptimizer(0.01, 0.9).minimize(
      loss, global_step=tf.train.get_or_create_global_step())
  rng = np.random.RandomState(0)
  return train, {x: rng.randn(BATCH, FEATURES).astype(np.float32),
                 y: rng.randint(0, 10, BATCH)}


@pytest.mark.parametrize("resource", [False, True], ids=["ref variables", "resource variables"])
def test_profile_of_a_small_model(resource, monkeypatch):
  with tf.Graph().as_default(), tf.Session() as sess:
    with tf.variable_scope(tf.get_variable_scope(), use_resource=resource):
      train, feed = _model()
    sess.run(tf.global_variables_initializer())
    profile = epl.profiler.profile(sess, train, feed, steps=2)
    for node in profile.nodes:                 # real timings: only their range is certain
      assert 0 < node.forward_ms < 1000 and 0 < node.backward_ms < 1000, str(node)
    # which op counts for which layer and direction, without the machine's noise (sub-ms ops
    # on a loaded machine inverted backward and forward): TF's real traces, a backward op
    # 1 ms, a forward one 1 us
    real_trace, traced = epl.profiler._trace, []

    def fixed_times(*args):
      meta = real_trace(*args)
      for dev in meta.step_stats.dev_stats:
        for n in dev.node_stats:
          n.op_end_rel_micros = n.op_start_rel_micros + (
              1000 if n.node_name.startswith("gradients/") else 1)
          traced.append(n.node_name)
      return meta
    monkeypatch.setattr(epl.profiler, "_trace", fixed_times)
    counted = epl.profiler.profile(sess, train, feed, steps=2)
  for node in counted.nodes[1:4]:     # each block's gradient ops, and only they, are its backward
    backward = sum(name.startswith("gradients/%s/" % node.name) for name in traced) / 2
    assert backward >= 5 and node.backward_ms == pytest.approx(backward), str(node)
    assert 0 < node.forward_ms < 0.1, str(node)
  assert [n.name for n in counted.nodes] == [n.name for n in profile.nodes]
  assert [n.name for n in profile.nodes] == ["embed", "layer_0", "layer_1", "layer_2", "head"]
  assert Profile.parse(profile.dump()) == profile            # the planner reads it back
  params = {n.name: n.parameter_bytes for n in profile.nodes}
  block = 4 * (WIDTH * 4 * WIDTH + 4 * WIDTH + 4 * WIDTH * WIDTH + WIDTH)
  assert params == {"embed": 4 * (FEATURES * WIDTH + WIDTH), "layer_0": block,
                    "layer_1": block, "layer_2": block, "head": 4 * (WIDTH * 10 + 10)}
  # a block hands the next one its [batch, width] output (read by its dense and its residual)
  for node in profile.nodes[:4]:
    assert node.activation_bytes == BATCH * WIDTH * 4, str(node)
  assert set(profile.edges) == {("node1", "node2"), ("node2", "node3"), ("node3", "node4"),
                                ("node4", "node5")}


def _blocks(stages_log=None):
  """An un-annotated 4-block model (tf.layers, scopes per block), Momentum and clipping."""
  def build():
    x = tf.placeholder(tf.float32, [None, 12], name="x")
    y = tf.placeholder(tf.int64, [None], name="y")
    with tf.variable_scope("embed"):
      h = tf.layers.dense(x, 32, activation=tf.nn.relu,
                          kernel_initializer=tf.glorot_uniform_initializer(seed=1))
    for i in range(4):
      with tf.variable_scope("block_%d" % i):
        width = 1024 if i == 0 else 32         # block 0 costs more than the other three
        z = tf.layers.dense(h, width, activation=tf.nn.relu,
                            kernel_initializer=tf.glorot_uniform_initializer(seed=10 + i))
        h = h + tf.layers.dense(z, 32, kernel_initializer=tf.glorot_uniform_initializer(
            seed=20 + i))
    with tf.variable_scope("head"):
      logits = tf.layers.dense(h, 10, kernel_initializer=tf.glorot_uniform_initializer(seed=3))
      loss = tf.losses.sparse_softmax_cross_entropy(y, logits)
    opt = tf.train.MomentumOptimizer(0.05, momentum=0.9)
    grads, variables = zip(*opt.compute_gradients(loss))
    grads, _ = tf.clip_by_global_norm(grads, 1.0)
    train_op = opt.apply_gradients(zip(grads, variables),
                                   global_step=tf.train.get_or_create_global_step())
    return dict(inputs=(x, y), loss=loss, train_op=train_op)
  return build


def test_auto_parallel_cuts_an_unannotated_model_into_stages_and_trains_it():
  from tests import split_models as sm
  data = sm.classification_data(5 * 16, 10)
  local = sm.train(_blocks(), data, 5, 16)
  config = epl.Config({"auto.auto_parallel": True, "pipeline.num_stages": 2,
                       "pipeline.num_micro_batch": 2, "cluster.devices_per_worker": 2,
                       "log.level": "warning"})
  auto = sm.train(_blocks(), data, 5, 16, config=config, initial=local.initial)
  np.testing.assert_allclose([f["loss"] for f in auto.fetched],
                             [f["loss"] for f in local.fetched], rtol=1e-5, atol=1e-6)
  for name, value in local.variables.items():
    np.testing.assert_allclose(auto.variables[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)
  plan = auto.parallel.plan
  assert [t.name for t in plan.taskgraphs] == ["stage_0", "stage_1"]
  assert plan.num_micro_batch == 2
  stage_of = {name: tg for name, (tg, phase) in plan.op_index.items() if phase == "forward"}
  # balanced by profiled cost, not by op count (which would cut after block_1): the wide
  # block 0 is a stage of its own with the embedding
  assert [stage_of["%s/dense/MatMul" % s] for s in (
      "embed", "block_0", "block_1", "block_2", "block_3", "head")] == [0, 0, 1, 1, 1, 1]


def test_auto_parallel_mistakes_are_clear_errors():
  from tests import split_models as sm
  from epl.errors import PlanError
  data = sm.classification_data(16, 10)
  for keys, match in (({"pipeline.num_stages": 9}, "has 6 layer"),
                      ({"pipeline.num_stages": 0}, "pipeline.num_stages is 0")):
    config = epl.Config(dict({"auto.auto_parallel": True, "cluster.devices_per_worker": 2,
                              "log.level": "warning"}, **keys))
    with pytest.raises(PlanError, match=match):
      sm.train(_blocks(), data, 1, 16, config=config)


def test_the_planner_is_asked_only_for_plans_epl_runs():
  from epl.runtime.auto_stages import epl_layout, runnable
  accept = runnable(4)
  assert accept((4,)) and accept((2, 2)) and accept((1, 1, 1, 1))
  assert accept((3, 1)) and accept((2, 1, 1))             # per-stage device counts
  assert not accept((1, 1, 1)) and not accept((2, 1))     # not every device used
  assert not runnable(6)((3, 2, 1))                         # 2 does not divide 3
  assert runnable(2, 2)((3, 1))          # one replica spanning 2 workers (worker 0 drives it)
  assert not runnable(4, 2)((3, 3, 2))                   # 2 does not divide 3
  assert epl_layout((4, 2), 6, 1) == (2, (2, 1))     # most replicas: 2 x (2:1)
  assert epl_layout((2, 2), 1, 4) == (4, (1, 1)) or epl_layout((2, 2), 1, 4) == (2, (1, 1))
  assert epl_layout((6,), 3, 2) == (6, (1,))


def _local_and_auto(caplog, devices, batch):
  """The block model trained 3 steps locally and under auto.auto_parallel (planner's choice,
  2 micro-batches configured) on ``devices`` devices, fed ``batch`` rows per step."""
  from tests import split_models as sm
  data = sm.classification_data(3 * batch, 10)
  local = sm.train(_blocks(), data, 3, batch)
  config = epl.Config({"auto.auto_parallel": True, "pipeline.num_micro_batch": 2,
                       "cluster.devices_per_worker": devices, "log.level": "info"})
  with caplog.at_level("INFO", logger="epl"):
    return local, sm.train(_blocks(), data, 3, batch, config=config, initial=local.initial)


def test_auto_parallel_lets_the_planner_choose_the_stages(caplog):
  local, auto = _local_and_auto(caplog, devices=2, batch=16)
  chose = [r.getMessage() for r in caplog.records if "the planner chose" in r.getMessage()]
  assert chose, [r.getMessage() for r in caplog.records]
  k = int(chose[0].split("the planner chose ")[1].split(" ")[0])
  assert [t.name for t in auto.parallel.plan.taskgraphs] == ["stage_%d" % i for i in range(k)]
  np.testing.assert_allclose([f["loss"] for f in auto.fetched],
                             [f["loss"] for f in local.fetched], rtol=1e-5, atol=1e-6)
  for name, value in local.variables.items():
    np.testing.assert_allclose(auto.variables[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)


def test_auto_parallel_runs_the_planners_per_stage_device_counts(monkeypatch, caplog):
  """The planner's plan with a 3:1 split of 4 devices (stage 0: embedding + two blocks on 3
  devices, stage 1: the rest on 1) runs as replicate(3) / replicate(1) stages, at the
  micro-batch count that keeps the data-parallel model's global batch, and trains the local
  model (fed batches: the step's batch is the feed)."""
  import epl.plan.auto as auto
  real = auto.plan_pipeline
  asked = []

  def planner(profile, pbs, gbs, devices, cost_model, accept, micro_batches, memory,
              accept_stages=None):
    asked.append((accept, micro_batches))
    plan = real(profile, pbs, gbs, devices, cost_model=cost_model, accept=accept,
                micro_batches=micro_batches, memory=memory)
    names = [n.id for n in profile.nodes]
    stages = (auto.Stage(0, 2, tuple(names[:3]), (0, 1, 2)),
              auto.Stage(3, len(names) - 1, tuple(names[3:]), (3,)))
    return dataclasses.replace(plan, stages=stages, micro_batches=micro_batches((3, 1)))
  monkeypatch.setattr(auto, "plan_pipeline", planner)
  local, run = _local_and_auto(caplog, devices=4, batch=24)
  accept, micro_batches = asked[0]
  assert accept((3, 1)) and not accept((2, 1))
  # the data-parallel model is kept: 1 replica of 3 + 1 devices runs 4 x 2 micro-batches,
  # pure data parallelism 2 (4 replicas: the same 8 batches per step)
  assert micro_batches((3, 1)) == 8 and micro_batches((4,)) == 2 and micro_batches((2, 2)) == 4
  plan = run.parallel.plan
  assert plan.num_micro_batch == 8
  assert [(t.name, t.placement.devices) for t in plan.taskgraphs] == [("stage_0", 3),
                                                                      ("stage_1", 1)]
  stage_of = {name: tg for name, (tg, phase) in plan.op_index.items() if phase == "forward"}
  assert [stage_of["%s/dense/MatMul" % s] for s in (
      "embed", "block_0", "block_1", "block_2", "block_3", "head")] == [0, 0, 0, 1, 1, 1]
  assert any("device_count 3:1" in r.getMessage() for r in caplog.records)
  np.testing.assert_allclose([f["loss"] for f in run.fetched],
                             [f["loss"] for f in local.fetched], rtol=1e-5, atol=1e-6)
  for name, value in local.variables.items():
    np.testing.assert_allclose(run.variables[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)
