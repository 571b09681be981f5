"""Pipeline efficiency and memory: measured step time vs the ideal, GPipe vs 1F1B memory.

  python bench/pipeline.py [--steps 5] [--forward_ms 20] [--timeline docs/pipeline_timeline]

(a) 4 stages x 8 micro-batches on 4 virtual devices, where each stage's forward and backward
    are fixed wall-time delays (a py_func sleep, so the 2-core machine does not serialise
    compute): measured step time / ideal, ideal = (M + S - 1) x (forward + backward of one
    stage for one micro-batch). Target <= 1.10. Both schedules.
(b) the same pipeline on a model with real activations (wide dense layers, no delays): the
    process's peak allocator bytes during one step, GPipe vs 1F1B, each in a fresh process.
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


def delayed_step_time(strategy, forward_ms, steps, timeline=None):
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
    epl.init(epl.Config({"cluster.devices_per_worker": STAGES,
                         "pipeline.num_micro_batch": MICRO, "pipeline.strategy": strategy}))
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
                          title="%s, %d stages x %d micro-batches" % (strategy, STAGES, MICRO))
  ideal = (MICRO + STAGES - 1) * (f + b)
  return statistics.median(times), ideal


def peak_memory(strategy):
  """Runs in a fresh process: peak allocator bytes of one training step."""
  import numpy as np
  import tensorflow.compat.v1 as tf
  import epl
  tf.disable_v2_behavior()
  graph = tf.Graph()
  with graph.as_default():
    epl.init(epl.Config({"cluster.devices_per_worker": STAGES,
                         "pipeline.num_micro_batch": MICRO, "pipeline.strategy": strategy}))
    x = tf.placeholder(tf.float32, [None, 256])
    h = x
    for s in range(STAGES):
      with epl.replicate(1, name="stage_%d" % s):
        for i in range(3):
          h = tf.layers.dense(h, 1024, activation=tf.nn.relu, name="s%d_%d" % (s, i))
        h = tf.layers.dense(h, 256, name="s%d_out" % s)
    loss = tf.reduce_mean(tf.square(h))
    train = tf.train.GradientDescentOptimizer(0.01).minimize(loss)
    feed = {x: np.ones([MICRO * 256, 256], np.float32)}
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(train, feed)
      tf.config.experimental.reset_memory_stats("CPU:0")
      sess.run(train, feed)
      return tf.config.experimental.get_memory_info("CPU:0")["peak"]


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--forward_ms", type=float, default=20)
  p.add_argument("--timeline", default="")
  p.add_argument("--memory_worker", default="")
  args = p.parse_args()
  if args.memory_worker:
    print(json.dumps({"peak": peak_memory(args.memory_worker)}))
    return
  print("(a) %d stages x %d micro-batches, forward %.0f ms / backward %.0f ms per stage and "
        "micro-batch:" % (STAGES, MICRO, args.forward_ms, 2 * args.forward_ms))
  for strategy in ("PreferBackward", "PreferForward"):
    measured, ideal = delayed_step_time(
        strategy, args.forward_ms, args.steps,
        args.timeline if strategy == "PreferBackward" and args.timeline else None)
    print("    %-15s step %.3f s, ideal %.3f s, ratio %.3f (target <= 1.10)" % (
        strategy, measured, ideal, measured / ideal))
  peaks = {}
  for strategy in ("PreferForward", "PreferBackward"):
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_ENABLE_ONEDNN_OPTS="0")
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--memory_worker",
                          strategy], env=env, capture_output=True, text=True, timeout=600)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if not lines:
      raise RuntimeError(out.stderr[-3000:])
    peaks[strategy] = json.loads(lines[-1])["peak"]
  print("(b) peak allocator bytes of one step, 4 stages x 8 micro-batches of 256 x 1024 "
        "activations: GPipe %.1f MiB, 1F1B %.1f MiB, ratio 1F1B/GPipe %.2f" % (
            peaks["PreferForward"] / 2**20, peaks["PreferBackward"] / 2**20,
            peaks["PreferBackward"] / peaks["PreferForward"]))
  if args.timeline:
    print("timeline: %s.json, %s.png" % (args.timeline, args.timeline))


if __name__ == "__main__":
  main()
