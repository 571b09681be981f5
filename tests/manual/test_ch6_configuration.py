"""EPL's manual, chapter 6 (Configuration): the Config API and every table's keys, as written.

The manual sets the memory keys with ``epl.init(epl.Config({...}))`` and nothing else: on a
graph without any annotation epl makes the whole graph one model copy and the key acts on it
(Key.unannotated, epl/config.py; tests/test_config_keys.py walks every key). Differences from
EPL that the tests assert (docs/user_guide.md, "From EPL's manual"): an unknown key is an
error; ZeRO on an unannotated graph is refused (it needs data-parallel copies; EPL ran one
copy); ZeRO works with gradient accumulation and on N workers x M devices; a refining key set
without the key it refines is refused; ``cluster.device_place_prefer_intra_node: False`` is
not built (refused).

  6.0   Config(param_dict=None); Config({"pipeline.num_micro_batch": 4})
  6.1   pipeline.num_micro_batch / num_stages / strategy
  6.2   gradient_checkpoint.type auto; collection + tf.add_to_collection("checkpoints", t)
  6.3   zero.level v1
  6.4   offload.level v0
  6.5   amp.level O1 with loss_scale "dynamic", then 128
  6.6   optimizer.num_apply_group 30
  6.7   cluster.*     6.8 communication.*     6.9 io.*     6.10 auto.auto_parallel
"""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.errors import ConfigError, NotImplementedYetError, PlanError
from tests.manual import snippets as s
from tests.manual.test_ch1_easy_parallel_library import _pipeline


def _blocks(x, y, under_epl, checkpoint=False):
  """A model of repeated blocks (what gradient checkpointing is for); ``checkpoint``: the
  manual's ``tensor = op1(); tf.add_to_collection("checkpoints", tensor)``."""
  h = x
  for i in range(3):
    with tf.variable_scope("block_%d" % i):
      h = tf.layers.dense(h, 16, activation=tf.nn.relu)
      if checkpoint and i == 1:
        tf.add_to_collection("checkpoints", h)
  return tf.losses.sparse_softmax_cross_entropy(y, tf.layers.dense(h, s.CLASSES))


def _dp(x, y, under_epl):
  if under_epl:
    epl.set_default_strategy(epl.replicate(1))
  return s.model(x, y)


def test_6_0_config_api_and_unknown_keys():
  config = epl.Config({"pipeline.num_micro_batch": 4})
  assert config.pipeline.num_micro_batch == 4 and epl.Config().pipeline.num_micro_batch == 1
  with pytest.raises(ConfigError, match="did you mean 'pipeline.num_micro_batch'"):
    epl.Config({"pipeline.num_micro_batches": 4})          # EPL ignored it silently


def test_6_0_four_micro_batches_as_written_accumulate_on_the_one_copy():
  # no annotation: the whole graph is one copy that reads 4 batches and updates once a run
  pg = s.assert_trains_the_local_model(lambda x, y, u: s.model(x, y),
                                       epl.Config({"pipeline.num_micro_batch": 4}), copies=4)
  assert pg.plan.total_copies == 1 and pg.plan.micro_batches == 4   # as runs (graph.micro_batches)


def test_6_1_pipeline_keys():
  with pytest.raises(ConfigError, match="'pipeline.num_stages'=2 has no effect unless "
                     "'auto.auto_parallel'"):
    epl.Config({"pipeline.num_stages": 2})
  s.assert_trains_the_local_model(
      _pipeline, s.devices(2, **{"pipeline.num_micro_batch": 4,
                                 "pipeline.strategy": "PreferForward"}), copies=4)


@pytest.mark.parametrize("kind", ["auto", "collection"])
def test_6_2_gradient_checkpointing_as_written(kind):
  build = lambda x, y, u: _blocks(x, y, u, checkpoint=kind == "collection")   # noqa: E731
  pg = s.assert_trains_the_local_model(build, epl.Config({"gradient_checkpoint.type": kind}),
                                       copies=1, rtol=1e-6)
  recomputed = pg.results["recompute"]
  assert recomputed.checkpoints and recomputed.recomputed_ops > 0


def test_6_2_an_empty_checkpoint_collection_is_refused():
  with pytest.raises(PlanError, match="\"checkpoints\" collection holds no tensor"):
    s.train(_blocks, s.data(16), 4, 1, epl.Config({"gradient_checkpoint.type": "collection"}))


def test_6_3_zero_as_written_is_refused_with_the_fix():
  with pytest.raises(PlanError, match=r"'zero.level'='v1'.*no epl annotation.*"
                     r"set_default_strategy\(epl.replicate\(1\)\)"):
    s.train(lambda x, y, u: s.model(x, y), s.data(16), 4, 1, epl.Config({"zero.level": "v1"}))


