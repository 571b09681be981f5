"""Tensor parallelism of transformer blocks (Megatron-LM's pattern) on the GPT-2-style
language model (tests/real_scripts/gpt2_lm.py) written as the local script writes it: the
whole model in one ``epl.split`` scope trains the local model (1e-5), and each weight is cut
as its use asks (epl.sharding.layout): the first dense of a pair by columns, the second by
rows, Q/K/V in groups with whole heads per part, layer norms whole, the tied embedding by
vocabulary rows."""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from tests import split_models as sm
from tests.real_scripts import gpt2_lm

ROWS, STEPS = 4, 3


def _build(stage, heads):
  t = gpt2_lm.build(None, stage, heads=heads)
  return dict(inputs=(t["placeholders"]["context"],), loss=t["loss"], train_op=t["train_op"])


def _cuts(graph):
  """{variable: [(offset, shape) of each part]} of the split variables."""
  out = {}
  for v in graph.get_collection(tf.GraphKeys.GLOBAL_VARIABLES):
    info = v._get_save_slice_info()          # pylint: disable=protected-access
    if info is not None:
      out.setdefault(info.full_name, []).append((tuple(info.var_offset), tuple(info.var_shape)))
  return {k: sorted(v) for k, v in out.items()}


@pytest.mark.parametrize("tp", [2, 4])
def test_a_transformer_split_over_parts_trains_the_local_model(tp):
  heads = tp
  data = (gpt2_lm.make_data(ROWS * STEPS + 3)["context"],)
  local = sm.train(lambda: _build(lambda i: _null(), heads), data, STEPS, ROWS)
  run = sm.train(lambda: _build(lambda i: epl.split(tp, name="tp"), heads), data, STEPS, ROWS,
                 config=epl.Config({"cluster.devices_per_worker": tp}), initial=local.initial)
  for got, want in zip(run.fetched, local.fetched):
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5, atol=1e-5)
  for name, value in local.variables.items():
    np.testing.assert_allclose(run.variables[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
  cuts = _cuts(run.graph)
  e, v = gpt2_lm.EMBD, gpt2_lm.VOCAB
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


def _null():
  import contextlib                          # pylint: disable=import-outside-toplevel
  return contextlib.nullcontext()
