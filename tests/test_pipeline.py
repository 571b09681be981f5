"""Pipeline parallelism and gradient accumulation: parity with one big batch."""
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.plan.schedule import make_schedule
from epl.testing import assert_parity, run_model
from tests import models


def cfg(devices, micro, strategy="PreferBackward"):
  return epl.Config({"cluster.devices_per_worker": devices, "pipeline.num_micro_batch": micro,
                     "pipeline.strategy": strategy})


def stages(n):
  return [(lambda i=i: epl.replicate(1, name="stage_%d" % i)) for i in range(n)]


@pytest.mark.parametrize("micro", [1, 4])
def test_gradient_accumulation_matches_one_big_batch(micro):
  local, dist = assert_parity(models.mlp, cfg(1, micro), copies=micro, optimizer="adam")
  assert dist.variables["global_step"] == 5                  # one update per session.run


@pytest.mark.parametrize("strategy", ["PreferBackward", "PreferForward"])
def test_two_stage_pipeline(strategy):
  assert_parity(models.mlp_two_stages, cfg(2, 4, strategy), copies=4, strategies=stages(2))


@pytest.mark.parametrize("strategy", ["PreferBackward", "PreferForward"])
def test_four_stage_pipeline(strategy):
  assert_parity(models.mlp_four_stages, cfg(4, 4, strategy), copies=4, strategies=stages(4),
                optimizer="adam")


@pytest.mark.parametrize("strategy", ["PreferBackward", "PreferForward"])
def test_transformer_blocks_pipeline(strategy):
  # momentum, not Adam: the key bias's true gradient is 0 (softmax ignores a shift shared by
  # all keys), and Adam turns its rounding noise into full-size steps in any two runs
  assert_parity(models.transformer_two_stages, cfg(2, 4, strategy), copies=4,
                strategies=stages(2), optimizer="momentum")


def test_hybrid_two_stages_two_replicas_on_four_devices():
  local, dist = assert_parity(models.mlp_two_stages, cfg(4, 4), copies=8, strategies=stages(2))
  assert dist.parallel.worker.num_replicas == 2 and len(dist.parallel.plan.taskgraphs) == 2


def test_pipeline_with_fed_batches():
  assert_parity(models.mlp_two_stages, cfg(2, 2), copies=2, strategies=stages(2), feed=True)


@pytest.mark.parametrize("strategy", ["PreferBackward", "PreferForward"])
def test_recorded_execution_order_follows_the_schedule(strategy):
  data = models.regression_data(64)
  res = run_model(models.mlp_two_stages, data, 4, 1, config=cfg(2, 4, strategy),
                  strategies=stages(2))
  graph, pg = res.graph, res.parallel
  with graph.as_default(), tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    train = graph.get_operation_by_name("Momentum")
    meta = tf.RunMetadata()
    sess.run(train, options=tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE),
             run_metadata=meta)
  start = {}
  for dev in meta.step_stats.dev_stats:
    for node in dev.node_stats:
      start[node.node_name] = min(start.get(node.node_name, 1 << 62), node.all_start_micros)
  expected = make_schedule(strategy, 2, 4)
  for s in range(2):
    actions = pg.schedule[(0, s)]
    first = [(min(start[op.name] for op in ops if op.name in start), name)
             for name, ops in actions if any(op.name in start for op in ops)]
    last = {name: max(start[op.name] for op in ops if op.name in start)
            for name, ops in actions if any(op.name in start for op in ops)}
    order = [name for _, name in sorted(first)]
    assert order == [str(a) for a in expected[s]], (s, order)
    for a, b in zip(order, order[1:]):          # an action starts after the previous ended
      assert last[a] <= min(start[op.name] for n, ops in actions if n == b
                            for op in ops if op.name in start)


def test_a_step_does_not_run_forward_ops_its_gradients_do_not_need():
  """A metric fed by its own placeholder (an eval threshold, a vote) must not become part of
  the schedule: the training step would demand its feed."""
  data = models.regression_data(64)
  g = tf.Graph()
  with g.as_default():
    epl.init(cfg(2, 4))
    x, y = tf.data.make_one_shot_iterator(
        tf.data.Dataset.from_tensor_slices(data).batch(4).repeat()).get_next()
    loss = models.mlp_two_stages(x, y, lambda i: epl.replicate(1, name="stage_%d" % i))
    threshold = tf.placeholder(tf.float32, [], name="threshold")
    above = tf.reduce_mean(tf.cast(loss > threshold, tf.float32))       # a metric
    train = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(train)                                    # no feed needed
      assert sess.run(above, {threshold: 0.0}) == 1.0


