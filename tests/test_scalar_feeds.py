"""Scalars fed to a run go whole to every copy and micro-batch (docs/user_guide.md, "Batches
and feeds"): ``tf.placeholder(tf.bool)`` without a shape (the batch-norm tutorials'
``is_training``), ``tf.placeholder(tf.float32, [])`` (a keep-probability), a learning rate
fed every step, and ``tf.placeholder_with_default`` fed or not -- in data parallelism and in a
2-stage pipeline with micro-batches, against the local run of the same batch."""
import logging

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.errors import PlanError
from epl.testing.values import load_values, read_values

STEPS = 3
CLASSES = 5


def _graph(config, pipeline):
  g = tf.Graph()
  with g.as_default():
    tf.set_random_seed(3)
    stage = _strategy(config, pipeline)
    x = tf.placeholder(tf.float32, [None, 8], name="x")
    y = tf.placeholder(tf.int64, [None], name="y")
    is_training = tf.placeholder(tf.bool, name="is_training")            # no shape
    keep = tf.placeholder(tf.float32, [], name="keep")
    scale = tf.placeholder_with_default(1.0, [], name="scale")
    lr = tf.placeholder(tf.float32, [], name="lr")
    with (stage(0) if stage else _null()):
      h = tf.layers.dense(x, 16, activation=tf.nn.relu)
      on = tf.reshape(tf.cast(is_training, tf.float32), [])
      h = h * on + 0.5 * h * (1.0 - on)                  # a train / eval switch
    with (stage(1) if stage else _null()):
      h = tf.layers.dense(h * keep * scale, 16, activation=tf.nn.tanh)
      logits = tf.layers.dense(h, 4)
      loss = tf.losses.sparse_softmax_cross_entropy(y, logits)
    step = tf.train.get_or_create_global_step()
    train = tf.train.MomentumOptimizer(lr, 0.9).minimize(loss, global_step=step)
    init = tf.global_variables_initializer()
  return g, dict(x=x, y=y, is_training=is_training, keep=keep, scale=scale, lr=lr, loss=loss,
                 train=train, init=init)


def _strategy(config, pipeline):
  """The stage scopes (pipeline: a replicate(1) per stage; DP: one replicate(1) over the whole
  model, as a default strategy; local: none)."""
  if config is None:
    return None
  epl.init(config)
  if pipeline:
    return lambda i: epl.replicate(1, name="stage_%d" % i)
  epl.set_default_strategy(epl.replicate(1))
  return None


class _null:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


def _start(sess, t, initial):
  """Initialises the graph's variables and loads ``initial`` (None: keeps and returns its own)."""
  sess.run(t["init"])
  variables = {v.op.name: v for v in tf.global_variables()}
  if initial is None:
    initial = read_values(sess, variables.values())
  else:
    load_values(sess, variables.values(), lambda v: initial[v.op.name])
  return variables, initial


