"""Resource variables: the same model whichever kind of variable the script makes.

``tf.disable_v2_behavior()`` makes ``tf.layers`` and ``tf.get_variable`` create ref variables
(the suite's default); a script that only disables eager execution, calls
``tf.enable_resource_variables()`` or passes ``use_resource=True`` makes resource variables,
whose reads are ``ReadVariableOp``s (TF marks them stateful) and whose op's output is a scalar
handle, not the value. Both kinds, under every layout: a ResNet/slim-style script (kernel
regularizers, weight decay, momentum on a schedule, an EMA of the weights after the step).
Resource variables (their ref runs are in test_same_model.py and test_pipeline.py): GPT-2
(tf.gradients + clipping, tied embeddings read by ``ResourceGather``), and Adam on stages of
different device counts (copies read the first stage's beta powers).
"""
import contextlib

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from epl.testing.parity import assert_parity
from tests import models
from tests.real_scripts import gpt2_lm, resnet_like
from tests.real_scripts.harness import MODES, assert_same_training, run, steps_of
from tests.test_pipeline import cfg, stages_on

STEPS = 4


@pytest.fixture(params=["ref", "resource"])
def variables(request):
  """The kind of variable the script makes (the process's default, restored after)."""
  with _variables(request.param):
    yield request.param


@pytest.fixture
def resource():
  """Resource variables only (the ref runs of these models are in test_same_model.py and
  test_pipeline.py)."""
  with _variables("resource"):
    yield "resource"


@contextlib.contextmanager
def _variables(kind):
  enabled = tf.resource_variables_enabled()
  (tf.enable_resource_variables if kind == "resource" else tf.disable_resource_variables)()
  try:
    yield
  finally:
    (tf.enable_resource_variables if enabled else tf.disable_resource_variables)()


def _kinds(result):
  return {type(v).__name__ for v in result.parallel.graph.get_collection(
      tf.GraphKeys.GLOBAL_VARIABLES)}


def _expected_kind(variables):
  return {"ref": {"RefVariable"}, "resource": {"ResourceVariable"}}[variables]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_resnet_style_script_with_regularizers_weight_decay_and_ema(variables, mode):
  """Each copy and micro-batch adds the regularization terms of its own clone of the layers
  to its loss (the collection holds the user's, once); the EMA and the schedule move once
  per step; every variable -- the averages and momentum slots too -- as the local run's."""
  m = MODES[mode]
  rows = m.pieces * 3
  data = resnet_like.make_data(rows * STEPS)
  local = run(resnet_like, rows, data, steps_of(rows, STEPS), extra=("cross_entropy",))
  dist = run(resnet_like, 3, data, steps_of(rows, STEPS), mode=m, initial=local.initial,
             extra=("cross_entropy",))
  assert _kinds(dist) == _expected_kind(variables)
  assert_same_training(local, dist)
  averages = [n for n in local.variables if n.endswith("ExponentialMovingAverage")]
  assert len(averages) == 4
  for name in averages:                      # the averages moved, and not to the weights
    assert not np.allclose(local.variables[name], local.initial[name])
    assert not np.allclose(local.variables[name], local.variables[name.rsplit("/", 1)[0]])


@pytest.mark.parametrize("mode", ["dp2", "pipeline2_m4", "accumulate_m4"])
def test_gpt2_style_lm_with_tied_embeddings(resource, mode):
  m = MODES[mode]
  rows = m.pieces * 2
  data = gpt2_lm.make_data(rows * 3)
  build = dict(grads="tf.gradients")
  local = run(gpt2_lm, rows, data, steps_of(rows, 3), race_free=True, build=build)
  dist = run(gpt2_lm, 2, data, steps_of(rows, 3), mode=m, initial=local.initial, build=build)
  assert _kinds(dist) == _expected_kind(resource)
  assert_same_training(local, dist)
  if mode == "accumulate_m4":
    # the tied wte's sparse gradient is clipped by the global norm: its micro-batches stay
    # clones (runs sum its rows; a norm over the local IndexedSlices' rows differs: ~7e-5)
    assert dist.parallel.plan.accumulate_runs == 1 and dist.parallel.plan.num_micro_batch == 4


@pytest.mark.parametrize("level,mode", [("v0", "dp2"), ("v1", "pipeline2_m4"), ("v2", "dp2"),
                                        ("v2", "pipeline2_m4")])
def test_gpt2_with_zero_on_resource_variables(resource, level, mode):
  """The learned positions' gradient is sparse (tf.gather: Adam's sparse path). A copy that
  does not own wpe still ran the reads of its never-initialised slot clones that its sparse
  update makes after its scatters (the update's group waits for them): "Could not find
  variable EPL_REPLICA_1/model/wpe/Adam_1" at the first step; with v2 its lookup read its
  never-initialised variable clone through the handle (ResourceGather)."""
  m = MODES[mode]
  rows = m.pieces * 2
  data = gpt2_lm.make_data(rows * 3)
  build = dict(grads="tf.gradients")
  local = run(gpt2_lm, rows, data, steps_of(rows, 3), race_free=True, build=build)
  dist = run(gpt2_lm, 2, data, steps_of(rows, 3), mode=m, initial=local.initial, build=build,
             config=m.config(**{"zero.level": level}))
  assert _kinds(dist) == {"ResourceVariable"}
  assert_same_training(local, dist)


def test_adam_on_stages_of_different_device_counts(resource):
  """1:2 with 3 micro-batches: copy 1 runs no stage 0 and reads copy 0's beta powers. A
  resource variable's read (ReadVariableOp) was taken for an update of the beta powers and
  made to wait for copy 1's updates, which read it: a cycle, on which the rewrite looped
  until the machine ran out of memory."""
  _, dist = assert_parity(models.mlp_two_stages, cfg(3, 3), copies=3,
                          strategies=stages_on((1, 2)), optimizer="adam")
  kinds = {type(v).__name__ for v in dist.graph.get_collection(tf.GraphKeys.GLOBAL_VARIABLES)}
  assert kinds == _expected_kind(resource)


def test_a_walk_downstream_ends_on_a_graph_with_a_loop():
  """TrainEnds (which train op an update belongs to) on a graph with a cycle -- a
  tf.while_loop after the op -- ends, with the loop's ends."""
  from epl.passes.slots import TrainEnds
  with tf.Graph().as_default() as graph:
    start = tf.constant(0)
    counted = tf.while_loop(lambda i: i < 3, lambda i: i + 1, [start])
    tf.group(tf.identity(counted), tf.identity(counted), name="train")
    ends = TrainEnds()
    assert [op.name for op in ends(start.op)] == ["train"]
    assert [op.name for op in ends(graph.get_operation_by_name("while/Merge"))] == ["train"]
