"""Data-parallel throughput across 2 worker processes: epl vs MultiWorkerMirroredStrategy
and Horovod.

  python bench/dp_scaling.py [--steps 200] [--repeats 3] [--width 512] [--batch 64] [--fp16]
                             [--intra-op N]

Runs the same MLP (3 dense layers of ``--width``, ``--batch`` samples per worker, SGD) as
(a) epl, 2 workers x 1 device, between-graph with TF collectives (ring on CPU),
(b) TF's MultiWorkerMirroredStrategy, TF2 style (tf.function train step, RING collectives),
(c) Horovod, when it is installed (``pip`` build notes in docs/benchmarks.md; never required),
all with the same global batch and TF's default threads (``--intra-op N`` sets
``TF_NUM_INTRAOP_THREADS`` for every process of all three). The three are run ``--repeats`` times interleaved (each run a
fresh pair of processes, so the machine's drift hits them alike) and the medians of samples/s
and their ratios are printed; then the median all-reduce latency of a 4 MiB float32 tensor
through epl's collectives vs a bare TF collective (vs Horovod when installed). Every worker is
a localhost process. ``--fp16`` adds epl with ``communication.fp16`` against Horovod with
``hvd.Compression.fp16`` (the same compression on both sides).
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time


def free_ports(n):
  socks = [socket.socket() for _ in range(n)]
  for s in socks:
    s.bind(("127.0.0.1", 0))
  ports = [s.getsockname()[1] for s in socks]
  for s in socks:
    s.close()
  return ports


def run_pair(role, args, extra_env=None):
  ports = free_ports(2)
  hosts = ["localhost:%d" % p for p in ports]
  procs = []
  for i in range(2):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
               TF_CONFIG=json.dumps({"cluster": {"worker": hosts},
                                     "task": {"type": "worker", "index": i}}),
               EPL_CLUSTER_DEVICES_PER_WORKER="1", **(extra_env or {}))
    procs.append(subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--role", role, "--steps", str(args.steps),
         "--width", str(args.width), "--batch", str(args.batch)], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  results = []
  for p in procs:
    out, err = p.communicate(timeout=600)
    lines = [l for l in out.splitlines() if l.startswith("{")]
    if p.returncode != 0 or not lines:
      raise RuntimeError("%s worker failed:\n%s" % (role, err[-3000:]))
    results.append(json.loads(lines[-1]))
  return results


def data(width, batch, seed):
  import numpy as np
  rng = np.random.RandomState(seed)
  return rng.randn(batch * 8, width).astype("float32"), rng.randint(0, 10, batch * 8)


def worker_epl(args):
  import numpy as np
  import tensorflow.compat.v1 as tf
  tf.disable_v2_behavior()
  import epl
  env = epl.init()
  x_np, y_np = data(args.width, args.batch, env.cluster.worker_index)
  with epl.replicate(1):
    x, y = tf.data.make_one_shot_iterator(tf.data.Dataset.from_tensor_slices(
        (x_np, y_np)).batch(args.batch).repeat()).get_next()
    h = x
    for _ in range(3):
      h = tf.layers.dense(h, args.width, activation=tf.nn.relu)
    loss = tf.losses.sparse_softmax_cross_entropy(y, tf.layers.dense(h, 10))
  train = tf.train.GradientDescentOptimizer(0.01).minimize(loss)
  big = tf.Variable(tf.ones([1 << 20]), name="big")
  with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    # a 4 MiB all-reduce through the collectives epl's gradient sync uses (same key space)
    pg = epl.Graph.get()
    group = pg.plan.group_of(0)
    mine = pg.worker.device_of(0, 0)
    with tf.device(mine):
      reduced = pg.collectives.all_reduce([big.read_value()], [mine], "mean", group=group)[0]
    for _ in range(5):
      sess.run(train)
    start = time.perf_counter()
    for _ in range(args.steps):
      sess.run(train)
    seconds = time.perf_counter() - start
    lat = []
    for _ in range(30):
      t = time.perf_counter()
      sess.run(reduced.op)
      lat.append(time.perf_counter() - t)
  print(json.dumps({"samples_per_s": args.steps * args.batch / seconds,
                    "allreduce_ms": statistics.median(lat[5:]) * 1e3}))


def worker_bare(args):
  """A bare TF between-graph collective all-reduce of 4 MiB (no epl)."""
  import tensorflow.compat.v1 as tf
  from tensorflow.python.ops import collective_ops
  tf.disable_v2_behavior()
  conf = json.loads(os.environ["TF_CONFIG"])
  index = conf["task"]["index"]
  config = tf.ConfigProto()
  config.experimental.collective_group_leader = "/job:worker/replica:0/task:0"
  server = tf.train.Server(tf.train.ClusterSpec({"worker": conf["cluster"]["worker"]}),
                           job_name="worker", task_index=index, config=config)
  with tf.device("/job:worker/replica:0/task:%d/device:CPU:0" % index):
    big = tf.Variable(tf.ones([1 << 20]))
    red = collective_ops.all_reduce_v2(big.read_value(), 2, 1, 1, "Add", "Div",
                                       communication_hint="ring")
  config.device_filters.append("/job:worker/task:%d" % index)
  with tf.Session(server.target, config=config) as sess:
    sess.run(tf.global_variables_initializer())
    lat = []
    for _ in range(30):
      t = time.perf_counter()
      sess.run(red.op)
      lat.append(time.perf_counter() - t)
  print(json.dumps({"allreduce_ms": statistics.median(lat[5:]) * 1e3}))


def worker_mwms(args):
  import tensorflow as tf
  strategy = tf.distribute.MultiWorkerMirroredStrategy(
      communication_options=tf.distribute.experimental.CommunicationOptions(
          implementation=tf.distribute.experimental.CommunicationImplementation.RING))
  index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
  x_np, y_np = data(args.width, args.batch, index)
  ds = tf.data.Dataset.from_tensor_slices((x_np, y_np)).batch(args.batch).repeat()
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
  it = iter(strategy.experimental_distribute_dataset(ds.with_options(options)))
  with strategy.scope():
    layers = [tf.keras.layers.Dense(args.width, activation="relu") for _ in range(3)]
    layers.append(tf.keras.layers.Dense(10))
    model = tf.keras.Sequential(layers)
    model.build([None, args.width])
    opt = tf.keras.optimizers.SGD(0.01)

  @tf.function
  def step(batch):
    def replica_step(x, y):
      with tf.GradientTape() as tape:
        logits = model(x)
        loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
            y, logits, from_logits=True))
      grads = tape.gradient(loss, model.trainable_variables)
      opt.apply_gradients(zip(grads, model.trainable_variables))
      return loss
    return strategy.run(replica_step, args=batch)

  for _ in range(5):
    step(next(it))
  start = time.perf_counter()
  for _ in range(args.steps):
    loss = step(next(it))
  float(strategy.reduce("MEAN", loss, axis=None))
  seconds = time.perf_counter() - start
  print(json.dumps({"samples_per_s": args.steps * args.batch / seconds}))


def worker_horovod(args):
  """The same MLP under Horovod (TF1 graph, DistributedOptimizer over Gloo), and a 4 MiB
  hvd.allreduce; started by horovodrun."""
  import tensorflow.compat.v1 as tf
  tf.disable_v2_behavior()
  import horovod.tensorflow as hvd
  hvd.init()
  x_np, y_np = data(args.width, args.batch, hvd.rank())
  x, y = tf.data.make_one_shot_iterator(tf.data.Dataset.from_tensor_slices(
      (x_np, y_np)).batch(args.batch).repeat()).get_next()
  h = x
  for _ in range(3):
    h = tf.layers.dense(h, args.width, activation=tf.nn.relu)
  loss = tf.losses.sparse_softmax_cross_entropy(y, tf.layers.dense(h, 10))
  compression = hvd.Compression.fp16 if args.fp16 else hvd.Compression.none
  train = hvd.DistributedOptimizer(tf.train.GradientDescentOptimizer(0.01),
                                   compression=compression).minimize(loss)
  big = tf.Variable(tf.ones([1 << 20]), name="big")
  reduced = hvd.allreduce(big.read_value())
  with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    sess.run(hvd.broadcast_global_variables(0))
    for _ in range(5):
      sess.run(train)
    start = time.perf_counter()
    for _ in range(args.steps):
      sess.run(train)
    seconds = time.perf_counter() - start
    lat = []
    for _ in range(30):
      t = time.perf_counter()
      sess.run(reduced.op)
      lat.append(time.perf_counter() - t)
  print(json.dumps({"samples_per_s": args.steps * args.batch / seconds,
                    "allreduce_ms": statistics.median(lat[5:]) * 1e3}))


def run_horovod(args, fp16=False):
  """Both Horovod workers under horovodrun (Gloo, localhost); their JSON lines."""
  runner = os.path.join(os.path.dirname(sys.executable), "horovodrun")
  out = subprocess.run(
      [runner, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
       os.path.abspath(__file__), "--role", "horovod", "--steps", str(args.steps), "--width",
       str(args.width), "--batch", str(args.batch)] + (["--fp16"] if fp16 else []),
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="",
               TF_USE_LEGACY_KERAS="1"),             # tf.layers, as in epl's workers
      capture_output=True, text=True, timeout=600)
  lines = [line[line.index("{"):] for line in out.stdout.splitlines() if "{" in line]
  if out.returncode != 0 or len(lines) < 2:
    raise RuntimeError("horovodrun failed:\n%s" % (out.stdout[-2000:] + out.stderr[-2000:]))
  return [json.loads(line) for line in lines[-2:]]


def horovod_available():
  try:
    import horovod.tensorflow  # noqa: F401
    return True
  except Exception:  # pylint: disable=broad-except
    return False


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--role", default="driver")
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--width", type=int, default=512)
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--fp16", action="store_true")
  p.add_argument("--intra-op", type=int, default=0)
  args = p.parse_args()
  if args.role != "driver":
    {"epl": worker_epl, "bare": worker_bare, "mwms": worker_mwms,
     "horovod": worker_horovod}[args.role](args)
    return
  if args.intra_op:
    os.environ["TF_NUM_INTRAOP_THREADS"] = str(args.intra_op)   # inherited by every worker
  runs = {"epl": [], "mwms": [], "hvd": []}
  allreduce = {"epl": [], "hvd": []}
  have_hvd = horovod_available()
  for _ in range(args.repeats):
    epl_res = run_pair("epl", args)
    runs["epl"].append(sum(r["samples_per_s"] for r in epl_res))   # workers run concurrently
    allreduce["epl"].extend(r["allreduce_ms"] for r in epl_res)
    runs["mwms"].append(sum(r["samples_per_s"] for r in run_pair("mwms", args)))
    if have_hvd:
      hvd_res = run_horovod(args)
      runs["hvd"].append(sum(r["samples_per_s"] for r in hvd_res))
      allreduce["hvd"].extend(r["allreduce_ms"] for r in hvd_res)
  med = {k: statistics.median(v) for k, v in runs.items() if v}
  print("MLP width %d, batch %d per worker, 2 workers x 1 device, %d timed steps, median of "
        "%d interleaved runs, %s" % (args.width, args.batch, args.steps, args.repeats,
                                    "TF_NUM_INTRAOP_THREADS=%d" % args.intra_op
                                    if args.intra_op else "TF's default threads"))
  print("  epl                          %8.0f samples/s  (runs: %s)" % (
      med["epl"], " ".join("%.0f" % v for v in runs["epl"])))
  print("  MultiWorkerMirroredStrategy  %8.0f samples/s" % med["mwms"])
  print("  ratio epl / MWMS = %.2f (target >= 1.0)" % (med["epl"] / med["mwms"]))
  if have_hvd:
    print("  Horovod 0.28.1 (Gloo)        %8.0f samples/s  (runs: %s)" % (
        med["hvd"], " ".join("%.0f" % v for v in runs["hvd"])))
    print("  ratio epl / Horovod = %.2f (target >= 1.0); per run: %s" % (
        med["epl"] / med["hvd"], " ".join("%.2f" % (e / h) for e, h in zip(
            runs["epl"], runs["hvd"]))))
  else:
    print("  Horovod 0.28.1: not installed here; bash bench/build_horovod.sh builds it")
  bare_res = run_pair("bare", args)
  e = statistics.median(allreduce["epl"])
  b = statistics.median(r["allreduce_ms"] for r in bare_res)
  print("all-reduce of 4 MiB float32, 2 processes, median: epl %.1f ms, bare TF collective "
        "%.1f ms, ratio %.2f" % (e, b, e / b))
  if have_hvd:
    h = statistics.median(allreduce["hvd"])
    print("  Horovod hvd.allreduce %.1f ms, ratio epl / Horovod %.2f (target <= 1.0)" % (
        h, e / h))
  if args.fp16:                       # the same compression on both sides
    epl16 = sum(r["samples_per_s"] for r in run_pair(
        "epl", args, {"EPL_COMMUNICATION_FP16": "true"}))
    print("float16 gradients on the wire:\n  epl (communication.fp16)      %8.0f samples/s "
          "(x%.2f of epl float32)" % (epl16, epl16 / med["epl"]))
    if have_hvd:
      hvd16 = sum(r["samples_per_s"] for r in run_horovod(args, fp16=True))
      print("  Horovod (Compression.fp16)    %8.0f samples/s\n  ratio epl / Horovod = %.2f"
            % (hvd16, epl16 / hvd16))


if __name__ == "__main__":
  main()
