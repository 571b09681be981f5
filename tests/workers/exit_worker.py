"""A data-parallel worker that ends in a chosen way at a chosen step (the launcher tests).

usage: exit_worker.py VICTIM STEP HOW
Worker VICTIM, after STEP training steps, ends by HOW: ``exit3`` (sys.exit(3)), ``os_exit``
(os._exit(4)), ``kill`` (SIGKILL to itself), ``return`` (its loop ends early: exit code 0),
``stop`` (SIGSTOP to itself: frozen). The others train on (up to 100,000 steps).
"""
import os
import signal
import sys
import time

import numpy as np
import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()

import epl  # noqa: E402


def main():
  victim, at, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
  env = epl.init()
  epl.set_default_strategy(epl.replicate(1))
  me = env.cluster.worker_index
  x = tf.placeholder(tf.float32, [None, 4])
  loss = tf.reduce_mean(tf.square(tf.layers.dense(x, 4)))
  train = tf.train.GradientDescentOptimizer(0.01).minimize(loss)
  with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    for step in range(1, 100001):
      sess.run(train, {x: np.ones([2, 4], np.float32)})
      if step % 10 == 0:
        print("worker %d step %d" % (me, step), flush=True)
      if me == victim and step == at:
        print("worker %d ends (%s) at step %d at %.3f" % (me, how, step, time.time()),
              flush=True)
        if how == "exit3":
          sys.exit(3)
        if how == "os_exit":
          os._exit(4)
        if how == "kill":
          os.kill(os.getpid(), signal.SIGKILL)
        if how == "stop":
          os.kill(os.getpid(), signal.SIGSTOP)
        if how == "return":
          return
      time.sleep(0.01)


if __name__ == "__main__":
  main()
