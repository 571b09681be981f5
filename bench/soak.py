"""Soak: train for a long time the way real jobs do; watch liveness, steps, threads and memory.

  python bench/soak.py [--alone] [--seconds 600]
                       [--cases dp2x1,dp2x2,pipe2x1,zero2x1,zerov2x1,local1x2]
                       [--interval 10] [--checkpoint-secs 30] [--eval-every 500] [--json]
  python bench/soak.py --cases restart2x1 --target-steps 100000
                       [--kill-every 120 | --kill-at-steps 20000,40000]

Cases (each worker is a user's training script started from TF_CONFIG, as a scheduler or
epl-launch starts it):
  dp2x1     data parallelism, 2 workers x 1 device
  dp2x2     data parallelism, 2 workers x 2 devices
  pipe2x1   a 2-stage pipeline across 2 workers (a stage per worker), 4 micro-batches
  zero2x1   ZeRO v1 across 2 workers x 1 device
  zerov2x1  ZeRO v2 across 2 workers x 1 device (each weight on its owner's worker only)
  local1x2  data parallelism over 2 devices of one process
  restart2x1  data parallelism, 2 workers x 1 device, started by ``epl-launch --max_restarts
            6 --restart_window`` 5 x ``--kill-every`` (600 s); ``--kill-every`` seconds (120)
            after the job trains again a random worker is killed with SIGKILL; the job must
            reach ``--target-steps`` (global_step) before ``--deadline``, with one restart per
            kill (not in the default --cases: run it by name). ``--kill-at-steps 1000,2000``
            kills once global_step passes each step instead: the same kills at any speed
  restart2x1trunc  restart2x1, and before each restart the newest checkpoint's .data file is
            cut in half (a disk that failed mid-write): every restart must resume from the
            checkpoint before it (epl.runtime.checkpoints), never from the truncated one
What every script does while it trains (tf.layers MLP, dataset iterator,
MonitoredTrainingSession): a checkpoint every ``--checkpoint-secs`` by the chief, summaries
every 100 steps, an evaluation pass (20 batches of another iterator) every ``--eval-every``
steps, and a GAN-style pair of train ops run in alternate steps (Adam on the first layer with
global_step, Momentum on the others). Workers stop together: every 100 steps each says
whether its time is up and the job-wide sum (GLOBAL_SUM_OBJECTS) decides.

``--alone`` runs the cases one after another, each alone on the machine at full speed (the
rate users see; TF's duplicate-request rejection is rate-dependent); without it they run at
the same time (they then measure leaks, not speed). A background thread of every worker
samples its thread count (/proc/self/task), RSS (VmRSS), training steps, global_step and the
steps TF rejected as duplicate requests (epl's log) every ``--interval`` seconds.

A worker passes when it lived to the end, its thread count stayed in the hundreds
(<= MAX_THREADS) and did not grow from the middle of its training to the end, its RSS did not
grow by more than RSS_GROWTH (and RSS_GROWTH_MB) from the middle to the end of its training,
TF pinned no more aborted rendezvous from the middle to the end
(epl._tf_compat.native.pinned_rendezvous), and its global_step never went back (EPL's issue
#17: a non-chief step fell back to 0 after a save and hung after the next one). The
script prints a table per worker (``--json``: one JSON object) and exits non-zero when a worker
fails. tests/test_soak.py runs it briefly in CI; docs/benchmarks.md records the long runs.
"""
import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time