@pytest.mark.parametrize("micro", [2, 4])
@pytest.mark.parametrize("fetch_loss", [True, False])
def test_cond_and_while_loops_with_micro_batches(micro, fetch_loss):
  # Schedule dependencies attach outside cond branches and loop frames: the dead branch of
  # one micro-batch must not reach the next one, whether the step fetches the loss or only
  # train_op (a wrong update, not an error, was the failure of the latter).
  assert_parity(models.cond_model, cfg(1, micro), copies=micro, fetch_loss=fetch_loss)
  assert_parity(models.while_v1, cfg(1, micro), copies=micro, fetch_loss=fetch_loss)
  assert_parity(models.control_flow_two_stages, cfg(2, micro), copies=micro,
                strategies=stages(2), fetch_loss=fetch_loss)


def stages_on(counts):
  return [(lambda i=i, k=k: epl.replicate(k, name="stage_%d" % i)) for i, k in enumerate(counts)]


@pytest.mark.parametrize("counts,micro,devices,feed", [
    ((2, 1), 1, 3, False), ((2, 1), 2, 3, True), ((1, 2), 3, 3, False), ((4, 2), 2, 6, False),
    ((2, 1), 2, 6, False), ((2, 1, 1, 2), 2, 6, False)],
    ids=["2:1", "2:1 x2 micro-batches fed", "1:2 x3 micro-batches", "4:2 x2 micro-batches",
         "2:1 x2 replicas x2 micro-batches", "2:1:1:2 x2 micro-batches"])
def test_stages_with_different_device_counts_train_the_local_model(counts, micro, devices,
                                                                   feed):
  """Per-stage replication (the planner's 15:1-style plans): stage i on counts[i] devices per
  model replica. A stage on fewer devices runs in every (max / count)-th copy on the rows of
  that many copies of the widest stage (gathered in, its gradients cut back out), with
  micro-batches and data-parallel replicas; Adam, iterator or fed batches."""
  replicas = devices // sum(counts)
  model = models.mlp_two_stages if len(counts) == 2 else models.mlp_four_stages
  _, dist = assert_parity(model, cfg(devices, micro), copies=micro * replicas,
                          strategies=stages_on(counts), optimizer="adam", feed=feed)
  plan, copies = dist.parallel.plan, dist.parallel.results["replicate"].copies
  assert plan.shards == max(counts)
  for t, k in enumerate(counts):
    assert len(plan.group_of(t)) == k * replicas              # its gradients' all-reduce
    first = plan.taskgraphs[t].ops["forward"][-1]
    holders = 1 + sum(1 for c in range(1, len(copies)) if first in copies[c])
    assert holders == k * replicas, (t, holders)               # built only where it runs
  gathers = dist.parallel.results["bridge"].count("gather")
  assert gathers >= micro * replicas


@pytest.mark.parametrize("level", ["v1", "v2"])
def test_zero_with_stages_on_different_device_counts_trains_the_local_model(level):
  """ZeRO x per-stage replication (#51): a stage on fewer devices gives its variables owners
  among the copies that run it; the owner's all-reduce root, slot and the others' copies of
  the updated weights are those copies' (it was refused)."""
  config = epl.Config({"cluster.devices_per_worker": 3, "pipeline.num_micro_batch": 2,
                       "zero.level": level})
  _, dist = assert_parity(models.mlp_two_stages, config, copies=2,
                          strategies=stages_on((2, 1)), optimizer="adam")
  plan = dist.parallel.plan
  owners = dist.parallel.results["zero"].owners
  assert {plan.op_index[name][0] for name in owners} == {0, 1}
  for name, k in owners.items():
    assert plan.runs_in(plan.copies[k], plan.op_index[name][0]), (name, k)


def test_copies_without_the_first_stage_read_adams_beta_powers_before_they_move():
  """1:2 with Adam: the beta powers belong to stage_0 (TF colocates them with the first
  variable), which copy 1 does not run; copy 1's updates read copy 0's, and copy 0's
  in-place update of them waits for those reads (ref variables alias on read). Before that
  ordering 2 runs in 3 differed from the local run; repeated here."""
  for _ in range(4):
    assert_parity(models.mlp_two_stages, cfg(3, 1), copies=1, strategies=stages_on((1, 2)),
                  optimizer="adam")


@pytest.mark.parametrize("counts,keys,error,match", [
    ((3, 2), {}, "PlanError", r"device_count stage_0=3, stage_1=2: each device_count must "
                              r"divide the largest \(3\)"),
])
def test_stage_device_counts_that_cannot_run_are_refused_before_the_rewrite(counts, keys,
                                                                           error, match):
  from epl import errors
  from epl.cluster import Cluster
  from epl.plan.build import build_plan
  g = tf.Graph()
  with g.as_default():
    epl.init(epl.Config(dict({"cluster.devices_per_worker": 6,
                              "pipeline.num_micro_batch": 2}, **keys)))
    x = tf.placeholder(tf.float32, [4, 8])
    y = tf.placeholder(tf.int64, [4])
    models.mlp_two_stages(x, y, lambda i: stages_on(counts)[i]())
    state = epl.Env.get()._state
    with pytest.raises(getattr(errors, error), match=match):
      build_plan(g, state.recorder, state.config, Cluster(("h0:6",), 0, 6, False))
