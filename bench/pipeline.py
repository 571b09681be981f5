"""Pipeline efficiency and memory: measured step time vs the ideal, GPipe vs 1F1B memory.

  python bench/pipeline.py [--steps 5] [--forward_ms 20] [--micro 8] [--memory-micro 8]
                           [--micro-batches auto|functions|clones]
                           [--timeline docs/pipeline_timeline]

(a) 4 stages x M micro-batches (``--micro``, a list: 16,64) on 4 virtual devices, where each
    stage's forward and backward are fixed wall-time delays (a py_func sleep, so the 2-core
    machine does not serialise compute): measured step time / ideal, ideal = (M + S - 1) x
    (forward + backward of one stage for one micro-batch). Target <= 1.10. Both schedules.
(b) the same pipeline on a model with real activations (wide dense layers, no delays), at
    each M of ``--memory-micro``: the process's peak allocator bytes during one step, and
    epl.memory's largest per-device step peak (the buffers held between a stage's actions:
    its saved activations), GPipe vs 1F1B, each in a fresh process; 1F1B's should not grow
    with M (it holds at most S micro-batches per stage), GPipe's grows with M.
``--micro-batches`` sets graph.micro_batches (auto: stage functions on these pipelines).
With --timeline PREFIX it also writes PREFIX.json (chrome trace) and PREFIX.png of one
PreferBackward step.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

STAGES, MICRO = 4, 8


def delayed_step_time(strategy, forward_ms, steps, timeline=None, micro=MICRO, mode="auto"):
  import numpy as np
  import tensorflow.compat.v1 as tf
  import epl
  tf.disable_v2_behavior()
  f, b = forward_ms / 1e3, 2 * forward_ms / 1e3

  def sleeper(seconds):
    def run(x):
      time.sleep(seconds)
      return x
    return run

  @tf.custom_gradient
  def delay(x):
    y = tf.py_func(sleeper(f), [x], tf.float32, stateful=True)
    y.set_shape(x.shape)

    def grad(dy):
      g = tf.py_func(sleeper(b), [dy], tf.float32, stateful=True)
      g.set_shape(dy.shape)
      return g
    return y, grad

  graph = tf.Graph()
  with graph.as_default():
    epl.init(epl.Config({"cluster.devices_per_worker": STAGES, "graph.micro_batches": mode,
                         "pipeline.num_micro_batch": micro, "pipeline.strategy": strategy}))
    data = np.random.RandomState(0).randn(64, 4).astype(np.float32)
    x = tf.data.make_one_shot_iterator(
        tf.data.Dataset.from_tensor_slices(data).batch(2).repeat()).get_next()
    h = x
    for s in range(STAGES):
      with epl.replicate(1, name="stage_%d" % s):
        h = delay(tf.layers.dense(h, 4, name="d%d" % s))
    loss = tf.reduce_mean(h)
    train = tf.train.GradientDescentOptimizer(0.01).minimize(loss)
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(train)
      times = []
      for _ in range(steps):
        t = time.perf_counter()
        sess.run(train)
        times.append(time.perf_counter() - t)
      if timeline:
        meta = tf.RunMetadata()
        sess.run(train, options=tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE),
                 run_metadata=meta)
        epl.timeline.save(meta, epl.Graph.get(), timeline + ".json", timeline + ".png",
                          title="%s, %d stages x %d micro-batches" % (strategy, STAGES, micro))
  ideal = (micro + STAGES - 1) * (f + b)
  return statistics.median(times), ideal


def peak_memory(strategy, micro=MICRO, mode="auto", rows=64):
  """Runs in a fresh process: (peak allocator bytes of one training step, epl.memory's
  largest per-device step peak)."""
  import numpy as np
  import tensorflow.compat.v1 as tf
  import epl
  tf.disable_v2_behavior()
  graph = tf.Graph()
  with graph.as_default():
    epl.init(epl.Config({"cluster.devices_per_worker": STAGES, "graph.micro_batches": mode,
                         "pipeline.num_micro_batch": micro, "pipeline.strategy": strategy}))
    x = tf.placeholder(tf.float32, [None, 256])
    h = x
    for s in range(STAGES):
      with epl.replicate(1, name="stage_%d" % s):
        for i in range(3):
          h = tf.layers.dense(h, 1024, activation=tf.nn.relu, name="s%d_%d" % (s, i))
        h = tf.layers.dense(h, 256, name="s%d_out" % s)
    loss = tf.reduce_mean(tf.square(h))
    train = tf.train.GradientDescentOptimizer(0.01).minimize(loss)
    feed = {x: np.ones([micro * rows, 256], np.float32)}
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(train, feed)
      tf.config.experimental.reset_memory_stats("CPU:0")
      sess.run(train, feed)
      peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
      report = epl.memory.measure(sess, train, feed_dict=feed)
      return peak, max(report.peaks.values())


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--forward_ms", type=float, default=20)
  p.add_argument("--timeline", default="")
  p.add_argument("--memory_worker", default="")
  p.add_argument("--micro", default=str(MICRO), help="micro-batches per step, a list: 16,64")
  p.add_argument("--memory-micro", default=str(MICRO),
                 help="micro-batches of the memory runs (b), a list: 16,64")
  p.add_argument("--micro-batches", default="auto", choices=["auto", "functions", "clones"])
  args = p.parse_args()
  if args.memory_worker:
    strategy, micro = args.memory_worker.split(":")
    peak, held = peak_memory(strategy, int(micro), args.micro_batches)
    print(json.dumps({"peak": peak, "held": held}))
    return
  for micro in [int(m) for m in args.micro.split(",")]:
    print("(a) %d stages x %d micro-batches (%s), forward %.0f ms / backward %.0f ms per stage "
          "and micro-batch:" % (STAGES, micro, args.micro_batches, args.forward_ms,
                                2 * args.forward_ms))
    for strategy in ("PreferBackward", "PreferForward"):
      measured, ideal = delayed_step_time(
          strategy, args.forward_ms, args.steps,
          args.timeline if strategy == "PreferBackward" and args.timeline else None, micro,
          args.micro_batches)
      print("    %-15s step %.3f s, ideal %.3f s, ratio %.3f (target <= 1.10)" % (
          strategy, measured, ideal, measured / ideal), flush=True)
  for micro in [int(m) for m in args.memory_micro.split(",")]:
    peaks = {}
    for strategy in ("PreferForward", "PreferBackward"):
      env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_ENABLE_ONEDNN_OPTS="0")
      out = subprocess.run([sys.executable, os.path.abspath(__file__), "--memory_worker",
                            "%s:%d" % (strategy, micro), "--micro-batches", args.micro_batches],
                           env=env, capture_output=True, text=True, timeout=1200)
      lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
      if not lines:
        raise RuntimeError(out.stderr[-3000:])
      peaks[strategy] = json.loads(lines[-1])
    g, f = peaks["PreferForward"], peaks["PreferBackward"]
    print("(b) M=%d, 4 stages, micro-batches of 64 x 1024 activations: allocator peak GPipe "
          "%.1f MiB, 1F1B %.1f MiB (1F1B/GPipe %.2f); epl.memory's largest device step peak "
          "GPipe %.1f MiB, 1F1B %.1f MiB" % (
              micro, g["peak"] / 2**20, f["peak"] / 2**20, f["peak"] / g["peak"],
              g["held"] / 2**20, f["held"] / 2**20), flush=True)
  if args.timeline:
    print("timeline: %s.json, %s.png" % (args.timeline, args.timeline))


if __name__ == "__main__":
  main()
