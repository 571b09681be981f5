"""A training script for the elastic tests (started by epl-launch --min_workers).

usage: elastic_worker.py CKPT_DIR OUT_DIR STEPS [local]

Data parallel, 2 micro-batches per worker, Adam, MonitoredTrainingSession checkpointing every
4 steps. The global batch of step s is 12 rows drawn from a generator seeded with s; each of
the job's W workers feeds its share (rows i*12/W to (i+1)*12/W of it), as a real input
pipeline sharded by rank does -- so the job trains on the same global batches whatever its
size. The loss is fetched merged job-wide; worker 0 appends "step loss" to OUT_DIR/losses.txt
and, at the end, writes every variable to OUT_DIR/final.npz. ``local``: the same model
without epl, on the whole global batch (the reference). TEST_PAUSE: seconds per step.
"""
import os
import sys
import time

import numpy as np
import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()

import epl  # noqa: E402
from epl.testing.values import read_values  # noqa: E402

ROWS, EVERY = 12, 4


def batch(step):
  rng = np.random.RandomState(step)
  return rng.randn(ROWS, 8).astype(np.float32), rng.randint(0, 4, ROWS).astype(np.int64)


def main():
  ckpt, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
  local = sys.argv[4:] == ["local"]
  index, workers = 0, 1
  if not local:
    env = epl.init(epl.Config({"pipeline.num_micro_batch": 2}))
    index, workers = env.cluster.worker_index, env.cluster.worker_num
    epl.set_default_strategy(epl.replicate(1))
  tf.set_random_seed(1)
  x = tf.placeholder(tf.float32, [None, 8])
  y = tf.placeholder(tf.int64, [None])
  hidden = tf.layers.dense(x, 16, activation=tf.nn.relu)
  loss = tf.losses.sparse_softmax_cross_entropy(y, tf.layers.dense(hidden, 4))
  if not local:
    epl.add_to_collection(loss, epl.GraphKeys.GLOBAL_MEAN_OBJECTS)
  step = tf.train.get_or_create_global_step()
  train = tf.train.AdamOptimizer(0.01).minimize(loss, global_step=step)
  share = slice(index * ROWS // workers, (index + 1) * ROWS // workers)
  pause = float(os.environ.get("TEST_PAUSE", "0"))
  with tf.train.MonitoredTrainingSession(checkpoint_dir=None if local else ckpt,
                                         save_checkpoint_steps=EVERY,
                                         save_checkpoint_secs=None, save_summaries_steps=None,
                                         log_step_count_steps=None) as sess:
    current = int(sess.run(step))
    print("worker %d of %d starts at step %d" % (index, workers, current), flush=True)
    while current < steps:
      bx, by = batch(current)
      _, value, after = sess.run([train, loss, step], {x: bx[share], y: by[share]})
      if index == 0:
        with open(os.path.join(out, "losses.txt"), "a") as f:
          f.write("%d %r\n" % (current, float(value)))
      current = after
      print("worker %d step %d" % (index, current), flush=True)
      time.sleep(pause)
    final = read_values(sess, tf.global_variables())
  if index == 0:
    np.savez(os.path.join(out, "final.npz"), **final)
  print("worker %d done" % index, flush=True)


if __name__ == "__main__":
  main()
