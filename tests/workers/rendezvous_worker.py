"""One worker of tests/test_rendezvous_leak.py, started from TF_CONFIG.

usage: rendezvous_worker.py STEPS
A data-parallel MLP trained STEPS runs with ``communication.release_aborted_rendezvous``
False (TensorFlow's own behaviour), then FAILS runs of a failing step (an assertion, in a graph
of its own on this worker's server: TF aborts the step's rendezvous, deterministically), then
epl's hook put in place by hand and both again. Prints one JSON line: how many aborted
rendezvous TF keeps after each part, and whether the hook was in place.
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()

import epl  # noqa: E402
from epl import _tf_compat as compat  # noqa: E402


FAILS = 5


def _failing_steps(index):
  """Runs FAILS steps that fail on this worker's server; returns how many more rendezvous TF
  keeps afterwards."""
  before = compat.pinned_rendezvous()
  g = tf.Graph()
  with g.as_default(), tf.device("/job:worker/task:%d/device:CPU:0" % index):
    value = tf.placeholder(tf.int32, [])
    check = tf.debugging.assert_equal(value, 1)
  target = epl.Env.get()._state.server.target  # pylint: disable=protected-access
  config = tf.ConfigProto(device_filters=["/job:worker/task:%d" % index])
  with tf.Session(target, graph=g, config=config) as sess:
    for _ in range(FAILS):
      try:
        sess.run(check, {value: 2})
        raise AssertionError("the failing step ran")
      except tf.errors.InvalidArgumentError:
        pass
  return compat.pinned_rendezvous() - before


def main():
  steps = int(sys.argv[1])
  env = epl.init(epl.Config({"communication.release_aborted_rendezvous": False}))
  rng = np.random.RandomState(env.cluster.worker_index)
  x = tf.constant(rng.randn(8, 16).astype(np.float32))
  with epl.replicate(1):
    loss = tf.reduce_mean(tf.square(tf.layers.dense(x, 8)))
  train = tf.train.GradientDescentOptimizer(0.01).minimize(loss)
  out = {"released_at_init": compat.aborted_rendezvous_released()}
  with tf.train.MonitoredTrainingSession(save_checkpoint_secs=None, save_summaries_steps=None,
                                         log_step_count_steps=None) as sess:
    for _ in range(steps):
      sess.run(train)
    out["pinned_without"] = compat.pinned_rendezvous()
    out["failed_without"] = _failing_steps(env.cluster.worker_index)
    out["hook"] = compat.release_aborted_rendezvous()
    before = compat.pinned_rendezvous()
    out["failed_with"] = _failing_steps(env.cluster.worker_index)
    for _ in range(steps):
      sess.run(train)
    out["trained_with"] = compat.pinned_rendezvous() - before
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  main()
