"""The launcher's edges, with real processes, signals, files and ports (no mocks).

Orphans at start-up, input the launcher must refuse at once; the others (exits, checkpoints,
stalls, a foreign client) follow the same pattern: start a real job, do to it what a user or a
machine does, read the console and the process table.
"""
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest
from tests.ports import private_ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")
TRAIN = os.path.join(WORKERS, "train_worker.py")
ENV = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")


def _launch(args, env=None):
  return subprocess.Popen([sys.executable, "-m", "epl.launch.cli"] + args, env=env or ENV,
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)


def _job_processes(job_id):
  """Pids of live processes whose environment carries ``EPL_LAUNCH_JOB_ID=job_id``."""
  mark = ("EPL_LAUNCH_JOB_ID=%s\0" % job_id).encode()
  found = []
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open("/proc/%s/environ" % name, "rb") as f:
        if mark not in f.read():
          continue
      with open("/proc/%s/stat" % name) as f:
        if f.read().rsplit(")", 1)[1].split()[0] == "Z":
          continue
    except OSError:
      continue
    found.append(int(name))
  return found


def _kill_all(pids):
  for pid in pids:
    try:
      os.kill(pid, signal.SIGKILL)
    except OSError:
      pass


# more workers than this host's memory holds (350 MiB each)
MANY = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (350 << 20) + 1

ENTRIES = {
    "python": [TRAIN],
    "shell": [os.path.join(WORKERS, "via_bash.sh"), TRAIN],          # python as a grandchild
}


@pytest.mark.parametrize("moment", [0.5, 1, 2, 3, 5, "training"])
@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_nothing_of_the_job_outlives_a_killed_launcher(tmp_path, entry, moment):
  """kill -9 of epl-launch at any moment, the first second included, whatever the entry:
  2 s later no process of the job is left (a shell entry's python used to move under PID 1
  and train to the end when the launcher died before epl.init's barrier)."""
  job = "orphans-" + uuid.uuid4().hex[:8]
  launcher = _launch(["--num_workers", "2", "--gpu_per_worker", "1", "--job_id", job,
                      "--log_dir", str(tmp_path / "logs")] + ENTRIES[entry] +
                     [str(tmp_path / "ck"), str(tmp_path), "100000", "0.05"])
  try:
    if moment == "training":
      seen, deadline = "", time.time() + 60
      while "step 3" not in seen and time.time() < deadline:
        seen += launcher.stdout.readline()
      assert "step 3" in seen, seen[-2000:]
    else:
      time.sleep(moment)
    assert launcher.poll() is None
    launcher.kill()
    launcher.wait()
    time.sleep(2)
    left = _job_processes(job)
    assert not left, "%d process(es) of the job outlived the launcher by 2 s" % len(left)
  finally:
    _kill_all(_job_processes(job))
    if launcher.poll() is None:
      launcher.kill()


@pytest.mark.parametrize("flags,message", [
    (["--num_workers", "2", "--machine_list", "localhost:99999,localhost:2"],
     "'localhost:99999' has port '99999'; a port is a number from 1 to 65535"),
    (["--num_workers", "2", "--machine_list", "localhost:abc,localhost:2"],
     "'localhost:abc' has port 'abc'; a port is a number from 1 to 65535"),
    (["--num_workers", "100000"], "--num_workers 100000: the launcher would hold"),
    (["--num_workers", str(MANY)], "--num_workers %d on this host: each worker imports "
                                   "TensorFlow" % MANY),
], ids=["port over 65535", "port not a number", "more workers than open files",
        "more workers than memory"])
