"""Tensor parallelism on GPT-2 as OpenAI publishes it (tests/real_scripts/gpt2_published.py:
model.py's key/value cache, the loss on ``logits[:, :-1]``, sample.py's sampler in a
``tf.while_loop``), trained as the fine-tuning script trains it (``tf.gradients`` +
``apply_gradients``, no global step): TP 2, TP 2 x DP 2 and DP 2 x PP 2 x TP 2 with 4
micro-batches train the local model with no gather in the training step, and the greedy sample
after training is the local model's on 2 and 4 parts."""
import functools
import importlib.util
import itertools
import re
import types

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.plan import picture
from epl.testing import race_free_step
from tests import split_models as sm
from tests.real_scripts import gpt2_published as gp

ROWS, STEPS, SAMPLE = 8, 3, 6


def _data():
  return gp.make_data(ROWS * STEPS)["context"]


def _train(stage, stage_of, config=None, initial=None, sample=False):
  """Trains the published GPT-2 (the local script with ``config`` None: each step as its reads,
  then its updates, the race-free reference) from ``initial`` (default: its own); returns
  its losses, weights, sampled tokens, initial weights, graph and ParallelGraph."""
  graph = tf.Graph()
  with graph.as_default():
    tf.set_random_seed(0)
    if config is not None:
      epl.init(epl.Config(config))
    t = gp.build(stage, stage_of, sample_length=SAMPLE if sample else 0)
    variables = tf.global_variables()
    data, losses = _data(), []
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      if initial is not None:
        sm.load_whole(sess, variables, initial)
      initial = sm.whole_values(sess, variables)
      for s in range(STEPS):
        feed = {t["placeholders"]["context"]: data[s * ROWS:(s + 1) * ROWS]}
        if config is None:
          losses.append(race_free_step(sess, t["train_op"], feed, t["loss"]))
        else:
          losses.append(sess.run([t["loss"], t["train_op"]], feed)[0])
      weights = sm.whole_values(sess, variables)
      tokens = sess.run(t["sample"], {t["prompt"]: data[:2, :3]}) if sample else None
    return types.SimpleNamespace(
        losses=losses, weights=weights, tokens=tokens, initial=initial, graph=graph,
        parallel=epl.Graph.get() if config is not None else None)


@functools.lru_cache(maxsize=None)
def _local():
  return _train(gp.local_stage, lambda layer: 0, sample=True)


def _check(run, local, sample, rtol=1e-5):
  np.testing.assert_allclose(run.losses, local.losses, rtol=rtol, atol=rtol)
  for name, value in local.weights.items():
    np.testing.assert_allclose(run.weights[name], value, rtol=rtol, atol=rtol, err_msg=name)
  in_step = [g for g in run.parallel.plan.gathers if g.in_step]
  assert not in_step, "\n".join(map(str, in_step))
  if sample:
    np.testing.assert_array_equal(run.tokens, local.tokens)


def _tp(tp):
  return lambda i: epl.split(tp, name="tp")


def _stages(tp):
  return lambda i: epl.split(tp, name="stage%d" % i)


LAYOUTS = {
    "TP 2": (_tp(2), lambda layer: 0, {"cluster.devices_per_worker": 2}, True),
    "TP 4": (_tp(4), lambda layer: 0, {"cluster.devices_per_worker": 4}, True),
    "TP 2 x DP 2": (_tp(2), lambda layer: 0, {"cluster.devices_per_worker": 4}, False),
    "DP 2 x PP 2 x TP 2, 4 micro-batches": (
        _stages(2), lambda layer: layer, {"cluster.devices_per_worker": 8,
                                          "pipeline.num_micro_batch": 4}, False),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_published_gpt2_trains_the_local_model_with_no_gather_in_its_step(layout, tmp_path):
  stage, stage_of, config, sample = LAYOUTS[layout]
  local = _local()
  run = _train(stage, stage_of, config, local.initial, sample=sample)
  _check(run, local, sample)
  if layout.startswith("TP") and "DP" not in layout:
    _check_cuts(run, int(layout[-1]))
  else:
    _check_devices(run, config, tmp_path)


def _cuts(graph):
  """{variable: [(offset, shape) of each part]} of the split variables."""
  out = {}
  for v in graph.get_collection(tf.GraphKeys.GLOBAL_VARIABLES):
    info = v._get_save_slice_info()          # pylint: disable=protected-access
    if info is not None:
      out.setdefault(info.full_name, []).append((tuple(info.var_offset), tuple(info.var_shape)))
  return {k: sorted(v) for k, v in out.items()}


def _check_cuts(run, tp):
  """Megatron-LM's cuts, read from the published code's use of each weight."""
  cuts = _cuts(run.graph)
  e, v = gp.HPARAMS.n_embd, gp.HPARAMS.n_vocab
  rows = lambda n, tail: [((0, i * n // tp) + (0,) * len(tail), (1, n // tp) + tail)
                          for i in range(tp)]
  assert cuts["model/h0/mlp/c_proj/w"] == rows(4 * e, (e,))          # row parallel
  assert cuts["model/h0/attn/c_proj/w"] == rows(e, (e,))
  assert cuts["model/h0/mlp/c_fc/w"] == [((0, 0, i * 4 * e // tp), (1, e, 4 * e // tp))
                                         for i in range(tp)]          # column parallel
  assert len(cuts["model/h0/attn/c_attn/w"]) == 3 * tp                 # Q, K, V in groups
  assert cuts["model/h0/ln_1/g"] == [((0,), (e,))]                    # whole
  assert cuts["model/h0/mlp/c_proj/b"] == [((0,), (e,))]
  assert cuts["model/wte"] == [((i * v // tp, 0), (v // tp, e)) for i in range(tp)]
  # each part on its own device (one model copy: placed all the same)
  for name in ("model/h0/mlp/c_fc/w", "model/h0/mlp/c_proj/w", "model/wte"):
    devices = set(sm.part_devices(run.graph)[name])
    assert len(devices) == tp, (name, devices)
  # Megatron's count: 2 all-reduces forward and 2 backward per block; the embeddings' lookups
  # (wte, wpe) forward, the tied logits' input backward -- the training step's (the sampler's
  # are not counted)
  layers = gp.HPARAMS.n_layer
  assert dict(run.parallel.plan.reductions) == {0: (2 * layers + 2, 2 * layers + 1)}
  assert "%d + %d all-reduce(s) of the parts" % (2 * layers + 2, 2 * layers + 1) in \
      run.parallel.format()


def _check_devices(run, config, tmp_path):
  """DP 2 around the parts: each device holds one (stage, part, replica)."""
  plan = run.parallel.plan
  assert len(plan.copies) == 2
  stages = [t.name for t in plan.taskgraphs]
  assert [t.placement.kind for t in plan.taskgraphs] == ["split"] * len(stages)
  labels = picture.device_labels(plan)
  held = sorted(re.match(r"(\w+) · part (\d)/2 \(replica (\d)\)", text).groups()
                for d in labels for _, text in labels[d])
  assert held == sorted(itertools.product(stages, "01", "01")), labels
  assert len(labels) == len(held), labels
  if importlib.util.find_spec("matplotlib"):
    devices = config["cluster.devices_per_worker"]
    assert run.parallel.draw(str(tmp_path / "plan.png")) == (round((1.6 + 2.4 * devices) * 100),
                                                             round((1.4 + 1.6) * 100))
