"""Gradient checkpointing (gradient_checkpoint.type): the job trains the model it trains
without it -- dropout included -- and holds fewer activation bytes at its peak."""
import contextlib
import sys

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.errors import PlanError
from tests import split_models as sm

STEPS, ROWS = 5, 8


def residual_mlp(blocks=6, width=32, features=sm.FEATURES, dropout=0.1, collection=False,
                 stages=None):
  """A residual MLP stack as people write it: layer-normed blocks under ``block_<i>``
  scopes, dropout (graph-seeded), Adam, clipping. ``stages``: scope factories per half."""
  def build():
    x = tf.placeholder(tf.float32, [None, features], name="x")
    y = tf.placeholder(tf.int64, [None], name="y")
    stage = stages or [contextlib.nullcontext, contextlib.nullcontext]
    with stage[0]():
      h = tf.layers.dense(x, width, name="embed",
                          kernel_initializer=tf.glorot_uniform_initializer(seed=1))
      for i in range(blocks):
        if i == blocks // 2:
          break
        h = _block(h, i, width, dropout, collection)
    with stage[1]():
      for i in range(blocks // 2, blocks):
        h = _block(h, i, width, dropout, collection)
      logits = tf.layers.dense(h, 10, name="logits",
                               kernel_initializer=tf.glorot_uniform_initializer(seed=2))
      loss = tf.losses.sparse_softmax_cross_entropy(y, logits)
    opt = tf.train.MomentumOptimizer(0.05, momentum=0.9)
    grads, variables = zip(*opt.compute_gradients(loss))
    grads, _ = tf.clip_by_global_norm(grads, 1.0)
    train_op = opt.apply_gradients(zip(grads, variables),
                                   global_step=tf.train.get_or_create_global_step())
    return dict(inputs=(x, y), loss=loss, train_op=train_op)
  return build


def gelu(x):
  """BERT's gelu (tanh approximation), as its modeling.py writes it."""
  return 0.5 * x * (1.0 + tf.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))


def _block(h, i, width, dropout, collection):
  with tf.variable_scope("block_%d" % i):
    mean, var = tf.nn.moments(h, [-1], keep_dims=True)
    z = (h - mean) * tf.rsqrt(var + 1e-6)
    z = tf.layers.dense(z, 4 * width, activation=gelu, name="up",
                        kernel_initializer=tf.glorot_uniform_initializer(seed=10 + i))
    if dropout:
      z = tf.nn.dropout(z, rate=dropout)
    z = tf.layers.dense(z, width, name="down",
                        kernel_initializer=tf.glorot_uniform_initializer(seed=50 + i))
    out = h + z
  if collection:
    tf.add_to_collection("checkpoints", out)
  return out


def _config(devices, **keys):
  return epl.Config(dict({"cluster.devices_per_worker": devices, "log.level": "warning"},
                         **keys))


def _train(build, config, steps=STEPS, rows=ROWS, **kw):
  data = sm.classification_data(steps * rows, 10)
  return sm.train(build, data, steps, rows, config=config, **kw)


