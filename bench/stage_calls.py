"""#50's step 0 (docs/design/micro_batches_without_clones.md): what a micro-batch costs as a
call of one graph function instead of a clone of the stage's ops -- no epl code involved.

A stage (``--layers`` dense + gelu layers of ``--hidden`` units, its loss and its gradients by
``tf.gradients``) runs ``--micro`` micro-batches per step on one device, built two ways:

* clones: the stage's forward and backward built once per micro-batch (what epl's
  micro_batch pass makes today);
* calls: the same forward and backward one graph function (a ``tf.function`` traced once in
  the TF1 graph: a PartitionedCall op per micro-batch, the weights passed in as values).

Each way sums the micro-batches' gradients and applies them with SGD. Printed: the graph's op
count, the first run (the session's graph set-up included), the steady step (median of
``--steps``), and the two ways' ratios. Usage:

    python bench/stage_calls.py [--micro 16 64] [--layers 6] [--hidden 256] [--rows 4]
                                [--noinline] [--grappler off] [--devices 2]
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np  # noqa: E402
import tensorflow as tf2  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()


def _stage(x, weights, devices=1):
  """The stage's loss; with ``devices`` > 1 its layers spread over that many virtual devices
  (a body whose ops send tensors between devices)."""
  h = x
  for i, w in enumerate(weights):
    with tf.device("/device:CPU:%d" % (1 + i * devices // len(weights)) if devices > 1
                   else None):
      h = tf.matmul(h, w)
      h = 0.5 * h * (1.0 + tf.tanh(0.7978845608 * (h + 0.044715 * h * h * h)))
  return tf.reduce_mean(tf.square(h))


def _build(way, micro, layers, hidden, rows, noinline=False, devices=1):
  graph = tf.Graph()
  with graph.as_default():
    tf.set_random_seed(0)
    weights = [tf.get_variable("w%d" % i, [hidden, hidden],
                               initializer=tf.random_normal_initializer(stddev=hidden ** -0.5))
               for i in range(layers)]
    batch = tf.placeholder(tf.float32, [micro * rows, hidden], name="batch")
    pieces = tf.split(batch, micro)
    values = [tf.identity(w) for w in weights]            # read once, passed to every call
    if way == "calls":
      @tf2.function(autograph=False,
                    experimental_attributes={"_noinline": True} if noinline else None)
      def forward_backward(x, *ws):
        loss = _stage(x, list(ws), devices)
        return [loss] + tf.gradients(loss, list(ws), colocate_gradients_with_ops=True)
      results = [forward_backward(p, *values) for p in pieces]
    else:
      results = []
      for p in pieces:
        loss = _stage(p, values, devices)
        results.append([loss] + tf.gradients(loss, values, colocate_gradients_with_ops=True))
    loss = tf.add_n([r[0] for r in results]) / micro
    grads = [tf.add_n([r[i + 1] for r in results]) / micro for i in range(layers)]
    train = tf.group(*[tf.assign_sub(w, 0.01 * g) for w, g in zip(weights, grads)])
    init = tf.global_variables_initializer()
  return graph, batch, loss, train, init


def measure(way, micro, layers, hidden, rows, steps, noinline=False, grappler=True, devices=1):
  start = time.time()
  graph, batch, loss, train, init = _build(way, micro, layers, hidden, rows, noinline, devices)
  built = time.time() - start
  feed = {batch: np.random.RandomState(0).randn(micro * rows, hidden).astype(np.float32)}
  config = tf.ConfigProto(inter_op_parallelism_threads=2, intra_op_parallelism_threads=2,
                          device_count={"CPU": devices + 1})
  if not grappler:
    config.graph_options.rewrite_options.disable_meta_optimizer = True
  with tf.Session(graph=graph, config=config) as sess:
    sess.run(init)
    start = time.time()
    first_loss = sess.run([loss, train], feed)[0]
    first = time.time() - start
    times = []
    for _ in range(steps):
      start = time.time()
      sess.run(train, feed)
      times.append(time.time() - start)
  return dict(ops=len(graph.get_operations()), build=built, first=first,
              step=statistics.median(times), loss=float(first_loss))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--micro", type=int, nargs="+", default=[16, 64])
  p.add_argument("--layers", type=int, default=6)
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--rows", type=int, default=4)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--noinline", action="store_true",
                 help="mark the function _noinline (Grappler's function optimizer skips it)")
  p.add_argument("--devices", type=int, default=1,
                 help="the stage's layers over this many virtual CPU devices (CPU:1..)")
  p.add_argument("--grappler", choices=("on", "off"), default="on",
                 help="off: the sessions run without Grappler's passes")
  args = p.parse_args(argv)
  print("%-7s %5s %8s %9s %9s %9s %12s" % ("way", "M", "ops", "build s", "1st s", "step s",
                                         "first loss"))
  out = {}
  for micro in args.micro:
    for way in ("clones", "calls"):
      r = out[(way, micro)] = measure(way, micro, args.layers, args.hidden, args.rows,
                                      args.steps, args.noinline, args.grappler == "on",
                                      args.devices)
      print("%-7s %5d %8d %9.2f %9.2f %9.4f %12.6f" % (way, micro, r["ops"], r["build"],
                                                       r["first"], r["step"], r["loss"]))
      sys.stdout.flush()
  for micro in args.micro:
    c, f = out[("clones", micro)], out[("calls", micro)]
    print("M=%d calls / clones: ops %.3f, build %.2f, first run %.2f, steady step %.2f; "
          "losses equal: %s" % (micro, f["ops"] / c["ops"], f["build"] / c["build"],
                                f["first"] / c["first"], f["step"] / c["step"],
                                abs(f["loss"] - c["loss"]) <= 1e-6 * max(1, abs(c["loss"]))))
  if len(args.micro) > 1:
    lo, hi = min(args.micro), max(args.micro)
    for way in ("clones", "calls"):
      print("%s: ops at M=%d / M=%d: %.2f" % (way, hi, lo, out[(way, hi)]["ops"] /
                                              out[(way, lo)]["ops"]))


if __name__ == "__main__":
  main()
