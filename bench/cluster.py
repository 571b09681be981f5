"""Gradient sync at the link's limit: epl across emulated hosts, every host link capped.

  sudo python bench/cluster.py [--rates 1gbit,10gbit] [--sizes 4,16,64] [--hosts 2,3]
                               [--steps 8] [--repeat 1] [--png docs/cluster_step.png] [--json]

Each host is a network namespace with its own address and its link to a bridge capped at the
rate (``tc tbf``, both directions; epl.testing.cluster); one worker per host, started with
TF_CONFIG as a scheduler starts it. Needs root. Measured, per rate:

(a) all-reduce of S MiB among n hosts: the time of epl's cross-worker all-reduce (the
    ``epl.collectives`` path gradient sync takes, built from a data-parallel plan) against
    the ring's lower bound 2(n-1)/n x S / R, printed as the fraction of the link epl reaches;
    Horovod's ``hvd.allreduce`` (Gloo) on the same hosts when Horovod is installed
    (bash bench/build_horovod.sh). ``--repeat N``: N fresh runs of each, epl's and
    Horovod's interleaved, each time printed, the medians compared (also for (b) and (e):
    the compute time, epl's and Horovod's DP runs interleaved, the run with the median
    ratio reported).
(b) data-parallel training (2 hosts) of a model whose gradients take longer to send than to
    compute (``comm``: 64 MiB of gradients, a batch of 8) and of one where compute dominates
    (``compute``: 4 MiB of gradients, a batch of 8192): step time / max(compute time, the
    ring bound of its gradients). The compute time is the same script without epl run on
    both hosts at once (each has the CPU share it has in the job).
(c) ``communication.fp16`` on the comm model: bytes each host sent per step (its link's
    counters) against float32's.
(d) bytes each host sent per step against the ring's minimum 2(n-1)/n x gradient bytes.
(e) samples/s of the comm model under epl against Horovod's DistributedOptimizer.
``--png``: each link's bytes/s over one traced step of the comm model (1st rate) with worker
0's phases (forward, backward, all-reduce buckets, update) from its trace.

Experiments (workers' environment): BENCH_PIECE_KIB and BENCH_IN_FLIGHT set epl's ring piece
size and pieces in flight (epl.collectives); ``--role allreduce --trace`` adds one traced
all-reduce's ops (name, start, end) to its JSON.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20
MODELS = {          # name: (layer widths, batch per worker)
    "comm": ([2048, 4096, 2048], 8),          # 2 x 8M weights: 64 MiB of gradients
    "compute": ([512, 512, 512, 512, 512], 8192),
}


# ---- workers (each runs inside its host's namespace) -------------------------------------
def _link_bytes():
  base = "/sys/class/net/eth0/statistics/"
  with open(base + "tx_bytes") as tx, open(base + "rx_bytes") as rx:
    return int(tx.read()), int(rx.read())


def _model(tf, name, x):
  widths, _ = MODELS[name]
  h = x
  blocks = int(os.environ.get("BENCH_BLOCKS", "0"))
  for i, width in enumerate(widths[1:]):
    act = tf.nn.relu if i < len(widths) - 2 else None
    if blocks:
      h = tf.concat([tf.layers.dense(h, width // blocks, activation=act, use_bias=False,
                                     name="layer%d_%d" % (i, j)) for j in range(blocks)], 1)
      continue
    h = tf.layers.dense(h, width, activation=act, use_bias=False, name="layer%d" % i)
  return tf.reduce_mean(tf.square(h))


def _timed(run, steps, warmup=3):
  for _ in range(warmup):
    run()
  times, (tx0, rx0), cpu0 = [], _link_bytes(), os.times()
  for _ in range(steps):
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
  tx1, rx1 = _link_bytes()
  cpu1 = os.times()
  return {"seconds": statistics.median(times), "tx_per_step": (tx1 - tx0) / steps,
          "rx_per_step": (rx1 - rx0) / steps,
          "cpu_per_step": (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / steps}


def _experiment_knobs():
  """Another ring piece size or number of pieces in flight than epl's (docstring)."""
  import epl.collectives
  if os.environ.get("BENCH_PIECE_KIB"):
    epl.collectives.PIECE_BYTES = int(os.environ["BENCH_PIECE_KIB"]) << 10
  if os.environ.get("BENCH_IN_FLIGHT"):
    epl.collectives.PIECES_IN_FLIGHT = int(os.environ["BENCH_IN_FLIGHT"])


