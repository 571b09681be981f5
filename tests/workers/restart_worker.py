"""A training script for the restart tests (started by epl-launch --max_restarts).

usage: restart_worker.py CKPT_DIR OUT_DIR STEPS

Data parallel over the job's workers, Adam, MonitoredTrainingSession checkpointing every 4
steps. The input is deterministic in the global step: the batch of step s on worker w is drawn
from a generator seeded with (s, w), so a job resumed from the checkpoint of step c reads for
steps c, c+1, ... exactly what an uninterrupted run read -- the way a real input pipeline
resumes when it is keyed by the step (or skips the samples of the steps done).
TEST_FAIL_AT_STEP_<w>: worker w raises at that global step, in every run of the job.
TEST_BAD_CONFIG: a misspelt Config key (epl.Config raises). TEST_FAIL_EARLY: the script
raises before its first step.
"""
import os
import sys

import numpy as np
import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()

import epl  # noqa: E402
from epl.testing.values import read_values

EVERY = 4


def batch(step, worker):
  rng = np.random.RandomState([step, worker])
  return rng.randn(4, 8).astype(np.float32), rng.randint(0, 4, 4).astype(np.int64)


def main():
  ckpt, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
  env = epl.init(epl.Config({"pipeline.num_micro_batchs": 2}) if os.environ.get(
      "TEST_BAD_CONFIG") else None)
  worker = env.cluster.worker_index
  fail_at = int(os.environ.get("TEST_FAIL_AT_STEP_%d" % worker, "-1"))
  epl.set_default_strategy(epl.replicate(1))
  tf.set_random_seed(1)                     # every run of the test starts from the same weights
  x = tf.placeholder(tf.float32, [None, 8])
  y = tf.placeholder(tf.int64, [None])
  hidden = tf.layers.dense(x, 16, activation=tf.nn.relu)
  loss = tf.losses.sparse_softmax_cross_entropy(y, tf.layers.dense(hidden, 4))
  step = tf.train.get_or_create_global_step()
  train = tf.train.AdamOptimizer(0.01).minimize(loss, global_step=step)
  if os.environ.get("TEST_FAIL_EARLY"):
    raise ValueError("the script's own error, before its first step")
  with tf.train.MonitoredTrainingSession(checkpoint_dir=ckpt, save_checkpoint_steps=EVERY,
                                         save_checkpoint_secs=None, save_summaries_steps=None,
                                         log_step_count_steps=None) as sess:
    current = int(sess.run(step))
    print("worker %d starts at step %d" % (worker, current), flush=True)
    while current < steps:
      if current == fail_at:
        raise RuntimeError("worker %d fails at step %d" % (worker, current))
      bx, by = batch(current, worker)
      _, current = sess.run([train, step], {x: bx, y: by})
      print("worker %d step %d" % (worker, current), flush=True)
    final = read_values(sess, tf.global_variables())
  np.savez(os.path.join(out, "final_%d.npz" % worker), **final)
  print("worker %d done" % worker, flush=True)


if __name__ == "__main__":
  main()
