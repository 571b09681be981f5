"""A training script with its own TensorBoard summaries, as users write it (started by
epl-launch from tests/test_board.py).

usage: board_worker.py LOGDIR STEPS
Each worker writes its loss summary to LOGDIR with its own FileWriter every step (only the
chief's reach the disk: epl's hook); epl's own summaries go to LOGDIR too
(EPL_LOG_SUMMARY_DIR, EPL_LOG_PROGRESS_SECS set by the test). Two pipeline stages, two
micro-batches, data parallel over the job's workers.
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()

import epl  # noqa: E402


def main():
  logdir, steps = sys.argv[1], int(sys.argv[2])
  epl.init(epl.Config({"pipeline.num_micro_batch": 2}))
  x = tf.placeholder(tf.float32, [None, 8])
  y = tf.placeholder(tf.int64, [None])
  with epl.replicate(1, name="stage_0"):
    h = tf.layers.dense(x, 16, activation=tf.nn.relu)
  with epl.replicate(1, name="stage_1"):
    logits = tf.layers.dense(h, 4)
    loss = tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)
  step = tf.train.get_or_create_global_step()
  train = tf.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step)
  tf.summary.scalar("loss", loss)
  merged = tf.summary.merge_all()
  rng = np.random.RandomState(0)
  writer = tf.summary.FileWriter(logdir)
  with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    for _ in range(steps):
      feed = {x: rng.randn(8, 8).astype(np.float32), y: rng.randint(0, 4, 8)}
      summary, _, global_step = sess.run([merged, train, step], feed)
      writer.add_summary(summary, global_step)
      time.sleep(0.05)
  writer.close()
  print("worker done")


if __name__ == "__main__":
  main()
