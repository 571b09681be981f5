"""Split models written the way published TF1 code writes them (tf.layers / keras layers,
get_variable expert weights, a GShard top-2 gate, Momentum with clipping), and a harness that
trains them locally and under epl from the same initial weights.

A split run's variables are TF PartitionedVariables; ``Run.variables`` holds every variable
whole (parts concatenated by their save-slice info), named as in the local run.
"""
import contextlib
import dataclasses
from typing import Dict, List

import numpy as np
import tensorflow.compat.v1 as tf

import epl
from epl.testing.reference import race_free_step
from epl.testing.values import load_values

FEATURES = 12


def _init(seed):
  return tf.glorot_uniform_initializer(seed=seed)


# ---- large-scale classification: replicated trunk, split classifier ----------------------
def classifier(classes, trunk, head, dense="layers"):
  """An image-classifier tail: a 2-layer trunk, then a ``classes``-way dense classifier."""
  images = tf.placeholder(tf.float32, [None, FEATURES], name="images")
  labels = tf.placeholder(tf.int64, [None], name="labels")
  with trunk():
    h = tf.layers.dense(images, 32, activation=tf.nn.relu, kernel_initializer=_init(1),
                        name="fc1")
    features = tf.layers.dense(h, 16, activation=tf.nn.relu, kernel_initializer=_init(2),
                               name="fc2")
  with head():
    if dense == "keras":
      logits = tf.keras.layers.Dense(classes, kernel_initializer=_init(3),
                                     bias_initializer=tf.random_normal_initializer(seed=4),
                                     name="classifier")(features)
    else:
      logits = tf.layers.dense(features, classes, kernel_initializer=_init(3),
                               bias_initializer=tf.random_normal_initializer(seed=4),
                               name="classifier")
    loss = tf.losses.sparse_softmax_cross_entropy(labels, logits)
    predictions = tf.argmax(logits, axis=1)
    correct = tf.equal(predictions, labels)
    accuracy = tf.reduce_mean(tf.cast(correct, tf.float32), name="accuracy")
  opt = tf.train.MomentumOptimizer(0.5, momentum=0.9)
  grads_and_vars = opt.compute_gradients(loss)
  grads, variables = zip(*grads_and_vars)
  grads, _ = tf.clip_by_global_norm(grads, 5.0)
  train_op = opt.apply_gradients(zip(grads, variables),
                                 global_step=tf.train.get_or_create_global_step())
  return dict(inputs=(images, labels), loss=loss, accuracy=accuracy, logits=logits,
              predictions=predictions, train_op=train_op)


def classification_data(rows, classes, seed=0):
  rng = np.random.RandomState(seed)
  return (rng.randn(rows, FEATURES).astype(np.float32),
          rng.randint(0, classes, rows).astype(np.int64))


# ---- mixture of experts (GShard top-2 gate with capacity) --------------------------------
TOKENS, MODEL, HIDDEN = 8, 12, 16


def top2_gate(x, experts, capacity):
  """GShard's top-2 gating: (combine weights [G, S, E, C], dispatch mask, auxiliary loss).

  Tokens beyond an expert's ``capacity`` in a group are dropped (their combine weight is 0).
  """
  logits = tf.layers.dense(x, experts, use_bias=False, kernel_initializer=_init(7), name="gate")
  probs = tf.nn.softmax(logits)
  index1 = tf.argmax(probs, axis=-1)
  mask1 = tf.one_hot(index1, experts)
  probs2 = probs * (1.0 - mask1)
  mask2 = tf.one_hot(tf.argmax(probs2, axis=-1), experts)
  position1 = tf.cumsum(mask1, axis=1, exclusive=True) * mask1
  mask1 *= tf.cast(position1 < capacity, tf.float32)
  position2 = (tf.cumsum(mask2, axis=1, exclusive=True) +
               tf.reduce_sum(mask1, axis=1, keepdims=True)) * mask2
  mask2 *= tf.cast(position2 < capacity, tf.float32)
  gate1 = tf.reduce_sum(probs * mask1, axis=-1)
  gate2 = tf.reduce_sum(probs * mask2, axis=-1)
  norm = gate1 + gate2 + 1e-9
  gate1, gate2 = gate1 / norm, gate2 / norm
  slot1 = tf.one_hot(tf.cast(tf.reduce_sum(position1, -1), tf.int32), capacity)
  slot2 = tf.one_hot(tf.cast(tf.reduce_sum(position2, -1), tf.int32), capacity)
  combine = (gate1[..., None, None] * mask1[..., None] * slot1[..., None, :] +
             gate2[..., None, None] * mask2[..., None] * slot2[..., None, :])
  dispatch = tf.cast(combine > 0, tf.float32)
  aux = tf.reduce_mean(tf.reduce_mean(mask1, 1) * tf.reduce_mean(probs, 1)) * experts ** 2
  return combine, dispatch, aux


