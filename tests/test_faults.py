"""Faults end every worker with an error, never a hang -- with and without epl-launch."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from tests.ports import private_ports


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "tests", "workers", "train_worker.py")
ENV = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")


def _alive(pid):
  try:
    with open("/proc/%d/stat" % pid) as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def _start_workers(tmp_path, count, steps=100000, extra=(), extra_env=None):
  """``count`` workers started from TF_CONFIG alone (as a scheduler would), no launcher."""
  hosts = ["localhost:%d" % p for p in private_ports(count)]
  procs = []
  for i in range(count):
    env = dict(ENV, TF_CONFIG=json.dumps({"cluster": {"worker": hosts},
                                          "task": {"type": "worker", "index": i}}),
               EPL_CLUSTER_DEVICES_PER_WORKER="1", EPL_LOG_PROGRESS_SECS="0", **(extra_env or {}))
    procs.append(subprocess.Popen(
        [sys.executable, TRAIN, str(tmp_path / "ck"), str(tmp_path), str(steps), "0.05"] +
        list(extra),
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT))
  return procs


def _wait_for_steps(procs, lines=3, timeout=120):
  """Reads worker 0's stdout until it trained ``lines`` steps."""
  deadline = time.time() + timeout
  seen = 0
  while seen < lines and time.time() < deadline:
    line = procs[0].stdout.readline()
    if not line:
      break
    seen += " step " in line
  assert seen >= lines, "training did not start: %s" % procs[0].stderr.read()[-2000:]


@pytest.mark.parametrize("count", [2, 3])
def test_a_killed_peer_ends_every_survivor_without_the_launcher(tmp_path, count):
  procs = _start_workers(tmp_path, count)
  try:
    _wait_for_steps(procs)
    victim = count - 1
    killed_at = time.time()
    procs[victim].send_signal(signal.SIGKILL)
    for i, p in enumerate(procs):
      if i == victim:
        continue
      _, err = p.communicate(timeout=90)
      assert time.time() - killed_at < 60, "worker %d took too long" % i
      assert p.returncode != 0
      lost = re.search(r"epl worker %d stops: lost worker ([\d, ]+):" % i, err)
      assert lost and str(victim) in lost.group(1).split(", "), err[-3000:]
      # one error, not a flood of retries
      assert err.count("lost worker") <= 3 and len(err.splitlines()) < 400, err[-3000:]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()


def test_a_stalled_peer_ends_the_job_at_the_step_deadline(tmp_path):
  # A stopped process still accepts connections (the kernel answers for it), so the peer
  # watch cannot see it: the step deadline (communication.collective_timeout, put on every
  # step as RunOptions.timeout_in_ms) is what must end the survivor.
  procs = _start_workers(tmp_path, 2, extra_env={"EPL_COMMUNICATION_COLLECTIVE_TIMEOUT": "8"})
  try:
    _wait_for_steps(procs)
    stopped_at = time.time()
    procs[1].send_signal(signal.SIGSTOP)
    _, err = procs[0].communicate(timeout=90)
    assert time.time() - stopped_at < 40, "the survivor outlived the step deadline"
    assert procs[0].returncode != 0
    assert "epl worker 0 stops: a step did not finish within " \
        "communication.collective_timeout=8 s: a peer is stalled" in err, err[-3000:]
    assert len(err.splitlines()) < 100, err[-3000:]
  finally:
    for p in procs:
      if p.poll() is None:
        p.send_signal(signal.SIGCONT)
        p.kill()


def test_a_serving_worker_that_loses_its_client_stops_with_an_error(tmp_path):
  procs = _start_workers(tmp_path, 2, extra=["pipeline"])   # worker 1 only serves stage 1
  try:
    _wait_for_steps(procs)
    killed_at = time.time()
    procs[0].send_signal(signal.SIGKILL)
    _, err = procs[1].communicate(timeout=90)
    assert time.time() - killed_at < 60
    assert procs[1].returncode != 0
    assert "epl worker 1 stops: lost worker 0" in err and "did not finish" in err, err[-3000:]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()


def test_workers_leave_together_so_no_last_step_loses_its_peer(tmp_path):
  # worker 1 is 4 s slower to finish: worker 0 keeps its server until worker 1 is done too
  # (otherwise a peer still pulling the last collective's chunk fails with "lost worker")
  procs = _start_workers(tmp_path, 2, steps=4, extra_env={"TEST_LINGER_1": "4"})
  ended = [None, None]
  outs = [None, None]
  while any(e is None for e in ended):
    for i, p in enumerate(procs):
      if ended[i] is None and p.poll() is not None:
        ended[i] = time.time()
    time.sleep(0.05)
  for i, p in enumerate(procs):
    outs[i] = p.communicate()
    assert p.returncode == 0, outs[i][1][-3000:]
  done = [float(re.search(r"done at ([0-9.]+)", o).group(1)) for o, _ in outs]
  assert ended[0] >= done[1] + 4, (ended, done)


def test_a_serving_worker_ends_cleanly_when_its_client_finishes(tmp_path):
  procs = _start_workers(tmp_path, 2, steps=6, extra=["pipeline"])
  for p in procs:
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err[-3000:]
  assert "the clients finished; the job has ended" in err


