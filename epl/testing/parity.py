"""``assert_parity``: the same tiny model, trained locally and under epl, must match.

Both runs start from the same initial weights (the local run's initial values are loaded into
the epl run, which also exercises epl's replica sync after an assign) and read the same
samples: the epl run reads ``copies`` batches of ``batch`` per step from the dataset, the local
run one batch of ``copies * batch``. Loss per step and every variable are compared with
``|epl - local| <= rtol * max(1, |local|)``.
"""
import contextlib
import dataclasses
from typing import Callable, Dict, List, Optional

import numpy as np
import tensorflow.compat.v1 as tf

import epl
from epl.testing.values import load_values, read_values


@dataclasses.dataclass
class ParityResult:
  losses: List[float]
  variables: Dict[str, np.ndarray]
  initial: Dict[str, np.ndarray]
  graph: tf.Graph = None
  parallel: object = None
  steps: List[Dict[str, np.ndarray]] = None     # every variable after each step (every_step)


class Stages:
  """Passed to model functions: ``with stages(i):`` opens stage i's scope under epl only."""

  def __init__(self, strategies=None):
    self._strategies = strategies

  def __call__(self, i):
    if self._strategies is None or i >= len(self._strategies):
      return contextlib.nullcontext()
    return self._strategies[i]()


def _make_optimizer(name, lr):
  if name == "momentum":
    return tf.train.MomentumOptimizer(lr, momentum=0.9)
  if name == "adam":
    return tf.train.AdamOptimizer(lr)
  if name == "sgd":
    return tf.train.GradientDescentOptimizer(lr)
  raise ValueError(name)


def _inputs(data, batch, feed):
  """(x, y): placeholders (``feed``) or a repeated dataset's batches of ``data``."""
  features, labels = data
  if feed:
    x = tf.placeholder(tf.float32, [None] + list(features.shape[1:]), name="x")
    y = tf.placeholder(tf.as_dtype(labels.dtype), [None] + list(labels.shape[1:]), name="y")
    return x, y
  ds = tf.data.Dataset.from_tensor_slices((features, labels)).batch(batch)
  return tf.data.make_one_shot_iterator(ds.repeat()).get_next()


def _train_ops(loss, optimizer, lr, alternate, clip_norm=None):
  """One train op (with global_step), or two for ``alternate`` steps (see run_model)."""
  global_step = tf.train.get_or_create_global_step()
  with tf.control_dependencies(tf.get_collection(tf.GraphKeys.UPDATE_OPS)):
    if clip_norm is not None:                 # as BERT and GPT-2 scripts clip
      opt = _make_optimizer(optimizer, lr)
      grads, variables = zip(*opt.compute_gradients(loss))
      grads, _ = tf.clip_by_global_norm(grads, clip_norm)
      return [opt.apply_gradients(zip(grads, variables), global_step=global_step)]
    if not alternate:
      return [_make_optimizer(optimizer, lr).minimize(loss, global_step=global_step)]
    trained = tf.trainable_variables()
    first = [v for v in trained if v.op.name.split("/")[0] == trained[0].op.name.split("/")[0]]
    return [
        _make_optimizer(optimizer, lr).minimize(loss, global_step=global_step, var_list=first),
        _make_optimizer(optimizer, lr).minimize(
            loss, var_list=[v for v in trained if v not in first])]


