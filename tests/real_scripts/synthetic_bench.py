"""A throughput benchmark with in-graph synthetic input, as tf_cnn_benchmarks-style scripts
build it: ``tf.random.uniform`` images and labels of a fixed batch shape, no input pipeline,
a small CNN, momentum SGD.
"""
import contextlib

import tensorflow.compat.v1 as tf


def build(batch_size, stage=lambda i: contextlib.nullcontext()):
  with stage(0):
    images = tf.random.uniform([batch_size, 8, 8, 3], name="synthetic_images")
    labels = tf.random.uniform([batch_size], minval=0, maxval=10, dtype=tf.int32,
                               name="synthetic_labels")
    net = tf.layers.conv2d(images, 8, 3, activation=tf.nn.relu, name="conv")
    net = tf.layers.max_pooling2d(net, 2, 2)
  with stage(1):
    net = tf.layers.flatten(net)
    logits = tf.layers.dense(net, 10, name="fc")
    loss = tf.losses.sparse_softmax_cross_entropy(labels=labels, logits=logits)
  train_op = tf.train.MomentumOptimizer(0.05, 0.9).minimize(
      loss, global_step=tf.train.get_or_create_global_step())
  return dict(placeholders=dict(images=images, labels=labels), loss=loss, train_op=train_op,
              images=images, labels=labels)
