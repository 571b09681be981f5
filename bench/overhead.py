"""epl's overhead: (a) step time vs plain TF, (b) rewrite time vs graph size, (c) the cost of
a host -> device hop with one device.

  python bench/overhead.py [--repeats 31] [--steps 200] [--sizes 2500,5000,10500]

(a) an MLP fed by a dataset iterator, with a ~0.5 ms step (the quick-start model, batch 10)
    and a ~10 ms step (3 x 512 wide, batch 448): epl with one replica (``replicate(1)`` on one
    device) vs the plain TF script; medians of interleaved repeats of ``--steps`` steps each.
    Target: ratio <= 1.02.
(b) a BERT-base-like stack of dense + layer-norm blocks trained with Adam, rewritten into 4
    replicas; seconds for the rewrite at several op counts. Target: < 10 s at ~10k ops.
(c) the same two models in plain TF with the model on a second CPU device (``CPU:1``) while the
    iterator stays on ``CPU:0`` -- where epl used to put a lone device whenever it placed ops
    explicitly (several workers, micro-batches); epl now uses ``CPU:0`` itself.
"""
import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

import epl  # noqa: E402
from epl.entry import _state  # noqa: E402
from epl.runtime import driver  # noqa: E402

tf.disable_v2_behavior()


SIZES = {"~0.5 ms": dict(batch=10, widths=(2,), features=20),
         "~10 ms": dict(batch=448, widths=(512, 512, 512), features=512)}


def quickstart_session(use_epl, size="~0.5 ms", model_device=None, progress=True):
  """The model of ``size`` trained with momentum; ``model_device`` pins the model (plain TF)."""
  shape = SIZES[size]
  g = tf.Graph()
  with g.as_default():
    if use_epl:
      epl.init(epl.Config({"cluster.devices_per_worker": 1,
                           "log.progress_secs": 30 if progress else 0}))
      epl.set_default_strategy(epl.replicate(1))
    rng = np.random.RandomState(0)
    num_x = rng.randint(0, 10, (500, shape["features"])).astype(np.float32)
    num_y = rng.randint(0, 10, 500).astype(np.int64)
    ds = tf.data.Dataset.from_tensor_slices((num_x, num_y)).batch(shape["batch"]).repeat()
    x, labels = tf.data.make_one_shot_iterator(ds).get_next()
    with tf.device(model_device):
      h = x
      for width in shape["widths"]:
        h = tf.layers.dense(h, width, activation=tf.nn.relu if width > 2 else None)
      logits = tf.layers.dense(h, 10)
      loss = tf.losses.sparse_softmax_cross_entropy(labels=labels, logits=logits)
    step = tf.train.get_or_create_global_step()
    train = tf.train.MomentumOptimizer(0.001, 0.9).minimize(
        loss, global_step=step, colocate_gradients_with_ops=True)
    config = tf.ConfigProto(device_count={"CPU": 2}) if model_device else None
    sess = tf.Session(config=config)
    sess.run(tf.global_variables_initializer())
  fetches = [loss, train, step]
  for _ in range(50):                                   # warm-up
    sess.run(fetches)
  return sess, fetches


def time_steps(sess, fetches, steps):
  start = time.perf_counter()
  for _ in range(steps):
    sess.run(fetches)
  return (time.perf_counter() - start) / steps


def interleaved(sessions, repeats, steps):
  """Median seconds per step of each (sess, fetches), measured in interleaved repeats."""
  times = [[] for _ in sessions]
  for _ in range(repeats):
    for i, s in enumerate(sessions):
      times[i].append(time_steps(*s, steps))
  return [statistics.median(t) for t in times]


def step_overhead(repeats, steps):
  print("(a) step time, epl (1 replica, 1 device) vs plain TF, %d interleaved repeats:" % repeats)
  for size in SIZES:
    n = steps if size == "~0.5 ms" else max(10, steps // 20)
    mp, me, mq = interleaved([quickstart_session(False, size), quickstart_session(True, size),
                              quickstart_session(True, size, progress=False)], repeats, n)
    print("    %-7s step: plain TF %8.1f us, epl %8.1f us, ratio epl/plain = %.3f "
          "(target <= 1.02); without the progress counter (log.progress_secs 0) %8.1f us, "
          "ratio %.3f" % (size, mp * 1e6, me * 1e6, me / mp, mq * 1e6, mq / mp))


def device_hop(repeats, steps):
  print("(c) one device: model on CPU:0 (epl now) vs on a second CPU device (epl before):")
  for size in SIZES:
    n = steps if size == "~0.5 ms" else max(10, steps // 20)
    same, hop = interleaved([quickstart_session(False, size),
                             quickstart_session(False, size, "/device:CPU:1")], repeats, n)
    print("    %-7s step: CPU:0 %8.1f us, CPU:1 %8.1f us, the hop costs %.1f us (ratio %.3f)"
          % (size, same * 1e6, hop * 1e6, (hop - same) * 1e6, hop / same))


def bert_like(layers, hidden=64, ffn=256):
  x = tf.placeholder(tf.float32, [None, 16, hidden], name="x")
  h = x
  for i in range(layers):
    with tf.variable_scope("layer_%d" % i):
      q = tf.layers.dense(h, hidden, name="q")
      k = tf.layers.dense(h, hidden, name="k")
      v = tf.layers.dense(h, hidden, name="v")
      att = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / 8.0)
      a = tf.layers.dense(tf.matmul(att, v), hidden, name="o")
      h = tf.keras.layers.LayerNormalization(name="ln1")(h + a)
      f = tf.layers.dense(tf.layers.dense(h, ffn, activation=tf.nn.relu, name="f1"), hidden,
                          name="f2")
      h = tf.keras.layers.LayerNormalization(name="ln2")(h + f)
  loss = tf.reduce_mean(tf.square(h))
  tf.train.AdamOptimizer(1e-3).minimize(loss, global_step=tf.train.get_or_create_global_step())


def rewrite_time(target_ops, replicas=4):
  counts = []
  for n in (1, 2):                  # ops per layer and fixed ops, to size the graph
    g = tf.Graph()
    with g.as_default():
      bert_like(n)
      counts.append(len(g.get_operations()))
  per_layer = counts[1] - counts[0]
  layers = max(1, round((target_ops - (counts[0] - per_layer)) / per_layer))
  g = tf.Graph()
  with g.as_default():
    epl.init(epl.Config({"cluster.devices_per_worker": replicas}))
    epl.set_default_strategy(epl.replicate(1))
    bert_like(layers)
    ops_before = len(g.get_operations())
    start = time.perf_counter()
    driver.rewrite(_state())
    seconds = time.perf_counter() - start
    ops_after = len(g.get_operations())
  return ops_before, ops_after, seconds


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--repeats", type=int, default=31)
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--sizes", default="2500,5000,10500")
  args = p.parse_args()
  step_overhead(args.repeats, args.steps)
  device_hop(args.repeats, args.steps)
  print("(b) rewrite time, BERT-like dense + layer-norm stack, Adam, 4 replicas:")
  rows = []
  for size in [int(s) for s in args.sizes.split(",")]:
    before, after, seconds = rewrite_time(size)
    rows.append((before, seconds))
    print("    %6d ops -> %6d ops after rewrite: %.2f s (%.0f us per input op)" % (
        before, after, seconds, seconds / before * 1e6))
  if len(rows) > 1:
    (n0, t0), (n1, t1) = rows[0], rows[-1]
    print("    growth: %.1fx ops -> %.1fx time (target < 10 s at ~10k ops)" % (n1 / n0, t1 / t0))


if __name__ == "__main__":
  main()
