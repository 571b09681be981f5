"""``auto.auto_parallel`` under a memory budget (#51): on the GPT-2-style language model as
OpenAI's code writes it (everything under one ``model/`` scope, ``tf.gradients`` + clipping,
the embedding tied to the logits), 8 devices: a budget data parallelism meets gives data
parallelism; one it cannot meet gives pipeline stages; both train the local model."""
import contextlib
import logging
import re

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from tests import split_models as sm
from tests.real_scripts import gpt2_lm

ROWS, STEPS = 128, 3


def _gpt2(grads):
  def build():
    t = gpt2_lm.build(ROWS, lambda i: contextlib.nullcontext(), grads=grads)
    return dict(inputs=(t["placeholders"]["context"],), loss=t["loss"], train_op=t["train_op"])
  return build


def _auto(grads, budget, local, caplog):
  config = epl.Config({"auto.auto_parallel": True, "pipeline.num_micro_batch": 2,
                       "cluster.devices_per_worker": 8, "auto.device_memory": budget,
                       "log.level": "info"})
  caplog.clear()
  logger = logging.getLogger("epl")
  logger.addHandler(caplog.handler)           # epl's logger does not propagate
  try:
    with caplog.at_level("INFO", logger="epl"):
      run = sm.train(_gpt2(grads), (gpt2_lm.make_data(ROWS * STEPS)["context"],), STEPS,
                     ROWS, config=config, initial=local.initial)
  finally:
    logger.removeHandler(caplog.handler)
  chose = [r.getMessage() for r in caplog.records if "the planner chose" in r.getMessage()]
  assert len(chose) == 1, [r.getMessage() for r in caplog.records]
  stages = int(re.search(r"the planner chose (\d+) stage", chose[0]).group(1))
  peak = int(re.search(r"predicted peak (\d+) bytes", chose[0]).group(1))
  return run, stages, peak


def _same(run, local):
  np.testing.assert_allclose([f["loss"] for f in run.fetched],
                             [f["loss"] for f in local.fetched], rtol=1e-5, atol=1e-6)
  for name, value in local.variables.items():
    np.testing.assert_allclose(run.variables[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)


@pytest.mark.parametrize("grads", ["tf.gradients", "minimize", "compute_gradients"])
def test_a_budget_data_parallelism_cannot_meet_gives_pipeline_stages(grads, caplog):
  data = (gpt2_lm.make_data(ROWS * STEPS)["context"],)
  local = sm.train(_gpt2(grads), data, STEPS, ROWS)
  roomy, stages, dp_peak = _auto(grads, "1TB", local, caplog)
  assert stages == 1 and len(roomy.parallel.plan.taskgraphs) == 1       # data parallelism
  _same(roomy, local)
  budget = int(dp_peak * 0.7)
  tight, stages, peak = _auto(grads, str(budget), local, caplog)
  assert stages >= 2 and peak <= budget
  assert [t.name for t in tight.parallel.plan.taskgraphs] == ["stage_%d" % i
                                                              for i in range(stages)]
  _same(tight, local)


def test_a_budget_nothing_meets_is_one_clear_error(caplog):
  data = (gpt2_lm.make_data(ROWS)["context"],)
  config = epl.Config({"auto.auto_parallel": True, "cluster.devices_per_worker": 8,
                       "auto.device_memory": "1000B", "log.level": "warning"})
  with pytest.raises(epl.errors.PlanError, match="no plan fits auto.device_memory=1000B"):
    sm.train(_gpt2("minimize"), data, 1, ROWS, config=config)
  with pytest.raises(epl.errors.PlanError, match="auto.device_memory"):
    sm.train(_gpt2("minimize"), data, 1, ROWS, config=epl.Config(
        {"auto.auto_parallel": True, "cluster.devices_per_worker": 8,
         "auto.device_memory": "lots"}))
  with pytest.raises(epl.errors.PlanError, match="drop one of the two keys"):
    sm.train(_gpt2("minimize"), data, 1, ROWS, config=epl.Config(
        {"auto.auto_parallel": True, "cluster.devices_per_worker": 8,
         "auto.device_memory": "1GB", "pipeline.num_stages": 2}))


def test_a_tied_embedding_keeps_its_stages_on_as_many_devices():
  """GPT-2 reads wte in its embedding and its logits: stages of different replica counts
  (6:1:1 with the logits in the last, which a CI machine's profile once chose) cannot both
  read it, so the planner is offered only cuts that keep its readers' stages on as many
  devices."""
  from epl import profiler
  from epl.runtime.auto_stages import same_copies, tied
  with tf.Graph().as_default() as graph:
    gpt2_lm.build(ROWS, lambda i: contextlib.nullcontext(), grads="minimize")
    layering = profiler.Layering(graph, [v.op for v in graph.get_collection(
        tf.GraphKeys.TRAINABLE_VARIABLES)])
    model = {layering.of(op.name)[0] for op in graph.get_operations()} - {None, "Adam"}
    assert tied(graph, layering, model) == ["model/wte"]
  accept = same_copies([frozenset({"e", "logits"})])
  assert not accept(((frozenset({"e", "h0"}), 6), (frozenset({"h1"}), 1),
                     (frozenset({"logits"}), 1)))
  assert accept(((frozenset({"e", "h0"}), 4), (frozenset({"h1", "logits"}), 4)))
  assert accept(((frozenset({"h0"}), 6), (frozenset({"e", "h1", "logits"}), 2)))
  assert same_copies([]) is None