def test_launcher_input_it_cannot_honour_is_refused_at_once_in_one_line(flags, message):
  start = time.time()
  env = dict(ENV)
  out = subprocess.run([sys.executable, "-m", "epl.launch.cli"] + flags +
                       [os.path.join(ROOT, "examples", "quickstart", "run.sh")], env=env,
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert out.returncode != 0 and time.time() - start < 10
  lines = [line for line in out.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and message in lines[0], out.stderr
  assert "Traceback" not in out.stderr and not out.stdout


EXIT = os.path.join(WORKERS, "exit_worker.py")


@pytest.mark.alone                  # ends within 10 s of a worker's exit
@pytest.mark.parametrize("how,says", [
    ("exit3", "worker 1 failed (exit code 3) at step 30, the first worker to end"),
    ("os_exit", "worker 1 failed (exit code 4) at step 30, the first worker to end"),
    ("kill", "worker 1 failed (killed by SIGKILL) at step 30, the first worker to end"),
    ("return", "worker 1 ended its script (exit code 0) at step 30 while worker 0 waits in "
               "step 31 for it"),
])
def test_any_worker_exit_ends_the_job_within_10_s_naming_it(tmp_path, how, says):
  """sys.exit(3) used to hang the job for 60 s in the farewell, then blame the other worker
  with a hint about TF's request ids."""
  out = subprocess.run([sys.executable, "-m", "epl.launch.cli", "--num_workers", "2",
                        "--log_dir", str(tmp_path), EXIT, "1", "30", how], env=ENV, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
  ended = time.time()
  text = out.stdout + out.stderr
  assert out.returncode == 1, text[-3000:]
  assert says in text, text[-3000:]
  assert "request" not in text and "duplicate" not in text
  mark = [line for line in out.stdout.splitlines() if "worker 1 ends (%s)" % how in line]
  left_at = float(mark[0].rsplit(" at ", 1)[1])
  assert ended - left_at < 10, "the job ended %.1f s after worker 1 left" % (ended - left_at)


@pytest.mark.alone                  # ends within 10 s of a worker's exit
@pytest.mark.parametrize("how,logs,says", [
    ("exit3", "shared", "epl worker 0 stops: worker 1 ended (exit code 3) at step 30"),
    ("exit3", "apart", "epl worker 0 stops: worker 1 ended (exit code 3) at step 30"),
    ("return", "apart", "epl worker 0 stops: worker 1 ended (exit code 0) at step 30 while "
                        "this worker waits in step 31"),
])
def test_a_peer_on_another_host_names_the_worker_that_ended_and_how(tmp_path, how, logs, says):
  """One launcher per worker, as on two hosts; their log directories shared (the peer reads
  the ended worker's status file) or apart (the flag the ended worker left on the peer's
  server). Worker 1 ends at step 30; worker 0's error names it, how and when -- within 10 s,
  also when worker 1's loop just ended early (exit code 0: it used to wait out the farewell's
  minute) -- and says nothing of request ids."""
  hosts = ",".join("localhost:%d" % p for p in private_ports(2))
  launchers = [_launch(["--num_workers", "2", "--machine_list", hosts, "--machine_rank",
                        str(rank), "--log_dir",
                        str(tmp_path if logs == "shared" else tmp_path / str(rank)),
                        EXIT, "1", "30", how])
               for rank in (0, 1)]
  try:
    out0 = launchers[0].communicate(timeout=120)[0]
    ended = time.time()
    out1 = launchers[1].communicate(timeout=120)[0]
  finally:
    for launcher in launchers:
      if launcher.poll() is None:
        launcher.kill()
  assert launchers[0].returncode == 1, out0[-3000:]
  assert says in out0, out0[-3000:]
  assert "request" not in out0 and "duplicate" not in out0
  mark = [line for line in out1.splitlines() if "worker 1 ends (%s)" % how in line]
  left_at = float(mark[0].rsplit(" at ", 1)[1])
  assert ended - left_at < 10, "worker 0's job ended %.1f s after worker 1 left" % (
      ended - left_at)
  if how == "exit3":
    assert launchers[1].returncode == 1 and \
        "worker 1 failed (exit code 3) at step 30" in out1, out1[-3000:]


def test_a_worker_that_notices_a_peer_left_first_does_not_take_the_blame(tmp_path):
  """Worker 1 ended its script at step 30; worker 0, waiting in step 31, read worker 1's ended
  flag and failed before the launcher's own 5 s check: the launcher still names worker 1 (a
  race between the two seen once in CI). Real status files, written by the worker's own
  Heartbeat and status code."""
  from epl.launch import status
  from epl.launch.cli import Job
  from epl.runtime.heartbeat import Heartbeat
  files = {w: str(tmp_path / ("worker_%d.status" % w)) for w in (0, 1)}
  waiting = Heartbeat(files[0])
  for _ in range(30):
    waiting.begin()
    waiting.end()
  waiting.begin()                                  # in step 31
  job = Job([], status_files=files)
  assert job._left_first() == []                   # nobody left yet
  status.report(files[1], status.ENDED, code=0, steps=30)
  assert job._left_first() == [(1, 0)]
  assert job.reason == ("worker 1 ended its script (exit code 0) at step 30 while worker 0 "
                        "waits in step 31 for it")


@pytest.mark.parametrize("said", [None, 10.0], ids=["killed, no word", "said it ended first"])
def test_workers_seen_gone_in_one_poll_are_blamed_in_the_order_they_ended(tmp_path, said):
  """Worker 1 ended first (killed: no ended event; or its event is the earlier), worker 0
  failed on noticing; both were gone by the launcher's next 0.2 s poll: worker 1 is named
  (the lower index won such ties, seen in the restart tests)."""
  from epl.launch import status
  from epl.launch.cli import Job
  files = {w: str(tmp_path / ("worker_%d.status" % w)) for w in (0, 1)}
  status.report(files[0], status.ENDED, code=1, steps=30, at=20.0)
  if said is not None:
    status.report(files[1], status.ENDED, code=3, steps=30, at=said)
  job = Job([], status_files=files)
  job.procs = {0: subprocess.Popen(["sh", "-c", "exit 1"], start_new_session=True),
               1: subprocess.Popen(["sh", "-c", "exit 3" if said else "kill -9 $$"],
                                   start_new_session=True)}
  for proc in job.procs.values():
    proc.wait()
  assert job.watch() == 1
  assert job.failure == (1, 3 if said else -9)


def test_a_frozen_worker_is_reported_with_what_its_process_does(tmp_path):
  """SIGSTOP of one worker: before the collective timeout the console says which worker the
  job waits for and that its process is stopped (nothing was said for 5 minutes)."""
  env = dict(ENV, EPL_LOG_STALL_SECS="4", EPL_COMMUNICATION_COLLECTIVE_TIMEOUT="40")
  launcher = _launch(["--num_workers", "2", "--log_dir", str(tmp_path), EXIT, "1", "30",
                      "stop"], env=env)
  seen, deadline = "", time.time() + 50
  try:
    while "no step finished" not in seen and time.time() < deadline:
      line = launcher.stdout.readline()
      if not line:
        break
      seen += line
    assert "no step finished for" in seen, seen[-3000:]
    report = [line for line in seen.splitlines() if "no step finished" in line][0]
    # (worker 0 may still wait in step 30: its ring all-reduce fetches from the frozen
    # worker's server, which SIGSTOP froze too)
    assert re.search(r"worker 0 waits in step 3[01]; worker 1 \(pid \d+\): stopped "
                     r"\(SIGSTOP\), after step 30", report), report
  finally:
    launcher.terminate()
    try:
      launcher.communicate(timeout=30)
    except subprocess.TimeoutExpired:
      launcher.kill()


# ---- checkpoints ----------------------------------------------------------------------------
def _train(tmp_path, steps, workers=1, env=None, logs="logs"):
  """Trains tests/workers/train_worker.py (a checkpoint every 2 steps) under epl-launch."""
  return subprocess.run([sys.executable, "-m", "epl.launch.cli", "--num_workers", str(workers),
                         "--log_dir", str(tmp_path / logs), TRAIN, str(tmp_path / "ck"),
                         str(tmp_path), str(steps), "0"], env=dict(ENV, **(env or {})),
                        cwd=ROOT, capture_output=True, text=True, timeout=120)


def _started_at(out):
  found = re.findall(r"worker 0 starts at step (\d+)", out.stdout)
  assert found, out.stdout[-3000:] + out.stderr[-3000:]
  return int(found[0])


def test_checkpoints_without_a_state_file_are_resumed_from_not_trained_over(tmp_path):
  """Deleting the state file ('checkpoint') used to restart training from step 0 over the old
  checkpoints; now the newest that reads back is resumed from, with a warning."""
  first = _train(tmp_path, 8)
  assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
  os.remove(tmp_path / "ck" / "checkpoint")
  again = _train(tmp_path, 10, logs="logs2")
  text = again.stdout + again.stderr + open(tmp_path / "logs2" / "worker_0.log").read()
  assert again.returncode == 0, text[-3000:]
  assert _started_at(again) == 8
  assert "has no readable state file ('checkpoint'), but holds" in text and \
      "resuming from model.ckpt-8, the newest that reads back" in text, text[-3000:]


def test_a_directory_whose_checkpoints_all_fail_to_read_stops_with_its_name(tmp_path):
  first = _train(tmp_path, 4)
  assert first.returncode == 0
  os.remove(tmp_path / "ck" / "checkpoint")
  for data in (tmp_path / "ck").glob("*.data-*"):
    data.write_bytes(data.read_bytes()[:10])
  again = _train(tmp_path, 6, logs="logs2")
  text = again.stdout + again.stderr
  assert again.returncode == 1
  assert "CheckpointError: %s holds" % (tmp_path / "ck") in text and \
      "epl does not train over them from step 0" in text, text[-3000:]


def test_a_truncated_newest_checkpoint_gives_way_to_the_one_before(tmp_path):
  """The newest .data file cut short: the restore used to fail on every start naming no
  file (OutOfRangeError); now the job resumes from the checkpoint before, naming both."""
  first = _train(tmp_path, 8, workers=2)
  assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
  data = next((tmp_path / "ck").glob("model.ckpt-8.data-*"))
  data.write_bytes(data.read_bytes()[:len(data.read_bytes()) // 2])
  again = _train(tmp_path, 10, workers=2, logs="logs2")
  text = again.stdout + again.stderr + open(tmp_path / "logs2" / "worker_0.log").read()
  assert again.returncode == 0, text[-3000:]
  assert _started_at(again) == 6
  assert "checkpoint %s does not restore" % (tmp_path / "ck" / "model.ckpt-8") in text and \
      "resuming from model.ckpt-6 instead of model.ckpt-8, which does not restore" in text, \
      text[-3000:]


def test_a_full_disk_names_the_checkpoint_path_and_leaves_no_temp_folder(tmp_path):
  mount = tmp_path / "small"
  mount.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                    capture_output=True).returncode != 0:
    pytest.skip("cannot mount a small tmpfs here (needs root)")
  try:
    out = subprocess.run([sys.executable, "-m", "epl.launch.cli", "--log_dir",
                          str(tmp_path / "logs"), TRAIN, str(mount / "ck"), str(tmp_path), "4",
                          "0"], env=dict(ENV, TEST_EXTRA_PARAMS="2000000"), cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-3000:]
    assert "saving a checkpoint to %s failed (its partial files are removed)" % (
        mount / "ck" / "model.ckpt") in text, text[-3000:]
    left = [p.name for p in (mount / "ck").iterdir()]
    assert not [name for name in left if "_temp" in name or "tempstate" in name], left
  finally:
    subprocess.run(["umount", str(mount)], capture_output=True)


FOREIGN = """
import socket, sys
import tensorflow.compat.v1 as tf
tf.disable_v2_behavior()
s = socket.socket(); s.bind(("", 0)); mine = s.getsockname()[1]; s.close()
cluster = tf.train.ClusterSpec({"worker": [sys.argv[1], "localhost:%d" % mine]})
server = tf.train.Server(cluster, job_name="worker", task_index=1)
tf.Session.reset(server.target)        # CleanupAll on every worker its cluster names
"""


def test_a_foreign_tf_client_that_clears_a_worker_ends_the_job_with_an_error_saying_so(
    tmp_path):
  """Any TF program that reaches a worker's port can clear it (TF's servers have no
  authentication): the job used to end with a hint about request ids."""
  launcher = _launch(["--num_workers", "2", "--log_dir", str(tmp_path), EXIT, "9", "0",
                      "none"])
  try:
    seen, deadline = "", time.time() + 60
    while "worker 0 step 30" not in seen and time.time() < deadline:
      seen += launcher.stdout.readline()
    host = re.search(r"worker 0 on (\S+),", seen).group(1)
    subprocess.run([sys.executable, "-c", FOREIGN, host], env=ENV, capture_output=True,
                   timeout=60)
    out, _ = launcher.communicate(timeout=60)
  finally:
    if launcher.poll() is None:
      launcher.kill()
  text = seen + out
  assert launcher.returncode == 1, text[-3000:]
  assert "duplicate" not in text
  if re.search(r"worker 0 failed \(killed by SIG(SEGV|ABRT)\)", text):
    # TF itself may crash when its containers are cleared under a running step (about one run
    # in twenty here: a segfault, or absl's "Mutex corrupt" abort): the launcher still ends the
    # job at once, naming the worker and how
    return
  # what TF says of the cleared state: a variable read uninitialised, or -- cleared under a
  # running update (once in a CI run) -- a variable that came back empty: "var and delta do
  # not have the same shape[] [4]"
  assert re.search(r"epl worker 0 stops: its state was cleared from outside the job \((Attempting "
                   r"to use uninitialized value|var and delta do not have the same shape\[\] )",
                   text) and "Let only the job's hosts reach its ports" in text, text[-3000:]


FOREIGN_MASTER = """
import socket, sys
import tensorflow.compat.v1 as tf
tf.disable_v2_behavior()
s = socket.socket(); s.bind(("", 0)); mine = s.getsockname()[1]; s.close()
cluster = tf.train.ClusterSpec({"worker": [sys.argv[1], "localhost:%d" % mine]})
server = tf.train.Server(cluster, job_name="worker", task_index=1)
with tf.device("/job:worker/task:0"):
  two = tf.constant(1.0) + 1
with tf.Session(server.target) as sess:
  print(sess.run(two))
"""


def test_a_foreign_master_naming_itself_a_task_of_the_job_does_not_end_it(tmp_path):
  """Item 7 of #35 as filed: a TF master whose cluster names worker 0 and itself task 1 runs
  one op on worker 0 (TF 2.21 keeps that session apart from the job's; the job trains on)."""
  launcher = _launch(["--num_workers", "2", "--log_dir", str(tmp_path), EXIT, "9", "0",
                      "none"])
  try:
    seen, deadline = "", time.time() + 60
    while "worker 0 step 30" not in seen and time.time() < deadline:
      seen += launcher.stdout.readline()
    host = re.search(r"worker 0 on (\S+),", seen).group(1)
    ran = subprocess.run([sys.executable, "-c", FOREIGN_MASTER, host], env=ENV,
                         capture_output=True, text=True, timeout=60)
    assert ran.stdout.strip() == "2.0", ran.stderr[-2000:]
    after = int(re.findall(r"worker 0 step (\d+)", seen)[-1]) + 100
    deadline = time.time() + 30
    while not re.search(r"worker [01] step %d\b" % after, seen) and time.time() < deadline:
      line = launcher.stdout.readline()
      assert line, seen[-3000:]
      seen += line
    assert "worker 0 step %d" % after in seen or "worker 1 step %d" % after in seen, \
        seen[-3000:]
    assert launcher.poll() is None and "stops" not in seen, seen[-3000:]
  finally:
    launcher.terminate()
    try:
      launcher.communicate(timeout=30)
    except subprocess.TimeoutExpired:
      launcher.kill()


TAKEN_FIRST = r"""
import socket, sys
from epl.launch import cli, spec
taken = socket.socket(); taken.bind(("", 0)); taken.listen()     # another process's port
picks = []


def pick(count, port_range=None):
  picks.append(count)
  if len(picks) == 1:          # the first pick names a port that is taken by now
    return [taken.getsockname()[1]] + spec.free_ports(count - 1, port_range)
  return spec.free_ports(count, port_range)


cli.settings_from_args = lambda args: spec.settings_from_args(args, pick_ports=pick)
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_picked_port_another_process_took_first_starts_the_job_again_on_fresh_ports(
    tmp_path):
  """Free ports can be told, not reserved: seen in CI, two jobs' launchers on one host got
  the same port and the slower one failed before its first step (StartupError, not
  restarted). The launcher now starts again on fresh ports, without --max_restarts."""
  (tmp_path / "out").mkdir()
  out = subprocess.run([sys.executable, "-c", TAKEN_FIRST, "--num_workers", "2",
                        "--log_dir", str(tmp_path / "logs"), TRAIN, str(tmp_path / "ckpt"),
                        str(tmp_path / "out"), "6", "0"], env=ENV, cwd=ROOT,
                       capture_output=True, text=True, timeout=180)
  text = out.stdout + out.stderr
  assert out.returncode == 0, text[-4000:]
  assert re.search(r"epl-launch: worker 0 found a port epl-launch picked taken by another "
                   r"process \(AddressTakenError\); starting every worker again on fresh "
                   r"ports \(1 of at most 3\)", text), text[-4000:]
  assert "could not start its server" in text and "restart 1" not in text, text[-4000:]
  assert "epl-launch: all workers finished; logs in" in text, text[-4000:]
  job_id = re.search(r"epl-launch: job (\S+):", text).group(1)
  assert not _job_processes(job_id), "left behind: %s" % _job_processes(job_id)
