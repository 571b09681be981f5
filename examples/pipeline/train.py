# The pipeline example of EPL's manual: two `replicate` stages, 4 micro-batches per step.
# On 2 devices it is a 2-stage pipeline; on 4 devices epl replicates the pipeline twice.
import numpy as np
import tensorflow.compat.v1 as tf
import epl

tf.disable_v2_behavior()
config = epl.Config({"pipeline.num_micro_batch": 4})
epl.init(config)

num_x = np.random.RandomState(0).randn(4096, 32).astype(np.float32)
num_y = (num_x[:, :4].sum(axis=1) > 0).astype(np.int64)
worker = epl.Env.get().cluster.worker_index
dataset = tf.data.Dataset.from_tensor_slices((num_x, num_y)).shard(
    epl.Env.get().cluster.worker_num, worker).batch(16).repeat()
x, labels = tf.data.make_one_shot_iterator(dataset).get_next()

with epl.replicate(device_count=1, name="stage_0"):
  hidden = tf.layers.dense(x, 64, activation=tf.nn.relu)
  hidden = tf.layers.dense(hidden, 64, activation=tf.nn.relu)
with epl.replicate(device_count=1, name="stage_1"):
  logits = tf.layers.dense(hidden, 2)
  loss = tf.losses.sparse_softmax_cross_entropy(labels=labels, logits=logits)

global_step = tf.train.get_or_create_global_step()
train_op = tf.train.AdamOptimizer(0.01).minimize(loss, global_step=global_step)

with tf.train.MonitoredTrainingSession() as sess:
  for _ in range(20):
    train_loss, _, step = sess.run([loss, train_op, global_step])
    print("worker %d step %d loss %.4f" % (worker, step, train_loss))
print(epl.Graph.get().format())
