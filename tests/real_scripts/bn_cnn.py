"""A batch-norm CNN in the style of the TF1 tutorials: image and label placeholders with an
unknown batch size, an ``is_training`` placeholder that switches batch norm and dropout (both
build a ``tf.cond``), ``UPDATE_OPS`` around the optimizer, accuracy, and an evaluation loop
over a held-out set with ``is_training=False``.
"""
import contextlib

import numpy as np
import tensorflow.compat.v1 as tf


def conv_net(images, is_training, stage):
  with stage(0):
    net = tf.layers.conv2d(images, 8, 3, padding="same", use_bias=False, name="conv1")
    net = tf.layers.batch_normalization(net, training=is_training, name="bn1")
    net = tf.nn.relu(net)
    net = tf.layers.max_pooling2d(net, 2, 2)
  with stage(1):
    net = tf.layers.conv2d(net, 16, 3, padding="same", activation=tf.nn.relu, name="conv2")
    net = tf.layers.flatten(net)
    net = tf.layers.dropout(net, rate=0.25, training=is_training)
    logits = tf.layers.dense(net, 10, name="logits")
  return logits


def build(batch_size, stage=lambda i: contextlib.nullcontext()):
  del batch_size                                   # the placeholders take any batch
  images = tf.placeholder(tf.float32, [None, 8, 8, 1], name="images")
  labels = tf.placeholder(tf.int64, [None], name="labels")
  is_training = tf.placeholder(tf.bool, [], name="is_training")
  logits = conv_net(images, is_training, stage)
  loss = tf.losses.sparse_softmax_cross_entropy(labels=labels, logits=logits)
  predictions = tf.argmax(logits, 1)
  accuracy = tf.reduce_mean(tf.cast(tf.equal(predictions, labels), tf.float32))
  global_step = tf.train.get_or_create_global_step()
  update_ops = tf.get_collection(tf.GraphKeys.UPDATE_OPS)
  with tf.control_dependencies(update_ops):
    train_op = tf.train.AdamOptimizer(1e-2).minimize(loss, global_step=global_step)
  return dict(placeholders=dict(images=images, labels=labels), is_training=is_training,
              loss=loss, train_op=train_op, accuracy=accuracy, predictions=predictions,
              logits=logits)


def make_data(rows, seed=0):
  rng = np.random.RandomState(seed)
  labels = rng.randint(0, 10, rows)
  images = rng.randn(rows, 8, 8, 1).astype(np.float32) * 0.5
  images[np.arange(rows), labels % 8, labels // 8 + 2, 0] += 3.0   # learnable
  return dict(images=images, labels=labels.astype(np.int64))


def evaluate(sess, t, data, batch_size):
  """The tutorial's evaluation loop: mean accuracy over held-out batches (the last one short)."""
  correct, seen, predictions = 0.0, 0, []
  for start in range(0, len(data["labels"]), batch_size):
    feed = {t["placeholders"][k]: v[start:start + batch_size] for k, v in data.items()}
    feed[t["is_training"]] = False
    acc, pred = sess.run([t["accuracy"], t["predictions"]], feed)
    rows = len(pred)
    correct += acc * rows
    seen += rows
    predictions.append(pred)
  return correct / seen, np.concatenate(predictions)