def _train(g, t, initial, data, feeds):
  with g.as_default(), tf.Session() as sess:
    variables, initial = _start(sess, t, initial)
    losses = []
    for s, (x, y) in enumerate(data):
      fed = {t["x"]: x, t["y"]: y}
      fed.update({t[k]: v(s) for k, v in feeds.items()})
      losses.append(sess.run([t["loss"], t["train"]], fed)[0])
    evaluation = sess.run(t["loss"], {t["x"]: data[0][0][:3], t["y"]: data[0][1][:3],
                                      t["is_training"]: False, t["keep"]: 1.0})
    return initial, losses, read_values(sess, variables.values()), evaluation


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("fed_scale", [False, True])
def test_scalars_fed_to_every_copy_and_micro_batch_train_the_local_model(pipeline, fed_scale):
  config = epl.Config({"cluster.devices_per_worker": 2,
                       "pipeline.num_micro_batch": 2 if pipeline else 1})
  pieces = 2                 # pipeline: 1 replica x 2 micro-batches; DP: 2 copies
  rng = np.random.RandomState(5)
  data = [(rng.randn(4 * pieces, 8).astype(np.float32),
           rng.randint(0, 4, 4 * pieces).astype(np.int64)) for _ in range(STEPS)]
  feeds = {"is_training": lambda s: True, "keep": lambda s: 0.8,
           "lr": lambda s: 0.1 / (1 + s)}                     # a decaying learning rate
  if fed_scale:
    feeds["scale"] = lambda s: 1.5
  lg, lt = _graph(None, pipeline)
  initial, local_losses, local_vars, local_eval = _train(lg, lt, None, data, feeds)
  g, t = _graph(config, pipeline)
  _, losses, variables, evaluation = _train(g, t, initial, data, feeds)
  np.testing.assert_allclose(losses, local_losses, rtol=1e-5)
  for name, value in local_vars.items():
    np.testing.assert_allclose(variables[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
  assert evaluation == pytest.approx(local_eval, rel=1e-5)     # False / 1.0 reach copy 0


def _weights_graph(config, pipeline, batch=None, label_batch=None, class_weight=True):
  """Values that are not batch-major beside the batch: per-class weights declared [5], a
  shapeless placeholder fed a 12-vector, a [None] placeholder fed 5 class weights (12 and 5
  are neither multiples nor divisors of the batch's 8 rows)."""
  g = tf.Graph()
  with g.as_default():
    tf.set_random_seed(3)
    stage = _strategy(config, pipeline)
    x = tf.placeholder(tf.float32, [batch, 8], name="x")
    y = tf.placeholder(tf.int64, [label_batch or batch], name="y")
    class_scale = tf.placeholder(tf.float32, [CLASSES], name="class_scale")
    shift = tf.placeholder(tf.float32, name="shift")                      # no shape
    use_weights, class_weight = class_weight, tf.placeholder(tf.float32, [None],
                                                             name="class_weight")
    with (stage(0) if stage else _null()):
      h = tf.layers.dense(x, 12, activation=tf.nn.relu) + tf.reshape(shift, [12])
    with (stage(1) if stage else _null()):
      logits = tf.layers.dense(h, CLASSES) * class_scale
      loss = tf.losses.sparse_softmax_cross_entropy(
          y, logits, weights=tf.gather(class_weight, y) if use_weights else 1.0)
    step = tf.train.get_or_create_global_step()
    train = tf.train.GradientDescentOptimizer(0.2).minimize(loss, global_step=step)
    init = tf.global_variables_initializer()
  return g, dict(x=x, y=y, class_scale=class_scale, shift=shift, class_weight=class_weight,
                 loss=loss, train=train, init=init)


def _train_weights(g, t, initial, data, rng_seed=9):
  rng = np.random.RandomState(rng_seed)
  extra = {t["class_scale"]: rng.uniform(0.5, 1.5, CLASSES).astype(np.float32),
           t["shift"]: rng.randn(12).astype(np.float32) * 0.1,
           t["class_weight"]: rng.uniform(0.5, 2.0, CLASSES).astype(np.float32)}
  if not t["class_weight"].consumers():
    del extra[t["class_weight"]]
  with g.as_default(), tf.Session() as sess:
    variables, initial = _start(sess, t, initial)
    losses = []
    for x, y in data:
      fed = {t["x"]: x, t["y"]: y}
      fed.update(extra)
      losses.append(sess.run([t["loss"], t["train"]], fed)[0])
    return initial, losses, read_values(sess, variables.values())


def _assert_same_model(local, run):
  np.testing.assert_allclose(run[1], local[1], rtol=1e-5)
  for name, value in local[2].items():
    np.testing.assert_allclose(run[2][name], value, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("pipeline", [False, True])
def test_values_that_are_not_batch_major_go_whole_to_every_copy(pipeline):
  """Before BatchRule the [5] placeholder was refused (a batch of 5 rows needs 10), and the
  [None] and shapeless ones were cut into pieces like the batch."""
  config = epl.Config({"cluster.devices_per_worker": 2,
                       "pipeline.num_micro_batch": 2 if pipeline else 1})
  rng = np.random.RandomState(5)
  data = [(rng.randn(8, 8).astype(np.float32), rng.randint(0, CLASSES, 8).astype(np.int64))
          for _ in range(STEPS)]
  local = _train_weights(*_weights_graph(None, pipeline), None, data)
  run = _train_weights(*_weights_graph(config, pipeline), local[0], data)
  _assert_same_model(local, run)


def test_a_fixed_batch_fed_one_copys_rows_goes_whole_and_warns(caplog):
  """x [4, 8] and y [4] fed 4 rows under 2 copies: both fit their placeholders as they are, so
  every copy gets them whole -- the local model (each copy's gradient is the same), with a
  warning naming the rows that would give each copy its own."""
  config = epl.Config({"cluster.devices_per_worker": 2})
  rng = np.random.RandomState(5)
  data = [(rng.randn(4, 8).astype(np.float32), rng.randint(0, CLASSES, 4).astype(np.int64))
          for _ in range(STEPS)]
  local = _train_weights(*_weights_graph(None, False, batch=4, class_weight=False), None, data)
  logger = logging.getLogger("epl")
  logger.addHandler(caplog.handler)           # epl's logger does not propagate
  try:
    run = _train_weights(*_weights_graph(config, False, batch=4, class_weight=False),
                         local[0], data)
  finally:
    logger.removeHandler(caplog.handler)
  _assert_same_model(local, run)
  assert any("'x' is fed 4 rows" in r.getMessage() and "Feed 8 rows" in r.getMessage()
             for r in caplog.records)


def test_a_fixed_placeholder_fed_the_batchs_rows_is_a_batch_with_a_clear_error():
  """x [None, 8] and y [4] fed 4 rows under 2 copies: y's 4 rows are the batch's, so y is a
  batch of one copy's rows -- an error naming y and the 8 rows to feed, not a silent whole."""
  config = epl.Config({"cluster.devices_per_worker": 2})
  g, t = _weights_graph(config, False, label_batch=4)
  rng = np.random.RandomState(5)
  with g.as_default(), tf.Session() as sess:
    sess.run(t["init"])
    with pytest.raises(PlanError, match="'y'.*feed 8 rows"):
      sess.run(t["train"], {t["x"]: rng.randn(4, 8), t["y"]: np.zeros(4, np.int64),
                            t["class_scale"]: np.ones(CLASSES), t["shift"]: np.zeros(12),
                            t["class_weight"]: np.ones(CLASSES)})


def _tokens_graph(config, pipeline):
  """Batch-major values of several sizes: tokens flattened to [None, 8] (8 sentences x 3
  tokens = 24 rows, the highest rank), their targets [None] (24: equal), each sentence's
  weight [None] (8: a divisor) -- all split, as before BatchRule."""
  g = tf.Graph()
  with g.as_default():
    tf.set_random_seed(3)
    stage = _strategy(config, pipeline)
    tokens = tf.placeholder(tf.float32, [None, 8], name="tokens")
    targets = tf.placeholder(tf.int64, [None], name="targets")
    sentence_weight = tf.placeholder(tf.float32, [None], name="sentence_weight")
    with (stage(0) if stage else _null()):
      h = tf.layers.dense(tokens, 16, activation=tf.nn.relu)
    with (stage(1) if stage else _null()):
      logits = tf.layers.dense(h, CLASSES)
      per_token = tf.reshape(tf.tile(sentence_weight[:, None], [1, 3]), [-1])
      loss = tf.losses.sparse_softmax_cross_entropy(targets, logits, weights=per_token)
    step = tf.train.get_or_create_global_step()
    train = tf.train.GradientDescentOptimizer(0.2).minimize(loss, global_step=step)
    init = tf.global_variables_initializer()
  return g, dict(tokens=tokens, targets=targets, sentence_weight=sentence_weight, loss=loss,
                 train=train, init=init)


def _train_tokens(g, t, initial, data):
  with g.as_default(), tf.Session() as sess:
    variables, initial = _start(sess, t, initial)
    losses = [sess.run([t["loss"], t["train"]], {t["tokens"]: x, t["targets"]: y,
                                                  t["sentence_weight"]: w})[0]
              for x, y, w in data]
    return initial, losses, read_values(sess, variables.values())


@pytest.mark.parametrize("pipeline", [False, True])
def test_batch_major_values_of_several_sizes_are_all_split(pipeline):
  config = epl.Config({"cluster.devices_per_worker": 2,
                       "pipeline.num_micro_batch": 2 if pipeline else 1})
  rng = np.random.RandomState(6)
  data = [(rng.randn(24, 8).astype(np.float32), rng.randint(0, CLASSES, 24).astype(np.int64),
           rng.uniform(0.5, 2.0, 8).astype(np.float32)) for _ in range(STEPS)]
  local = _train_tokens(*_tokens_graph(None, pipeline), None, data)
  run = _train_tokens(*_tokens_graph(config, pipeline), local[0], data)
  _assert_same_model(local, run)
