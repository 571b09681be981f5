"""A DCGAN-style GAN written as such scripts are: a generator and a discriminator with batch
norm, two Adam optimizers with their own ``var_list`` and their own ``UPDATE_OPS``, a
discriminator step that feeds real images and noise and a generator step that feeds only
noise, in alternate session runs. ``is_training`` is a fed bool (batch norm in training mode,
or on its moving statistics).

Stage 0 is the generator, stage 1 the discriminator.
"""
import numpy as np
import tensorflow.compat.v1 as tf

NOISE, PIXELS = 4, 12


def generator(z, is_training):
  with tf.variable_scope("generator"):
    h = tf.layers.dense(z, 16, use_bias=False, name="fc0")   # batch norm centres it
    h = tf.nn.relu(tf.layers.batch_normalization(h, training=is_training, name="bn0"))
    return tf.nn.tanh(tf.layers.dense(h, PIXELS, name="out"))


def discriminator(x, is_training, reuse):
  with tf.variable_scope("discriminator", reuse=reuse):
    h = tf.nn.leaky_relu(tf.layers.dense(x, 16, name="fc0"), 0.2)
    h = tf.layers.batch_normalization(h, training=is_training, name="bn0")
    h = tf.nn.leaky_relu(tf.layers.dense(h, 8, name="fc1"), 0.2)
    return tf.layers.dense(h, 1, name="logit")


def _xent(logits, ones):
  labels = tf.ones_like(logits) if ones else tf.zeros_like(logits)
  return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))


def build(stage, lr=0.01):
  real = tf.placeholder(tf.float32, [None, PIXELS], name="real_images")
  z = tf.placeholder(tf.float32, [None, NOISE], name="z")
  is_training = tf.placeholder(tf.bool, [], name="is_training")
  with stage(0):
    fake = generator(z, is_training)
  with stage(1):
    d_real = discriminator(real, is_training, reuse=False)
    d_fake = discriminator(fake, is_training, reuse=True)
    d_loss = _xent(d_real, True) + _xent(d_fake, False)
    g_loss = _xent(d_fake, True)
  d_vars = [v for v in tf.trainable_variables() if v.name.startswith("discriminator/")]
  g_vars = [v for v in tf.trainable_variables() if v.name.startswith("generator/")]
  updates = tf.get_collection(tf.GraphKeys.UPDATE_OPS)
  with tf.control_dependencies([u for u in updates if u.name.startswith("discriminator/")]):
    d_train = tf.train.AdamOptimizer(lr, beta1=0.5).minimize(d_loss, var_list=d_vars)
  with tf.control_dependencies([u for u in updates if u.name.startswith("generator/")]):
    g_train = tf.train.AdamOptimizer(lr, beta1=0.5).minimize(g_loss, var_list=g_vars)
  return dict(real=real, z=z, is_training=is_training, d_loss=d_loss, g_loss=g_loss,
              d_train=d_train, g_train=g_train)


def make_data(rows, seed=0):
  rng = np.random.RandomState(seed)
  return (np.tanh(rng.randn(rows, PIXELS)).astype(np.float32),
          rng.randn(rows, NOISE).astype(np.float32))
