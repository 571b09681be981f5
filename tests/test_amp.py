"""AMP O1 (amp.level): which ops run in float16, no float16 weights, parity with the float32
local script within float16 tolerance (alone, data-parallel, pipelined, accumulated), the
user's clipping sees unscaled gradients, and a step with inf/nan is skipped while the dynamic
loss scale halves (and doubles after enough good steps).

Tolerance: float16 keeps 11 significant bits (relative step 2^-11 ~ 5e-4); over 5 steps of
these tiny models losses and variables stay within ``FP16_RTOL`` of the float32 run, i.e.
``|amp - fp32| <= FP16_RTOL * max(1, |fp32|)``; bfloat16 keeps 8 bits: ``BF16_RTOL``.
"""
import collections
import contextlib
import sys

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.testing.values import read_values
from epl.testing import assert_parity
from tests import models

FP16_RTOL = 3e-3
BF16_RTOL = 3e-2
TRANSFORMER_RTOL = 5e-3     # attention weights' momentum slots: their gradients sum many
                            # float16 products (measured up to 2.4e-3 in 5 steps)


def cfg(devices=1, **extra):
  keys = {"cluster.devices_per_worker": devices, "amp.level": "O1", "amp.loss_scale": 1024}
  keys.update(extra)
  return epl.Config(keys)


def _low_ops(graph, dtype=tf.float16):
  """Op type -> count of ops (casts aside) computing in ``dtype``."""
  return collections.Counter(op.type for op in graph.get_operations()
                             if op.type != "Cast" and any(t.dtype == dtype for t in op.outputs))


def _is_variable_read(t):
  return t.op.type == "ReadVariableOp" or (t.op.type == "Identity" and t.op.inputs and
                                           t.op.inputs[0].dtype._is_ref_dtype)


def test_listed_ops_run_in_float16_and_no_weight_is_kept_in_float16():
  local, dist = assert_parity(models.mlp, cfg(), copies=1, optimizer="adam",
                              rtol=FP16_RTOL)
  graph = dist.graph
  low = _low_ops(graph)
  originals = [op for op in graph.get_operations() if not op.name.startswith("epl_amp/")]
  matmuls = [op for op in originals if op.type == "MatMul"]
  # every matmul of the forward and backward pass (3 + 6 here) has a float16 twin; the chain
  # bias -> relu / tanh -> matmul and its gradients follow it; the loss side does not
  assert len(matmuls) == 9 and low["MatMul"] == 9
  assert low["BiasAdd"] == 3 and low["Relu"] == 1 and low["Tanh"] == 1
  assert low["ReluGrad"] == 1 and low["TanhGrad"] == 1 and low["BiasAddGrad"] >= 2
  for kept in ("SparseSoftmaxCrossEntropyWithLogits", "Mean", "Sum", "Softmax", "ApplyAdam"):
    assert low[kept] == 0, kept
  assert not [v for v in tf.global_variables(graph) if v.dtype.base_dtype != tf.float32 and
              v.dtype.base_dtype.is_floating]
  # a weight is cast once per use, just before it: no float16 copy shared by two ops
  weight_casts = [op for op in graph.get_operations() if op.type == "Cast" and
                  op.outputs[0].dtype == tf.float16 and _is_variable_read(op.inputs[0])]
  assert weight_casts and all(len(op.outputs[0].consumers()) == 1 for op in weight_casts)
  twins = [op for op in graph.get_operations() if op.name.startswith("epl_amp/")
           and op.type != "Cast"]
  weight_uses = sum(1 for op in twins for t in op.inputs
                    if t.op.type == "Cast" and _is_variable_read(t.op.inputs[0]))
  assert weight_uses == len(weight_casts)


@pytest.mark.parametrize("loss_scale", [1024, "dynamic"])
def test_mlp_trains_the_float32_model_within_float16_tolerance(loss_scale):
  assert_parity(models.mlp, cfg(**{"amp.loss_scale": loss_scale}), copies=1,
                optimizer="adam", rtol=FP16_RTOL)


