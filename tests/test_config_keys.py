"""Every Config key, set alone on a graph without any epl annotation: it acts, or it is
refused with one message naming it -- never accepted and ignored (docs/configuration.md).

The decision is each key's ``Key.unannotated`` (epl/config.py); this test walks ``KEYS`` so
that a new key cannot be added without deciding, and checks the decision for real:
  implicit  epl makes the whole graph one model copy and the key acts on it (gradient
            checkpointing, offload, grouped apply, gradient accumulation)
  acts      it acts whatever the annotations (AMP, logging, the job's set-up)
  moot      it only concerns several copies or a split: the graph runs as the local script
  refused   a PlanError names the key and the fix
A key that only refines another (``Key.requires``) is refused by ``epl.Config`` when set
without it, and then checked together with it.
"""
import logging
import os

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.config import ACTS, IMPLICIT, KEYS, MOOT, REFUSED
from epl.errors import ConfigError, NotImplementedYetError, PlanError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _recomputed(pg, graph, logs):
  return pg.results["recompute"].checkpoints


def _float16_ops(dtype):
  def check(pg, graph, logs):
    return any(op.outputs and op.outputs[0].dtype == dtype for op in graph.get_operations()
               if op.name.startswith("epl_amp"))
  return check


def _merged(pg):
  from epl.runtime.session_config import session_config
  state = epl.Env.get()._state  # pylint: disable=protected-access
  return session_config(state.cluster, pg.plan, state.config, None)


def _session_option(pg, graph, logs):
  return _merged(pg).gpu_options.visible_device_list == "0"