def run_model(model_fn, data, batch, steps, config=None, strategies=None, optimizer="momentum",
              lr=0.01, initial=None, seed=7, feed=False, default_strategy=None,
              fetch_loss=True, every_step=False, alternate=False, clip_norm=None):
  """Builds and trains ``model_fn`` once; epl is used when ``config`` is given.

  Args:
    model_fn: (x, y, stages) -> scalar loss.
    data: (features, labels) numpy arrays.
    batch: the script's batch size.
    strategies: list of zero-arg callables returning epl scopes (one per stage), or None.
    feed: feed batches through placeholders instead of a dataset (epl splits them).
    initial: {var name: value} loaded after initialisation.
    fetch_loss: False runs only ``train_op`` each step (no loss recorded), as scripts that
      log every N steps do.
    every_step: read every variable right after each step (``ParityResult.steps``), as a
      script that evaluates or saves between steps does.
    alternate: two train ops in alternate steps, as GAN scripts have: the first layer's
      variables (with global_step) in even steps, the others in odd ones.
    clip_norm: the gradients clipped by their global norm (tf.clip_by_global_norm) between
      compute_gradients and apply_gradients; not with ``alternate``.
  """
  graph = tf.Graph()
  with graph.as_default():
    tf.set_random_seed(seed)
    if config is not None:
      epl.init(config)
      if default_strategy is not None:
        epl.set_default_strategy(default_strategy())
    x, y = _inputs(data, batch, feed)
    stages = Stages(strategies if config is not None else None)
    loss = model_fn(x, y, stages)
    train_ops = _train_ops(loss, optimizer, lr, alternate, clip_norm)
    variables = tf.global_variables()
    init = tf.global_variables_initializer()
    with tf.Session() as sess:
      sess.run(init)
      if initial:
        load_values(sess, [v for v in variables if v.op.name in initial],
                    lambda v: initial[v.op.name])
      start = read_values(sess, variables)
      losses, trajectory = [], [] if every_step else None
      features, labels = data
      for step in range(steps):
        fd = None
        if feed:
          lo = step * batch % len(features)
          fd = {x: features[lo:lo + batch], y: labels[lo:lo + batch]}
        train_op = train_ops[step % len(train_ops)]
        if not fetch_loss:
          sess.run(train_op, fd)
        else:
          value, _ = sess.run([loss, train_op], fd)
          losses.append(float(value))
        if every_step:
          trajectory.append(read_values(sess, variables))
      final = read_values(sess, variables)
      parallel = epl.Graph.get() if config is not None else None
  return ParityResult(losses, final, start, graph, parallel, trajectory)


def assert_parity(model_fn, config, copies, batch=4, steps=5, rtol=1e-5, data=None,
                  local_lr=None, strategies=None, optimizer="momentum", lr=0.01, feed=False,
                  default_strategy=None, check_loss=True, skip_variable=None, fetch_loss=True):
  """Trains locally with batch ``copies * batch`` and under epl with ``batch``; compares.

  Returns:
    (local ParityResult, epl ParityResult).
  Raises:
    AssertionError: a loss or variable differs by more than rtol * max(1, |local|).
  """
  if data is None:
    rng = np.random.RandomState(0)
    data = (rng.randn(copies * batch * steps, 8).astype(np.float32),
            rng.randint(0, 4, copies * batch * steps).astype(np.int64))
  local = run_model(model_fn, data, copies * batch, steps, optimizer=optimizer,
                    lr=local_lr or lr, feed=feed)
  if strategies is None and default_strategy is None:
    strategies = [lambda: epl.replicate(1)] * 4
  dist = run_model(model_fn, data, batch if not feed else copies * batch, steps, config=config,
                   strategies=strategies, optimizer=optimizer, lr=lr, initial=local.initial,
                   feed=feed, default_strategy=default_strategy, fetch_loss=fetch_loss)
  if check_loss and fetch_loss:
    _close("loss per step", np.array(dist.losses), np.array(local.losses), rtol)
  assert set(dist.variables) == set(local.variables), (
      sorted(set(dist.variables) ^ set(local.variables)))
  for name, value in local.variables.items():
    if skip_variable is not None and skip_variable(name):
      continue
    _close("variable %s" % name, dist.variables[name], value, rtol)
  return local, dist


def _close(what, got, want, rtol):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  tol = rtol * np.maximum(1.0, np.abs(want))
  bad = np.abs(got - want) > tol
  assert not bad.any(), "%s differs: max |epl - local| = %g (epl %s, local %s)" % (
      what, np.max(np.abs(got - want)), got.ravel()[:6], want.ravel()[:6])
