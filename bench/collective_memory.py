"""Does a worker's memory grow with TensorFlow's cross-process collectives alone (no epl)?

usage:
  python bench/collective_memory.py [--seconds 600] [--interval 30] [--modes allreduce,local]
                                    [--elements 100000] [--timeout-ms 0]

Each mode starts 2 worker processes (``tf.train.Server`` on localhost, between-graph: each
worker its own graph and ``Session(server.target)``), runs one training step in a loop at full
speed for ``--seconds``, and samples the process's RSS and glibc's heap in use
(``mallinfo2``: ``uordblks + hblkhd``) every ``--interval`` seconds:

  allreduce  w -= lr * all_reduce_v2(w * 0.5) on the ring across the 2 workers (a data-parallel
             step's collective, on ``--elements`` float32)
  local      the same step with no collective (w -= lr * w * 0.5): what the session, the server
             and the step loop cost by themselves

``--timeout-ms``: put ``RunOptions.timeout_in_ms`` on every step (epl does, for the collective
timeout). The environment passes to the workers: run under ``MALLOC_ARENA_MAX=2`` or
``LD_PRELOAD=libjemalloc.so.2`` to compare allocators (the heap columns are then jemalloc's
allocated bytes). The modes run one after another (each alone on the machine). The only epl piece in the
workers is its request-id hook (without it TF rejects a repeated RunGraph id within minutes
at full speed and the run ends). It prints, per mode
and worker, the growth over the second half (MB a minute and bytes a step) of RSS and of the
heap in use: RSS growing with the heap flat is the allocator keeping freed memory; both
growing is memory held by live allocations.
"""
import argparse
import ctypes
import json
import os
import subprocess
import sys
import time


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _MallInfo2(ctypes.Structure):
  _fields_ = [(name, ctypes.c_size_t) for name in (
      "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
      "fordblks", "keepcost")]


def _jemalloc():
  """(allocated, resident) bytes from jemalloc's statistics when it is the process's malloc
  (``LD_PRELOAD=libjemalloc.so.2``), else None."""
  try:
    mallctl = ctypes.CDLL(None).mallctl
  except AttributeError:
    return None
  epoch = ctypes.c_uint64(1)
  mallctl(b"epoch", None, None, ctypes.byref(epoch), ctypes.c_size_t(8))
  out = []
  for name in (b"stats.allocated", b"stats.resident"):
    value, size = ctypes.c_size_t(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_size_t))
    if mallctl(name, ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0)):
      return None
    out.append(value.value)
  return tuple(out)


def memory():
  """(RSS MB, heap in use MB, heap held from the system MB) of this process: glibc's
  (``mallinfo2``), or jemalloc's (allocated, resident) when it is preloaded."""
  with open("/proc/self/status") as f:
    rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
  jemalloc = _jemalloc()
  if jemalloc is not None:
    return rss_kb / 1024.0, jemalloc[0] / 2.0 ** 20, jemalloc[1] / 2.0 ** 20
  try:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    m = libc.mallinfo2()
    in_use, held = m.uordblks + m.hblkhd, m.arena + m.hblkhd
  except (OSError, AttributeError):          # not glibc, or older than 2.33
    in_use = held = 0
  return rss_kb / 1024.0, in_use / 2.0 ** 20, held / 2.0 ** 20


