"""How often TensorFlow rejects a step as a duplicate request, per step path, with TF's own
request ids and with epl's (communication.unique_request_ids).

  python bench/rejections.py [--steps 200000] [--bits 20,24] [--natural 0] [--paths run,callable]

Each measurement is one process: a worker server (tf.train.Server) and a session on it running
a small step (a variable update) ``--steps`` times; a step TF rejects ("The same RunGraph
(Worker) request was received twice") is counted and run again. TF draws a step's RunGraph id
from a thread-local generator seeded with 32 random bits on the new thread the master starts
for the step, and a worker rejects an id among its last 100,000: per step about
min(steps so far, 100k) / 2^32. To measure that in minutes, the seeds keep only ``b`` random
bits (epl.testing.rejections, preloaded): the rate is 2^(32-b) times TF's, and the script
prints the measured rate and the rate it implies for TF's 32 bits. ``--natural N`` also runs N
steps with TF's full 32 bits (no preload). Paths: ``run`` (Session.run: the master's RunStep)
and ``callable`` (Session.make_callable: RunCallable). With epl's ids the seeds do not matter:
zero rejections whatever the bits.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WINDOW = 100000


def measure(path, steps, unique):
  """(runs in the child) -> dict with the counts."""
  import tensorflow.compat.v1 as tf
  tf.disable_v2_behavior()
  sys.path.insert(0, ROOT)
  from epl import _tf_compat as compat
  from epl.launch.spec import free_ports
  host = "localhost:%d" % free_ports(1)[0]
  server = tf.train.Server(tf.train.ClusterSpec({"worker": [host]}), "worker", 0)
  if unique:
    why = compat.unique_request_ids()
    assert why is None, why
  with tf.Graph().as_default():
    v = tf.Variable(0.0)
    step = tf.assign_add(v, 1.0)
    sess = tf.Session(server.target)
    sess.run(v.initializer)
    run = sess.make_callable(step) if path == "callable" else (lambda: sess.run(step))
    rejected, done, start, error = [], 0, time.time(), None
    while done < steps:
      try:
        run()
        done += 1
      except tf.errors.OpError as e:
        if "received twice" not in str(e):
          error = "%s after %d steps: %s" % (type(e).__name__, done, str(e)[:300])
          break
        rejected.append(done)
    seconds = time.time() - start
    if error is None and sess.run(v) != steps:
      error = "the variable counted %d updates for %d steps" % (sess.run(v), steps)
  return {"path": path, "steps": done, "rejected": rejected, "seconds": seconds,
          "error": error}


def expected(steps, bits):
  """Rejections the birthday bound predicts for ``steps`` steps: each step's id is the first
  output of one of 2^bits seeds, checked against the last WINDOW ids."""
  total, space = 0.0, float(2 ** bits)
  for n in range(0, steps, 1000):
    total += 1000 * min(n, WINDOW) / space
  return total


def child(args):
  print(json.dumps(measure(args.path, args.steps, args.unique)), flush=True)


def run_child(path, steps, bits, unique):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="",
             PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
  if bits is not None:
    sys.path.insert(0, ROOT)
    from epl.testing import rejections
    env = rejections.preloaded(env, bits)
  argv = [sys.executable, os.path.abspath(__file__), "--role", "child", "--path", path,
          "--steps", str(steps)] + (["--unique"] if unique else [])
  done = subprocess.run(argv, env=env, capture_output=True, text=True)
  lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
  if done.returncode != 0 or not lines:
    return {"path": path, "steps": 0, "rejected": [], "seconds": 1.0,
            "error": "exit %d: %s" % (done.returncode, done.stderr.strip()[-500:])}
  return json.loads(lines[-1])


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--steps", type=int, default=200000)
  p.add_argument("--bits", default="20,24")
  p.add_argument("--natural", type=int, default=0)
  p.add_argument("--paths", default="run,callable")
  p.add_argument("--role", default="driver", choices=["driver", "child"])
  p.add_argument("--path", default="run")
  p.add_argument("--unique", action="store_true")
  args = p.parse_args()
  if args.role == "child":
    return child(args)
  rows = []
  for path in args.paths.split(","):
    for bits in [int(b) for b in args.bits.split(",") if b]:
      for unique in (False, True):
        rows.append((path, bits, unique, run_child(path, args.steps, bits, unique)))
    if args.natural:
      rows.append((path, 32, False, run_child(path, args.natural, None, False)))
  print("%-9s %5s %-9s %9s %9s %10s %12s %14s" % ("path", "bits", "ids", "steps", "rejected",
                                                  "predicted", "per 100k", "TF (32 bits)"))
  for path, bits, unique, r in rows:
    count = len(r["rejected"])
    per = 1e5 * count / max(1, r["steps"])
    predicted = 0.0 if unique else expected(r["steps"], bits)
    tf_rate = "" if unique else "%.2f" % (per * 2.0 ** (bits - 32))
    print("%-9s %5d %-9s %9d %9d %10.1f %12.2f %14s   (%.0f steps/s)%s" % (
        path, bits, "epl" if unique else "TF's own", r["steps"], count, predicted, per, tf_rate,
        r["steps"] / r["seconds"], "  ERROR " + r["error"] if r.get("error") else ""))
  return 0


if __name__ == "__main__":
  sys.exit(main())