def worker_allreduce(args):
  """epl's cross-worker all-reduce of --mib MiB (float32)."""
  import tensorflow.compat.v1 as tf
  tf.disable_v2_behavior()
  import epl
  _experiment_knobs()
  epl.init()
  with epl.replicate(1):
    w = tf.get_variable("w", [4], initializer=tf.ones_initializer())
    loss = tf.reduce_sum(w * w)
  train = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
  big = tf.Variable(tf.ones([args.mib * MIB // 4]), name="big")
  with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    sess.run(train)
    pg = epl.Graph.get()
    mine = pg.worker.device_of(0, 0)
    with tf.device(mine):
      reduced = pg.collectives.all_reduce([big.read_value()], [mine], "sum",
                                          group=pg.plan.group_of(0))[0]
    result = _timed(lambda: sess.run(reduced.op), args.steps)
    if args.trace:          # experiments: where one all-reduce's time goes, op by op
      meta = tf.RunMetadata()
      sess.run(reduced.op, options=tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE),
               run_metadata=meta)
      spans = [(n.node_name, n.all_start_micros, n.all_start_micros + n.all_end_rel_micros)
               for d in meta.step_stats.dev_stats for n in d.node_stats]
      first = min(s for _, s, _ in spans)
      result["trace"] = sorted((name, (s - first) / 1e6, (e - first) / 1e6)
                               for name, s, e in spans if e - s > 2000)
  print(json.dumps(result), flush=True)


def worker_horovod_allreduce(args):
  import tensorflow.compat.v1 as tf
  tf.disable_v2_behavior()
  import horovod.tensorflow as hvd
  hvd.init()
  big = tf.Variable(tf.ones([args.mib * MIB // 4]), name="big")
  reduced = hvd.allreduce(big.read_value(), op=hvd.Sum)
  with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    result = _timed(lambda: sess.run(reduced.op), args.steps)
  print(json.dumps(result), flush=True)


def _data(tf, name, seed):
  import numpy as np
  widths, batch = MODELS[name]
  x = np.random.RandomState(seed).randn(batch, widths[0]).astype(np.float32)
  return tf.constant(x)


def worker_dp(args):
  """Data-parallel training of --model under epl; with --trace, one traced step's phases."""
  import tensorflow.compat.v1 as tf
  tf.disable_v2_behavior()
  import epl
  _experiment_knobs()
  config = {"communication.fp16": True} if args.fp16 else {}
  env = epl.init(epl.Config(config))
  with epl.replicate(1):
    loss = _model(tf, args.model, _data(tf, args.model, env.cluster.worker_index))
  train = tf.train.GradientDescentOptimizer(1e-4).minimize(loss)
  with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    result = _timed(lambda: sess.run(train), args.steps)
    result["samples_per_s"] = MODELS[args.model][1] * env.cluster.worker_num / result["seconds"]
    if args.trace:
      meta = tf.RunMetadata()
      time.sleep(0.5)                          # a quiet link before and after the step
      start = time.time()
      sess.run(train, options=tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE),
               run_metadata=meta)
      end = time.time()
      time.sleep(0.5)
      first = min(n.all_start_micros for d in meta.step_stats.dev_stats for n in d.node_stats)
      result["trace"] = {"start": start, "end": end, "origin": first / 1e6,
                         "spans": epl.timeline.action_spans(meta, epl.Graph.get())}
  print(json.dumps(result), flush=True)


def worker_local(args):
  """The same model and batch without epl: the compute time of one worker's step."""
  import tensorflow.compat.v1 as tf
  tf.disable_v2_behavior()
  loss = _model(tf, args.model, _data(tf, args.model, 0))
  train = tf.train.GradientDescentOptimizer(1e-4).minimize(loss)
  with tf.Session(config=tf.ConfigProto(inter_op_parallelism_threads=2)) as sess:
    sess.run(tf.global_variables_initializer())
    print(json.dumps(_timed(lambda: sess.run(train), args.steps)), flush=True)


def worker_horovod_dp(args):
  import tensorflow.compat.v1 as tf
  tf.disable_v2_behavior()
  import horovod.tensorflow as hvd
  hvd.init()
  loss = _model(tf, args.model, _data(tf, args.model, hvd.rank()))
  train = hvd.DistributedOptimizer(tf.train.GradientDescentOptimizer(1e-4)).minimize(loss)
  with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    sess.run(hvd.broadcast_global_variables(0))
    result = _timed(lambda: sess.run(train), args.steps)
    result["samples_per_s"] = MODELS[args.model][1] * hvd.size() / result["seconds"]
  print(json.dumps(result), flush=True)


WORKERS = {"allreduce": worker_allreduce, "horovod_allreduce": worker_horovod_allreduce,
           "dp": worker_dp, "local": worker_local, "horovod_dp": worker_horovod_dp}


# ---- the driver ---------------------------------------------------------------------------
class Bench:
  """Runs the measurements on one testbed (its hosts, its rate)."""

  def __init__(self, bed, rate, steps):
    self.bed, self.rate, self.steps = bed, rate, steps
    self._port = 23500

  def _env(self):
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
                EPL_LOG_PROGRESS_SECS="0", EPL_LOG_LEVEL="warning",
                EPL_COMMUNICATION_COLLECTIVE_TIMEOUT="600",
                PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))

  def run(self, role, hosts, *extra, horovod=False, sampler=None):
    """Starts ``role`` on the first ``hosts`` hosts; returns each worker's JSON result."""
    self._port += 10
    addresses = ["%s:%d" % (a, self._port) for a in self.bed.addresses[:hosts]]
    argv = [sys.executable, os.path.abspath(__file__), "--role", role, "--steps",
            str(self.steps)] + [str(e) for e in extra]
    rendezvous = _horovod_rendezvous(self.bed, hosts) if horovod else None
    procs = []
    try:
      for i in range(hosts):
        env = self._env()
        if horovod:
          env.update(rendezvous.env(i))
        elif role != "local":
          env["TF_CONFIG"] = json.dumps({"cluster": {"worker": addresses},
                                         "task": {"type": "worker", "index": i}})
        procs.append(self.bed.start(i, argv, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True))
      if sampler is not None:
        sampler.start()
      results = []
      for p in procs:
        out, err = p.communicate(timeout=1800)
        lines = [l for l in out.splitlines() if l.startswith("{")]
        if p.returncode != 0 or not lines:
          raise RuntimeError("%s failed (%s):\n%s" % (role, p.returncode, err[-3000:]))
        results.append(json.loads(lines[-1]))
      return results
    finally:
      if sampler is not None:
        sampler.stop()
      for p in procs:
        if p.poll() is None:
          p.kill()
      if rendezvous is not None:
        rendezvous.close()


def _bits(rate):
  from epl.testing.cluster import _bits as bits     # pylint: disable=protected-access
  return bits(rate)


def ring_seconds(nbytes, hosts, rate):
  """The ring all-reduce's lower bound: 2(n-1)/n x S over a link of ``rate``."""
  return 2.0 * (hosts - 1) / hosts * nbytes * 8 / _bits(rate)


def gradient_bytes(model):
  widths, _ = MODELS[model]
  return sum(a * b for a, b in zip(widths, widths[1:])) * 4


class _HorovodRendezvous:
  """Horovod's Gloo rendezvous (an HTTP key-value store) inside host 0, and the environment
  each rank needs (what horovodrun would set; horovodrun itself would need ssh)."""

  def __init__(self, bed, hosts):
    self.bed, self.hosts = bed, hosts
    self.proc = bed.start(0, [sys.executable, "-c", _RENDEZVOUS % hosts], env=dict(
        os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE, text=True)
    self.port = int(self.proc.stdout.readline())

  def env(self, rank):
    return {"HOROVOD_GLOO_RENDEZVOUS_ADDR": self.bed.addresses[0],
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(self.port), "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": "eth0",
            "HOROVOD_HOSTNAME": "h%d" % rank, "HOROVOD_RANK": str(rank),
            "HOROVOD_SIZE": str(self.hosts), "HOROVOD_LOCAL_RANK": "0",
            "HOROVOD_LOCAL_SIZE": "1", "HOROVOD_CROSS_RANK": str(rank),
            "HOROVOD_CROSS_SIZE": str(self.hosts)}

  def close(self):
    self.proc.kill()
    self.proc.wait()


_RENDEZVOUS = """
import time
from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
from horovod.runner.http.http_server import RendezvousServer
hosts = %d
server = RendezvousServer(verbose=0)
port = server.start()
addresses = ",".join("h%%d:1" %% i for i in range(hosts))
server.init(get_host_assignments(parse_hosts(addresses), hosts))
print(port, flush=True)
time.sleep(3600)
"""


def _horovod_rendezvous(bed, hosts):
  return _HorovodRendezvous(bed, hosts)


def horovod_available():
  try:
    import horovod.tensorflow  # noqa: F401  pylint: disable=unused-import,import-outside-toplevel
    return True
  except ImportError:
    return False


class LinkSampler:
  """Samples every host link's bytes (both directions) every ``every`` seconds.

  The workers keep both cores busy, so the sampling thread asks for real-time priority (as
  root) and keeps only the samples whose counters were read within ``max_read`` seconds of
  their timestamp: a thread preempted between the clock and the counters would put a late
  count on an early time, which draws as a rate far above the link's."""

  def __init__(self, bed, hosts, every=0.005, max_read=0.001):
    self.bed, self.hosts, self.every, self.max_read = bed, hosts, every, max_read
    self.samples = []
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, daemon=True)

  def start(self):
    self._thread.start()

  def stop(self):
    self._stop.set()
    self._thread.join(5)

  def _loop(self):
    try:                                 # pid 0: this thread only; needs root
      os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (AttributeError, OSError):
      pass
    while not self._stop.is_set():
      before = time.time()
      counts = [self.bed.link_bytes(h) for h in range(self.hosts)]
      after = time.time()
      if after - before <= self.max_read:
        self.samples.append(((before + after) / 2, counts))
      time.sleep(self.every)


def slowest(results):
  """The slowest worker's median step time of one run (every worker waits for it)."""
  return max(r["seconds"] for r in results)


def measure(bed, rate, args, have_hvd):
  b = Bench(bed, rate, args.steps)
  report = {"rate": rate, "allreduce": [], "dp": {}}
  for hosts in args.hosts:
    for mib in args.sizes:
      runs = []                   # --repeat: epl's and Horovod's runs interleaved
      for _ in range(args.repeat):
        runs.append((b.run("allreduce", hosts, "--mib", mib), b.run(
            "horovod_allreduce", hosts, "--mib", mib, horovod=True) if have_hvd else None))
      epl_r = runs[0][0]
      row = {"hosts": hosts, "mib": mib, "bound_s": ring_seconds(mib * MIB, hosts, rate),
             "epl_runs_s": [slowest(e) for e, _ in runs],
             "epl_tx_per_step": statistics.mean(r["tx_per_step"] for r in epl_r),
             "epl_cpu_s": statistics.median(sum(r["cpu_per_step"] for r in e) for e, _ in runs)}
      row["epl_s"] = statistics.median(row["epl_runs_s"])
      if have_hvd:
        row["hvd_runs_s"] = [slowest(h) for _, h in runs]
        row["hvd_s"] = statistics.median(row["hvd_runs_s"])
        row["hvd_cpu_s"] = statistics.median(sum(r["cpu_per_step"] for r in h)
                                             for _, h in runs)
      report["allreduce"].append(row)
      if args.repeat > 1:
        print("  %d runs each, interleaved: epl %s s; Horovod %s s (medians below)" % (
            args.repeat, " ".join("%.4f" % t for t in row["epl_runs_s"]),
            " ".join("%.4f" % t for t in row.get("hvd_runs_s", []))), flush=True)
      # CPU: seconds of CPU per all-reduce, summed over the hosts' workers (the hosts share
      # this machine's cores: a sum near 2 x the time is a CPU-bound all-reduce)
      print("  all-reduce %2d MiB, %d hosts: epl %.4f s (CPU %.2f s), bound %.4f s, link "
            "fraction %.3f%s" % (
                mib, hosts, row["epl_s"], row["epl_cpu_s"], row["bound_s"],
                row["bound_s"] / row["epl_s"],
                "; Horovod %.4f s (CPU %.2f s, %.3f)" % (
                    row["hvd_s"], row["hvd_cpu_s"], row["bound_s"] / row["hvd_s"])
                if "hvd_s" in row else ""), flush=True)
  for model in ("comm", "compute"):
    bound = ring_seconds(gradient_bytes(model), 2, rate)
    runs = []            # --repeat: (compute, epl's DP, Horovod's DP) each time, interleaved
    for _ in range(args.repeat):
      local = slowest(b.run("local", 2, "--model", model))
      dp = b.run("dp", 2, "--model", model)
      hvd = (b.run("horovod_dp", 2, "--model", model, horovod=True)
             if model == "comm" and have_hvd else None)
      runs.append((local, dp, hvd))
    ratios = [slowest(dp) / max(local, bound) for local, dp, _ in runs]
    local, dp, hvd = runs[sorted(range(len(runs)), key=ratios.__getitem__)[len(runs) // 2]]
    step = slowest(dp)                             # the run with the median ratio
    entry = {"compute_s": local, "comm_bound_s": bound, "step_s": step,
             "ratio": step / max(local, bound), "ratio_runs": ratios,
             "samples_per_s": dp[0]["samples_per_s"],
             "tx_per_step": statistics.mean(r["tx_per_step"] for r in dp),
             "min_tx_per_step": 2.0 * (2 - 1) / 2 * gradient_bytes(model)}
    if args.repeat > 1:
      print("  DP %s, %d runs each, interleaved: epl step / max %s%s (median run below)" % (
          model, args.repeat, " ".join("%.2f" % r for r in ratios),
          "; Horovod's %s" % " ".join(
              "%.2f" % (slowest(h) / max(l, bound)) for l, _, h in runs)
          if runs[0][2] else ""), flush=True)
    print("  DP %-7s: step %.3f s, compute %.3f s, comm bound %.3f s: step / max = %.2f; "
          "sent per step %.1f MB = %.2f x the ring's minimum" % (
              model, step, local, bound, entry["ratio"], entry["tx_per_step"] / 1e6,
              entry["tx_per_step"] / entry["min_tx_per_step"]), flush=True)
    if model == "comm":
      fp16 = b.run("dp", 2, "--model", model, "--fp16")
      entry["fp16_tx_per_step"] = statistics.mean(r["tx_per_step"] for r in fp16)
      entry["fp16_step_s"] = slowest(fp16)
      print("  DP comm, communication.fp16: sent per step %.1f MB = %.2f x float32's; step "
            "%.3f s" % (entry["fp16_tx_per_step"] / 1e6,
                        entry["fp16_tx_per_step"] / entry["tx_per_step"],
                        entry["fp16_step_s"]), flush=True)
      if hvd:
        entry["hvd_samples_per_s"] = hvd[0]["samples_per_s"]
        entry["hvd_step_s"] = slowest(hvd)
        print("  DP comm samples/s: epl %.1f, Horovod %.1f: epl / Horovod %.2f; Horovod's "
              "step / max = %.2f" % (
                  entry["samples_per_s"], entry["hvd_samples_per_s"],
                  entry["samples_per_s"] / entry["hvd_samples_per_s"],
                  entry["hvd_step_s"] / max(local, bound)), flush=True)
    report["dp"][model] = entry
  return report


def picture(bed, rate, args):
  """Runs one traced DP step of the comm model with the links sampled; draws --png."""
  b = Bench(bed, rate, 3)
  sampler = LinkSampler(bed, 2)
  results = b.run("dp", 2, "--model", "comm", "--trace", sampler=sampler)
  trace = results[0]["trace"]
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  t0 = trace["start"]
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True,
                                    gridspec_kw={"height_ratios": [3, 2]})
  samples = [(t, v) for t, v in sampler.samples if t0 - 0.2 <= t <= trace["end"] + 0.2]
  # rates over windows of >= 20 ms: tc's token bucket lets 20 ms worth through at once
  # (epl.testing.cluster), so a shorter window shows its bursts, not the link's rate
  windows, start = [], 0
  for end in range(1, len(samples)):
    if samples[end][0] - samples[start][0] >= 0.02:
      windows.append((samples[start], samples[end]))
      start = end
  for h in range(2):
    for direction, style in ((1, "-"), (0, "--")):
      xs, ys = [], []
      for (ta, va), (tb, vb) in windows:
        xs.append((ta + tb) / 2 - t0)
        ys.append((vb[h][direction] - va[h][direction]) * 8 / (tb - ta) / 1e6)
      top.plot(xs, ys, style, label="host %d %s" % (h, "sends" if direction else "receives"))
  top.axhline(_bits(rate) / 1e6, color="grey", linewidth=0.8)
  top.set_ylabel("Mbit/s on the link\n(20 ms windows)")
  top.legend(loc="upper right", fontsize=8)
  top.set_title("one data-parallel step, 2 hosts, links capped at %s, %.0f MiB of gradients"
                % (rate, gradient_bytes("comm") / MIB))
  colours = {"forward": "#4c9be8", "backward": "#f28e2b", "update": "#b07aa1"}
  # a lane per device and kind (compute, gradient all-reduce buckets): overlap shows as bars
  # above one another; a label only where its bar is wide enough to hold it
  lane = lambda row, label: "worker 0 %s %s" % (
      row.split("/")[-1], "all-reduce" if label.startswith("AR") else "compute")
  lanes = sorted({lane(row, label) for row, label, _, _ in trace["spans"]})
  offset, width = trace["origin"] - t0, trace["end"] - t0
  labelled = {}                  # lane -> where its last label's bar ends (no label on top)
  for row, label, start, end in sorted(trace["spans"], key=lambda s: s[2]):
    y = lanes.index(lane(row, label))
    bottom.barh(y, (end - start) / 1e6, left=offset + start / 1e6, height=0.6,
                color=colours.get(label, "#59a14f"), edgecolor="white", linewidth=0.6)
    if (end - start) / 1e6 > width / 30 and start >= labelled.get(y, -1):
      bottom.text(offset + (start + end) / 2e6, y, label, ha="center", va="center",
                  fontsize=7)
      labelled[y] = end
  bottom.set_yticks(range(len(lanes)))
  bottom.set_yticklabels(lanes, fontsize=8)
  bottom.set_xlabel("seconds from the start of the step")
  fig.tight_layout()
  fig.savefig(args.png, dpi=110)
  print("  picture: %s" % args.png)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--role", default="driver", choices=["driver"] + sorted(WORKERS))
  p.add_argument("--rates", default="1gbit,10gbit")
  p.add_argument("--sizes", default="4,16,64")
  p.add_argument("--hosts", default="2,3")
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--repeat", type=int, default=1)
  p.add_argument("--mib", type=int, default=4)
  p.add_argument("--model", default="comm", choices=sorted(MODELS))
  p.add_argument("--fp16", action="store_true")
  p.add_argument("--trace", action="store_true")
  p.add_argument("--png", default=None)
  p.add_argument("--json", action="store_true")
  args = p.parse_args()
  if args.role != "driver":
    WORKERS[args.role](args)
    return 0
  sys.path.insert(0, ROOT)
  from epl.testing import cluster
  why = cluster.available()
  if why:
    print("bench/cluster.py needs network namespaces: %s" % why)
    return 2
  args.sizes = [int(s) for s in args.sizes.split(",")]
  args.hosts = [int(h) for h in args.hosts.split(",")]
  have_hvd = horovod_available()
  if not have_hvd:
    print("Horovod is not installed here (bash bench/build_horovod.sh builds it): epl only")
  reports = []
  for i, rate in enumerate(args.rates.split(",")):
    print("links capped at %s:" % rate, flush=True)
    with cluster.Testbed(max(args.hosts), rate=rate) as bed:
      reports.append(measure(bed, rate, args, have_hvd))
      if args.png and i == 0:
        picture(bed, rate, args)
  if args.json:
    print(json.dumps(reports))
  return 0


if __name__ == "__main__":
  sys.exit(main())