def worker(args):
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import tensorflow.compat.v1 as tf
  from tensorflow.python.ops import collective_ops
  tf.disable_v2_behavior()
  # the one epl piece: TF's own RunGraph request ids repeat (birthday bound) and TF's rejection
  # of the repeat ends a run at full speed within minutes (docs/architecture.md)
  sys.path.insert(0, ROOT)
  from epl._tf_compat import native
  native.unique_request_ids()
  if args.release:       # epl's other hook: TF no longer keeps rendezvous aborted at cleanup
    native.release_aborted_rendezvous()
  hosts = args.hosts.split(",")
  config = tf.ConfigProto()
  config.experimental.collective_group_leader = "/job:worker/replica:0/task:%d" % args.leader
  server = tf.train.Server(tf.train.ClusterSpec({"worker": hosts}), job_name="worker",
                           task_index=args.index, config=config)
  with tf.device("/job:worker/task:%d/device:CPU:0" % args.index):
    w = tf.get_variable("w", [args.elements], initializer=tf.ones_initializer())
    grad = w * 0.5
    if args.mode == "allreduce":
      grad = collective_ops.all_reduce_v2(grad, group_size=len(hosts), group_key=1,
                                          instance_key=1, merge_op="Add", final_op="Id",
                                          communication_hint="ring")
    step = w.assign_sub(1e-6 * grad).op
  session_config = tf.ConfigProto(device_filters=["/job:worker/task:%d" % args.index])
  session_config.experimental.collective_group_leader = "/job:worker/replica:0/task:%d" % args.leader
  options = tf.RunOptions(timeout_in_ms=args.timeout_ms) if args.timeout_ms else None
  with tf.Session(server.target, config=session_config) as sess:
    sess.run(tf.global_variables_initializer())
    for _ in range(200):                    # warm up: caches, pools, first allocations
      sess.run(step, options=options)
    start, runs, samples, next_sample = time.time(), 0, [], 0.0
    while True:
      now = time.time() - start
      if now >= next_sample:
        rss, in_use, held = memory()
        samples.append({"t": round(now, 1), "runs": runs, "rss_mb": round(rss, 2),
                        "heap_mb": round(in_use, 2), "held_mb": round(held, 2),
                        "pinned": native.pinned_rendezvous()})
        next_sample += args.interval
        if now >= args.seconds:
          break
      try:
        sess.run(step, options=options)
      except tf.errors.OpError as e:   # the peer reached its own last sample first and left
        print("worker %d stopped at %.1f s: %s" % (args.index, now, str(e).splitlines()[0]),
              file=sys.stderr, flush=True)
        break
      runs += 1
  print(json.dumps({"worker": args.index, "mode": args.mode, "samples": samples}), flush=True)


def growth(samples, key):
  """(MB a minute, bytes a run) of ``key`` over the second half of ``samples``."""
  half = [s for s in samples if s["t"] >= samples[-1]["t"] / 2]
  a, b = half[0], half[-1]
  minutes, runs = (b["t"] - a["t"]) / 60.0, b["runs"] - a["runs"]
  delta = b[key] - a[key]
  return delta / max(minutes, 1e-9), delta * 2 ** 20 / max(runs, 1)


def drive(args):
  sys.path.insert(0, ROOT)
  from epl.launch.spec import free_ports
  print("allocator: %s; MALLOC_ARENA_MAX=%s; --timeout-ms %d; %d float32 a step" % (
      os.environ.get("LD_PRELOAD") or "glibc", os.environ.get("MALLOC_ARENA_MAX", "(default)"),
      args.timeout_ms, args.elements))
  print("%-10s %-6s %8s %9s %10s %10s %9s %10s %9s %8s" % (
      "mode", "worker", "runs", "runs/s", "RSS MB", "RSS MB/min", "RSS B/run", "heap MB/min",
      "heap B/run", "pinned"))
  for mode in args.modes.split(","):
    hosts = ",".join("localhost:%d" % p for p in free_ports(2))
    procs = [subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--role", "worker", "--index", str(i),
         "--hosts", hosts, "--mode", mode, "--seconds", str(args.seconds), "--interval",
         str(args.interval), "--elements", str(args.elements), "--timeout-ms",
         str(args.timeout_ms), "--leader", str(args.leader)] +
        (["--release"] if args.release else []), stdout=subprocess.PIPE, text=True) for i in range(2)]
    try:
      outs = [p.communicate(timeout=args.seconds + 300)[0] for p in procs]
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
    for out in outs:
      report = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
      samples = report["samples"]
      rss_min, rss_run = growth(samples, "rss_mb")
      heap_min, heap_run = growth(samples, "heap_mb")
      last = samples[-1]
      print("%-10s %-6d %8d %9.0f %10.1f %10.2f %9.1f %10.2f %9.1f %8s" % (
          mode, report["worker"], last["runs"], last["runs"] / last["t"], last["rss_mb"],
          rss_min, rss_run, heap_min, heap_run, last.get("pinned")))
      if args.verbose:
        for s in samples:
          print("    " + json.dumps(s))
  return 0


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--seconds", type=float, default=600)
  p.add_argument("--interval", type=float, default=30)
  p.add_argument("--modes", default="allreduce,local")
  p.add_argument("--elements", type=int, default=100000)
  p.add_argument("--timeout-ms", type=int, default=0)
  p.add_argument("--release", action="store_true",
                 help="with epl's release_aborted_rendezvous hook (docs/benchmarks.md)")
  p.add_argument("--leader", type=int, default=0, help="the collective group leader's task")
  p.add_argument("--verbose", action="store_true", help="print every sample")
  p.add_argument("--role", default="driver", choices=["driver", "worker"])
  p.add_argument("--index", type=int, default=0)
  p.add_argument("--hosts", default="")
  p.add_argument("--mode", default="allreduce")
  args = p.parse_args()
  if args.role == "worker":
    worker(args)
    return 0
  return drive(args)


if __name__ == "__main__":
  sys.exit(main())
