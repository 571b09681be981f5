"""A checkpointed training run for the fault and resume tests (started by epl-launch).

usage: train_worker.py CKPT_DIR OUT_DIR STEPS SLEEP [pipeline]
TEST_EXTRA_PARAMS: a variable of that many floats more (its gradient travels every
step). TEST_LINGER_<index> (seconds): worker <index> waits that long after its last step before its
script ends (a worker slower to finish than its peers).
Every worker passes is_chief=True, as EPL's examples do; epl lets only worker 0 write. With
``pipeline`` the model is two stages with 2 micro-batches (on 2 workers x 1 device, worker 1
only serves).
"""
import os
import sys
import time

import numpy as np
import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()

import epl  # noqa: E402


def main():
  ckpt, out, steps, pause = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
  pipeline = sys.argv[5:] == ["pipeline"]
  env = epl.init(epl.Config({"pipeline.num_micro_batch": 2}) if pipeline else None)
  index = env.cluster.worker_index
  rng = np.random.RandomState(index)
  data = (rng.randn(256, 8).astype(np.float32), rng.randint(0, 4, 256).astype(np.int64))
  with epl.replicate(1, name="stage_0"):
    x, y = tf.data.make_one_shot_iterator(
        tf.data.Dataset.from_tensor_slices(data).batch(4).repeat()).get_next()
    hidden = tf.layers.dense(x, 8, activation=tf.nn.relu)
  with epl.replicate(1, name="stage_1" if pipeline else "stage_0"):
    logits = tf.layers.dense(hidden, 4)
    loss = tf.losses.sparse_softmax_cross_entropy(y, logits)
    extra = int(os.environ.get("TEST_EXTRA_PARAMS", "0"))     # gradient bytes on the wire
    if extra:
      big = tf.get_variable("big", [extra], initializer=tf.zeros_initializer())
      loss += 1e-9 * tf.reduce_sum(big * big) + 1e-9 * tf.reduce_sum(big)
  step = tf.train.get_or_create_global_step()
  train = tf.train.AdamOptimizer(0.01).minimize(loss, global_step=step)
  names = sorted(v.op.name for v in tf.global_variables())
  with tf.train.MonitoredTrainingSession(checkpoint_dir=ckpt, save_checkpoint_steps=2,
                                         save_summaries_steps=None,
                                         log_step_count_steps=None) as sess:
    start = dict(zip(names, sess.run([n + ":0" for n in names])))
    first = int(start["global_step"])
    np.savez(os.path.join(out, "start_%d.npz" % index), **start)
    print("worker %d starts at step %d" % (index, first), flush=True)
    current = first
    while current < steps:
      _, current = sess.run([train, step])
      print("worker %d step %d" % (index, current), flush=True)
      time.sleep(pause)
  print("worker %d done at %.3f" % (index, time.time()), flush=True)
  time.sleep(float(os.environ.get("TEST_LINGER_%d" % index, "0")))


if __name__ == "__main__":
  main()
