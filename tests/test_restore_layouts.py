"""A checkpoint of any epl layout restores into any other, and into the local script.

A job restarted on other devices (4 GPUs lost, 2 left; a pipeline now, data parallel before)
must get the same model back. For each pair: layout A trains 3 steps from the local run's
initial weights and saves; layout B builds the same script with its own annotations and
Config and restores through ``MonitoredTrainingSession(checkpoint_dir=...)`` -- every
variable and optimizer slot (by the user's names; a split model's parts put together) equals
what A saved -- and trains one step more: ``global_step`` continues, and the step equals the
local script's step from the same checkpoint (1e-5; 2e-3 for an amp step).
"""
import contextlib

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from tests import models
from tests import split_models as sm

ROWS, SAVED_STEPS = 8, 3
FP16_TOL = 2e-3          # a float16 forward and backward (amp) against the float32 step
DATA = models.regression_data(64)


def _dp(devices, **extra):
  return dict({"cluster.devices_per_worker": devices}, **extra), "replicate"


# layout -> (Config dict, annotations); None: the local script
LAYOUTS = {
    "local": (None, None),
    "dp4": _dp(4),
    "dp2": _dp(2),
    "pipeline": ({"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": 4}, "stages"),
    "zero_v2": _dp(2, **{"zero.level": "v2"}),
    "zero_v1": _dp(2, **{"zero.level": "v1"}),
    "zero_v0": _dp(2, **{"zero.level": "v0"}),
    "offload": _dp(2, **{"offload.level": "v0"}),
    "amp": _dp(2, **{"amp.level": "O1"}),
    "gc": _dp(2, **{"gradient_checkpoint.type": "auto"}),
}


def _batch(step):
  lo = step * ROWS % len(DATA[0])
  return DATA[0][lo:lo + ROWS], DATA[1][lo:lo + ROWS]


def _build(layout):
  """The script under ``layout``: (graph, train op, loss, x, y, global step)."""
  config, annotations = LAYOUTS[layout]
  graph = tf.Graph()
  with graph.as_default():
    tf.set_random_seed(5)
    if config is not None:
      epl.init(epl.Config(config))
      if annotations == "replicate":
        epl.set_default_strategy(epl.replicate(1))
    x = tf.placeholder(tf.float32, [None, DATA[0].shape[1]], name="x")
    y = tf.placeholder(tf.int64, [None], name="y")
    scopes = [lambda: epl.replicate(1, name="s0"), lambda: epl.replicate(1, name="s1")]

    def stages(i):
      return scopes[i]() if annotations == "stages" else contextlib.nullcontext()
    loss = models.mlp_two_stages(x, y, stages)
    step = tf.train.get_or_create_global_step()
    train = tf.train.AdamOptimizer(0.01).minimize(loss, global_step=step)
  return graph, train, loss, x, y, step


def _user_variables(graph):
  """The script's own variables (epl's AMP loss scale is not one of them)."""
  return [v for v in graph.get_collection(tf.GraphKeys.GLOBAL_VARIABLES)
          if not v.op.name.startswith("epl_")]


def _train_and_save(layout, directory, initial):
  graph, train, _, x, y, step = _build(layout)
  with graph.as_default(), tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    sm.load_whole(sess, [v for v in _user_variables(graph) if v.op.name in initial], initial)
    for s in range(SAVED_STEPS):
      bx, by = _batch(s)
      sess.run(train, {x: bx, y: by})
    tf.train.Saver().save(sess, str(directory / "model.ckpt"), global_step=step)
    return sm.whole_values(sess, _user_variables(graph))


def _restore_and_step(layout, directory):
  """(values right after the restore, values after one more step, that step's loss)."""
  graph, train, loss, x, y, step = _build(layout)
  with graph.as_default(), tf.train.MonitoredTrainingSession(
      checkpoint_dir=str(directory), save_checkpoint_secs=None, save_summaries_steps=None,
      log_step_count_steps=None) as sess:
    variables = _user_variables(graph)
    restored = sm.whole_values(sess, variables)
    bx, by = _batch(int(restored["global_step"]))
    _, value = sess.run([train, loss], {x: bx, y: by})
    return restored, sm.whole_values(sess, variables), value


def _initial():
  graph = _build("local")[0]
  with graph.as_default(), tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    return sm.whole_values(sess, _user_variables(graph))