# key -> (the value set, the keys it needs with their values, what shows that it acted)
# A check of None: the key acts on the job, not on this graph -- the named test shows it.
ALONE = {
    "pipeline.num_micro_batch": (2, {}, lambda pg, g, l: pg.plan.accumulate_runs == 2 and
                                 pg.sync_report.sums.accumulators),
    "graph.micro_batches": ("clones", {"pipeline.num_micro_batch": 2},
                            lambda pg, g, l: pg.results["micro_batch"].clones),
    "pipeline.num_stages": (1, {"auto.auto_parallel": True},
                            lambda pg, g, l: pg.plan.taskgraphs[0].name == "stage_0"),
    "pipeline.strategy": ("PreferForward", {}, None),
    "gradient_checkpoint.type": ("auto", {}, _recomputed),
    "gradient_checkpoint.end_taskgraph": (0, {"gradient_checkpoint.type": "auto"},
                                          _recomputed),
    "gradient_checkpoint.check_gradients": (
        True, {"gradient_checkpoint.type": "auto"},
        lambda pg, g, l: any("check_gradients: checking" in m for m in l)),
    "zero.level": ("v1", {}, None),
    "offload.level": ("v0", {}, lambda pg, g, l: pg.results["offload"].variables),
    "amp.level": ("O1", {}, _float16_ops(tf.float16)),
    "amp.loss_scale": (128, {"amp.level": "O1"},
                       lambda pg, g, l: any("loss scale 128" in m for m in l)),
    "amp.debug_log": (True, {"amp.level": "O1"},
                      lambda pg, g, l: any("runs in float16 as" in m for m in l)),
    "amp.dtype": ("bfloat16", {"amp.level": "O1"}, _float16_ops(tf.bfloat16)),
    "optimizer.num_apply_group": (2, {}, lambda pg, g, l:
                                  len(pg.results["apply_groups"].groups[0]) == 2),
    "cluster.device_place_prefer_intra_node": (False, {}, None),
    "cluster.run_visible_devices": ("0", {}, _session_option),
    "cluster.colocate_split_and_replicate": (True, {}, None),
    "cluster.startup_timeout": (10, {}, "tests/test_multiworker.py::test_worker_that_never_starts_is_an_error_within_60s"),
    "cluster.devices_per_worker": (2, {}, lambda pg, g, l:
                                   epl.Env.get().cluster.gpu_num_per_worker == 2),
    "communication.num_communicators": (1, {}, None),
    "communication.sparse_as_dense": (True, {}, None),
    "communication.max_splits": (1, {}, None),
    "communication.fp16": (True, {}, None),
    "communication.fp16_scale": (64, {"communication.fp16": True}, None),
    "communication.clip_after_allreduce": (False, {}, None),
    "communication.gradients_reduce_method": ("sum", {}, None),
    "communication.collective_timeout": (60, {}, None),
    "communication.release_aborted_rendezvous": (
        False, {}, "tests/test_rendezvous_leak.py::test_tf_pins_aborted_rendezvous_and_epl_stops_it"),
    "communication.native_hooks_untested_tf": (
        True, {}, "tests/test_engine_shape.py::test_a_native_hook_that_cannot_go_in_warns_and_the_job_trains"),
    "communication.unique_request_ids": (
        False, {}, "tests/test_rejections.py::test_a_rejected_step_runs_again_exactly_whichever_worker_and_however_often"),
    "io.slicing": (True, {}, "tests/test_multiworker.py::test_io_slicing_each_worker_reads_only_its_files"),
    "io.unbalanced_io_slicing": (True, {"io.slicing": True},
                                 "tests/test_multiworker.py::test_io_slicing_each_worker_reads_only_its_files"),
    "io.drop_last_files": (True, {"io.slicing": True},
                           "tests/test_multiworker.py::test_io_slicing_each_worker_reads_only_its_files"),
    "auto.auto_parallel": (True, {}, lambda pg, g, l: pg.plan.taskgraphs[0].name == "stage_0"),
    "auto.device_memory": ("1TB", {"auto.auto_parallel": True}, "tests/test_auto_memory.py::test_a_budget_data_parallelism_cannot_meet_gives_pipeline_stages"),
    "auto.layout": ('{"split": 2, "micro_batches": 2}', {"auto.auto_parallel": True, "cluster.devices_per_worker": 2}, "tests/test_auto_tp.py::test_auto_layout_builds_the_model_split_and_trains_the_local_model"),
    "launch.worker_index": (0, {}, "tests/test_launch.py::test_local_workers_get_tf_config_and_devices"),
    "launch.parent_pid": (1, {}, "tests/test_launch.py::test_local_workers_get_tf_config_and_devices"),
    "launch.machine_list": ("a,b", {}, "tests/test_scheduler.py::test_mpirun_epl_launch_two_ranks_on_one_host_train_the_local_model"),
    "launch.job_id": ("mine", {}, "tests/test_cluster.py::test_a_worker_given_another_jobs_address_fails_at_once_naming_both_jobs"),
    "launch.attempt": (1, {}, "tests/test_restarts.py::test_a_worker_killed_mid_training_is_restarted_and_trains_the_uninterrupted_model"),
    "launch.status_file": ("s", {}, "tests/test_restarts.py::test_a_config_error_is_not_restarted"),
    "launch.max_restarts": (2, {}, "tests/test_launch.py::test_port_range_job_id_and_restart_flags"),
    "launch.restart_window": (60, {}, "tests/test_launch.py::test_port_range_job_id_and_restart_flags"),
    "launch.python": ("python3", {}, "tests/test_launch.py::test_launch_python_is_the_command_a_py_script_runs_with"),
    "launch.elastic_workers": (3, {}, "tests/test_elastic.py::test_a_job_that_loses_a_host_trains_on_and_grows_back_to_the_same_model"),
    "launch.resize_file": ("r", {}, "tests/test_elastic.py::test_a_job_that_loses_a_host_trains_on_and_grows_back_to_the_same_model"),
    "launch.port_range": ("30000-30009", {}, "tests/test_cluster.py::test_epl_launch_prints_its_ports_and_keeps_to_the_port_range"),
    "log.progress_secs": (5, {}, None),
    "log.summary_dir": ("/tmp/board", {}, "tests/test_board.py::test_a_two_worker_jobs_event_files_hold_epls_scalars_and_the_chiefs_summaries"),
    "testing.race_delay_ms": (20, {}, None),
    "split.gather_fallback": ("refuse", {}, "tests/test_split_rules.py::test_the_strict_key_refuses_a_gather_in_the_step_naming_the_op_and_where"),
    "graph.grappler": ("off", {}, lambda pg, g, l: _merged(pg).graph_options.rewrite_options
                       .disable_meta_optimizer),
    "log.stall_secs": (5, {}, "tests/test_launch_edges.py::test_a_frozen_worker_is_reported_with_what_its_process_does"),
    "log.level": ("debug", {}, lambda pg, g, l: any(m.startswith("epl.init:") for m in l)),
}


