"""A 2-worker data-parallel job whose native hooks cannot go in (the engine-shape tests).

usage: native_worker.py MODE
MODE ``missing``: the hooks' symbols do not exist (a TF build without them); ``untested``:
TensorFlow's version is not among the tested ones. Trains 20 steps and prints "trained".
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()

import epl  # noqa: E402
from epl._tf_compat import native  # noqa: E402


def main():
  if sys.argv[1] == "missing":
    native._THREAD_LOCAL_NEW64 = "_ZN3tsl6random13NoSuchFunctionEv"   # pylint: disable=protected-access
    native._START_ABORT = "_ZN10tensorflow6NoSuchEv"                # pylint: disable=protected-access
  else:
    native.TESTED_TF = ("0.0.1",)
  epl.init()
  epl.set_default_strategy(epl.replicate(1))
  x = tf.placeholder(tf.float32, [None, 4])
  loss = tf.reduce_mean(tf.square(tf.layers.dense(x, 4)))
  train = tf.train.GradientDescentOptimizer(0.01).minimize(loss)
  with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    for _ in range(20):
      sess.run(train, {x: np.ones([2, 4], np.float32)})
  print("trained; request ids unique: %s, rendezvous released: %s" % (
      native.request_ids_unique(), native.aborted_rendezvous_released()), flush=True)


if __name__ == "__main__":
  main()
