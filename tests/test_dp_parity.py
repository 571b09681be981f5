"""Data-parallel parity on one worker: epl with N copies vs the local script at N x batch."""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.testing import assert_parity
from tests import models


def cfg(devices, **extra):
  return epl.Config(dict({"cluster.devices_per_worker": devices}, **extra))


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
@pytest.mark.parametrize("model", ["mlp", "convnet"])
def test_dp_parity(model, optimizer, devices):
  assert_parity(getattr(models, model), cfg(devices), copies=devices, optimizer=optimizer)


def test_replicate_device_count_2_on_4_devices():
  # 2 replicas, each splitting its batch of 4 over 2 devices: the local batch is 2 x 4.
  local, dist = assert_parity(models.mlp, cfg(4), copies=2, batch=4,
                              strategies=[lambda: epl.replicate(device_count=2)])
  assert dist.parallel.worker.num_replicas == 2 and dist.parallel.plan.shards == 2
  assert dist.parallel.num_copies == 4


def test_sum_reduction_matches_n_times_learning_rate():
  assert_parity(models.mlp, cfg(2, **{"communication.gradients_reduce_method": "sum"}),
                copies=2, optimizer="momentum", lr=0.01, local_lr=0.02,
                # the momentum slot accumulates N x larger gradients; weights must match
                skip_variable=lambda name: name.endswith("/Momentum"))


def test_default_strategy_parity():
  assert_parity(models.mlp, cfg(2), copies=2, strategies=[],
                default_strategy=lambda: epl.replicate(1))


def test_feed_dict_batches_are_split_over_copies():
  assert_parity(models.mlp, cfg(2), copies=2, feed=True)


@pytest.mark.parametrize("sparse_as_dense,optimizer", [
    (False, "adam"), (False, "momentum"),
    # densified gradients touch every row, which sparse-aware optimizers treat differently
    # (momentum decays untouched rows' accumulators): compare with plain SGD there
    (True, "sgd")])
def test_sparse_gradients(sparse_as_dense, optimizer):
  local, dist = assert_parity(
      models.embedding, cfg(2, **{"communication.sparse_as_dense": sparse_as_dense}),
      copies=2, optimizer=optimizer)
  report = dist.parallel.sync_report
  assert ("table" in report.gathered) == (not sparse_as_dense)


def test_v1_while_loop_and_cond():
  assert_parity(models.while_v1, cfg(2), copies=2)
  assert_parity(models.cond_model, cfg(2), copies=2)


def test_v2_control_flow():
  from tensorflow.python.ops import control_flow_v2_toggles as toggles
  was = toggles.control_flow_v2_enabled()
  toggles.enable_control_flow_v2()
  try:
    assert_parity(models.while_v1, cfg(2), copies=2)
    assert_parity(models.cond_model, cfg(2), copies=2)
  finally:
    if not was:
      toggles.disable_control_flow_v2()


def test_tf_function_in_model():
  @tf.function
  def block(h):
    return tf.nn.relu(h) + 0.5 * h

  def model(x, y, stages):
    with stages(0):
      h = block(tf.layers.dense(x, 8))
      logits = tf.layers.dense(h, 4)
    return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)
  assert_parity(model, cfg(2), copies=2)


def test_model_parallel_two_taskgraphs():
  two = [lambda: epl.replicate(1, name="stage_0"), lambda: epl.replicate(1, name="stage_1")]
  local, dist = assert_parity(models.mlp_two_stages, cfg(2), copies=1, strategies=two)
  worker = dist.parallel.worker
  assert worker.num_replicas == 1 and worker.device_of(0, 0) != worker.device_of(0, 1)
  # 4 devices: the 2-device model is replicated twice.
  local, dist = assert_parity(models.mlp_two_stages, cfg(4), copies=2, strategies=two)
  assert dist.parallel.worker.num_replicas == 2


def test_no_annotation_runs_like_the_local_script():
  local, dist = assert_parity(models.mlp, cfg(4), copies=1, strategies=[lambda: _null()])
  assert dist.parallel.plan.is_local


class _null:
  def __enter__(self):
    return self

  def __exit__(self, *a):
    return False


