"""Runs a real-script model locally and under epl, the way its training loop runs it.

A script module exposes ``build(batch_size, stage) -> dict`` (placeholders, loss, train_op and
any other tensors) and ``make_data(rows, seed)``. Under epl the graph is built for one copy's
micro-batch and fed the whole step (copies x micro-batches x batch rows, which epl splits);
locally it is built for, and fed, the whole step.
"""
import contextlib
import dataclasses
from typing import Dict, List

import numpy as np
import tensorflow.compat.v1 as tf

import epl
from epl.testing.reference import race_free_step
from epl.testing.values import load_values, read_values


@dataclasses.dataclass(frozen=True)
class Mode:
  devices: int
  micro: int
  stages: int

  @property
  def pieces(self):
    """Copies x micro-batches one step feeds."""
    return self.devices // self.stages * self.micro

  def config(self, **extra):
    return epl.Config(dict({"cluster.devices_per_worker": self.devices,
                            "pipeline.num_micro_batch": self.micro}, **extra))


MODES = {
    "dp2": Mode(2, 1, 1),
    "pipeline2_m2": Mode(2, 2, 2),
    "pipeline2_m4": Mode(2, 4, 2),
    "accumulate_m4": Mode(1, 4, 1),
}


@dataclasses.dataclass
class Run:
  losses: List[float]
  variables: Dict[str, np.ndarray]
  initial: Dict[str, np.ndarray]
  fetched: List[dict]
  after: object = None                 # what ``after(sess, tensors)`` returned
  parallel: object = None              # epl.Graph.get() under epl


def null_stage(_):
  return contextlib.nullcontext()


def steps_of(rows_per_step, steps, last=None):
  """Row slices of ``steps`` full steps, then optionally a last step of ``last`` rows."""
  out = [slice(s * rows_per_step, (s + 1) * rows_per_step) for s in range(steps)]
  if last:
    out.append(slice(steps * rows_per_step, steps * rows_per_step + last))
  return out


def run(script, batch, data, batches, mode=None, initial=None, extra=(), feed=None,
        after=None, config=None, seed=3, stage=None, race_free=True, build=None):
  """Trains one step per row slice of ``batches``; ``feed(tensors)`` adds feeds to every step,
  ``after(sess, tensors)`` runs once training is done (evaluation, prediction); ``stage``: the
  script's stage annotation under epl (default: ``replicate(1, name="stage_<i>")`` scopes).
  ``race_free`` (the default): the local run (no ``mode``) takes each step as all reads, then
  all updates (``epl.testing.race_free_step``; a plain TF1 step races its backward's reads
  with its updates); ``build``: keyword arguments of ``script.build``."""
  run_stage = stage
  graph = tf.Graph()
  with graph.as_default():
    tf.set_random_seed(seed)
    stage = null_stage
    if mode is not None:
      epl.init(config or mode.config())
      if mode.stages == 1:
        epl.set_default_strategy(epl.replicate(1))
      else:
        stage = run_stage or (lambda i: epl.replicate(1, name="stage_%d" % i))  # noqa: E731
    t = script.build(batch, stage, **(build or {}))
    variables = tf.global_variables()
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      if initial:
        load_values(sess, variables, lambda v: initial[v.op.name])
      start = read_values(sess, variables)
      losses, fetched = [], []
      for rows in batches:
        feed_dict = {t["placeholders"][k]: v[rows] for k, v in data.items()}
        feed_dict.update(feed(t) if feed else {})
        if race_free and mode is None:
          out = race_free_step(sess, t["train_op"], feed_dict,
                               dict(loss=t["loss"], **{k: t[k] for k in extra}))
        else:
          out = sess.run(dict(loss=t["loss"], train=t["train_op"],
                              **{k: t[k] for k in extra}), feed_dict)
        losses.append(float(out["loss"]))
        fetched.append({k: out[k] for k in extra})
      final = read_values(sess, variables)
      result = after(sess, t) if after else None
      parallel = epl.Graph.get() if mode is not None else None
  return Run(losses, final, start, fetched, result, parallel)


def close(what, got, want, rtol=1e-5):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  bad = np.abs(got - want) > rtol * np.maximum(1.0, np.abs(want))
  assert not bad.any(), "%s differs: max |epl - local| = %g" % (what, np.abs(got - want).max())


def assert_same_training(local, dist, rtol=1e-5):
  close("loss per step", dist.losses, local.losses, rtol)
  assert set(dist.variables) == set(local.variables), \
      sorted(set(dist.variables) ^ set(local.variables))
  for name, value in local.variables.items():
    close("variable %s" % name, dist.variables[name], value, rtol)
