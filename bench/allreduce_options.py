"""What TF 2.21's own collective engine offers for a 4 MiB all-reduce between 2 localhost
worker processes (issue 13: "find the path inside TF's engine").

  python bench/allreduce_options.py [--repeat 2]

Each variant is one pair of fresh processes (tf.train.Server, between-graph collectives,
ring on CPU) timing ``session.run`` of the all-reduce 60 times (median of the last 50):
  baseline         one CollectiveReduceV2 of 1M float32
  pieces=k         the tensor cut in k all-reduces run concurrently (one group key)
  pieces=k groups  the same, each piece on its own group key (an independent channel)
  subdivs=k        TF's ring ``max_subdivs_per_device`` (the ring's own chunk pipelining)
  recv_buf_max_chunk  the server's ``ConfigProto.experimental.recv_buf_max_chunk``: the
                   size of the pieces a collective's buffer is cut into for gRPC (TF's
                   default 0 means 4096 bytes; -1 means one piece)
  gRPC ...         gRPC channel arguments through TF's ``TF_GRPC_DEFAULT_OPTIONS`` (HTTP/2
                   frame size, write buffer) and ``TF_GRPC_WORKER_CACHE_THREADS`` (the
                   threads polling the peers' responses)
  channels=2       ``RPCOptions.num_channels_per_target``: two gRPC channels per peer
  gather+sum       an all-gather of the whole tensor and a local sum (one round, 2x bytes)
  fp16 wire        the tensor cast to float16 for the wire (``communication.fp16``)
  tiny (4 KiB)     the per-collective floor (latency, not bytes)
  in-graph         no collective: one master session drives both tasks and the same ring
                   (each task sums one half, then both halves travel back) is plain ops
                   placed on the two tasks, moved by TF's Send/Recv (RecvTensor over gRPC)
and, when Horovod is installed (bench/build_horovod.sh), ``hvd.allreduce`` of the same
tensor under horovodrun (Gloo), as float32 and with ``hvd.Compression.fp16``. Prints ms per variant and its ratio to the baseline.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = [
    ("baseline", {}),
    ("pieces=2", {"pieces": 2}),
    ("pieces=4", {"pieces": 4}),
    ("pieces=4 groups", {"pieces": 4, "groups": 1}),
    ("subdivs=4", {"subdivs": 4}),
    ("channels=2, pieces=4 groups", {"channels": 2, "pieces": 4, "groups": 1}),
    ("gather+sum", {"gather": 1}),
    ("fp16 wire", {"fp16": 1}),
    ("tiny (4 KiB)", {"elems": 1024}),
    ("recv_buf_max_chunk=-1", {"chunk": -1}),
    ("recv_buf_max_chunk=1 MiB", {"chunk": 1 << 20}),
    ("gRPC max_frame_size=16 MiB", {"env": {
        "TF_GRPC_DEFAULT_OPTIONS": "grpc.http2.max_frame_size=16777215"}}),
    ("gRPC write_buffer_size=8 MiB", {"env": {
        "TF_GRPC_DEFAULT_OPTIONS": "grpc.http2.write_buffer_size=8388608"}}),
    ("gRPC worker cache threads=1", {"env": {"TF_GRPC_WORKER_CACHE_THREADS": "1"}}),
]


def free_ports(n):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from epl.launch.spec import free_ports as ports       # no TF import
  return ports(n)


def median_ms(sess, op):
  """Median of the last 50 of 60 timed ``sess.run(op)``, in ms."""
  times = []
  for _ in range(60):
    start = time.perf_counter()
    sess.run(op)
    times.append(time.perf_counter() - start)
  return statistics.median(times[10:]) * 1e3


def worker(variant):
  import tensorflow.compat.v1 as tf
  from tensorflow.python.ops import collective_ops
  tf.disable_v2_behavior()
  conf = json.loads(os.environ["TF_CONFIG"])
  index = conf["task"]["index"]
  v = json.loads(variant)
  config = tf.ConfigProto()
  config.experimental.collective_group_leader = "/job:worker/replica:0/task:0"
  if v.get("chunk"):
    config.experimental.recv_buf_max_chunk = v["chunk"]
  if v.get("channels"):
    config.rpc_options.num_channels_per_target = v["channels"]
  server = tf.train.Server(tf.train.ClusterSpec({"worker": conf["cluster"]["worker"]}),
                           job_name="worker", task_index=index, config=config)
  with tf.device("/job:worker/replica:0/task:%d/device:CPU:0" % index):
    x = tf.Variable(tf.ones([v.get("elems", 1 << 20)])).read_value()
    if v.get("fp16"):
      x = tf.cast(x, tf.float16)
    if v.get("gather"):
      outs = [tf.reduce_sum(collective_ops.all_gather_v2(
          tf.reshape(x, [1, -1]), 2, 1, 1, communication_hint="ring"), 0)]
    else:
      k = v.get("pieces", 1)
      outs = [collective_ops.all_reduce_v2(
          p, 2, 1 + (i if v.get("groups") else 0), 1 + i, "Add", "Div",
          communication_hint="ring", max_subdivs_per_device=v.get("subdivs", -1))
              for i, p in enumerate(tf.split(x, k) if k > 1 else [x])]
    step = tf.group(*[o.op for o in outs])
  config.device_filters.append("/job:worker/task:%d" % index)
  with tf.Session(server.target, config=config) as sess:
    sess.run(tf.global_variables_initializer())
    ms = median_ms(sess, step)
  print(json.dumps({"ms": ms}))


def pair(variant):
  hosts = ["localhost:%d" % p for p in free_ports(2)]
  procs = [subprocess.Popen(
      [sys.executable, os.path.abspath(__file__), "--variant", json.dumps(variant)],
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="",
               TF_CONFIG=json.dumps({"cluster": {"worker": hosts},
                                     "task": {"type": "worker", "index": i}}),
               **variant.get("env", {})),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
  results = []
  for p in procs:
    out, err = p.communicate(timeout=300)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
      raise RuntimeError(err[-2000:])
    results.append(json.loads(lines[-1])["ms"])
  return max(results)


def ingraph_worker(index, hosts):
  """Task 1 serves; task 0's session runs the in-graph ring on both tasks."""
  import tensorflow.compat.v1 as tf
  tf.disable_v2_behavior()
  server = tf.train.Server(tf.train.ClusterSpec({"worker": hosts}), job_name="worker",
                           task_index=index)
  if index == 1:
    server.join()
  devices = ["/job:worker/replica:0/task:%d/device:CPU:0" % i for i in range(2)]
  variables, halves = [], []
  for d in devices:
    with tf.device(d):
      variables.append(tf.Variable(tf.ones([1 << 20])))
      halves.append(tf.split(variables[-1].read_value(), 2))
  sums = []
  for i, d in enumerate(devices):                     # task i sums half i
    with tf.device(d):
      sums.append(halves[0][i] + halves[1][i])
  assigns = []
  for d, v in zip(devices, variables):                # both halves back on every task
    with tf.device(d):
      assigns.append(v.assign(tf.concat(sums, 0) * 0.5).op)
  step = tf.group(*assigns)
  with tf.Session(server.target) as sess:
    sess.run(tf.global_variables_initializer())
    ms = median_ms(sess, step)
  print(json.dumps({"ms": ms}), flush=True)


