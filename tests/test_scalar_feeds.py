"""Scalars fed to a run go whole to every copy and micro-batch (docs/user_guide.md, "Batches
and feeds"): ``tf.placeholder(tf.bool)`` without a shape (the batch-norm tutorials'
``is_training``), ``tf.placeholder(tf.float32, [])`` (a keep-probability), a learning rate
fed every step, and ``tf.placeholder_with_default`` fed or not -- in data parallelism and in a
2-stage pipeline with micro-batches, against the local run of the same batch."""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl

STEPS = 3


def _graph(config, pipeline):
  g = tf.Graph()
  with g.as_default():
    tf.set_random_seed(3)
    if config is not None:
      epl.init(config)
    stage = (lambda i: epl.replicate(1, name="stage_%d" % i)) if config is not None and \
        pipeline else (lambda i: epl.replicate(1)) if config is not None else None
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


class _null:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


def _train(g, t, initial, data, feeds):
  with g.as_default(), tf.Session() as sess:
    sess.run(t["init"])
    variables = {v.op.name: v for v in tf.global_variables()}
    if initial is None:
      initial = {n: sess.run(v) for n, v in variables.items()}
    else:
      for n, v in variables.items():
        v.load(initial[n], sess)
    losses = []
    for s, (x, y) in enumerate(data):
      fed = {t["x"]: x, t["y"]: y}
      fed.update({t[k]: v(s) for k, v in feeds.items()})
      losses.append(sess.run([t["loss"], t["train"]], fed)[0])
    evaluation = sess.run(t["loss"], {t["x"]: data[0][0][:3], t["y"]: data[0][1][:3],
                                      t["is_training"]: False, t["keep"]: 1.0})
    return initial, losses, {n: sess.run(v) for n, v in variables.items()}, evaluation


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("fed_scale", [False, True])
def test_scalars_fed_to_every_copy_and_micro_batch_train_the_local_model(pipeline, fed_scale):
  config = epl.Config({"cluster.devices_per_worker": 2,
                       "pipeline.num_micro_batch": 2 if pipeline else 1})
  pieces = 2 if pipeline else 2          # pipeline: 1 replica x 2 micro-batches; DP: 2 copies
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