MAX_THREADS = 400
THREAD_SLACK = 4            # a pool may start a thread late; growth beyond this is a leak
RSS_GROWTH = 0.05
# ...and at least this much: one-time allocations (the first checkpoint, an evaluation) move a
# short run's middle sample; 5% of a fresh worker (~600 MB), and a worker forked from a process
# that imported TensorFlow before (launch.python: the tests' fork server) starts at ~300 MB
RSS_GROWTH_MB = 32
VOTE_EVERY = 100
EVAL_BATCHES = 20
CASES = {                   # name: (workers, devices per worker, epl config)
    "dp2x1": (2, 1, {}),
    "dp2x2": (2, 2, {}),
    "pipe2x1": (2, 1, {"pipeline.num_micro_batch": 4}),
    "zero2x1": (2, 1, {"zero.level": "v1"}),
    "zerov2x1": (2, 1, {"zero.level": "v2"}),
    "local1x2": (1, 2, {}),
    "restart2x1": (2, 1, {}),      # started by epl-launch --max_restarts (drive_restarts)
}
RESTART_CASE = "restart2x1"
TRUNCATED_CASE = "restart2x1trunc"     # restart2x1 with the newest checkpoint truncated
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- the worker: a user's training script plus a sampler ---------------------------------
def _proc_sample():
  """(threads, RSS MB, heap in use MB, rendezvous TF keeps) of this process: RSS growing with
  the heap in use flat is the allocator keeping freed memory; both growing, live allocations
  (the last: epl._tf_compat.native.pinned_rendezvous, 0 with epl's hook)."""
  from collective_memory import memory     # bench/, beside this script
  from epl._tf_compat import native
  rss, heap, _ = memory()
  return len(os.listdir("/proc/self/task")), rss, heap, native.pinned_rendezvous()


class _Rejections(logging.Handler):
  """Counts epl's "rejected a step as a duplicate request" warnings (one per rerun)."""

  def __init__(self):
    super().__init__(logging.WARNING)
    self.count = 0

  def emit(self, record):
    if "duplicate request" in record.getMessage():
      self.count += 1


class _Sampler:
  """Prints a JSON sample every ``interval`` seconds from a daemon thread (a worker that only
  serves a pipeline stage never reaches the training loop), and a last one at exit."""

  def __init__(self, interval, rejections):
    self.start = time.time()
    self.interval = interval
    self.rejections = rejections
    self.steps = self.gs = self.evals = 0
    self.samples = []
    self.lock = threading.Lock()
    threading.Thread(target=self._loop, daemon=True).start()

  def sample(self, **extra):
    threads, rss, heap, pinned = _proc_sample()
    with self.lock:
      s = dict(t=round(time.time() - self.start, 1), steps=self.steps, gs=self.gs,
               evals=self.evals, rejected=self.rejections.count, threads=threads,
               rss_mb=round(rss, 1), heap_mb=round(heap, 1), pinned=pinned, **extra)
      self.samples.append(s)
    print(json.dumps(dict(s, sample=True)), flush=True)

  def _loop(self):
    while True:
      self.sample()
      time.sleep(self.interval)

  def done(self, **extra):
    self.sample(**extra)
    print(json.dumps({"done": True, "samples": self.samples}), flush=True)


