"""Gradient communication across 2 worker processes: fused vs unfused, float16 on the wire.

Two gradient sets, each a model whose compute is negligible (loss = sum of weight * input),
so the step time is the gradient sync:
  small       200 gradients of 64 floats each (biases, layer norms)
  bert-like   the tensors of a 12-layer BERT encoder at hidden 384 (half BERT-base's width,
              a quarter of its vocabulary: 172 tensors, ~24.4M floats)

For each: the step time with fused buckets (communication.max_splits 5, the default), with
one all-reduce per gradient (max_splits = the number of gradients), and with fused float16
buckets (communication.fp16), plus the bytes the cross-worker all-reduces carry per step.

usage: python bench/comm.py [--steps 30]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from dp_scaling import free_ports      # bench/ is this script's directory

HIDDEN = 384


def gradient_set(name):
  if name == "small":
    return [[64]] * 200
  shapes = [[30522 // 4, HIDDEN], [512, HIDDEN], [HIDDEN], [HIDDEN]]
  for _ in range(12):
    shapes += [[HIDDEN, HIDDEN], [HIDDEN]] * 4 + [[HIDDEN], [HIDDEN]]
    shapes += [[HIDDEN, 4 * HIDDEN], [4 * HIDDEN], [4 * HIDDEN, HIDDEN], [HIDDEN]]
  return shapes


def worker(args):
  import numpy as np
  import tensorflow.compat.v1 as tf
  tf.disable_v2_behavior()
  import epl
  epl.init()
  shapes = gradient_set(args.set)
  with epl.replicate(1):
    loss = 0.0
    for i, shape in enumerate(shapes):
      w = tf.get_variable("w%d" % i, shape, initializer=tf.zeros_initializer())
      loss += tf.reduce_sum(w * tf.constant(np.full(shape, 1e-3, np.float32)))
  train = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
  with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    for _ in range(5):
      sess.run(train)
    times = []
    for _ in range(args.steps):
      start = time.perf_counter()
      sess.run(train)
      times.append(time.perf_counter() - start)
    graph = tf.get_default_graph()
    reduces = [op for op in graph.get_operations() if op.type == "CollectiveReduceV2"]
    wire = sum(op.inputs[0].shape.num_elements() * op.inputs[0].dtype.size for op in reduces)
  print(json.dumps({"step_ms": statistics.median(times) * 1e3, "collectives": len(reduces),
                    "wire_bytes": wire}))


def run_pair(args, gradients, env):
  hosts = ["localhost:%d" % p for p in free_ports(2)]
  procs = []
  for i in range(2):
    full = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="",
                PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                TF_CONFIG=json.dumps({"cluster": {"worker": hosts},
                                      "task": {"type": "worker", "index": i}}),
                EPL_CLUSTER_DEVICES_PER_WORKER="1", EPL_LOG_LEVEL="warning",
                EPL_LOG_PROGRESS_SECS="0", **env)
    procs.append(subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", "--set", gradients,
         "--steps", str(args.steps)], env=full, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True))
  results = []
  for p in procs:
    out, err = p.communicate(timeout=600)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
      raise RuntimeError("worker failed:\n%s" % err[-3000:])
    results.append(json.loads(lines[-1]))
  return max(r["step_ms"] for r in results), results[0]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--worker", action="store_true")
  parser.add_argument("--set", default="small")
  args = parser.parse_args()
  if args.worker:
    return worker(args)
  print("2 worker processes x 1 device, median of %d steps" % args.steps)
  for gradients in ("small", "bert-like"):
    n = len(gradient_set(gradients))
    fused_ms, fused = run_pair(args, gradients, {})
    unfused_ms, unfused = run_pair(args, gradients,
                                   {"EPL_COMMUNICATION_MAX_SPLITS": str(n)})
    half_ms, half = run_pair(args, gradients, {"EPL_COMMUNICATION_FP16": "true"})
    print("  %s (%d gradients)" % (gradients, n))
    print("    unfused  %3d all-reduces  %8.2f ms/step  %10d bytes on the wire" % (
        unfused["collectives"], unfused_ms, unfused["wire_bytes"]))
    print("    fused    %3d all-reduces  %8.2f ms/step  %10d bytes on the wire" % (
        fused["collectives"], fused_ms, fused["wire_bytes"]))
    print("    fp16     %3d all-reduces  %8.2f ms/step  %10d bytes on the wire" % (
        half["collectives"], half_ms, half["wire_bytes"]))
    print("    fused / unfused speed-up %.1fx (target >= 3x for the small set); fp16 / fp32 "
          "bytes %.2f, time %.2f" % (unfused_ms / fused_ms, half["wire_bytes"] /
                                     fused["wire_bytes"], half_ms / fused_ms))


if __name__ == "__main__":
  main()
