"""Soak: train for a long time and watch threads, resident memory and steps/s.

  python bench/soak.py [--seconds 600] [--cases dp2,workers2x1,pipeline2] [--interval 10] [--json]

Cases (each a training script written the way users write them: tf.layers MLP, a dataset
iterator, Adam, global_step, MonitoredTrainingSession, a loop until time is up):
  dp2         data parallelism over 2 devices in one process
  workers2x1  2 worker processes x 1 device (TF_CONFIG, as a scheduler or epl-launch sets it)
  pipeline2   a 2-stage pipeline with 4 micro-batches on 2 devices
The cases run at the same time (they measure leaks, not speed). Every worker samples its own
thread count (/proc/self/task), RSS (VmRSS) and step count every ``--interval`` seconds.

A worker passes when it lived to the end, its thread count stayed in the hundreds
(<= MAX_THREADS) and did not grow from the middle of the run to the end, and its RSS did not
grow by more than RSS_GROWTH from the middle to the end. The script prints a table per worker
(``--json``: one JSON object) and exits non-zero when a worker fails. tests/test_soak.py runs it
for 60 s in CI; docs/benchmarks.md records a 10-minute run.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

MAX_THREADS = 400
THREAD_SLACK = 4            # a pool may start a thread late; growth beyond this is a leak
RSS_GROWTH = 0.05
VOTE_EVERY = 100
CASES = ("dp2", "workers2x1", "pipeline2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- the worker: a user's training script plus a sampler ---------------------------------
def _sample():
  with open("/proc/self/status") as f:
    rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
  return len(os.listdir("/proc/self/task")), rss_kb / 1024.0


def worker(case, seconds, interval):
  import numpy as np
  import tensorflow.compat.v1 as tf
  tf.disable_v2_behavior()
  import epl
  micro = 4 if case == "pipeline2" else 1
  env = epl.init(epl.Config({"pipeline.num_micro_batch": micro}))
  rng = np.random.RandomState(env.cluster.worker_index)
  features = rng.randn(1024, 32).astype(np.float32)
  labels = (features[:, :3].sum(axis=1) > 0).astype(np.int64)
  dataset = tf.data.Dataset.from_tensor_slices((features, labels)).shuffle(1024).batch(16)
  x, y = tf.data.make_one_shot_iterator(dataset.repeat()).get_next()
  with epl.replicate(1, name="stage_0"):
    h = tf.layers.dense(x, 64, activation=tf.nn.relu)
  if case == "pipeline2":
    with epl.replicate(1, name="stage_1"):
      h = tf.layers.dense(h, 64, activation=tf.nn.relu)
      logits = tf.layers.dense(h, 2)
  else:
    h = tf.layers.dense(h, 64, activation=tf.nn.relu)
    logits = tf.layers.dense(h, 2)
  loss = tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)
  step = tf.train.get_or_create_global_step()
  train = tf.train.AdamOptimizer(1e-3).minimize(loss, global_step=step)
  # Workers stop together: every VOTE_EVERY steps each says whether its time is up, and the
  # job-wide sum decides (a worker that left alone would fail its peers' next collective).
  vote = tf.placeholder(tf.float32, [], name="stop_vote")
  votes = vote * 1.0
  epl.add_to_collection(votes, epl.GraphKeys.GLOBAL_SUM_OBJECTS)
  samples = []
  start = time.time()
  next_sample = start
  steps = 0
  with tf.train.MonitoredTrainingSession(save_summaries_steps=None, save_checkpoint_secs=None,
                                         log_step_count_steps=None) as sess:
    while True:
      now = time.time()
      if now >= next_sample:
        threads, rss = _sample()
        samples.append({"t": round(now - start, 1), "steps": steps, "threads": threads,
                        "rss_mb": round(rss, 1)})
        print(json.dumps(dict(samples[-1], sample=True)), flush=True)
        next_sample += interval
      if steps % VOTE_EVERY == 0 and steps and \
          sess.run(votes, {vote: float(now - start >= seconds)}) > 0:
        break
      sess.run([train, loss])
      steps += 1
    closing = time.time()
  threads, rss = _sample()
  samples.append({"t": round(time.time() - start, 1), "steps": steps, "threads": threads,
                  "rss_mb": round(rss, 1), "close_s": round(time.time() - closing, 2)})
  print(json.dumps({"done": True, "samples": samples}), flush=True)


# ---- the driver ---------------------------------------------------------------------------
def _free_ports(n):
  socks = [socket.socket() for _ in range(n)]
  for s in socks:
    s.bind(("127.0.0.1", 0))
  ports = [s.getsockname()[1] for s in socks]
  for s in socks:
    s.close()
  return ports


def _start(case, seconds, interval):
  """Starts the case's worker processes; returns [(name, Popen)]."""
  base = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
              PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
  argv = [sys.executable, os.path.abspath(__file__), "--role", "worker", "--cases", case,
          "--seconds", str(seconds), "--interval", str(interval)]
  if case == "workers2x1":
    hosts = ["localhost:%d" % p for p in _free_ports(2)]
    envs = [dict(base, EPL_CLUSTER_DEVICES_PER_WORKER="1", TF_CONFIG=json.dumps(
        {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": i}}))
            for i in range(2)]
  else:
    envs = [dict(base, EPL_CLUSTER_DEVICES_PER_WORKER="2")]
  return [("%s/worker%d" % (case, i), subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                                        stderr=subprocess.PIPE, text=True))
          for i, env in enumerate(envs)]


def judge(samples):
  """Returns a list of problems with one worker's samples (empty: it passed)."""
  if len(samples) < 3:
    return ["only %d sample(s): the worker did not live to the end" % len(samples)]
  middle, end = samples[len(samples) // 2], samples[-1]
  problems = []
  peak = max(s["threads"] for s in samples)
  if peak > MAX_THREADS:
    problems.append("thread count reached %d (> %d)" % (peak, MAX_THREADS))
  if end["threads"] > middle["threads"] + THREAD_SLACK:
    problems.append("threads grew from %d (t=%.0f s) to %d (t=%.0f s)" % (
        middle["threads"], middle["t"], end["threads"], end["t"]))
  if end["rss_mb"] > middle["rss_mb"] * (1 + RSS_GROWTH):
    problems.append("RSS grew from %.1f MB (t=%.0f s) to %.1f MB (t=%.0f s), more than %d%%" % (
        middle["rss_mb"], middle["t"], end["rss_mb"], end["t"], RSS_GROWTH * 100))
  return problems


def drive(cases, seconds, interval, as_json):
  procs = [p for case in cases for p in _start(case, seconds, interval)]
  report = {}
  for name, proc in procs:
    try:
      out, err = proc.communicate(timeout=seconds + 120)
    except subprocess.TimeoutExpired:
      proc.kill()
      out, err = proc.communicate()
    done = [json.loads(l) for l in out.splitlines() if l.startswith('{"done"')]
    samples = done[0]["samples"] if done else [
        json.loads(l) for l in out.splitlines() if l.startswith("{") and '"sample"' in l]
    problems = judge(samples)
    if proc.returncode != 0:
      errors = [l for l in err.splitlines() if "Error" in l and not l.startswith(" ")]
      problems.insert(0, "exited with code %s: %s\n%s" % (
          proc.returncode, "\n".join(errors[-4:]), err.strip()[-1500:]))
    report[name] = {"samples": samples, "problems": problems}
  if as_json:
    print(json.dumps(report))
  else:
    for name, r in report.items():
      print("%s: %s" % (name, "PASS" if not r["problems"] else "FAIL: " + "; ".join(
          r["problems"])))
      print("    %7s %9s %8s %8s %9s" % ("t (s)", "steps", "steps/s", "threads", "RSS (MB)"))
      prev = None
      for s in r["samples"]:
        rate = (s["steps"] - prev["steps"]) / max(1e-9, s["t"] - prev["t"]) if prev else 0.0
        print("    %7.0f %9d %8.0f %8d %9.1f" % (s["t"], s["steps"], rate, s["threads"],
                                                  s["rss_mb"]))
        prev = s
  return 0 if all(not r["problems"] for r in report.values()) else 1


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--seconds", type=float, default=600)
  p.add_argument("--interval", type=float, default=10)
  p.add_argument("--cases", default=",".join(CASES))
  p.add_argument("--json", action="store_true")
  p.add_argument("--role", default="driver", choices=["driver", "worker"])
  args = p.parse_args()
  cases = [c for c in args.cases.split(",") if c]
  unknown = set(cases) - set(CASES)
  if unknown:
    p.error("unknown case(s) %s; choose from %s" % (", ".join(sorted(unknown)), ", ".join(CASES)))
  if args.role == "worker":
    worker(cases[0], args.seconds, args.interval)
    return 0
  return drive(cases, args.seconds, args.interval, args.json)


if __name__ == "__main__":
  sys.exit(main())
