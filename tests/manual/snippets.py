"""What a user writes around EPL's manual snippets (../shared/seeds/epl_docs.txt).

The manual's placeholders -- ``model()``, ``model_part1()``, ``resnet()``,
``classification()``, ``AttentionAndGating()``, ``MOE_Variable_Define()``,
``MOE_Calculation_Define()`` -- completed as tiny TF1 models the way published code writes
them, each built exactly where the snippet calls it. Every completion takes the snippet's
annotation lines as a function ``annotate(part)`` (a context manager, or a call) so that the
same model builds locally (no epl line) and under epl.
"""
import contextlib

import numpy as np
import tensorflow.compat.v1 as tf

import epl
from tests import split_models as sm

FEATURES, CLASSES = 8, 4


def data(rows, seed=0):
  rng = np.random.RandomState(seed)
  return (rng.randn(rows, FEATURES).astype(np.float32),
          rng.randint(0, CLASSES, rows).astype(np.int64))


def model(x, y):
  """``model()``: a small MLP classifier."""
  h = tf.layers.dense(x, 16, activation=tf.nn.relu, name="fc1")
  h = tf.layers.dense(h, 16, activation=tf.nn.tanh, name="fc2")
  logits = tf.layers.dense(h, CLASSES, name="logits")
  return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)


def model_part1(x):
  return tf.layers.dense(x, 16, activation=tf.nn.relu, name="fc1")


def model_part2(h, y):
  h = tf.layers.dense(h, 16, activation=tf.nn.tanh, name="fc2")
  logits = tf.layers.dense(h, CLASSES, name="logits")
  return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)


def train(build, data_xy, batch, steps, config=None, initial=None, optimizer=None):
  """Builds ``build(x, y, under_epl) -> loss`` (after ``epl.init(config)`` when a config is
  given), trains ``steps`` steps of ``batch`` rows from a dataset iterator with Momentum and
  global_step under MonitoredTrainingSession-free plain sessions; returns (losses, variables,
  initial values, epl.Graph.get() or None)."""
  g = tf.Graph()
  with g.as_default():
    tf.set_random_seed(3)
    if config is not None:
      epl.init(config)
    x, y = tf.data.make_one_shot_iterator(
        tf.data.Dataset.from_tensor_slices(data_xy).batch(batch).repeat()).get_next()
    loss = build(x, y, config is not None)
    step = tf.train.get_or_create_global_step()
    opt = optimizer() if optimizer else tf.train.MomentumOptimizer(0.05, 0.9)
    train_op = opt.minimize(loss, global_step=step)
    variables = tf.global_variables()
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      if initial:                          # split variables: each part its slice
        sm.load_whole(sess, variables, initial)
      start = sm.whole_values(sess, variables)
      losses = [float(sess.run([loss, train_op])[0]) for _ in range(steps)]
      final = sm.whole_values(sess, variables)
      parallel = epl.Graph.get() if config is not None else None
  return losses, final, start, parallel


def assert_trains_the_local_model(build, config, copies, batch=4, steps=4, rtol=1e-5,
                                  optimizer=None):
  """The snippet under epl (batch ``batch`` per copy) against the local model (batch
  ``copies * batch``): every step's loss and every variable. Returns epl.Graph.get()."""
  rows = data(copies * batch * steps)
  local = train(build, rows, copies * batch, steps, optimizer=optimizer)
  dist = train(build, rows, batch, steps, config, initial=local[2], optimizer=optimizer)
  close(dist[0], local[0], rtol, "loss per step")
  assert sorted(dist[1]) == sorted(local[1])
  for name, value in local[1].items():
    close(dist[1][name], value, rtol, name)
  return dist[3]


def close(got, want, rtol, what):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  bad = np.abs(got - want) > rtol * np.maximum(1.0, np.abs(want))
  assert not bad.any(), "%s: max |epl - local| %g" % (what, np.abs(got - want).max())


def devices(n, **keys):
  return epl.Config(dict({"cluster.devices_per_worker": n}, **keys))


def scope(under_epl, make):
  """The snippet's ``with epl.<strategy>(...):`` line, or nothing in the local script."""
  return make() if under_epl else contextlib.nullcontext()


# ---- §1.2.3 / §5.3.1: large-scale classification -----------------------------------------
def assert_classification_trains_the_local_model(k, steps=3, rows=8):
  """``with epl.replicate(k): resnet()`` then ``with epl.split(k): classification()`` with
  ``cluster.colocate_split_and_replicate``: one model replica whose batch the trunk's k copies
  share and whose 1000-way classifier is split k ways -- the local model at the script's
  batch (not k times it)."""
  rows_xy = sm.classification_data(steps * rows, 1000)
  local = sm.train(lambda: sm.classifier(1000, *sm.local_scopes()), rows_xy, steps, rows)
  config = devices(k, **{"cluster.colocate_split_and_replicate": True})
  run = sm.train(lambda: sm.classifier(1000, *sm.scopes(k, k)), rows_xy, steps, rows, config,
                 initial=local.initial)
  close([f["loss"] for f in run.fetched], [f["loss"] for f in local.fetched], 1e-5, "loss")
  for name, value in local.variables.items():
    close(run.variables[name], value, 1e-5, name)
  return run


# ---- §5.3.2 / §9.2: MoE ------------------------------------------------------------------
EXPERTS, CAPACITY = 4, 4


def moe_build(under_epl):
  """§5.3.2 as written: default strategy replicate(total_gpu_num); AttentionAndGating();
  ``with epl.split(total_gpu_num): MOE_Variable_Define()``; MOE_Calculation_Define() after the
  scope (it reads the sharded experts, so it joins the split TaskGraph)."""
  if under_epl:
    total_gpu_num = epl.Env.get().cluster.total_gpu_num
    epl.set_default_strategy(epl.replicate(total_gpu_num))
  tokens = tf.placeholder(tf.float32, [None, sm.TOKENS, sm.MODEL], name="tokens")
  target = tf.placeholder(tf.float32, [None, sm.TOKENS, sm.MODEL], name="target")
  # AttentionAndGating()
  x = tf.layers.dense(tokens, sm.MODEL, activation=tf.nn.tanh,
                      kernel_initializer=tf.glorot_uniform_initializer(seed=5), name="embed")
  combine, dispatch, aux = sm.top2_gate(x, EXPERTS, CAPACITY)
  # with epl.split(total_gpu_num): MOE_Variable_Define()
  with scope(under_epl, lambda: epl.split(epl.Env.get().cluster.total_gpu_num)):
    w_in = tf.get_variable("experts_in", [EXPERTS, sm.MODEL, sm.HIDDEN],
                           initializer=tf.glorot_uniform_initializer(seed=8))
    w_out = tf.get_variable("experts_out", [EXPERTS, sm.HIDDEN, sm.MODEL],
                            initializer=tf.glorot_uniform_initializer(seed=9))
  # MOE_Calculation_Define()
  expert_inputs = tf.einsum("gsec,gsm->egcm", dispatch, x)
  hidden = tf.nn.relu(tf.einsum("egcm,emh->egch", expert_inputs, w_in))
  expert_outputs = tf.einsum("egch,ehm->egcm", hidden, w_out)
  y = x + tf.einsum("gsec,egcm->gsm", combine, expert_outputs)
  loss = tf.reduce_mean(tf.square(y - target)) + 0.01 * aux
  train_op = tf.train.GradientDescentOptimizer(1.0).minimize(loss)
  return dict(inputs=(tokens, target), loss=loss, train_op=train_op)