def moe_layer(x, combine, dispatch, experts):
  """Expert FFNs ([E, M, H] weights) on the dispatched tokens, combined back per token."""
  w_in = tf.get_variable("experts_in", [experts, MODEL, HIDDEN], initializer=_init(8))
  w_out = tf.get_variable("experts_out", [experts, HIDDEN, MODEL], initializer=_init(9))
  expert_inputs = tf.einsum("gsec,gsm->egcm", dispatch, x)
  hidden = tf.nn.relu(tf.einsum("egcm,emh->egch", expert_inputs, w_in))
  expert_outputs = tf.einsum("egch,ehm->egcm", hidden, w_out)
  return tf.einsum("gsec,egcm->gsm", combine, expert_outputs)


def moe_model(experts, capacity, trunk, experts_scope, gate_in_experts=False):
  """Tokens -> dense -> MoE FFN (residual) -> regression loss + GShard's auxiliary loss.

  The gate runs in the trunk (the copies' own tokens: dispatch and combine are an
  all-to-all), or with ``gate_in_experts`` inside the split scope (computed per part).
  """
  tokens = tf.placeholder(tf.float32, [None, TOKENS, MODEL], name="tokens")
  target = tf.placeholder(tf.float32, [None, TOKENS, MODEL], name="target")
  with trunk():
    x = tf.layers.dense(tokens, MODEL, activation=tf.nn.tanh, kernel_initializer=_init(5),
                        name="embed")
    if not gate_in_experts:
      combine, dispatch, aux = top2_gate(x, experts, capacity)
  with experts_scope():
    if gate_in_experts:
      combine, dispatch, aux = top2_gate(x, experts, capacity)
    moe = moe_layer(x, combine, dispatch, experts)
  with trunk():
    y = x + moe
    loss = tf.reduce_mean(tf.square(y - target)) + 0.01 * aux
  train_op = tf.train.GradientDescentOptimizer(1.0).minimize(loss)
  return dict(inputs=(tokens, target), loss=loss, output=y, moe=moe, train_op=train_op)


def moe_data(rows, seed=0):
  rng = np.random.RandomState(seed)
  return (rng.randn(rows, TOKENS, MODEL).astype(np.float32),
          rng.randn(rows, TOKENS, MODEL).astype(np.float32))


# ---- harness ---------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
  fetched: List[Dict[str, np.ndarray]]       # per step
  variables: Dict[str, np.ndarray]           # every variable whole, by its local name
  initial: Dict[str, np.ndarray]
  parallel: object = None
  memory: object = None
  graph: object = None
  evaluated: Dict[str, np.ndarray] = None    # an evaluation run (eval_rows rows) at the end


def whole_values(sess, variables):
  """{name: value} with every partitioned variable's parts put together."""
  out, values = {}, sess.run(list(variables))
  for var, value in zip(variables, values):
    info = var._get_save_slice_info()     # pylint: disable=protected-access
    if info is None:
      out[var.op.name] = value
      continue
    whole = out.setdefault(info.full_name, np.zeros(info.full_shape, value.dtype))
    whole[tuple(slice(o, o + s) for o, s in zip(info.var_offset, info.var_shape))] = value
  return out


def load_whole(sess, variables, values):
  """Sets every variable (or part) to its slice of ``values`` (by local name)."""
  def value(var):
    info = var._get_save_slice_info()     # pylint: disable=protected-access
    if info is None:
      return values[var.op.name]
    return values[info.full_name][tuple(
        slice(o, o + s) for o, s in zip(info.var_offset, info.var_shape))]
  load_values(sess, variables, value)


