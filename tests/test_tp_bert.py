"""Tensor parallelism on BERT as google-research publishes it (tests/real_scripts/bert_like.py:
modeling.py's attention on a 2-D ``[batch*seq, hidden]`` matrix with separate query, key and
value dense layers and an additive mask, ``tf.slice`` of the position table, the optimizer's
hand-written ``AdamWeightDecayOptimizer`` whose slots are ``tf.get_variable(param_name +
"/adam_m")``): at TP 2, TP 2 x DP 2 and DP 2 x PP 2 x TP 2 it trains the local model with no gather in the
step, each slot is split like its weight, on the weight's device, and a TP 2 checkpoint restores into the local script and into
TP 4 with every weight and slot equal."""
import contextlib
import functools

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from tests import split_models as sm
from tests.real_scripts import bert_like as bl

ROWS, STEPS = 8, 3
KEYS = ("input_ids", "input_mask", "segment_ids", "label_ids")


def _data():
  data = bl.make_data(ROWS * STEPS)
  return tuple(data[k] for k in KEYS)


def _build(stage):
  t = bl.build(ROWS, stage)
  return dict(inputs=tuple(t["placeholders"][k] for k in KEYS), loss=t["loss"],
              train_op=t["train_op"])


def _local_stage(i):
  del i
  return contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def _local():
  return sm.train(lambda: _build(_local_stage), _data(), STEPS, ROWS, race_free=True,
                  eval_rows=ROWS)


LAYOUTS = {
    "TP 2": (lambda i: epl.split(2, name="tp"), {"cluster.devices_per_worker": 2}),
    "TP 2 x DP 2": (lambda i: epl.split(2, name="tp"), {"cluster.devices_per_worker": 4}),
    "DP 2 x PP 2 x TP 2, 4 micro-batches": (lambda i: epl.split(2, name="stage%d" % i),
                                            {"cluster.devices_per_worker": 8,
                                             "pipeline.num_micro_batch": 4}),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_published_bert_trains_the_local_model_with_its_own_optimizer(layout):
  stage, config = LAYOUTS[layout]
  local = _local()
  run = sm.train(lambda: _build(stage), _data(), STEPS, ROWS, config=epl.Config(config),
                 initial=local.initial, eval_rows=ROWS)
  for got, want in zip(run.fetched, local.fetched):
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5, atol=1e-5)
  assert any(name.endswith("/adam_m") for name in local.variables)
  for name, value in local.variables.items():             # weights and adam_m / adam_v
    np.testing.assert_allclose(run.variables[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
  in_step = [g for g in run.parallel.plan.gathers if g.in_step]
  assert not in_step, "\n".join(map(str, in_step))
  # each part's slots sit on the part's device (sm.check_parts_placed saw them split)
  devices = sm.part_devices(run.graph)
  for name, parts in devices.items():
    if name.endswith(("/adam_m", "/adam_v")):
      assert parts == devices[name.rsplit("/", 1)[0]], name


def _saved_or_restored(stage, config, directory, initial=None):
  """BERT under ``config`` (None: the local script) trained STEPS steps from ``initial`` and
  saved to ``directory``, or (``initial`` None) restored from it; its whole values."""
  graph = tf.Graph()
  with graph.as_default():
    tf.set_random_seed(0)
    if config is not None:
      epl.init(epl.Config(config))
    t = _build(stage)
    variables = tf.global_variables()
    saver = tf.train.Saver()             # as run_classifier does: before the first run
    with tf.Session() as sess:
      if initial is None:
        saver.restore(sess, tf.train.latest_checkpoint(str(directory)))
        return sm.whole_values(sess, variables)
      sess.run(tf.global_variables_initializer())
      sm.load_whole(sess, variables, initial)
      data = _data()
      for s in range(STEPS):
        sess.run(t["train_op"], {p: d[s * ROWS:(s + 1) * ROWS]
                                 for p, d in zip(t["inputs"], data)})
      saver.save(sess, str(directory / "model.ckpt"), global_step=tf.train.get_global_step())
      return sm.whole_values(sess, variables)


def test_a_tp_checkpoint_with_a_hand_written_optimizers_slots_restores_anywhere(tmp_path):
  local = _local()
  saved = _saved_or_restored(lambda i: epl.split(2, name="tp"),
                             {"cluster.devices_per_worker": 2}, tmp_path, local.initial)
  names = tf.train.list_variables(tf.train.latest_checkpoint(str(tmp_path)))
  assert "bert/embeddings/word_embeddings/adam_m" in dict(names), names   # the local names
  for stage, config in ((_local_stage, None),
                        (lambda i: epl.split(4, name="tp"), {"cluster.devices_per_worker": 4})):
    restored = _saved_or_restored(stage, config, tmp_path)
    assert sorted(restored) == sorted(saved)
    for name, value in saved.items():
      np.testing.assert_allclose(restored[name], value, rtol=1e-6, atol=1e-6, err_msg=name)


def test_a_fixed_batch_entering_a_split_stage_from_several_copies_is_one_clear_error():
  """run_classifier's placeholders fix the batch ([batch_size, seq]) and modeling.py builds
  its masks with that size: a split stage fed by 2 replicated copies would read their rows
  concatenated -- refused before training, naming the tensor and the fix."""
  stage = lambda i: epl.replicate(2, name="s0") if i == 0 else epl.split(2, name="s1")
  with pytest.raises(epl.errors.PlanError, match=r"batch rows fixed at %d\) of TaskGraph "
                     r"'s0' is read by .* which runs once for 2 copies of 's0' and reads their "
                     r"rows concatenated \(%d rows\).*\[None, \.\.\.\]" % (ROWS, 2 * ROWS)):
    sm.train(lambda: _build(stage), _data(), 1, ROWS,
             config=epl.Config({"cluster.devices_per_worker": 2,
                                "cluster.colocate_split_and_replicate": True}))
