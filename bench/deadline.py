"""What each way of bounding a collective's wait costs (issue 7's choice, measured).

  python bench/deadline.py [--steps 3000]

One process, 2 virtual CPU devices, a TF collective all-reduce of 64 floats per step (the
cheapest step, so any per-step cost shows), run three ways:

  (a) no bound at all (a dead peer would hang the step forever);
  (b) TF's per-op collective timeout (``timeout=300`` on the op, what epl did before);
  (c) a per-step deadline, ``RunOptions.timeout_in_ms`` (what epl's run hook sets now).

Prints the step time and the process's thread count after the steps. (c) also covers
cross-worker steps, where a per-op timeout costs the same thread per launch.
"""
import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import tensorflow.compat.v1 as tf  # noqa: E402
from tensorflow.python.ops import collective_ops  # noqa: E402

tf.disable_v2_behavior()


def threads():
  return len(os.listdir("/proc/self/task"))


def measure(steps, per_op_timeout, deadline, key):
  graph = tf.Graph()
  with graph.as_default():
    outs = []
    for d in (1, 2):
      with tf.device("/device:CPU:%d" % d):
        x = tf.Variable(tf.ones([64]))
        outs.append(collective_ops.all_reduce_v2(
            x, group_size=2, group_key=key, instance_key=key, merge_op="Add", final_op="Id",
            communication_hint="ring", timeout=per_op_timeout))
    config = tf.ConfigProto(device_count={"CPU": 3}, use_per_session_threads=True,
                            inter_op_parallelism_threads=4)
    options = tf.RunOptions(timeout_in_ms=300000) if deadline else None
    with tf.Session(graph=graph, config=config) as sess:
      sess.run(tf.global_variables_initializer())
      for _ in range(50):
        sess.run(outs, options=options)
      start = time.perf_counter()
      for _ in range(steps):
        sess.run(outs, options=options)
      took = (time.perf_counter() - start) / steps
      return took, threads()


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=3000)
  args = parser.parse_args()
  print("%d steps of a 2-device collective all-reduce (64 floats), one process:" % args.steps)
  print("  threads at start: %d" % threads())
  # (b) last: its threads outlive its steps by the timeout and would count in later rows
  rows = [("(a) no bound", 0, False), ("(c) step deadline (RunOptions)", 0, True),
          ("(b) per-op timeout=300 s", 300, False)]
  results = {}
  for i, (name, per_op, deadline) in enumerate(rows):
    took, count = measure(args.steps, per_op, deadline, 100 + i)
    results[name] = took
    print("  %-32s %7.1f us/step, %6d threads after" % (name, took * 1e6, count))
  base = results[rows[0][0]]
  for name, _, _ in rows[1:]:
    print("  %s / (a): step time x%.2f" % (name.split(")")[0] + ")", results[name] / base))


if __name__ == "__main__":
  main()
