# Large-scale classification (EPL manual §5.3.1): a data-parallel convolutional trunk and a
# 20,000-class classifier (memorising 64 images) split over the same devices. Every device holds 1/N of the
# classifier's weight and of its Momentum slot; the features of the whole batch are gathered
# into the split classifier and the softmax cross-entropy is computed over the sharded logits
# without ever building the full logits on one device.
#
#   python train.py                                   # 1 worker, EPL_CLUSTER_DEVICES_PER_WORKER devices
#   epl-launch --num_workers 2 --gpu_per_worker 1 run.sh
# The lines marked "epl" are all that parallelises the local script.
import numpy as np
import tensorflow.compat.v1 as tf
import epl  # epl

tf.disable_v2_behavior()
CLASSES, BATCH, STEPS = 20000, 16, 30

config = epl.Config({"cluster.colocate_split_and_replicate": True})  # epl
epl.init(config)  # epl
total_gpu_num = epl.Env.get().cluster.total_gpu_num  # epl

rng = np.random.RandomState(0)
num_images = rng.rand(64, 16, 16, 3).astype(np.float32)
num_labels = rng.randint(0, CLASSES, 64).astype(np.int64)
dataset = tf.data.Dataset.from_tensor_slices((num_images, num_labels)).batch(BATCH).repeat()
images, labels = tf.data.make_one_shot_iterator(dataset).get_next()


def resnet(images):
  """A small convolutional trunk standing in for ResNet-50."""
  net = tf.layers.conv2d(images, 16, 3, padding="same", activation=tf.nn.relu, name="conv1")
  net = tf.layers.max_pooling2d(net, 2, 2)
  shortcut = net
  net = tf.layers.conv2d(net, 16, 3, padding="same", activation=tf.nn.relu, name="conv2")
  net = tf.layers.conv2d(net, 16, 3, padding="same", name="conv3")
  net = tf.nn.relu(net + shortcut)
  net = tf.layers.flatten(net)
  return tf.layers.dense(net, 64, activation=tf.nn.relu, name="features")


def classification(features, labels):
  logits = tf.layers.dense(features, CLASSES, name="classifier")
  loss = tf.losses.sparse_softmax_cross_entropy(labels, logits)
  correct = tf.equal(tf.argmax(logits, axis=1), labels)
  accuracy = tf.reduce_mean(tf.cast(correct, tf.float32))
  return loss, accuracy


with epl.replicate(total_gpu_num, name="resnet"):  # epl
  features = resnet(images)
with epl.split(total_gpu_num, name="classification"):  # epl
  loss, accuracy = classification(features, labels)

global_step = tf.train.get_or_create_global_step()
optimizer = tf.train.MomentumOptimizer(0.05, momentum=0.5)
grads, variables = zip(*optimizer.compute_gradients(loss))
grads, _ = tf.clip_by_global_norm(grads, 1.0)
train_op = optimizer.apply_gradients(zip(grads, variables), global_step=global_step)

with tf.train.MonitoredTrainingSession() as sess:
  while not sess.should_stop():
    step_loss, step_accuracy, _, step = sess.run([loss, accuracy, train_op, global_step])
    if step % 5 == 0 or step == STEPS:
      print("step %d loss %.4f accuracy %.3f" % (step, step_loss, step_accuracy), flush=True)
    if step >= STEPS:
      break
print(epl.Graph.get().format())  # epl
