"""What epl shows while it trains: a 2-stage pipeline, replicated twice on 4 devices.

  python examples/visibility/train.py [OUT_DIR]       (OUT_DIR: docs/ for the docs' pictures)

Prints the plan summary (epl logs it at start) and progress lines, then draws the plan
(OUT_DIR/plan.png) and the timeline of one step (OUT_DIR/timeline.png, .json).
"""
import os
import sys
import time

os.environ.setdefault("EPL_CLUSTER_DEVICES_PER_WORKER", "4")
import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

import epl  # noqa: E402

tf.disable_v2_behavior()
out = sys.argv[1] if len(sys.argv) > 1 else "."
epl.init(epl.Config({"pipeline.num_micro_batch": 4, "log.progress_secs": 2}))

rng = np.random.RandomState(0)
features = rng.randn(4096, 64).astype(np.float32)
labels = (features[:, :4].sum(axis=1) > 0).astype(np.int64)
dataset = tf.data.Dataset.from_tensor_slices((features, labels)).batch(32).repeat()
x, y = tf.data.make_one_shot_iterator(dataset).get_next()
with epl.replicate(device_count=1, name="stage_0"):
  hidden = tf.layers.dense(x, 256, activation=tf.nn.relu)
  hidden = tf.layers.dense(hidden, 256, activation=tf.nn.relu)
with epl.replicate(device_count=1, name="stage_1"):
  hidden = tf.layers.dense(hidden, 256, activation=tf.nn.relu)
  loss = tf.losses.sparse_softmax_cross_entropy(y, tf.layers.dense(hidden, 2))
step = tf.train.get_or_create_global_step()
train = tf.train.AdamOptimizer(1e-3).minimize(loss, global_step=step)

with tf.train.MonitoredTrainingSession(log_step_count_steps=None) as sess:
  start = time.time()
  while time.time() - start < 5:
    sess.run(train)
  meta = tf.RunMetadata()
  sess.run(train, options=tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE),
           run_metadata=meta)
  pg = epl.Graph.get()
  print("plan picture: %s (%d x %d)" % ((os.path.join(out, "plan.png"),) +
                                        pg.draw(os.path.join(out, "plan.png"))))
  epl.timeline.save(meta, pg, os.path.join(out, "timeline.json"),
                    os.path.join(out, "timeline.png"), title="2 stages x 2 replicas, 4 micro-batches")
  print("timeline: %s" % os.path.join(out, "timeline.png"))