def _assert_same(run, reference):
  np.testing.assert_allclose([f["loss"] for f in run.fetched],
                             [f["loss"] for f in reference.fetched], rtol=1e-5, atol=1e-6)
  for name, value in reference.variables.items():
    np.testing.assert_allclose(run.variables[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)


def _dp(devices):
  return [lambda: epl.replicate(1, name="model"), lambda: epl.replicate(1, name="model")]


CASES = {
    "collection, 1 device": (1, "collection", None),
    "auto, 1 device": (1, "auto", None),
    "auto, data parallel on 2 devices": (2, "auto", None),
    "auto, 2-stage pipeline, 2 micro-batches": (2, "auto", 2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_recompute_trains_the_model_it_trains_without(case):
  devices, kind, micro = CASES[case]
  # (the pipeline case as clones; as stage functions: tests/test_stage_functions.py -- the
  # two draw dropout masks from other streams)
  keys = {"pipeline.num_micro_batch": micro, "graph.micro_batches": "clones"} if micro else {}
  if micro:
    stages = [lambda: epl.replicate(1, name="stage_0"), lambda: epl.replicate(1, name="stage_1")]
  else:
    stages = _dp(devices)
  build = residual_mlp(collection=kind == "collection", stages=stages)
  plain = _train(build, _config(devices, **keys))
  gc = _train(build, _config(devices, **dict(keys, **{"gradient_checkpoint.type": kind})),
              initial=plain.initial)
  _assert_same(gc, plain)
  done = gc.parallel.results["recompute"]
  assert done.recomputed_ops > 0 and done.rewired > 0, str(done)
  if kind == "collection":
    assert len(done.checkpoints) == 6
  elif not micro:           # the repeated blocks' outputs
    assert [n.split("/")[0] for n in done.checkpoints][:5] == [
        "block_%d" % i for i in range(5)], done.checkpoints
  else:                     # per stage; stage 0 has too few blocks: ~sqrt(n) separators
    assert "block_0/add_1:0" in done.checkpoints and "block_4/add_1:0" in done.checkpoints, \
        done.checkpoints


def test_dropout_masks_are_reused_not_redrawn():
  """With dropout 0.5 a re-drawn mask would change every gradient; GC matches no-GC."""
  build = residual_mlp(blocks=4, dropout=0.5, stages=_dp(1))
  plain = _train(build, _config(1))
  gc = _train(build, _config(1, **{"gradient_checkpoint.type": "auto"}),
              initial=plain.initial)
  _assert_same(gc, plain)


@pytest.mark.parametrize("annotated", [True, False], ids=["replicate(1)", "no annotation"])
def test_recompute_lowers_the_step_peak(annotated):
  """A residual stack (12 blocks, width 256, batch 256) on one device: the traced step peak
  drops by at least a quarter -- also with no annotation at all, the manual's
  ``epl.init(epl.Config({"gradient_checkpoint.type": "auto"}))`` alone (issue #23: that
  graph was left as it was, the same peak with and without the key)."""
  build = residual_mlp(blocks=12, width=256, dropout=0.0, stages=_dp(1) if annotated else None)
  data = (np.random.RandomState(0).randn(256, sm.FEATURES).astype(np.float32),
          np.random.RandomState(1).randint(0, 10, 256))
  peaks = {}
  for kind in ("", "auto"):
    run = sm.train(build, data, 1, 256, config=_config(1, **{"gradient_checkpoint.type": kind}),
                   measure_memory=True)
    peaks[kind] = max(run.memory.peak(d) for d in run.memory.devices())
  assert peaks["auto"] < 0.75 * peaks[""], peaks


def test_an_empty_checkpoints_collection_is_a_clear_error():
  with pytest.raises(PlanError, match="checkpoints"):
    _train(residual_mlp(stages=_dp(1)), _config(1, **{"gradient_checkpoint.type": "collection"}))


def test_check_gradients_passes_a_faithful_recompute_and_catches_a_wrong_one(monkeypatch):
  build = residual_mlp(blocks=4, dropout=0.5, stages=_dp(1))
  keys = {"gradient_checkpoint.type": "auto", "gradient_checkpoint.check_gradients": True}
  plain = _train(build, _config(1))
  checked = _train(build, _config(1, **keys), initial=plain.initial)
  _assert_same(checked, plain)
  assert checked.parallel.results["recompute"].check_op is not None
  # a recompute that re-draws the dropout masks (as a naive recompute would) is caught in
  # the first training step
  redraw_masks(monkeypatch)
  with pytest.raises(tf.errors.InvalidArgumentError, match="check_gradients"):
    _train(build, _config(1, **keys), initial=plain.initial)


def redraw_masks(monkeypatch):
  """Makes the recompute pass re-draw dropout masks (as a naive recompute would): random
  ops no longer count as kept."""
  module = sys.modules["epl.passes.recompute"]
  monkeypatch.setattr(module, "RANDOM_OPS", frozenset())
  monkeypatch.setattr(module, "mutates",
                      lambda op, keep=module.mutates: op.type != "RandomUniform" and keep(op))


def transformer_stack(layers=4, length=16, model=32, heads=4, stages=None):
  """Post-norm transformer encoder layers (BERT's layout: attention, add & norm, gelu FFN,
  add & norm) under ``layer_<i>`` scopes, mean-pooled into a classifier."""
  def build():
    x = tf.placeholder(tf.float32, [None, sm.FEATURES], name="x")
    y = tf.placeholder(tf.int64, [None], name="y")
    stage = (stages or [contextlib.nullcontext])[0]
    with stage():
      h = tf.reshape(tf.layers.dense(x, length * model, name="embed"), [-1, length, model])
      for i in range(layers):
        h = _encoder_layer(h, i, length, model, heads)
      logits = tf.layers.dense(tf.reduce_mean(h, axis=1), 10, name="logits")
      loss = tf.losses.sparse_softmax_cross_entropy(y, logits)
    train_op = tf.train.MomentumOptimizer(0.05, momentum=0.9).minimize(
        loss, global_step=tf.train.get_or_create_global_step())
    return dict(inputs=(x, y), loss=loss, train_op=train_op)
  return build


def _norm(x, name):
  with tf.variable_scope(name):
    mean, var = tf.nn.moments(x, [-1], keep_dims=True)
    gamma = tf.get_variable("gamma", [x.shape[-1]], initializer=tf.ones_initializer())
    return (x - mean) * tf.rsqrt(var + 1e-12) * gamma


def _encoder_layer(h, i, length, model, heads):
  size = model // heads
  with tf.variable_scope("layer_%d" % i):
    def split(t):
      return tf.transpose(tf.reshape(t, [-1, length, heads, size]), [0, 2, 1, 3])
    q, k, v = (split(tf.layers.dense(h, model, name=n)) for n in ("query", "key", "value"))
    probs = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / float(size) ** 0.5)
    context = tf.reshape(tf.transpose(tf.matmul(probs, v), [0, 2, 1, 3]), [-1, length, model])
    h = _norm(h + tf.layers.dense(context, model, name="attention_output"), "attention_norm")
    ffn = tf.layers.dense(tf.layers.dense(h, 4 * model, activation=gelu, name="intermediate"),
                          model, name="output")
    return _norm(h + ffn, "output_norm")


def test_recompute_of_a_transformer_stack_trains_the_same_model_with_less_memory():
  build = transformer_stack(layers=6, length=32, model=64, stages=_dp(1))
  data = (np.random.RandomState(0).randn(64, sm.FEATURES).astype(np.float32),
          np.random.RandomState(1).randint(0, 10, 64))
  runs = {kind: sm.train(build, data, 2, 32, measure_memory=True,
                         config=_config(1, **{"gradient_checkpoint.type": kind}))
          for kind in ("", "auto")}
  _assert_same(runs["auto"], runs[""])
  checkpoints = runs["auto"].parallel.results["recompute"].checkpoints
  assert [n.split("/")[0] for n in checkpoints] == ["layer_%d" % i for i in range(6)], \
      checkpoints
  peak = {k: max(r.memory.peak(d) for d in r.memory.devices()) for k, r in runs.items()}
  assert peak["auto"] < 0.6 * peak[""], peak
