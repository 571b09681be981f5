"""One worker of the duplicate-request tests (tests/test_rejections.py), started from TF_CONFIG.

usage: reject_worker.py OUT_DIR STEPS
Environment (JSON): TEST_CONFIG the epl.Config dict; TEST_REJECT {"<worker>": {"<step>": times}}
(TF rejects that training step that many times on that worker, epl.testing.rejections);
TEST_LATE {"<worker>": {"<step>": seconds}} (the worker sleeps before that step: its peers are
ahead). A tf.layers MLP on a dataset iterator, Momentum, MonitoredTrainingSession; every step
also fetches the loss merged job-wide (GLOBAL_MEAN_OBJECTS). Writes OUT_DIR/worker_<i>.npz
with every global variable and the merged losses.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()

import epl  # noqa: E402


def main():
  out, steps = sys.argv[1], int(sys.argv[2])
  env = epl.init(epl.Config(json.loads(os.environ.get("TEST_CONFIG", "{}"))))
  index = env.cluster.worker_index
  rejections = json.loads(os.environ.get("TEST_REJECT", "{}")).get(str(index), {})
  late = json.loads(os.environ.get("TEST_LATE", "{}")).get(str(index), {})
  seeds = None
  if rejections:
    from epl.testing.rejections import Seeds
    seeds = Seeds()
    seeds.plan({int(k): v for k, v in rejections.items()})
  tf.set_random_seed(7)
  rng = np.random.RandomState(index)
  data = (rng.randn(512, 16).astype(np.float32), rng.randint(0, 4, 512).astype(np.int64))
  x, y = tf.data.make_one_shot_iterator(
      tf.data.Dataset.from_tensor_slices(data).batch(8).repeat()).get_next()
  with epl.replicate(1):
    hidden = tf.layers.dense(x, 32, activation=tf.nn.relu)
    logits = tf.layers.dense(hidden, 4)
    loss = tf.losses.sparse_softmax_cross_entropy(y, logits)
  epl.add_to_collection(loss, epl.GraphKeys.GLOBAL_MEAN_OBJECTS)
  step = tf.train.get_or_create_global_step()
  train = tf.train.MomentumOptimizer(0.05, 0.9).minimize(loss, global_step=step)
  losses = []
  with tf.train.MonitoredTrainingSession(save_checkpoint_secs=None, save_summaries_steps=None,
                                         log_step_count_steps=None) as sess:
    for i in range(steps):
      if str(i) in late:
        time.sleep(late[str(i)])
      if seeds is not None:
        seeds.before_step(i)
      _, value = sess.run([train, loss])
      losses.append(value)
    names = sorted(v.op.name for v in tf.global_variables())
    values = dict(zip(names, sess.run([n + ":0" for n in names])))
  np.savez(os.path.join(out, "worker_%d.npz" % index), __losses__=np.array(losses), **values)
  print("worker %d done" % index, flush=True)


if __name__ == "__main__":
  main()