def worker(case, seconds, interval, checkpoint_secs, eval_every, checkpoint_dir,
           target_steps=0):
  import atexit
  import numpy as np
  import tensorflow.compat.v1 as tf
  tf.disable_v2_behavior()
  import epl
  _, _, config = CASES[RESTART_CASE if case == TRUNCATED_CASE else case]
  if case == TRUNCATED_CASE and os.environ.get("EPL_LAUNCH_ATTEMPT", "0") != "0" and \
      os.environ.get("EPL_LAUNCH_WORKER_INDEX") == "0":
    # the restarted chief, before its session restores: the newest checkpoint cut short (a
    # disk that failed mid-write); the driver reads this line
    print("soak: truncated checkpoint %s" % _truncate_newest(checkpoint_dir), flush=True)
  rejections = _Rejections()
  logging.getLogger("epl").addHandler(rejections)
  env = epl.init(epl.Config(config))
  sampler = _Sampler(interval, rejections)
  closing = []            # [time the loop ended, time the session was closed]

  def at_exit():
    now = time.time()
    sampler.done(**({} if not closing else {
        "close_s": round(closing[1] - closing[0], 2) if len(closing) > 1 else None,
        "exit_s": round(now - closing[-1], 2)}))
  atexit.register(at_exit)
  pipeline = case.startswith("pipe")
  rng = np.random.RandomState(env.cluster.worker_index)

  def batches(n, seed):
    features = np.random.RandomState(seed).randn(n, 32).astype(np.float32)
    labels = (features[:, :3].sum(axis=1) > 0).astype(np.int64)
    return tf.data.Dataset.from_tensor_slices((features, labels))
  x, y = tf.data.make_one_shot_iterator(
      batches(1024, rng.randint(1 << 30)).shuffle(1024).repeat().batch(16)).get_next()
  ex, ey = tf.data.make_one_shot_iterator(batches(320, 99).repeat().batch(16)).get_next()

  def model(inputs, labels, reuse):
    with epl.replicate(1, name="stage_0"), tf.variable_scope("g", reuse=reuse):
      h = tf.layers.dense(inputs, 64, activation=tf.nn.relu)
    with epl.replicate(1, name="stage_1" if pipeline else "stage_0"), \
        tf.variable_scope("d", reuse=reuse):
      h = tf.layers.dense(h, 64, activation=tf.nn.relu)
      logits = tf.layers.dense(h, 2)
    return tf.losses.sparse_softmax_cross_entropy(labels=labels, logits=logits)
  loss = model(x, y, False)
  eval_loss = model(ex, ey, True)
  tf.summary.scalar("loss", loss)
  step = tf.train.get_or_create_global_step()
  g_vars = tf.trainable_variables("g")
  d_vars = tf.trainable_variables("d")
  train_g = tf.train.AdamOptimizer(1e-3).minimize(loss, var_list=g_vars, global_step=step)
  train_d = tf.train.MomentumOptimizer(1e-2, 0.9).minimize(loss, var_list=d_vars)
  vote = tf.placeholder(tf.float32, [], name="stop_vote")
  votes = vote * 1.0
  epl.add_to_collection(votes, epl.GraphKeys.GLOBAL_SUM_OBJECTS)
  start = time.time()
  with tf.train.MonitoredTrainingSession(
      checkpoint_dir=checkpoint_dir, save_checkpoint_secs=checkpoint_secs,
      save_summaries_steps=100, log_step_count_steps=None) as sess:
    last_gs = first_gs = int(sess.run(step))       # > 0 when restored from a checkpoint
    while True:
      steps = sampler.steps
      if target_steps:                    # the restart case: train up to a global step
        if last_gs >= target_steps:
          break
      elif steps % VOTE_EVERY == 0 and steps:
        if sess.run(votes, {vote: float(time.time() - start >= seconds)}) > 0:
          break
      if steps % 2 == 0:
        _, gs = sess.run([train_g, step])
        if gs < last_gs:                  # (read before or after this step's increment)
          raise RuntimeError("global_step went from %d back to %d" % (last_gs, gs))
        last_gs = gs
      else:
        sess.run(train_d)
      sampler.steps, sampler.gs = steps + 1, int(last_gs)
      if eval_every and (steps + 1) % eval_every == 0:
        for _ in range(EVAL_BATCHES):
          sess.run(eval_loss)
        sampler.evals += 1
    final = int(sess.run(step))
    if final != first_gs + (sampler.steps + 1) // 2:
      raise RuntimeError("global_step is %d after %d runs of the first train op from %d" % (
          final, (sampler.steps + 1) // 2, first_gs))
    sampler.gs = final
    closing.append(time.time())
  closing.append(time.time())


# ---- the restart case: epl-launch --max_restarts, a worker killed every --kill-every s ------
def _truncate_newest(ckpt):
  """Cuts the newest checkpoint's .data file in half; returns its step (None: none there)."""
  import glob
  import re
  steps = [(int(m.group(1)), path) for path in glob.glob(os.path.join(ckpt, "*.data-*"))
           for m in [re.search(r"ckpt-(\d+)\.data", path)] if m]
  if not steps:
    return None
  step, path = max(steps)
  with open(path, "rb") as f:
    data = f.read()
  with open(path, "wb") as f:
    f.write(data[:len(data) // 2])
  return step


def _logs_text(scratch):
  logs = os.path.join(scratch, "restart_logs")
  try:
    names = os.listdir(logs)
  except OSError:
    return ""
  return "".join(open(os.path.join(logs, f), errors="replace").read() for f in names
                 if f.endswith(".log"))


def drive_restarts(args, scratch, truncate=False):
  """Runs ``restart2x1`` to ``--target-steps`` (``truncate``: restart2x1trunc); returns its
  report."""
  import random
  import re
  import signal
  ckpt = os.path.join(scratch, "restart2x1")
  truncated = []
  argv = [sys.executable, "-m", "epl.launch.cli", "--num_workers", "2", "--max_restarts",
          str(RESTARTS_PER_WINDOW), "--restart_window",
          str(int(round(KILLS_PER_WINDOW * args.kill_every))), "--log_dir",
          os.path.join(scratch, "restart_logs"), os.path.abspath(__file__), "--role", "worker",
          "--cases", TRUNCATED_CASE if truncate else RESTART_CASE, "--target-steps",
          str(args.target_steps), "--interval",
          str(args.interval), "--checkpoint-secs", str(args.checkpoint_secs), "--eval-every",
          str(args.eval_every), "--checkpoint-dir", ckpt]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
             EPL_LOG_PROGRESS_SECS="0",
             PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
  start = time.time()
  launcher = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
  lines, pids, samples = [], {}, []
  fresh = [0]      # samples from this index on come from workers started since the last kill

  def read():
    for line in launcher.stdout:
      lines.append((time.time() - start, line))
      found = re.search(r"epl-launch: worker (\d+) started \(pid (\d+)\)", line)
      if found:
        pids[int(found.group(1))] = int(found.group(2))
        fresh[0] = len(samples)
      if line.startswith("[0] {") and '"sample"' in line:
        samples.append(json.loads(line[4:]))
      found = re.search(r"soak: truncated checkpoint (\S+)", line)
      if found:
        truncated.append(None if found.group(1) == "None" else int(found.group(1)))
  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  # The clock of the next kill starts when the (re)started job trains again: a fixed schedule
  # leaves no training between kills on a machine where a restart takes most of --kill-every
  kills, pick, armed = [], random.Random(args.seed), None
  kill_at = sorted(int(x) for x in args.kill_at_steps.split(",") if x) if args.kill_at_steps else []
  try:
    while launcher.poll() is None:
      time.sleep(0.5)
      now = time.time()
      if now - start > args.deadline:
        break
      if armed is None and fresh[0] is not None and any(
          s["steps"] > 0 for s in samples[fresh[0]:]):
        armed = now
      gs_now = samples[-1]["gs"] if samples else 0
      done = gs_now >= args.target_steps   # closing: no kill
      if kill_at:     # by global_step: as many kills however fast the machine trains
        due = armed is not None and len(kills) < len(kill_at) and gs_now >= kill_at[len(kills)]
      else:
        due = armed is not None and now >= armed + args.kill_every
      if due and pids and not done:
        victim = pick.choice(sorted(pids))
        try:
          os.kill(pids.pop(victim), signal.SIGKILL)
          kills.append({"t": round(now - start), "worker": victim, "gs_before": gs_now})
          fresh[0], armed = None, None
        except ProcessLookupError:
          pass
  finally:
    if launcher.poll() is None:      # past the deadline, or the driver itself failed
      os.killpg(launcher.pid, signal.SIGKILL)
      launcher.wait()
  reader.join(10)
  seconds = time.time() - start
  text = "".join(l for _, l in lines)
  restarts = [(round(t), l.strip()) for t, l in lines if re.search(
      r"epl-launch: restart \d+ of at most", l)]
  resumed = [int(g) for g in re.findall(r"restart \d+ resumed at global_step (\d+)", text)]
  final = samples[-1]["gs"] if samples else 0
  problems = []
  if seconds > args.deadline:
    problems.append("global_step %d of %d not reached in --deadline %d s; stopped the job" % (
        samples[-1]["gs"] if samples else 0, args.target_steps, args.deadline))
  elif launcher.returncode != 0:
    errors = [line for line in _logs_text(scratch).splitlines()
              if "Error" in line and not line.startswith(" ")]
    problems.append("epl-launch exited with %s:\n%s\nerrors in the workers' logs:\n%s" % (
        launcher.returncode, text[-3000:], "\n".join(errors[-10:])))
  if final != args.target_steps:
    problems.append("reached global_step %d of %d" % (final, args.target_steps))
  if len(restarts) != len(kills):
    problems.append("%d kill(s) but %d restart(s); kills %s; the launcher's last lines:\n%s" % (
        len(kills), len(restarts), kills,
        "".join(l for _, l in lines if not l.startswith("[0] {"))[-4000:]))
  if kills and armed is None and final == args.target_steps and len(resumed) == len(kills) - 1:
    # the last kill hit a worker closing at the target (between two samples): its restart
    # restored the final step and ran none, so it resumed no training and reports none
    kills[-1]["at_the_end"] = True
  elif len(resumed) != len(kills):
    problems.append("%d kill(s) but %d 'resumed at' report(s); the launcher's last lines:\n%s" % (
        len(kills), len(resumed),
        "".join(l for _, l in lines if not l.startswith("[0] {"))[-4000:]))
  for k, gs in zip(kills, resumed):
    k["resumed_at"] = gs
  for k, step in zip(kills, truncated):
    k["truncated"] = step
    if step is not None and k.get("resumed_at") is not None and k["resumed_at"] >= step:
      problems.append("the restart after the kill at t=%d s resumed at global_step %d, but the "
                      "checkpoint of step %d was truncated" % (k["t"], k["resumed_at"], step))
    warned = r"resuming from model\.ckpt-\d+ instead of model\.ckpt-%d\b" % (step or -1)
    if step is not None and not re.search(warned, text + _logs_text(scratch)):
      problems.append("no warning that the truncated checkpoint %d was skipped" % step)
  return {(TRUNCATED_CASE if truncate else RESTART_CASE): {
              "seconds": round(seconds), "target_steps": args.target_steps,
              "final_gs": final, "kills": kills, "restarts": len(restarts),
              "steps_per_s": round(final / seconds, 1), "problems": problems}}


# a kill every K seconds puts up to 6 restarts in a window of 5 K (kills at 0, K, ..., 5 K of
# it): the budget must hold them all, or the launcher rightly gives up at the 7th. The window
# follows K: a fixed one (600 s) gave up on a slow machine where a short test run (K = 12 s)
# took longer than 6 K to reach its steps
RESTARTS_PER_WINDOW, KILLS_PER_WINDOW = 6, 5


# ---- the driver ---------------------------------------------------------------------------
def _start(case, args, scratch):
  """Starts the case's worker processes; returns [(name, Popen)]."""
  sys.path.insert(0, ROOT)
  from epl.launch.spec import free_ports, python_command
  workers, devices, _ = CASES[case]
  base = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
              EPL_CLUSTER_DEVICES_PER_WORKER=str(devices), EPL_LOG_PROGRESS_SECS="0",
              PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
  ckpt = os.path.join(scratch, case)
  # the command epl-launch would run a .py with (launch.python; the tests' fork server)
  python = python_command(os.environ.get("EPL_LAUNCH_PYTHON", ""), sys.exit) or (sys.executable,)
  argv = list(python) + [os.path.abspath(__file__), "--role", "worker", "--cases", case,
          "--seconds", str(args.seconds), "--interval", str(args.interval),
          "--checkpoint-secs", str(args.checkpoint_secs), "--eval-every", str(args.eval_every),
          "--checkpoint-dir", ckpt]
  hosts = ["localhost:%d" % p for p in free_ports(workers)]
  procs = []
  for i in range(workers):
    env = dict(base)
    if workers > 1:
      env["TF_CONFIG"] = json.dumps({"cluster": {"worker": hosts},
                                     "task": {"type": "worker", "index": i}})
    procs.append(("%s/worker%d" % (case, i), subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
  return procs


def judge(samples):
  """Returns a list of problems with one worker's samples (empty: it passed)."""
  if len(samples) < 3:
    return ["only %d sample(s): the worker did not live to the end" % len(samples)]
  # growth is judged while the worker trains: the sample at exit (``exit_s``) follows the
  # session's close and its last checkpoint, whose buffers RSS still holds (+16-32 MB seen)
  training = [s for s in samples if "exit_s" not in s] or samples
  middle, end = training[len(training) // 2], training[-1]
  problems = []
  if any(s["evals"] for s in training):
    # the first evaluation starts its own threads (its iterator's pools: +6 seen) once; growth
    # is judged from the first sample after it (on a slow machine it came after the middle)
    settled = next(s for s in training if s["evals"])
    if settled is end:
      problems.append("the first evaluation came only in the last sample (t=%.0f s): growth "
                      "not judged; evaluate more often (--eval-every)" % end["t"])
    middle = max(middle, settled, key=lambda s: s["t"])
  peak = max(s["threads"] for s in samples)
  if peak > MAX_THREADS:
    problems.append("thread count reached %d (> %d)" % (peak, MAX_THREADS))
  if end["threads"] > middle["threads"] + THREAD_SLACK:
    problems.append("threads grew from %d (t=%.0f s) to %d (t=%.0f s)" % (
        middle["threads"], middle["t"], end["threads"], end["t"]))
  if end["rss_mb"] > middle["rss_mb"] + max(middle["rss_mb"] * RSS_GROWTH, RSS_GROWTH_MB):
    problems.append("RSS grew from %.1f MB (t=%.0f s) to %.1f MB (t=%.0f s), more than %d%% "
                    "and %d MB" % (middle["rss_mb"], middle["t"], end["rss_mb"], end["t"],
                                   RSS_GROWTH * 100, RSS_GROWTH_MB))
  pinned = (samples[-1].get("pinned") or 0) - (middle.get("pinned") or 0)
  if pinned > 0:
    problems.append("TensorFlow pinned %d more aborted rendezvous from t=%.0f s to t=%.0f s "
                    "(a leak; epl's hook communication.release_aborted_rendezvous removes the "
                    "distributed runtime's)" % (pinned, middle["t"], samples[-1]["t"]))
  gs = [s["gs"] for s in samples]
  if any(b < a for a, b in zip(gs, gs[1:])):
    problems.append("global_step went back: %s" % gs)
  return problems


def _collect(procs, seconds, log_dir=None):
  report = {}
  for name, proc in procs:
    try:
      out, err = proc.communicate(timeout=seconds + 300)
    except subprocess.TimeoutExpired:
      proc.kill()
      out, err = proc.communicate()
    if log_dir:
      os.makedirs(log_dir, exist_ok=True)
      for kind, text in (("out", out), ("err", err)):
        with open(os.path.join(log_dir, "%s.%s" % (name.replace("/", "."), kind)), "w") as f:
          f.write(text)
    done = [json.loads(l) for l in out.splitlines() if l.startswith('{"done"')]
    samples = done[-1]["samples"] if done else [
        json.loads(l) for l in out.splitlines() if l.startswith("{") and '"sample"' in l]
    problems = judge(samples)
    if proc.returncode != 0:
      errors = [l for l in err.splitlines() if "Error" in l and not l.startswith(" ")]
      problems.insert(0, "exited with code %s: %s\n%s" % (
          proc.returncode, "\n".join(errors[-4:]), err.strip()[-1500:]))
    report[name] = {"samples": samples, "problems": problems}
  return report


def drive(cases, args):
  import contextlib
  import tempfile
  report = {}
  keep = contextlib.nullcontext(args.keep) if args.keep else \
      tempfile.TemporaryDirectory(prefix="epl-soak-")
  with keep as scratch:
    if RESTART_CASE in cases:
      cases = [c for c in cases if c != RESTART_CASE]
      report.update(drive_restarts(args, scratch))
    if TRUNCATED_CASE in cases:
      cases = [c for c in cases if c != TRUNCATED_CASE]
      report.update(drive_restarts(args, os.path.join(scratch, "truncated"), truncate=True))
    if args.alone:
      for case in cases:
        report.update(_collect(_start(case, args, scratch), args.seconds, args.log_dir))
    elif cases:
      procs = [p for case in cases for p in _start(case, args, scratch)]
      report.update(_collect(procs, args.seconds, args.log_dir))
  if args.json:
    print(json.dumps(report))
  else:
    for name, r in report.items():
      if name in (RESTART_CASE, TRUNCATED_CASE):
        print("%s: %s" % (name, "PASS" if not r["problems"] else "FAIL: " + "; ".join(
            r["problems"])))
        print("    %d s, global_step %d of %d, %d kill(s), %d restart(s), %.1f steps/s "
              "overall" % (r["seconds"], r["final_gs"], r["target_steps"], len(r["kills"]),
                           r["restarts"], r["steps_per_s"]))
        for k in r["kills"]:
          print("    t=%5d s: killed worker %d near global_step %d, resumed at %s%s" % (
              k["t"], k["worker"], k["gs_before"], k.get("resumed_at", "?"),
              " (checkpoint %s truncated)" % k["truncated"] if "truncated" in k else ""))
        continue
      print("%s: %s" % (name, "PASS" if not r["problems"] else "FAIL: " + "; ".join(
          r["problems"])))
      print("    %7s %9s %9s %8s %6s %8s %8s %9s %10s %7s" % (
          "t (s)", "steps", "gl.step", "steps/s", "evals", "rejected", "threads", "RSS (MB)",
          "heap (MB)", "pinned"))
      prev = None
      for s in r["samples"]:
        rate = (s["steps"] - prev["steps"]) / max(1e-9, s["t"] - prev["t"]) if prev else 0.0
        print("    %7.0f %9d %9d %8.0f %6d %8d %8d %9.1f %10.1f %7s" % (
            s["t"], s["steps"], s["gs"], rate, s["evals"], s["rejected"], s["threads"],
            s["rss_mb"], s.get("heap_mb", 0.0), s.get("pinned")))
        prev = s
    if cases:
      total = sum(r["samples"][-1]["steps"] for n, r in report.items()
                  if n.endswith("worker0") and r["samples"])
      print("training steps in all cases (worker 0 of each): %d" % total)
  return 0 if all(not r["problems"] for r in report.values()) else 1


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--seconds", type=float, default=600)
  p.add_argument("--interval", type=float, default=10)
  p.add_argument("--cases", default=",".join(c for c in CASES if c != RESTART_CASE))
  # (restart2x1trunc runs its workers as restart2x1)
  p.add_argument("--alone", action="store_true", help="one case at a time, at full speed")
  p.add_argument("--checkpoint-secs", type=float, default=30)
  p.add_argument("--eval-every", type=int, default=500)
  p.add_argument("--checkpoint-dir", default=None)
  p.add_argument("--json", action="store_true")
  p.add_argument("--keep", default=None, metavar="DIR",
                 help="work in DIR and keep it (checkpoints, the launcher's logs)")
  p.add_argument("--log-dir", default=None,
                 help="keep every worker's stdout and stderr in this directory")
  p.add_argument("--target-steps", type=int, default=20000,
                 help="restart2x1: the global_step the job must reach")
  p.add_argument("--kill-every", type=float, default=120,
                 help="restart2x1: SIGKILL a random worker this long (seconds) after the "
                      "job trains again")
  p.add_argument("--kill-at-steps", default="",
                 help="restart2x1: instead of --kill-every, SIGKILL a random worker once the "
                      "job's global_step passes each of these (comma-separated) steps")
  p.add_argument("--deadline", type=float, default=3 * 3600,
                 help="restart2x1: stop the job and fail if --target-steps is not reached "
                      "within this many seconds")
  p.add_argument("--seed", type=int, default=0, help="restart2x1: which worker is killed")
  p.add_argument("--role", default="driver", choices=["driver", "worker"])
  args = p.parse_args()
  cases = [c for c in args.cases.split(",") if c]
  unknown = set(cases) - set(CASES) - {RESTART_CASE, TRUNCATED_CASE}
  if unknown:
    p.error("unknown case(s) %s; choose from %s" % (", ".join(sorted(unknown)), ", ".join(CASES)))
  if args.role == "worker":
    worker(cases[0], args.seconds, args.interval, args.checkpoint_secs, args.eval_every,
           args.checkpoint_dir, args.target_steps if cases[0] in (RESTART_CASE, TRUNCATED_CASE)
           else 0)
    return 0
  return drive(cases, args)


if __name__ == "__main__":
  sys.exit(main())