def ingraph_ms():
  hosts = ",".join("localhost:%d" % p for p in free_ports(2))
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
  serving = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--ingraph", "1",
                              hosts], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
  try:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--ingraph", "0", hosts],
                         env=env, capture_output=True, text=True, timeout=300)
  finally:
    serving.kill()
  lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
  if not lines:
    raise RuntimeError(out.stderr[-2000:])
  return json.loads(lines[-1])["ms"]


def horovod_ms(fp16=False):
  runner = os.path.join(os.path.dirname(sys.executable), "horovodrun")
  if not os.path.exists(runner):
    return None
  out = subprocess.run(
      [runner, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
       os.path.abspath(__file__), "--horovod"] + (["--fp16"] if fp16 else []),
      capture_output=True, text=True, timeout=300,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES=""))
  values = [json.loads(line[line.index("{"):])["ms"] for line in out.stdout.splitlines()
            if "{" in line]
  return max(values) if values else None


def horovod_worker(fp16):
  import tensorflow.compat.v1 as tf
  tf.disable_v2_behavior()
  import horovod.tensorflow as hvd
  hvd.init()
  reduced = hvd.allreduce(tf.Variable(tf.ones([1 << 20])).read_value(),
                          compression=hvd.Compression.fp16 if fp16 else hvd.Compression.none)
  with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    ms = median_ms(sess, reduced.op)
  print(json.dumps({"ms": ms}))


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--variant")
  p.add_argument("--horovod", action="store_true")
  p.add_argument("--fp16", action="store_true")
  p.add_argument("--repeat", type=int, default=2)
  p.add_argument("--ingraph", nargs=2)
  args = p.parse_args()
  if args.ingraph:
    ingraph_worker(int(args.ingraph[0]), args.ingraph[1].split(","))
    return
  if args.variant:
    worker(args.variant)
    return
  if args.horovod:
    horovod_worker(args.fp16)
    return
  print("4 MiB float32 all-reduce, 2 localhost processes, median ms (best of %d runs)" %
        args.repeat)
  base = None
  for name, variant in VARIANTS:
    ms = min(pair(variant) for _ in range(args.repeat))
    base = base or ms
    print("  %-30s %6.2f ms  x%.2f of baseline" % (name, ms, ms / base), flush=True)
  ms = min(ingraph_ms() for _ in range(args.repeat))
  print("  %-30s %6.2f ms  x%.2f of baseline" % ("in-graph Send/Recv ring", ms, ms / base))
  hvd = horovod_ms()
  if hvd is None:
    print("  Horovod: not installed (bash bench/build_horovod.sh)")
  else:
    hvd = min([hvd] + [horovod_ms() for _ in range(args.repeat - 1)])
    print("  %-30s %6.2f ms  x%.2f of baseline" % ("Horovod hvd.allreduce (Gloo)", hvd,
                                                   hvd / base))
    hvd16 = min(horovod_ms(fp16=True) for _ in range(args.repeat))
    print("  %-30s %6.2f ms  x%.2f of baseline" % ("Horovod, Compression.fp16", hvd16,
                                                   hvd16 / base))


if __name__ == "__main__":
  main()