def train(build, data, steps, rows, config=None, initial=None, fetch=("loss",),
          measure_memory=False, eval_rows=3, session_first=False, race_free=True):
  """Trains ``steps`` steps of ``rows`` rows; ``config`` None: the local run.
  ``session_first``: the session is opened before ``build()`` runs, as scripts that build
  their model inside ``with tf.Session() as sess:`` do; ``race_free`` (the default): the
  local run takes each step as its reads, then its updates (``epl.testing.race_free_step``)
  -- a plain TF1 step lets a layer's backward read a weight its update already changed,
  so the reference itself would differ from run to run."""
  graph = tf.Graph()
  with graph.as_default():
    tf.set_random_seed(0)
    if config is not None:
      epl.init(config)
    with contextlib.ExitStack() as stack:
      sess = stack.enter_context(tf.Session()) if session_first else None
      t = build()
      variables = tf.global_variables()
      run = Run([], {}, {})
      sess = sess or stack.enter_context(tf.Session())
      sess.run(tf.global_variables_initializer())
      if initial is not None:
        load_whole(sess, variables, initial)
      run.initial = whole_values(sess, variables)
      for s in range(steps):
        feed = {p: d[s * rows:(s + 1) * rows] for p, d in zip(t["inputs"], data)}
        if race_free and config is None:
          values = race_free_step(sess, t["train_op"], feed, {k: t[k] for k in fetch})
        else:
          values = sess.run({k: t[k] for k in fetch} | {"_": t["train_op"]}, feed)
          values.pop("_")
        run.fetched.append(values)
      run.variables = whole_values(sess, variables)
      feed = {p: d[:eval_rows] for p, d in zip(t["inputs"], data)}
      run.evaluated = sess.run({k: t[k] for k in fetch}, feed)
      if measure_memory:
        feed = {p: d[:rows] for p, d in zip(t["inputs"], data)}
        run.memory = epl.memory.measure(sess, t["train_op"], feed)
    if config is not None:
      run.parallel = epl.Graph.get()
      check_parts_placed(graph)
    run.graph = graph
  return run


def part_devices(graph):
  """{split variable's full name: the device of each of its parts}."""
  parts = {}
  for var in graph.get_collection(tf.GraphKeys.GLOBAL_VARIABLES):
    info = var._get_save_slice_info()     # pylint: disable=protected-access
    if info is not None:
      parts.setdefault(info.full_name, []).append(var.op.device)
  return parts


def check_parts_placed(graph):
  """A split variable's parts are used on several devices (a split that runs all its parts
  on one device trains the same numbers: parity alone cannot see it). The parts sit there
  too, except with offload.level (then on the host, read by the devices)."""
  for name, devices in part_devices(graph).items():
    if len(devices) > 1:
      # several devices (a weight cut in groups, Q/K/V, has a part of each group on each)
      if len(set(devices)) == 1 and devices[0].endswith("CPU:0"):   # offloaded: readers
        trained = {v._get_save_slice_info().full_name   # pylint: disable=protected-access
                   for v in graph.get_collection(tf.GraphKeys.TRAINABLE_VARIABLES)
                   if v._get_save_slice_info() is not None}  # pylint: disable=protected-access
        if name not in trained:
          continue                    # a slot: read by the update only, on the host too
        devices = [_user_device(graph, name, i) for i in range(len(devices))]
      assert len(set(devices)) > 1 and all(devices), (name, devices)


def _user_device(graph, name, i):
  """The device of the first compute op that reads part ``i`` of split variable ``name``."""
  parts = [v for v in graph.get_collection(tf.GraphKeys.GLOBAL_VARIABLES)
           if v._get_save_slice_info() is not None and     # pylint: disable=protected-access
           v._get_save_slice_info().full_name == name]     # pylint: disable=protected-access
  work = list(parts[i].op.outputs[0].consumers())
  while work:
    op = work.pop(0)
    if op.device and not op.device.endswith("CPU:0"):
      return op.device
    if op.type in ("Identity", "ReadVariableOp", "Cast"):
      work.extend(c for t in op.outputs for c in t.consumers())
  return ""


def scopes(trunk_count, split_count):
  """(trunk scope factory, split scope factory) for an epl run."""
  return (lambda: epl.replicate(trunk_count, name="trunk"),
          lambda: epl.split(split_count, name="split"))


def local_scopes():
  return contextlib.nullcontext, contextlib.nullcontext
