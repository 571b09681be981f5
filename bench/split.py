"""Split vs data parallel for a large classifier: memory per device and step time.

A 100,000-class classifier on 512 features (a replicated 512 -> 512 trunk before it),
Momentum, on 4 virtual devices, the same global batch either way:

  data parallel   every device holds the whole model and computes 1/4 of the batch; the
                  classifier's gradient (100k x 512 floats) is all-reduced every step
  split           epl.replicate(4) trunk + epl.split(4) classifier, colocated: each device
                  holds a quarter of the classifier and its slot, and computes its classes
                  for the whole batch; only activations and their gradients cross

Prints the variables held and the traced step peak per device (epl.memory), the step time,
and the ratios split / data parallel.

usage: python bench/split.py [--classes 100000] [--dim 512] [--batch 128] [--steps 5]
"""
import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()

import epl  # noqa: E402

DEVICES = 4


def run(mode, args):
  graph = tf.Graph()
  with graph.as_default():
    epl.init(epl.Config({"cluster.devices_per_worker": DEVICES,
                         "cluster.colocate_split_and_replicate": True,
                         "log.level": "warning"}))
    features = tf.placeholder(tf.float32, [None, args.dim])
    labels = tf.placeholder(tf.int64, [None])
    trunk = epl.replicate(DEVICES if mode == "split" else 1, name="trunk")
    with trunk:
      h = tf.layers.dense(features, args.dim, activation=tf.nn.relu)
    head = epl.split(DEVICES, name="classifier") if mode == "split" else \
        epl.replicate(1, name="trunk")
    with head:
      logits = tf.layers.dense(h, args.classes)
      loss = tf.losses.sparse_softmax_cross_entropy(labels, logits)
    train = tf.train.MomentumOptimizer(0.01, 0.9).minimize(loss)
    rng = np.random.RandomState(0)
    feed = {features: rng.randn(args.batch, args.dim).astype(np.float32),
            labels: rng.randint(0, args.classes, args.batch)}
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      for _ in range(2):
        sess.run(train, feed)
      start = time.perf_counter()
      for _ in range(args.steps):
        sess.run(train, feed)
      step = (time.perf_counter() - start) / args.steps
      memory = epl.memory.measure(sess, train, feed)
  return step, memory


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--classes", type=int, default=100000)
  parser.add_argument("--dim", type=int, default=512)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--steps", type=int, default=5)
  args = parser.parse_args()
  print("%d classes x %d features, global batch %d, %d virtual devices, Momentum" % (
      args.classes, args.dim, args.batch, DEVICES))
  results = {}
  for mode in ("data parallel", "split"):
    step, memory = run("split" if mode == "split" else "dp", args)
    results[mode] = (step, memory)
    print("\n%s: %.3f s/step\n%s" % (mode, step, memory))
  (dp_step, dp_mem), (sp_step, sp_mem) = results["data parallel"], results["split"]
  devices = [d for d in sp_mem.devices() if not d.endswith("CPU:0")]
  held = max(sp_mem.held(d) for d in devices) / max(dp_mem.held(d) for d in devices)
  peak = max(sp_mem.total(d) for d in devices) / max(dp_mem.total(d) for d in devices)
  print("\nsplit / data parallel: variables per device %.3f, variables + step peak per "
        "device %.3f, step time %.3f" % (held, peak, sp_step / dp_step))


if __name__ == "__main__":
  main()