def test_every_key_has_decided_what_it_does_alone():
  assert sorted(ALONE) == sorted(KEYS), "decide (and test) what a new key does alone"
  for name, key in KEYS.items():
    assert key.unannotated in (IMPLICIT, ACTS, MOOT, REFUSED), name
    assert key.requires is None or key.requires in KEYS, name
    value, needs, check = ALONE[name]
    assert value != key.default, name
    assert (key.requires is None) == (not needs) or key.requires in needs, name


class _Logs(logging.Handler):
  def __init__(self):
    super().__init__(logging.DEBUG)
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


def _train(config_dict):
  """An unannotated model (3 blocks, a dataset iterator, Momentum) trained 2 steps."""
  g = tf.Graph()
  logs = _Logs()
  log = logging.getLogger("epl")
  log.addHandler(logs)
  try:
    with g.as_default():
      tf.set_random_seed(1)
      epl.init(epl.Config(config_dict))
      rng = np.random.RandomState(0)
      data = (rng.randn(64, 8).astype(np.float32), rng.randint(0, 4, 64).astype(np.int64))
      x, y = tf.data.make_one_shot_iterator(
          tf.data.Dataset.from_tensor_slices(data).batch(4).repeat()).get_next()
      h = x
      for i in range(3):
        with tf.variable_scope("block_%d" % i):
          h = tf.layers.dense(h, 8, activation=tf.nn.relu)
      loss = tf.losses.sparse_softmax_cross_entropy(y, tf.layers.dense(h, 4))
      step = tf.train.get_or_create_global_step()
      train = tf.train.MomentumOptimizer(0.1, 0.9).minimize(loss, global_step=step)
      with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        losses = [sess.run([train, loss])[1] for _ in range(2)]
      return epl.Graph.get(), g, logs.messages, losses
  finally:
    log.removeHandler(logs)
    log.setLevel(logging.INFO)


@pytest.mark.parametrize("name", sorted(KEYS))
def test_a_key_set_alone_on_an_unannotated_graph_acts_or_is_refused(name):
  key = KEYS[name]
  value, needs, check = ALONE[name]
  if key.requires:                       # alone it is refused, naming both keys
    with pytest.raises(ConfigError, match=r"%r=.* has no effect unless %r" % (
        name, key.requires)):
      epl.Config({name: value})
  if not key.is_built(value):
    with pytest.raises(NotImplementedYetError, match=name):
      epl.Config({name: value})
    return
  config = dict(needs, **{name: value})
  if key.unannotated == REFUSED:
    with pytest.raises(PlanError, match=r"Config key %r=.* no epl annotation.*"
                       r"set_default_strategy" % name):
      _train(config)
    return
  pg, graph, logs, losses = _train(config)
  assert all(np.isfinite(losses)), (name, losses)
  if isinstance(check, str):             # acts on the job: that test shows it
    path, test = check.split("::")
    with open(os.path.join(ROOT, path)) as f:
      assert "def %s(" % test in f.read(), check
    return
  if key.unannotated == MOOT:
    assert pg.plan.is_local, (name, pg.summary())
    assert check is None
    return
  assert check is not None and check(pg, graph, logs), (name, pg.summary(), logs[-5:])
  if key.unannotated == IMPLICIT:
    assert not pg.plan.is_local and pg.plan.total_copies == 1, pg.summary()