@pytest.mark.parametrize("micro", [1, 2])
def test_6_3_zero_v1_with_data_parallelism(micro):
  # EPL: "cannot be used with gradient accumulation", "Nx1 only" -- epl can (both here)
  pg = s.assert_trains_the_local_model(
      _dp, s.devices(2, **{"zero.level": "v1", "pipeline.num_micro_batch": micro}),
      copies=2 * micro)
  assert pg.results["zero"].owners


def test_6_4_offload_as_written_keeps_the_weights_on_the_host():
  pg = s.assert_trains_the_local_model(lambda x, y, u: s.model(x, y),
                                       epl.Config({"offload.level": "v0"}), copies=1)
  assert len(pg.results["offload"].variables) >= 6


@pytest.mark.parametrize("loss_scale", ["dynamic", 128])
def test_6_5_amp_as_written(loss_scale):
  config = epl.Config({"amp.level": "O1", "amp.loss_scale": loss_scale})
  s.assert_trains_the_local_model(lambda x, y, u: s.model(x, y), config, copies=1, rtol=3e-3)
  _, _, _, pg = s.train(lambda x, y, u: s.model(x, y), s.data(16), 4, 1, config)
  assert any(op.outputs and op.outputs[0].dtype == tf.float16
             for op in pg.graph.get_operations())


def test_6_6_num_apply_group_30_as_written():
  pg = s.assert_trains_the_local_model(lambda x, y, u: s.model(x, y),
                                       epl.Config({"optimizer.num_apply_group": 30}), copies=1)
  groups = pg.results["apply_groups"].groups[0]
  assert len(groups) == 6                     # at most one group per trained variable


def test_6_7_cluster_keys():
  with pytest.raises(NotImplementedYetError, match="device_place_prefer_intra_node"):
    epl.Config({"cluster.device_place_prefer_intra_node": False})
  from epl.runtime.session_config import session_config
  from epl.cluster import Cluster
  config = epl.Config({"cluster.run_visible_devices": "0,1"})
  _, _, _, pg = s.train(_dp, s.data(16), 4, 1, config)
  merged = session_config(Cluster.local(1), pg.plan, config, None)
  assert merged.gpu_options.visible_device_list == "0,1"


@pytest.mark.parametrize("key,value", [
    ("communication.num_communicators", 1), ("communication.max_splits", 1),
    ("communication.fp16", True), ("communication.sparse_as_dense", True)])
def test_6_8_communication_keys_keep_the_local_model(key, value):
  # (float16 all-reduce acts between workers only: tests/test_multiworker.py; on one worker
  # the copies sum in float32)
  s.assert_trains_the_local_model(_dp, s.devices(2, **{key: value}), copies=2)


def test_6_8_gradients_reduce_method_sum_is_the_sum_of_the_copies_gradients():
  def sgd(rate):
    return lambda: tf.train.GradientDescentOptimizer(rate)
  rows = s.data(2 * 4 * 3)
  local = s.train(_dp, rows, 8, 3, optimizer=sgd(0.2))           # 2 x the mean's rate
  dist = s.train(_dp, rows, 4, 3, s.devices(2, **{"communication.gradients_reduce_method":
                                                  "sum"}), initial=local[2],
                 optimizer=sgd(0.1))
  for name, value in local[1].items():
    s.close(dist[1][name], value, 1e-5, name)


def test_6_8_clip_after_allreduce_false_is_epls_per_copy_clipping():
  # True (epl's default) trains the local model with clipping; False clips each copy's own
  # gradient (EPL's behaviour): tests/test_clipping.py compares both with their references
  with pytest.raises(ConfigError, match="fp16_scale"):
    epl.Config({"communication.fp16_scale": 64})               # refines communication.fp16
  s.assert_trains_the_local_model(
      _dp, s.devices(2, **{"communication.clip_after_allreduce": False}), copies=2)


def test_6_9_io_keys_refine_io_slicing():
  # io.slicing itself: 2 workers reading their share of a file list,
  # tests/test_multiworker.py::test_io_slicing_each_worker_reads_only_its_files
  for key in ("io.unbalanced_io_slicing", "io.drop_last_files"):
    with pytest.raises(ConfigError, match="'io.slicing'"):
      epl.Config({key: True})
    assert epl.Config({key: True, "io.slicing": True}).get(key) is True


def test_6_10_auto_parallel_cuts_the_unannotated_model_into_stages():
  config = s.devices(2, **{"auto.auto_parallel": True, "pipeline.num_stages": 2,
                           "pipeline.num_micro_batch": 2})
  pg = s.assert_trains_the_local_model(_blocks, config, copies=2)
  assert [tg.name for tg in pg.plan.taskgraphs] == ["stage_0", "stage_1"]
  assert np.isfinite(pg.plan.num_micro_batch)
