"""Tensor parallelism on the widely copied TF1 Transformer (tests/real_scripts/heads_in_batch.py:
Kyubyong's modules.py and model.py, the heads folded into the batch axis with
``tf.concat(tf.split(Q, h, axis=2), axis=0)``, encoder and decoder each in a split scope): TP 2,
TP 2 x DP 2 and DP 2 x PP 2 x TP 2 with 4 micro-batches train the local model with no gather in the step.

Each head's features are cut over the parts (Q, K and V by columns, in h groups), so
``Q_ @ K_^T`` is summed over the parts (one all-reduce per attention); the rest runs per part."""
import functools

import numpy as np
import pytest

import epl
from tests import split_models as sm
from tests.real_scripts import heads_in_batch as hb

ROWS, STEPS = 8, 3
# the key projection's bias has a zero gradient (a softmax over the keys does not see it): Adam
# turns the float noise there into full-size steps, another in any two runs of other orders
NOISE_ONLY = ("multihead_attention/dense_1/bias", "self_attention/dense_1/bias",
              "vanilla_attention/dense_1/bias")

LAYOUTS = {
    "TP 2": (lambda name: epl.split(2, name="tp"), {"cluster.devices_per_worker": 2}, True),
    "TP 2 x DP 2": (lambda name: epl.split(2, name="tp"), {"cluster.devices_per_worker": 4},
                    False),
    # no padding: the loss is a mean over the batch's tokens, and micro-batches with other
    # token counts average to another number (data parallelism's, not epl's)
    "DP 2 x PP 2 x TP 2, 4 micro-batches": (lambda name: epl.split(2, name=name), {
        "cluster.devices_per_worker": 8, "pipeline.num_micro_batch": 4}, False),
}


@functools.lru_cache(maxsize=None)
def _local(pad):
  data = hb.make_data(ROWS * STEPS, pad=pad)
  return data, sm.train(hb.build, data, STEPS, ROWS, race_free=True, eval_rows=ROWS)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_heads_folded_into_the_batch_train_the_local_model_with_no_gather(layout):
  stage, config, pad = LAYOUTS[layout]
  data, local = _local(pad)
  run = sm.train(lambda: hb.build(stage), data, STEPS, ROWS, config=epl.Config(config),
                 initial=local.initial, eval_rows=ROWS)
  in_step = [g for g in run.parallel.plan.gathers if g.in_step]
  assert not in_step, "\n".join(map(str, in_step))
  for got, want in zip(run.fetched, local.fetched):
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5, atol=1e-5)
  compared = 0
  for name, value in local.variables.items():
    if not name.endswith(NOISE_ONLY):
      np.testing.assert_allclose(run.variables[name], value, rtol=1e-5, atol=1e-5,
                                 err_msg=name)
      compared += 1
  assert compared > 20, compared
