"""A classifier in the style of the TF1 ResNet / slim training scripts: layers with a
``kernel_regularizer`` whose terms ``tf.losses.get_regularization_loss()`` adds to the loss, an
explicit L2 weight decay over part of ``tf.trainable_variables()``, momentum with a piecewise
learning-rate schedule on ``global_step``, and an exponential moving average of the weights
applied after the optimizer step (the weights evaluation reads).
"""
import contextlib

import numpy as np
import tensorflow.compat.v1 as tf

FEATURES, CLASSES = 12, 5


def build(batch_size, stage=lambda i: contextlib.nullcontext()):
  del batch_size                                   # the placeholders take any batch
  x = tf.placeholder(tf.float32, [None, FEATURES], name="x")
  y = tf.placeholder(tf.int64, [None], name="y")
  regularizer = lambda w: 3e-2 * tf.nn.l2_loss(w)   # noqa: E731 (slim's l2_regularizer)
  with stage(0):
    h = tf.layers.dense(x, 16, activation=tf.nn.relu, kernel_regularizer=regularizer,
                        name="block1")
  with stage(1):
    logits = tf.layers.dense(h, CLASSES, kernel_regularizer=regularizer, name="logits")
  cross_entropy = tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)
  weight_decay = 1e-2 * tf.add_n([tf.nn.l2_loss(v) for v in tf.trainable_variables()
                                  if "bias" in v.name])
  loss = cross_entropy + tf.losses.get_regularization_loss() + weight_decay
  global_step = tf.train.get_or_create_global_step()
  learning_rate = tf.train.piecewise_constant(global_step, [2], [0.1, 0.05])
  step = tf.train.MomentumOptimizer(learning_rate, 0.9).minimize(loss, global_step=global_step)
  ema = tf.train.ExponentialMovingAverage(0.5, num_updates=global_step)
  with tf.control_dependencies([step]):
    train_op = ema.apply(tf.trainable_variables())
  return dict(placeholders=dict(x=x, y=y), loss=loss, train_op=train_op,
              cross_entropy=cross_entropy)


def make_data(rows, seed=0):
  rng = np.random.RandomState(seed)
  return dict(x=rng.randn(rows, FEATURES).astype(np.float32),
              y=rng.randint(0, CLASSES, rows).astype(np.int64))
