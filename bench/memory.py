"""Memory passes vs the baseline: bytes per device and step time, measured in one run.

  offload      offload.level v0 vs none: a 4 x 1024 MLP with Adam, data parallel on 2
               virtual devices: the variables each device holds between steps, the traced
               step peak per device, the step time
  apply groups optimizer.num_apply_group 4 vs 1: the same MLP with a hand-written Adam (the
               update as plain ops, BERT-style) on 1 device: the step peak, the step time

Memory is epl.memory.measure (variables = bytes the variables hold on the device; step peak =
the traced peak of one step's allocations on it). Gradient checkpointing and ZeRO are not
built yet (issue 12).

usage: python bench/memory.py [--width 1024] [--layers 4] [--batch 256] [--steps 10]
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

MiB = 1024.0 ** 2


class HandWrittenAdam(tf.train.Optimizer):
  """BERT's AdamWeightDecayOptimizer in spirit: slots by get_variable, the update as ops."""

  def __init__(self, lr):
    super().__init__(False, "HandWrittenAdam")
    self.lr = lr

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    updates = []
    for grad, var in grads_and_vars:
      m = tf.get_variable(var.op.name + "/adam_m", var.shape, trainable=False,
                          initializer=tf.zeros_initializer())
      v = tf.get_variable(var.op.name + "/adam_v", var.shape, trainable=False,
                          initializer=tf.zeros_initializer())
      next_m = 0.9 * m + 0.1 * grad
      next_v = 0.999 * v + 0.001 * tf.square(grad)
      update = next_m / (tf.sqrt(next_v) + 1e-6) + 0.01 * var
      updates += [var.assign(var - self.lr * update), m.assign(next_m), v.assign(next_v)]
    with tf.control_dependencies(updates):
      return global_step.assign_add(1)


def run(args, devices, keys, optimizer):
  graph = tf.Graph()
  with graph.as_default():
    epl.init(epl.Config(dict({"cluster.devices_per_worker": devices, "log.level": "warning",
                              "log.progress_secs": 0}, **keys)))
    x = tf.placeholder(tf.float32, [None, args.width])
    y = tf.placeholder(tf.int64, [None])
    with epl.replicate(1, name="model"):
      h = x
      for i in range(args.layers):
        h = tf.layers.dense(h, args.width, activation=tf.nn.relu, name="dense_%d" % i)
      loss = tf.losses.sparse_softmax_cross_entropy(y, tf.layers.dense(h, 10, name="logits"))
    step = tf.train.get_or_create_global_step()
    opt = HandWrittenAdam(1e-3) if optimizer == "hand" else tf.train.AdamOptimizer(1e-3)
    train = opt.minimize(loss, global_step=step)
    rng = np.random.RandomState(0)
    feed = {x: rng.randn(args.batch, args.width).astype(np.float32),
            y: rng.randint(0, 10, args.batch)}
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      for _ in range(3):
        sess.run(train, feed)
      start = time.perf_counter()
      for _ in range(args.steps):
        sess.run(train, feed)
      seconds = (time.perf_counter() - start) / args.steps
      report = epl.memory.measure(sess, train, feed)
  return seconds, report


def _devices(report):
  return [d for d in report.devices() if not d.endswith("CPU:0") and d.startswith("/")]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--width", type=int, default=1024)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--steps", type=int, default=10)
  args = parser.parse_args()
  print("MLP %d x %d, batch %d, %d timed steps" % (args.layers, args.width, args.batch,
                                                   args.steps))

  base_t, base = run(args, 2, {}, "adam")
  off_t, off = run(args, 2, {"offload.level": "v0"}, "adam")
  print("\noffload, data parallel on 2 devices, Adam")
  print("  baseline: %.1f ms/step\n%s" % (base_t * 1e3, base))
  print("  offload v0: %.1f ms/step\n%s" % (off_t * 1e3, off))
  held = [base.held(d) for d in _devices(base)]
  held_off = [off.held(d) for d in _devices(off)]
  print("  variables per device: %.1f MiB -> %.1f MiB; host %.1f MiB; step time x%.2f" % (
      max(held) / MiB, max(held_off) / MiB,
      max(off.held(d) for d in off.devices() if d.endswith("CPU:0")) / MiB, off_t / base_t))

  one_t, one = run(args, 1, {}, "hand")
  four_t, four = run(args, 1, {"optimizer.num_apply_group": 4}, "hand")
  peak = lambda r: max(r.peak(d) for d in r.devices())    # noqa: E731
  print("\napply groups, 1 device, hand-written Adam")
  print("  1 group : step peak %.1f MiB, %.1f ms/step" % (peak(one) / MiB, one_t * 1e3))
  print("  4 groups: step peak %.1f MiB, %.1f ms/step" % (peak(four) / MiB, four_t * 1e3))
  print("  ratio 4 groups / 1: step peak %.2f, step time %.2f" % (peak(four) / peak(one),
                                                                   four_t / one_t))
  print("\ngradient checkpointing, ZeRO: not built yet")


if __name__ == "__main__":
  main()