def test_without_amp_the_same_check_is_exact_so_the_tolerance_is_amps():
  with pytest.raises(AssertionError):      # AMP really changes the numerics
    assert_parity(models.mlp, cfg(), copies=1, optimizer="adam", rtol=1e-6)


def test_data_parallel_amp_trains_the_local_model():
  assert_parity(models.mlp, cfg(2), copies=2, optimizer="adam", rtol=FP16_RTOL)


def test_transformer_pipeline_with_micro_batches():
  local, dist = assert_parity(
      # momentum, not Adam: the attention key's bias has a zero gradient in exact arithmetic
      # (softmax ignores a per-query constant), and Adam would amplify its rounding noise
      models.transformer_two_stages, cfg(2, **{"pipeline.num_micro_batch": 2}), copies=2,
      optimizer="momentum", rtol=TRANSFORMER_RTOL,
      strategies=[lambda: epl.replicate(1, name="s0"), lambda: epl.replicate(1, name="s1")])
  np.testing.assert_allclose(dist.losses, local.losses, rtol=FP16_RTOL)
  low = _low_ops(dist.graph)
  assert low["BatchMatMulV2"] + low["BatchMatMul"] > 0 and low["Softmax"] == 0


def test_gradient_accumulation_with_amp():
  assert_parity(models.mlp, cfg(1, **{"pipeline.num_micro_batch": 2}), copies=2,
                optimizer="adam", rtol=FP16_RTOL)


def test_bfloat16():
  _, dist = assert_parity(models.mlp, cfg(2, **{"amp.dtype": "bfloat16"}), copies=2,
                          optimizer="adam", rtol=BF16_RTOL)
  assert _low_ops(dist.graph, tf.bfloat16)["MatMul"] == 2 * 9          # in each copy
  assert not _low_ops(dist.graph, tf.float16)
  assert not [op for op in dist.graph.get_operations() if "loss_scale" in op.name]


def _clipped_run(config, steps=4):
  """A script that clips by global norm (BERT's optimization.py does) with a low clip norm,
  so clipping acts on every step: a scaled gradient would be clipped to another direction."""
  rng = np.random.RandomState(3)
  xs = rng.randn(steps, 8, 8).astype(np.float32)
  ys = rng.randint(0, 4, (steps, 8)).astype(np.int64)
  graph = tf.Graph()
  with graph.as_default():
    tf.set_random_seed(1)
    if config is not None:
      epl.init(config)
    x = tf.placeholder(tf.float32, [8, 8])
    y = tf.placeholder(tf.int64, [8])
    with epl.replicate(1) if config is not None else contextlib.nullcontext():
      loss = models.mlp(x, y, lambda i: contextlib.nullcontext())
    params = tf.trainable_variables()
    grads = tf.gradients(loss, params)
    grads, norm = tf.clip_by_global_norm(grads, 0.05)
    step = tf.train.get_or_create_global_step()
    train = tf.train.GradientDescentOptimizer(0.5).apply_gradients(zip(grads, params),
                                                                  global_step=step)
    init = tf.global_variables_initializer()
    with tf.Session() as sess:
      sess.run(init)
      norms = [sess.run([train, norm], {x: xs[i], y: ys[i]})[1] for i in range(steps)]
      return norms, read_values(sess, params)


def test_the_users_clipping_sees_unscaled_gradients():
  norms, weights = _clipped_run(None)
  amp_norms, amp_weights = _clipped_run(cfg(**{"amp.loss_scale": 4096}))
  np.testing.assert_allclose(amp_norms, norms, rtol=FP16_RTOL)
  assert min(norms) > 0.05                            # clipping acted on every step
  for name, value in weights.items():
    np.testing.assert_allclose(amp_weights[name], value, rtol=FP16_RTOL, atol=FP16_RTOL)


def _overflow_graph():
  x = tf.placeholder(tf.float32, [8, 8], name="x")
  y = tf.placeholder(tf.int64, [8], name="y")
  with epl.replicate(1):
    loss = models.mlp(x, y, lambda i: contextlib.nullcontext())
  step = tf.train.get_or_create_global_step()
  train = tf.train.AdamOptimizer(0.01).minimize(loss, global_step=step)
  return x, y, loss, train