def test_batch_norm_and_dropout_keep_statistics_and_masks_per_copy():
  """Documented behaviour (not parity): each copy updates batch-norm moving statistics from its
  own batch and draws its own dropout mask; fetches and checkpoints see copy 0's statistics."""
  from epl.testing import run_model
  data = models.regression_data(2 * 4 * 20)
  res = run_model(models.bn_dropout, data, batch=4, steps=20, config=cfg(2),
                  strategies=[lambda: epl.replicate(1)], lr=0.05)
  assert all(np.isfinite(res.losses))
  assert res.variables["global_step"] == 20          # +1 per step, not per copy
  pg = res.parallel
  assert pg.num_copies == 2
  mean = [n for n in res.variables if n.endswith("moving_mean")][0]
  assert not np.allclose(res.variables[mean], res.initial[mean])
  with res.graph.as_default(), tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    copies = [op.outputs[0] for op in pg.replication.mirrored[mean]]
    masks = [op for op in res.graph.get_operations() if op.type == "RandomUniform" and
             "dropout" in op.name]
    assert len(masks) == 2 and masks[0].get_attr("seed2") != masks[1].get_attr("seed2")
    a, b = sess.run([masks[0].outputs[0], masks[1].outputs[0]])
    assert not np.array_equal(a, b)                   # each copy its own mask
    sess.run("global_step:0")                          # (initialised graph runs)
  assert len(copies) == 2


@pytest.mark.parametrize("model,devices,micro,strategies,optimizer", [
    ("convnet", 4, 1, None, "adam"), ("mlp", 2, 4, None, "adam"),
    ("mlp_two_stages", 2, 4, "stages", "adam"),
    # momentum: Adam turns the key bias's rounding noise (its true gradient is 0) into steps
    ("transformer_two_stages", 2, 2, "stages", "momentum")])
def test_with_grappler_on_the_same_model(model, devices, micro, strategies, optimizer):
  """graph.grappler on (TF's graph optimizer over the cloned graph, as EPL ran it) trains the
  model the local script trains. The default, auto, skips Grappler on these graphs (their
  first step compiles ~8x faster): every other parity test runs that way, against a local
  script with Grappler on."""
  config = cfg(devices, **{"pipeline.num_micro_batch": micro, "graph.grappler": "on"})
  kwargs = {}
  if strategies:
    kwargs["strategies"] = [lambda i=i: epl.replicate(1, name="stage_%d" % i) for i in range(2)]
  local, dist = assert_parity(getattr(models, model), config, copies=devices * micro // (
      2 if strategies else 1), optimizer=optimizer, **kwargs)
  from epl.runtime.session_config import session_config
  state = epl.Env.get()._state  # pylint: disable=protected-access
  merged = session_config(state.cluster, dist.parallel.plan, state.config, None)
  assert not merged.graph_options.rewrite_options.disable_meta_optimizer
  assert epl.Config({}).graph.grappler == "auto"


def test_where_grappler_goes_off_so_does_tfs_classic_graph_optimizer_unless_the_user_set_it():
  """graph.grappler off (auto: a graph of several copies or micro-batches): the session also
  gets optimizer_options L0 (no per-partition CSE and constant folding, 3 of the 131k-op
  pipeline graph's 7 s first step); a user's own optimizer or rewrite options stay."""
  from epl.cluster import Cluster
  from epl.runtime.session_config import session_config
  cluster = Cluster.local(2)
  auto = epl.Config({"pipeline.num_micro_batch": 2})
  merged = session_config(cluster, None, auto, None)
  assert merged.graph_options.rewrite_options.disable_meta_optimizer
  assert merged.graph_options.optimizer_options.opt_level == tf.OptimizerOptions.L0
  mine = tf.ConfigProto()
  mine.graph_options.optimizer_options.do_function_inlining = True
  merged = session_config(cluster, None, auto, mine)
  assert merged.graph_options.rewrite_options.disable_meta_optimizer
  assert merged.graph_options.optimizer_options.opt_level == tf.OptimizerOptions.L1
  assert merged.graph_options.optimizer_options.do_function_inlining
  on = session_config(cluster, None, epl.Config({"graph.grappler": "on"}), None)
  assert not on.graph_options.rewrite_options.disable_meta_optimizer
  assert not on.graph_options.HasField("optimizer_options")
  local = session_config(Cluster.local(1), None, epl.Config({}), None)
  assert not local.graph_options.HasField("optimizer_options")
