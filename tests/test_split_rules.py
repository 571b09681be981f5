"""One test per split rule (epl.sharding.rules.RULES): an op applied to a split dense layer's
output gives the local value and the local gradients."""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from tests import split_models as sm

CLASSES, ROWS = 10, 6


def _weights(shape, seed):
  return tf.constant(np.random.RandomState(seed).randn(*shape).astype(np.float32))


def _reduce(t, seed=11):
  """A scalar that depends on every element of ``t`` differently."""
  t = tf.cast(t, tf.float32)
  return tf.reduce_sum(t * _weights(t.shape.as_list()[1:], seed))


# name -> fn(logits [ROWS, CLASSES] (split), labels [ROWS]) -> scalar to minimise
CASES = {
    "relu + bias add": lambda z, y: _reduce(tf.nn.relu(z)),
    "gelu (erf, mul, add)": lambda z, y: _reduce(0.5 * z * (1.0 + tf.math.erf(z / 1.4142135))),
    "tanh, sigmoid, square, sub": lambda z, y: _reduce(tf.tanh(z) - tf.square(tf.sigmoid(z))),
    "broadcast operand sliced": lambda z, y: _reduce(z * _weights([CLASSES], 3) + 1.0),
    "cast and comparison": lambda z, y: _reduce(tf.where(z > 0.1, z, -z)),
    "reshape keeping the split axis": lambda z, y: _reduce(tf.reshape(z, [-1, 2, CLASSES])),
    "shape": lambda z, y: _reduce(z) * tf.cast(tf.reduce_prod(tf.shape(z)), tf.float32) / (
        ROWS * CLASSES),
    "reduce_sum over the split axis": lambda z, y: _reduce(tf.reduce_sum(z, axis=1,
                                                                         keepdims=True)),
    "reduce_mean over the batch": lambda z, y: _reduce(tf.reduce_mean(tf.square(z), axis=0,
                                                                      keepdims=True)),
    "reduce_max over everything": lambda z, y: tf.reduce_max(z) + tf.reduce_min(z),
    "reduce_mean over everything": lambda z, y: tf.reduce_mean(tf.exp(z)),
    "softmax": lambda z, y: _reduce(tf.nn.softmax(z)),
    "log_softmax": lambda z, y: _reduce(tf.nn.log_softmax(z)),
    "sparse softmax cross-entropy": lambda z, y: tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=z)),
    "softmax cross-entropy (one-hot)": lambda z, y: tf.reduce_mean(
        tf.nn.softmax_cross_entropy_with_logits_v2(labels=tf.one_hot(y, CLASSES), logits=z)),
    "argmax and accuracy": lambda z, y: _reduce(z) + tf.reduce_mean(
        tf.cast(tf.equal(tf.argmax(z, axis=1), y), tf.float32)),
    "two split layers": lambda z, y: _reduce(tf.layers.dense(
        tf.nn.relu(z), CLASSES, kernel_initializer=sm._init(6), name="second")),
    # epl.sharding.arrays: what published transformers do with split values
    "stack and unstack (a key/value cache)": lambda z, y: _reduce(
        tf.unstack(tf.stack([z, tf.tanh(z)], axis=1), axis=1)[1]) + _reduce(
            tf.stack([z, 2.0 * z], axis=-2), 4),
    "concat along another axis, a whole operand": lambda z, y: _reduce(
        tf.concat([z, tf.tanh(z), _weights([2, CLASSES], 5)], axis=-2)),
    "concat along the split axis": lambda z, y: _reduce(tf.concat([z, tf.nn.relu(z)], 1)),
    "strided slices taking the split axis whole": lambda z, y: 0.2 * (_reduce(z[1:, :]) + _reduce(
        z[:-1, tf.newaxis, ..., :CLASSES], 5) + _reduce(z[..., tf.newaxis], 6) + tf.reduce_sum(
            z[-1, :] * _weights([CLASSES], 7))),
    "tf.slice taking the split axis whole": lambda z, y: _reduce(
        tf.slice(z, [1, 0], [3, -1])) + _reduce(tf.slice(z, [0, 0], [-1, CLASSES]), 5),
    "expand_dims and squeeze": lambda z, y: _reduce(tf.squeeze(tf.expand_dims(
        z, 0), axis=[0])) + _reduce(tf.expand_dims(z, -1), 5),
    "tile and pad": lambda z, y: _reduce(tf.tile(z, [2, 1])) + _reduce(
        tf.pad(z, [[1, 2], [0, 0]]), 5),
    "top_k over the split axis": lambda z, y: _reduce(tf.nn.top_k(z, 3).values) + 1e-3 * \
        tf.reduce_sum(tf.cast(tf.nn.top_k(z + 1.0, 4).indices, tf.float32)),
    "l2_loss": lambda z, y: tf.nn.l2_loss(z) + _reduce(z),
    "argument forms of TF1 code (tensors, Dimensions and ints mixed, negative axes)": (
        lambda z, y: 0.2 * (tf.reduce_sum(tf.slice(z, [tf.constant(1), 0], [
            tf.shape(z)[0] - 1, -1]) * _weights([CLASSES], 4)) + _reduce(tf.reshape(
                z, [tf.shape(z)[0], z.shape[1]]), 5) + _reduce(tf.concat(
                    [z, z], axis=tf.constant(-2)), 6) + _reduce(tf.expand_dims(
                        z, np.int64(-1)), 7))),
    "dropout (a seeded mask of the whole shape, sliced)": lambda z, y: _reduce(
        tf.nn.dropout(z, rate=0.5, seed=3)),
    "reshape to heads of rank 4 and back to rank 2 (BERT)": lambda z, y: _reduce(tf.reshape(
        tf.transpose(tf.reshape(z, [-1, 1, 2, CLASSES // 2]), [0, 2, 1, 3]) * 2.0,
        [-1, CLASSES])),
}


def _build(fn, trunk, head):
  x = tf.placeholder(tf.float32, [None, 5], name="x")
  y = tf.placeholder(tf.int64, [None], name="y")
  with trunk():
    h = tf.layers.dense(x, 8, activation=tf.nn.tanh, kernel_initializer=sm._init(1))
  with head():
    z = tf.layers.dense(h, CLASSES, kernel_initializer=sm._init(2),
                        bias_initializer=tf.random_normal_initializer(seed=3))
    out = fn(z, y)
  train = tf.train.GradientDescentOptimizer(0.5).minimize(out)
  return dict(inputs=(x, y), loss=out, train_op=train)


@pytest.mark.parametrize("case", sorted(CASES))
def test_split_rule_matches_the_local_op(case):
  rng = np.random.RandomState(0)
  data = (rng.randn(2 * ROWS, 5).astype(np.float32), rng.randint(0, CLASSES, 2 * ROWS))
  fn = CASES[case]
  local = sm.train(lambda: _build(fn, *sm.local_scopes()), data, 2, ROWS, eval_rows=4)
  trunk, head = sm.scopes(2, 2)
  run = sm.train(lambda: _build(fn, trunk, head), data, 2, ROWS,
                 config=epl.Config({"cluster.devices_per_worker": 2,
                                    "cluster.colocate_split_and_replicate": True}),
                 initial=local.initial, eval_rows=4)
  assert not run.parallel.plan.gathers, "\n".join(map(str, run.parallel.plan.gathers))
  for got, want in zip(run.fetched, local.fetched):
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(run.evaluated["loss"], local.evaluated["loss"], rtol=1e-5,
                             atol=1e-5)
  for name, value in local.variables.items():
    np.testing.assert_allclose(run.variables[name], value, rtol=1e-5, atol=1e-5,
                               err_msg=name)


def _cumsum_head(z, y):
  """The loss through an op no split rule covers (tf.cumsum over the split axis), and one
  the step does not need (a sampling-style top-p cumsum, fetched only)."""
  tf.cumsum(tf.nn.softmax(z), axis=1, name="unused_cumsum")
  return 0.05 * _reduce(tf.cumsum(z, axis=1, name="loss_cumsum"))


def test_an_op_without_a_rule_runs_on_the_gathered_value_and_trains_the_local_model():
  rng = np.random.RandomState(0)
  data = (rng.randn(2 * ROWS, 5).astype(np.float32), rng.randint(0, CLASSES, 2 * ROWS))
  local = sm.train(lambda: _build(_cumsum_head, *sm.local_scopes()), data, 2, ROWS)
  trunk, head = sm.scopes(2, 2)
  run = sm.train(lambda: _build(_cumsum_head, trunk, head), data, 2, ROWS,
                 config=epl.Config({"cluster.devices_per_worker": 2,
                                    "cluster.colocate_split_and_replicate": True}),
                 initial=local.initial)
  gathers = {g.op: g for g in run.parallel.plan.gathers}
  assert sorted(gathers) == ["loss_cumsum", "unused_cumsum"], gathers
  used, unused = gathers["loss_cumsum"], gathers["unused_cumsum"]
  assert (used.op_type, used.in_step, used.backward) == ("Cumsum", True, True), used
  assert (unused.in_step, unused.backward) == (False, False), unused
  assert used.reason == "no split rule for Cumsum" and used.bytes == -1, used  # batch: None
  assert used.location.startswith("test_split_rules.py:"), used
  report = run.parallel.format()
  assert "Gathers (ops no split rule covers, run on the whole value): 1 in the training step" \
      in report and "1 outside it" in report, report
  for got, want in zip(run.fetched, local.fetched):
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5, atol=1e-5)
  for name, value in local.variables.items():
    np.testing.assert_allclose(run.variables[name], value, rtol=1e-5, atol=1e-5,
                               err_msg=name)


def test_the_strict_key_refuses_a_gather_in_the_step_naming_the_op_and_where():
  rng = np.random.RandomState(0)
  data = (rng.randn(2 * ROWS, 5).astype(np.float32), rng.randint(0, CLASSES, 2 * ROWS))
  trunk, head = sm.scopes(2, 2)
  with pytest.raises(epl.errors.PlanError) as e:
    sm.train(lambda: _build(_cumsum_head, trunk, head), data, 1, ROWS,
             config=epl.Config({"cluster.devices_per_worker": 2,
                                "cluster.colocate_split_and_replicate": True,
                                "split.gather_fallback": "refuse"}))
  message = str(e.value)
  assert "1 split value(s) whole" in message and "loss_cumsum (Cumsum, test_split_rules.py:" \
      in message and "no split rule for Cumsum" in message, message
  assert "unused_cumsum" not in message, message          # outside the step: allowed
  assert 'set split.gather_fallback to "allow"' in message, message


def test_a_rule_that_fails_gives_way_to_the_gather_and_says_why(monkeypatch):
  """A rule never ends the job: one that raises on arguments it was not written for runs the
  op on the gathered value, the reason in the plan."""
  from epl.sharding import rules

  def broken(scope, op_type, build, kw, name):
    raise RuntimeError("not written for this")
  monkeypatch.setitem(rules.RULES, "Tanh", broken)
  rng = np.random.RandomState(0)
  data = (rng.randn(2 * ROWS, 5).astype(np.float32), rng.randint(0, CLASSES, 2 * ROWS))
  fn = lambda z, y: _reduce(tf.tanh(z))
  local = sm.train(lambda: _build(fn, *sm.local_scopes()), data, 2, ROWS)
  trunk, head = sm.scopes(2, 2)
  run = sm.train(lambda: _build(fn, trunk, head), data, 2, ROWS,
                 config=epl.Config({"cluster.devices_per_worker": 2,
                                    "cluster.colocate_split_and_replicate": True}),
                 initial=local.initial)
  (gather,) = run.parallel.plan.gathers
  assert gather.op_type == "Tanh" and gather.in_step and gather.reason == (
      "the Tanh rule failed on these arguments (RuntimeError: not written for this)"), gather
  for name, value in local.variables.items():
    np.testing.assert_allclose(run.variables[name], value, rtol=1e-5, atol=1e-5,
                               err_msg=name)
