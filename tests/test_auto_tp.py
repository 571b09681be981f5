"""auto.auto_parallel picks tensor parallelism (#51 item 3): when no data-parallel or pipeline
plan fits auto.device_memory, the smallest epl.split degree whose plan fits re-executes the
script with auto.layout, which builds the model in an epl.split scope -- without the user
writing any -- and trains the local model."""
import contextlib
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.runtime import auto_tp
from tests import split_models as sm
from tests.real_scripts import gpt2_lm
from tests.workers import auto_tp_worker as worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def _wide_model_restored():
  """worker.build widens gpt2_lm's module constants: put them back after."""
  saved = gpt2_lm.EMBD, gpt2_lm.LAYERS
  try:
    yield
  finally:
    gpt2_lm.EMBD, gpt2_lm.LAYERS = saved


def _train_wide(config):
  with _wide_model_restored():
    return sm.train(worker.build, worker.data(), 1, worker.ROWS, config=config)


@pytest.fixture(scope="module")
def local():
  with _wide_model_restored():
    return sm.train(worker.build, worker.data(), worker.STEPS, worker.ROWS)


def _same(losses, variables, local):
  np.testing.assert_allclose(losses, [f["loss"] for f in local.fetched], rtol=1e-5, atol=1e-6)
  for name, value in local.variables.items():
    np.testing.assert_allclose(variables[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_budget_only_tensor_parallelism_meets_reexecutes_the_script_split(local, tmp_path):
  """3MB: data parallelism peaks at ~3.7MB and no pipeline cut lowers it (one block holds
  the weights); epl.split(2) x 4 replicas peaks at ~2.1MB. The script (the step as
  tf.gradients + clipping, as OpenAI's trainers write it) runs twice in one pid: the plan,
  then the split model, which trains the local model."""
  np.savez(tmp_path / "initial.npz", **local.initial)
  env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
  env.update(PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
  done = subprocess.run(
      [sys.executable, "-m", "tests.workers.auto_tp_worker", str(tmp_path / "initial.npz"),
       str(tmp_path / "out.npz"), "3MB"], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "re-executing this process with auto.layout={\"micro_batches\": 4, \"split\": 2}" \
      in done.stderr, done.stderr[-3000:]
  assert "the model is built in epl.split(2) (auto.layout)" in done.stderr
  out = np.load(tmp_path / "out.npz")
  pids = str(out["pids"]).split()
  assert len(pids) == 2 and pids[0] == pids[1]
  assert list(out["kinds"]) == ["auto_split:split"]
  _same(out["losses"], {k[4:]: out[k] for k in out.files if k.startswith("var:")}, local)


@pytest.mark.parametrize("grads, kind, session_first", [
    ("minimize", "resource", False), ("compute_gradients", "ref", False),
    ("tf.gradients", "ref", True)])
def test_auto_layout_builds_the_model_split_and_trains_the_local_model(grads, kind,
                                                                      session_first):
  """The second pass in-process (auto.layout given, as a user skipping the planning would),
  the step written three ways, ref and resource variables, the session opened first."""
  with _variables(kind):
    _second_pass(grads, session_first)


@contextlib.contextmanager
def _variables(kind):
  enabled = tf.resource_variables_enabled()
  if kind == "resource":
    tf.enable_resource_variables()
  try:
    yield
  finally:
    if not enabled:
      tf.disable_resource_variables()


def _second_pass(grads, session_first):
  def build():
    t = gpt2_lm.build(None, lambda i: contextlib.nullcontext(), grads=grads)
    return dict(inputs=(t["placeholders"]["context"],), loss=t["loss"], train_op=t["train_op"])
  rows, steps = 32, 3
  data = (gpt2_lm.make_data(rows * steps)["context"],)
  local = sm.train(build, data, steps, rows)
  run = sm.train(build, data, steps, rows, initial=local.initial, session_first=session_first,
                 config=epl.Config({
      "auto.auto_parallel": True, "pipeline.num_micro_batch": 2,
      "cluster.devices_per_worker": 4,
      "auto.layout": '{"split": 2, "micro_batches": 4}'}))
  [taskgraph] = run.parallel.plan.taskgraphs
  assert (taskgraph.name, taskgraph.placement.kind) == ("auto_split", "split")
  assert run.parallel.plan.micro_batches == 4
  assert sm.part_devices(run.graph)["model/h0/mlp/c_fc/w"]      # the weights are cut
  _same([f["loss"] for f in run.fetched], run.variables, local)


def test_under_pytest_the_choice_is_an_error_not_a_second_test_session(local):
  config = epl.Config({"auto.auto_parallel": True, "pipeline.num_micro_batch": 2,
                       "cluster.devices_per_worker": 8, "auto.device_memory": "3MB"})
  with pytest.raises(epl.errors.PlanError, match=r"chose the layout \{\"micro_batches\": 4, "
                     r"\"split\": 2\}.*pytest run.*EPL_AUTO_LAYOUT="):
    _train_wide(config)


def test_a_budget_nothing_meets_names_the_degrees_tried(local):
  config = epl.Config({"auto.auto_parallel": True, "cluster.devices_per_worker": 8,
                       "auto.device_memory": "100KB"})
  with pytest.raises(epl.errors.PlanError, match=r"no plan fits auto.device_memory=100KB.*nor "
                     r"does tensor parallelism \(epl.split of degree 2 or 4 or 8\)"):
    _train_wide(config)


def test_a_multi_worker_job_is_told_to_set_the_layout_on_every_worker():
  with pytest.raises(epl.errors.PlanError, match=r"a job of 2 workers.*EPL_AUTO_LAYOUT"):
    auto_tp.relaunch({"split": 2, "micro_batches": 4}, types.SimpleNamespace(worker_num=2))


@pytest.mark.parametrize("text, error", [
    ("split 2", "is not JSON"), ('{"split": 0, "micro_batches": 2}', "whole numbers >= 1"),
    ('{"split": 2}', "whole numbers >= 1"), ('{"split": 2, "micro_batches": 2, "x": 1}',
                                             "whole numbers >= 1")])
def test_a_bad_auto_layout_is_one_clear_error(text, error):
  with tf.Graph().as_default(), pytest.raises(epl.errors.ConfigError,
                                             match="auto.layout=.*" + error):
    epl.init(epl.Config({"auto.auto_parallel": True, "auto.layout": text}))
  with pytest.raises(epl.errors.ConfigError, match="auto.layout.*auto.auto_parallel"):
    epl.Config({"auto.layout": json.dumps({"split": 2, "micro_batches": 2})})


def test_the_tensor_parallel_profile_divides_compute_and_cut_weights_and_adds_all_reduces():
  from epl.plan.auto import DeviceSpec, Node, Profile
  profile = Profile((Node("node1", "wide", 8.0, 16.0, (1e6,), 4000.0),
                     Node("node2", "norm", 2.0, 2.0, (1e6,), 100.0)), (("node1", "node2"),))
  spec = DeviceSpec.parse("8")
  wide, norm = auto_tp.tp_profile(profile, 4, {"wide": 0.75, "norm": 0.0}, spec).nodes
  reduce_ms = 2 * 1e3 * spec.allreduce_s(range(4), 1e6)     # two all-reduces of the output
  assert reduce_ms > 0
  assert (wide.forward_ms, wide.backward_ms) == pytest.approx((2.0 + reduce_ms, 4.0 + reduce_ms))
  assert wide.parameter_bytes == pytest.approx(4000 * (0.25 + 0.75 / 4))
  assert (norm.forward_ms, norm.backward_ms, norm.parameter_bytes) == pytest.approx(
      (0.5, 0.5, 100.0))            # nothing cut: no all-reduce, its weights whole
  assert auto_tp.degrees(8) == [2, 4, 8] and auto_tp.degrees(6) == [2, 3, 6]


LAYOUT = {"auto.auto_parallel": True, "auto.layout": '{"split": 2, "micro_batches": 1}',
          "cluster.devices_per_worker": 2}


def test_the_second_pass_refuses_a_model_built_before_epl_init():
  with tf.Graph().as_default():
    tf.get_variable("w", [2, 2])
    with pytest.raises(epl.errors.PlanError, match="call epl.init before building the model"):
      epl.init(epl.Config(LAYOUT))


def test_epl_init_again_ends_the_scope_a_graph_never_differentiated_left_open():
  with tf.Graph().as_default():
    epl.init(epl.Config(LAYOUT))          # the scope opens; no tf.gradients follows
    tf.get_variable("w", [2, 2])
  for config in (LAYOUT, {}):
    with tf.Graph().as_default():         # not "epl scopes cannot be nested"
      epl.init(epl.Config(config))
      with epl.replicate(1) if not config else contextlib.nullcontext():
        tf.get_variable("v", [2, 2])