PAIRS = [("dp4", "dp2"), ("dp2", "pipeline"), ("pipeline", "dp2"), ("zero_v2", "dp2"),
         ("amp", "dp2"), ("dp2", "amp"), ("offload", "zero_v1"), ("zero_v0", "gc"),
         ("local", "pipeline")] + [(a, "local") for a in ("dp4", "pipeline", "zero_v2",
                                                           "zero_v1", "zero_v0", "amp",
                                                           "offload", "gc")]


@pytest.fixture(scope="module")
def local_saved(tmp_path_factory):
  """What the local script saves after the same steps from the same initial values."""
  return _train_and_save("local", tmp_path_factory.mktemp("local_saved"), _initial())


@pytest.mark.parametrize("source,target", PAIRS, ids=["%s->%s" % p for p in PAIRS])
def test_a_checkpoint_restores_into_another_layout(tmp_path, local_saved, source, target):
  saved = _train_and_save(source, tmp_path, _initial())
  assert saved["global_step"] == SAVED_STEPS
  # what the layout saved is the local script's state (a stale or partial slot of a ZeRO
  # owner, a pipeline stage or an offloaded copy would show here, not only after restoring)
  assert sorted(saved) == sorted(local_saved)
  tol = FP16_TOL if source == "amp" else 1e-5
  for name, value in local_saved.items():
    np.testing.assert_allclose(saved[name], value, rtol=tol, atol=tol, err_msg=name)
  restored, stepped, loss = _restore_and_step(target, tmp_path)
  assert sorted(restored) == sorted(saved)              # every variable and slot, by name
  slots = [n for n in saved if n.endswith(("/Adam", "/Adam_1"))]
  assert len(slots) == 12 and "beta1_power" in saved
  for name, value in saved.items():
    np.testing.assert_array_equal(restored[name], value, err_msg=name)
  assert stepped["global_step"] == SAVED_STEPS + 1      # global_step continues
  if target != "local":                 # the step is the local script's from that checkpoint
    _, local, local_loss = _restore_and_step("local", tmp_path)
    tol = FP16_TOL if target == "amp" else 1e-5
    np.testing.assert_allclose(loss, local_loss, rtol=tol, atol=tol)
    for name, value in local.items():
      np.testing.assert_allclose(stepped[name], value, rtol=tol, atol=tol, err_msg=name)


# ---- split: the parts of a variable are one tensor in the checkpoint ----------------------
def _split_run(split, directory, save, initial=None, steps=0):
  """A split classifier (``split`` parts; 0: the local script) trained ``steps`` steps from
  ``initial``, saved (``save``) or restored from ``directory``; returns its whole values."""
  from tests.test_split import CLASSES
  data = sm.classification_data(32, CLASSES)
  graph = tf.Graph()
  with graph.as_default():
    tf.set_random_seed(0)
    if split:
      epl.init(epl.Config({"cluster.devices_per_worker": split,
                           "cluster.colocate_split_and_replicate": True}))
      t = sm.classifier(CLASSES, *sm.scopes(split, split))
    else:
      t = sm.classifier(CLASSES, *sm.local_scopes())
    feed = {p: d[:8] for p, d in zip(t["inputs"], data)}
    variables = tf.global_variables()
    if save:
      with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        if initial is not None:
          sm.load_whole(sess, variables, initial)
        for _ in range(steps):
          sess.run(t["train_op"], feed)
        tf.train.Saver().save(sess, str(directory / "model.ckpt"),
                              global_step=tf.train.get_global_step())
        return sm.whole_values(sess, variables)
    with tf.train.MonitoredTrainingSession(
        checkpoint_dir=str(directory), save_checkpoint_secs=None, save_summaries_steps=None,
        log_step_count_steps=None) as sess:
      restored = sm.whole_values(sess, variables)
      sess.run(t["train_op"], feed)
      return restored, sm.whole_values(sess, variables)


def test_a_split_checkpoint_restores_into_more_parts_and_into_the_local_script(tmp_path):
  initial = _split_run(0, tmp_path / "init", save=True)
  saved = _split_run(2, tmp_path / "two", save=True, initial=initial, steps=2)
  assert saved["global_step"] == 2 and "classifier/kernel/Momentum" in saved
  results = {}
  for parts in (4, 0):
    restored, results[parts] = _split_run(parts, tmp_path / "two", save=False)
    assert sorted(restored) == sorted(saved)
    for name, value in saved.items():
      np.testing.assert_array_equal(restored[name], value, err_msg=name)
    assert results[parts]["global_step"] == 3
  for name, value in results[0].items():            # split 4's next step is the local one's
    np.testing.assert_allclose(results[4][name], value, rtol=1e-5, atol=1e-6, err_msg=name)