def test_a_duplicate_address_in_tf_config_is_refused_before_any_server_starts(tmp_path):
  port = private_ports(1)[0]
  env = dict(ENV, TF_CPP_MIN_LOG_LEVEL="0", TF_CONFIG=json.dumps({   # TF's INFO lines shown
      "cluster": {"worker": ["localhost:%d" % port, "127.0.0.1:%d" % port]},
      "task": {"type": "worker", "index": 0}}))
  start = time.time()
  out = subprocess.run([sys.executable, "-c", "import epl, tensorflow.compat.v1 as tf;"
                        "tf.disable_v2_behavior(); epl.init()"], env=env, capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
  assert out.returncode != 0 and time.time() - start < 30
  assert "TF_CONFIG names one server twice: task 0 'localhost:%d' and task 1 " \
      "'127.0.0.1:%d' are the same address" % (port, port) in out.stderr, out.stderr[-2000:]
  assert "Started server" not in out.stderr and "grpc_server_lib" not in out.stderr


def _launch(args, **kwargs):
  return subprocess.Popen([sys.executable, "-m", "epl.launch.cli"] + args, env=ENV, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_workers_stop_when_the_launcher_is_killed(tmp_path):
  launcher = _launch(["--num_workers", "2", "--gpu_per_worker", "1", "--log_dir",
                      str(tmp_path / "logs"), os.path.join(ROOT, "tests", "workers",
                                                           "via_bash.sh"),
                      TRAIN, str(tmp_path / "ck"), str(tmp_path), "100000", "0.05"])
  pids = {}
  deadline = time.time() + 120
  while len(pids) < 2 and time.time() < deadline:        # the Python grandchildren
    for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
      try:
        cmd = open("/proc/%d/cmdline" % pid).read()
        env = open("/proc/%d/environ" % pid, "rb").read()
      except OSError:
        continue
      if "train_worker.py" in cmd and "via_bash" not in cmd and \
          ("EPL_LAUNCH_PARENT_PID=%d" % launcher.pid).encode() in env:
        pids[pid] = True
    time.sleep(0.5)
  assert len(pids) == 2, "the workers did not start"
  time.sleep(3)
  launcher.kill()
  launcher.wait()
  killed_at = time.time()
  while any(_alive(p) for p in pids) and time.time() - killed_at < 60:
    time.sleep(0.5)
  assert not [p for p in pids if _alive(p)], "workers outlived their launcher"


def test_the_launcher_leaves_no_process_behind(tmp_path):
  script = os.path.join(ROOT, "tests", "workers", "lingering.sh")
  for run in range(5):
    pid_file = tmp_path / ("pids_%d" % run)
    pid_file.write_text("")
    out, err = _launch(["--num_workers", "2", "--log_dir", str(tmp_path / "logs"), script,
                        str(pid_file)]).communicate(timeout=60)
    pids = [int(p) for p in pid_file.read_text().split()]
    assert len(pids) == 4, (pids, err)                     # 2 workers x (sleep + python)
    assert not [p for p in pids if _alive(p)], "run %d left %s" % (run, pids)
    assert "worker 0 failed (exit code 3)" in err, err


def test_the_peer_watch_ends_only_a_long_step_that_waits_on_a_lost_peer():
  from epl.cluster import Cluster
  from epl.runtime.faults import PeerWatch
  cluster = Cluster(("localhost:1", "localhost:%d" % private_ports(1)[0]), 0, 1, False)
  exits = []
  watch = PeerWatch(cluster, 300, check_after=0.3, interval=0.05, exit_fn=exits.append)
  with watch:                                 # a short step: never checked
    time.sleep(0.2)
  time.sleep(0.3)
  assert exits == []
  with watch:                                 # a long one that waits on a closed port
    deadline = time.time() + 5
    while not exits and time.time() < deadline:
      time.sleep(0.05)
  assert exits == [1]


def test_every_step_gets_the_collective_deadline_and_keeps_the_users_options():
  import tensorflow.compat.v1 as tf
  from epl.runtime.step import step_deadline
  assert step_deadline(None, 8).timeout_in_ms == 8000
  traced = tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE, timeout_in_ms=60000)
  merged = step_deadline(traced, 8)
  assert merged.timeout_in_ms == 8000 and merged.trace_level == tf.RunOptions.FULL_TRACE
  assert traced.timeout_in_ms == 60000               # the user's object is not changed
  shorter = tf.RunOptions(timeout_in_ms=2000)
  assert step_deadline(shorter, 8) is shorter        # a tighter deadline the user set stays


def test_a_duplicate_request_runs_again_and_aborted_collectives_stop_the_worker():
  """A run TF rejects as a duplicate request did not run anywhere: it runs again (a bounded
  number of times). A collective that failed because a peer's part of the step was cleaned up
  under it ("Delete called on non-empty BufRendezvous") has aborted every collective of the
  process for good (TF: "Restart your program to reset"): no rerun, one error that says so.
  tests/test_rejections.py makes both happen for real."""
  import types
  import tensorflow.compat.v1 as tf
  from epl.runtime import faults
  duplicate = tf.errors.AbortedError(None, None, "From /job:worker/replica:0/task:1:\nThe same "
                                     "RunGraph (Worker) request was received twice. step_id: 7")
  aborted = tf.errors.InternalError(None, None, "From /job:worker/replica:0/task:1:\n"
                                                "Delete called on non-empty BufRendezvous")
  other = tf.errors.InternalError(None, None, "Matrix size-incompatible")
  assert faults.is_duplicate_request(duplicate) and not faults.is_duplicate_request(aborted)
  assert faults.collectives_aborted(aborted) and not faults.collectives_aborted(other)

  def failing(*errors):
    left = list(errors)

    def run():
      if left:
        raise left.pop(0)
      return "done"
    return run
  seen = []
  assert faults.with_reruns(failing(duplicate, duplicate), 3,
                            lambda e, n: seen.append(n)) == "done"
  assert seen == [1, 2]
  for error in (aborted, other):
    with pytest.raises(tf.errors.InternalError):
      faults.with_reruns(failing(error), 3, lambda e, n: seen.append(n))
  assert seen == [1, 2]
  with pytest.raises(faults.StepRejectedError, match="4 times in a row.*received twice"):
    faults.with_reruns(failing(*[duplicate] * 4), 3, lambda e, n: None)
  with socket.socket() as peer:              # the peer still accepts connections
    peer.bind(("127.0.0.1", 0))
    peer.listen()
    cluster = types.SimpleNamespace(worker_index=0, worker_hosts=(
        "localhost:1", "127.0.0.1:%d" % peer.getsockname()[1]))
    message = str(faults.peer_error(aborted, cluster, 300))
  assert "aborted this worker's collectives" in message and "non-empty BufRendezvous" in message


def test_a_reset_connection_asks_the_peer_again_before_calling_it_reachable(monkeypatch):
  """A killed peer's connections can reset before its listening port closes (its sockets close
  one by one as the process exits; seen in the network-namespace cluster test and here): the
  peer is asked again, and named lost once its port is gone. A stalled peer's deadline, aborted
  collectives and a peer that left its exit code are told at once."""
  import types
  import tensorflow.compat.v1 as tf
  from epl.runtime import faults
  answers = iter([True, True, False])
  monkeypatch.setattr(faults, "reachable", lambda host: next(answers))
  monkeypatch.setattr(faults.time, "sleep", lambda seconds: None)
  cluster = types.SimpleNamespace(worker_index=0, worker_hosts=("a:1", "b:2"))
  reset = tf.errors.UnavailableError(
      None, None, "Collective ops is aborted by: recvmsg:Connection reset by peer")
  assert "lost worker 1: b:2 no longer accepts connections" in str(
      faults.peer_error(reset, cluster, 300))
  asked = []
  monkeypatch.setattr(faults, "reachable", lambda host: asked.append(host) or True)
  stalled = tf.errors.DeadlineExceededError(None, None, "Collective ops timed out")
  assert "a peer is stalled" in str(faults.peer_error(stalled, cluster, 300))
  aborted = tf.errors.InternalError(None, None, "Collective ops is aborted by: Delete called "
                                    "on non-empty BufRendezvous (connection reset)")
  assert "aborted this worker's collectives" in str(faults.peer_error(aborted, cluster, 300))
  ended = str(faults.peer_error(reset, cluster, 300, ended_peers=lambda: {1: (7, 1)}))
  assert "worker 1 ended (exit code 1) at step 7" in ended
  assert asked == ["b:2"] * 3                       # once each: nobody was asked again


def test_a_connection_to_itself_is_not_a_listener(monkeypatch):
  """Nobody listens on the port; a connection whose source port the kernel picked equal to it
  connects to itself (forced here by binding the source): reachable() must say no."""
  from epl.launch.spec import free_ports
  from epl.runtime import faults
  address = ("127.0.0.1", free_ports(1)[0])
  with socket.create_connection(address, 2, source_address=address) as s:
    assert s.getsockname() == s.getpeername()            # the case exists
  real = socket.create_connection
  monkeypatch.setattr(faults.socket, "create_connection",
                      lambda addr, timeout=None: real(addr, timeout, source_address=addr))
  assert not faults.reachable("%s:%d" % address)


def test_a_variable_cleared_under_its_update_is_state_cleared_from_outside():
  """A foreign client's reset under a running update: TF's error is a shape mismatch against
  an empty variable, not "uninitialized value" (seen once in CI)."""
  import tensorflow.compat.v1 as tf
  from epl.runtime import faults
  cleared = tf.errors.InvalidArgumentError(
      None, None, "var and delta do not have the same shape[] [4]\n\t [[{{node "
      "GradientDescent/update_dense/bias/ApplyGradientDescent}}]]")
  mine = tf.errors.InvalidArgumentError(None, None, "var and delta do not have the same "
                                        "shape[4] [5]")
  assert faults.cleared_from_outside(cleared)
  assert not faults.cleared_from_outside(mine)