def _scale_variable():
  return next(v for v in tf.global_variables() if v.op.name == "epl_amp/loss_scale")


def test_an_overflowing_step_is_skipped_and_the_dynamic_scale_halves():
  rng = np.random.RandomState(0)
  feed_x, feed_y = rng.randn(8, 8).astype(np.float32), rng.randint(0, 4, 8)
  with tf.Graph().as_default():
    epl.init(cfg(**{"amp.loss_scale": "dynamic"}))
    x, y, loss, train = _overflow_graph()
    init = tf.global_variables_initializer()      # built before epl adds its scale: covered
    with tf.Session() as sess:
      sess.run(init)
      scale = _scale_variable()
      state = tf.global_variables()
      sess.run(train, {x: feed_x, y: feed_y})
      assert sess.run(scale) == 2.0 ** 15
      before = read_values(sess, state)
      # 1e6 is beyond float16's range (65504): the forward pass overflows to inf
      value, _ = sess.run([loss, train], {x: feed_x * 1e6, y: feed_y})
      assert not np.isfinite(value)
      after = read_values(sess, state)
      for name, v in before.items():          # weights, Adam slots, beta powers, global_step
        if not name.startswith("epl_amp/"):
          np.testing.assert_array_equal(after[name], v, err_msg=name)
      assert sess.run(scale) == 2.0 ** 14
      sess.run(train, {x: feed_x, y: feed_y})
      assert sess.run(tf.train.get_global_step()) == 2
      assert sess.run(scale) == 2.0 ** 14
      changed = read_values(sess, state)
      assert not np.array_equal(changed["dense/kernel"], after["dense/kernel"])


def test_the_dynamic_scale_doubles_after_enough_good_steps(monkeypatch):
  monkeypatch.setattr(sys.modules["epl.amp.scaling"], "GROWTH_INTERVAL", 3)
  rng = np.random.RandomState(0)
  feed = rng.randn(8, 8).astype(np.float32), rng.randint(0, 4, 8)
  with tf.Graph().as_default():
    epl.init(cfg(**{"amp.loss_scale": "dynamic"}))
    x, y, _, train = _overflow_graph()
    with tf.train.MonitoredTrainingSession() as sess:
      scale = _scale_variable()
      scales = []
      for _ in range(7):
        sess.run(train, {x: feed[0], y: feed[1]})
        scales.append(sess.run(scale))
  assert scales == [2.0 ** 15] * 2 + [2.0 ** 16] * 3 + [2.0 ** 17] * 2


def test_debug_log_names_the_converted_ops(caplog):
  import logging
  with caplog.at_level(logging.INFO, logger="epl"):
    logger = logging.getLogger("epl")
    logger.addHandler(caplog.handler)
    try:
      assert_parity(models.mlp, cfg(**{"amp.debug_log": True}), copies=1, rtol=FP16_RTOL)
    finally:
      logger.removeHandler(caplog.handler)
  text = caplog.text
  assert "amp: dense/MatMul (MatMul) runs in float16" in text
  assert "amp O1: " in text and "MatMul 9" in text


def test_amp_with_offload_trains_what_amp_trains_on_the_devices():
  """(offload x AMP O1 was refused until #51; tests/test_memory_passes.py checks where the
  casts run.)"""
  assert_parity(models.mlp, cfg(2, **{"offload.level": "v0"}), copies=2, rtol=FP16_RTOL)


def test_amp_with_gradient_checkpointing_recomputes_in_float16():
  local, dist = assert_parity(
      models.transformer_two_stages, cfg(1, **{"gradient_checkpoint.type": "auto"}), copies=1,
      optimizer="momentum", rtol=TRANSFORMER_RTOL,
      strategies=[lambda: epl.replicate(1, name="all")] * 2)
  recomputed = dist.parallel.results["recompute"]
  assert recomputed.segments >= 1 and recomputed.rewired > 0
  clones = [op for op in dist.graph.get_operations() if "recompute" in op.name.lower() and
            op.type == "BatchMatMulV2" and "epl_amp/" in op.name]
  assert clones and all(op.outputs[0].dtype == tf.float16 for op in clones)
