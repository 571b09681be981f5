"""epl-launch: the pure (argv, env) step, and IO slicing assignment."""
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from epl.errors import PlanError
from epl.launch.spec import parser, settings_from_args, worker_specs
from epl.io_slicing import assign_files

HERE = os.path.abspath(__file__)


def settings(*argv, environ=None):
  return settings_from_args(parser().parse_args(list(argv)), pick_ports=lambda n, r: [
      (r[0] if r else 5000) + i for i in range(n)], environ=environ or {})


def test_local_workers_get_tf_config_and_devices():
  s = settings("--num_workers", "2", "--gpu_per_worker", "3", "--log_dir", "/tmp/l", HERE, "-x")
  specs = worker_specs(s, {"PATH": "/bin"}, python="/venv/bin/py")
  assert [spec.index for spec in specs] == [0, 1]
  for spec in specs:
    conf = json.loads(spec.env["TF_CONFIG"])
    assert conf == {"cluster": {"worker": ["localhost:5000", "localhost:5001"]},
                    "task": {"type": "worker", "index": spec.index}}
    assert spec.env["EPL_CLUSTER_DEVICES_PER_WORKER"] == "3"
    assert spec.env["PATH"] == "/venv/bin:/bin"        # `python` in run.sh is the venv's
    assert spec.argv == ("/venv/bin/py", HERE, "-x")    # .py runs under python
    assert spec.log_path == "/tmp/l/worker_%d.log" % spec.index
    assert "CUDA_VISIBLE_DEVICES" not in spec.env


def test_launch_python_is_the_command_a_py_script_runs_with(tmp_path):
  s = settings("--num_workers", "1", HERE, "-x",
               environ={"EPL_LAUNCH_PYTHON": "/opt/py -X 'faulthandler'"})
  spec, = worker_specs(s, {"PATH": "/bin"}, python="/venv/bin/py")
  assert spec.argv == ("/opt/py", "-X", "faulthandler", HERE, "-x")
  assert spec.env["PATH"] == "/venv/bin:/bin"
  script = tmp_path / "run.sh"                           # a shell script: still bash
  script.write_text("true\n")
  s = settings("--num_workers", "1", str(script), environ={"EPL_LAUNCH_PYTHON": "/opt/py"})
  assert worker_specs(s, {})[0].argv[0] == "bash"
  with pytest.raises(SystemExit, match="EPL_LAUNCH_PYTHON"):
    settings("--num_workers", "1", HERE, environ={"EPL_LAUNCH_PYTHON": "/opt/py 'open"})


def test_shell_script_runs_under_bash_and_gpus_are_sliced(tmp_path):
  script = tmp_path / "run.sh"
  script.write_text("true\n")
  s = settings("--num_workers", "2", "--gpu_per_worker", "2", str(script))
  specs = worker_specs(s, {}, gpus_on_host=4)
  assert specs[0].argv[0] == "bash"
  assert [spec.env["CUDA_VISIBLE_DEVICES"] for spec in specs] == ["0,1", "2,3"]


def test_machine_rank_starts_one_worker_of_a_multi_host_job():
  s = settings("--num_workers", "3", "--machine_list", "10.0.0.1,10.0.0.2:7000,10.0.0.3",
               "--machine_rank", "1", HERE)
  specs = worker_specs(s, {})
  assert [spec.index for spec in specs] == [1]
  conf = json.loads(specs[0].env["TF_CONFIG"])
  assert conf["cluster"]["worker"] == ["10.0.0.1:22220", "10.0.0.2:7000", "10.0.0.3:22222"]
  assert conf["task"]["index"] == 1


@pytest.mark.parametrize("argv,message", [
    (["--num_workers", "2", "--machine_list", "a", HERE], "names 1 host"),
    (["--num_workers", "2", "--machine_list", "a:1,a:1", HERE], "repeats a host:port"),
    (["--num_workers", "2", "--machine_rank", "0", HERE], "needs --machine_list"),
    (["--num_workers", "2", "--machine_list", "a,b", "--machine_rank", "5", HERE],
     "out of range"),
    (["--num_workers", "0", HERE], "--num_workers must be >= 1"),
    (["/no/such/script.py"], "not found"),
    (["--port_range", "30000", HERE], "expected LOW-HIGH"),
    (["--port_range", "30010-30000", HERE], "1 <= LOW <= HIGH"),
    (["--num_workers", "2", "--machine_list", "a:7000,b", "--port_range", "30000-30009", HERE],
     "port 7000 of a:7000 is outside --port_range 30000-30009"),
    (["--max_restarts", "-1", HERE], "--max_restarts must be >= 0"),
    (["--job_id", "a b", HERE], "--job_id 'a b'"),
])
def test_bad_flags(argv, message):
  with pytest.raises(SystemExit, match=message):
    settings(*argv)


def test_io_file_assignment():
  files = ["f%d" % i for i in range(6)]
  assert assign_files(files, 2, 0) == ["f0", "f2", "f4"]
  assert assign_files(files, 2, 1) == ["f1", "f3", "f5"]
  assert assign_files(files[:5], 2, 0, unbalanced=True) == ["f0", "f2", "f4"]
  assert assign_files(files[:5], 2, 1, unbalanced=True) == ["f1", "f3"]
  assert assign_files(files[:5], 2, 1, drop_last=True) == ["f1", "f3"]
  assert assign_files(files[:5], 2, 0, drop_last=True) == ["f0", "f2"]
  with pytest.raises(PlanError, match="5 files do not divide evenly among 2 workers; set "
                     "io.unbalanced_io_slicing=True"):
    assign_files(files[:5], 2, 0)
  with pytest.raises(PlanError, match=r"1 file\(s\) cannot be shared by 2 workers"):
    assign_files(files[:1], 2, 0)


def test_exit_descriptions_and_console_filter():
  from epl.launch.console import NoiseFilter, describe_exit, last_traceback, prefixed
  assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(3) == "exit code 3"
  noise = NoiseFilter()
  kept = [line for line in [
      "E0000 00:00:1 cuda_platform.cc:52] failed call to cuInit: INTERNAL",
      "I0000 00:00:1 port.cc:153] oneDNN custom operations are on.",
      "/x.py:3: UserWarning: `tf.layers.dense` is deprecated and will be removed.",
      "  h = tf.layers.dense(x, 16)",
      "Use standard file utilities to get mtimes.",
      "Iteration 1 , Loss: 2.3 .",
      "E0000 00:00:1 base_collective_executor.cc:252] StartAbort UNAVAILABLE",
  ] if noise.keep(line)]
  assert kept == ["Iteration 1 , Loss: 2.3 .",
                  "E0000 00:00:1 base_collective_executor.cc:252] StartAbort UNAVAILABLE"]
  assert NoiseFilter(debug=True).keep("I0000 00:00:1 port.cc:153] oneDNN")
  assert prefixed(3, "hello") == "[3] hello\n"
  log = "\n".join(["step 1", "Traceback (most recent call last):", '  File "a.py", line 1',
                   "ValueError: first", "", "The above exception was the direct cause of the "
                   "following exception:", "", "Traceback (most recent call last):",
                   '  File "b.py", line 2', "PeerError: lost worker 1"])
  tb = last_traceback(log)
  assert tb.startswith("Traceback") and "ValueError: first" in tb and tb.endswith(
      "PeerError: lost worker 1")


def test_help_is_instant_and_never_imports_tensorflow():
  from tests.cli_help import assert_help_is_instant
  assert_help_is_instant("epl-launch", "epl.launch.cli", "--num_workers")


def test_port_range_job_id_and_restart_flags():
  s = settings("--num_workers", "2", "--port_range", "30000-30009", HERE)
  assert s.hosts == ("localhost:30000", "localhost:30001") and s.local_hosts
  assert s.job_id.startswith("job-") and s.job_id != settings(HERE).job_id   # random locally
  s = settings("--num_workers", "2", "--machine_list", "a,b:30005", "--port_range",
               "30000-30009", "--machine_rank", "0", HERE)
  assert s.hosts == ("a:30000", "b:30005") and not s.local_hosts
  # every host's launcher of one job derives the same id; the workers get it
  assert s.job_id == settings("--num_workers", "2", "--machine_list", "a,b:30005",
                              "--port_range", "30000-30009", "--machine_rank", "1",
                              HERE).job_id
  spec, = worker_specs(s, {})
  assert spec.env["EPL_LAUNCH_JOB_ID"] == s.job_id and spec.env["EPL_LAUNCH_ATTEMPT"] == "0"
  assert spec.env["EPL_LAUNCH_STATUS_FILE"].endswith("worker_0.status")
  spec, = worker_specs(s, {}, attempt=2)
  assert spec.log_path.endswith("worker_0.restart2.log") and spec.env["EPL_LAUNCH_ATTEMPT"] == "2"
  assert settings("--job_id", "mine", HERE).job_id == "mine"
  # flags default to the launch.* Config keys in the environment (schedulers)
  s = settings(HERE, environ={"EPL_LAUNCH_MAX_RESTARTS": "3", "EPL_LAUNCH_RESTART_WINDOW": "60",
                              "EPL_LAUNCH_JOB_ID": "sched-7"})
  assert (s.max_restarts, s.restart_window, s.job_id) == (3, 60, "sched-7")
  assert settings("--max_restarts", "1", HERE,
                  environ={"EPL_LAUNCH_MAX_RESTARTS": "3"}).max_restarts == 1
  with pytest.raises(SystemExit, match="EPL_LAUNCH_MAX_RESTART"):
    settings(HERE, environ={"EPL_LAUNCH_MAX_RESTART": "3"})


def test_free_ports_in_a_range_skip_taken_ones_and_say_when_too_few():
  import socket
  from epl.launch.spec import free_ports
  taken = socket.socket()
  taken.bind(("", 0))
  taken.listen()
  port = taken.getsockname()[1]
  try:
    picked = free_ports(2, (port, port + 40))
    assert port not in picked and all(port < p <= port + 40 for p in picked)
    with pytest.raises(SystemExit, match=r"--port_range %d-%d has 0 free port\(s\) for 1 "
                       % (port, port)):
      free_ports(1, (port, port))
  finally:
    taken.close()


def test_which_failures_are_restarted():
  from epl.launch.cli import Restarts, failed_with, restart_refused
  log = "\n".join(["[0] step 3", "Traceback (most recent call last):", '  File "t.py"',
                   "epl.errors.ConfigError: Config key 'x' ..."])
  assert failed_with(log) == "ConfigError"
  assert failed_with("Traceback (most recent call last):\n  File\nValueError: bad") == \
      "ValueError"
  assert failed_with("no traceback here") == ""
  assert "ConfigError repeats" in restart_refused(1, "ConfigError", ran=True)
  assert "PlanError repeats" in restart_refused(-9, "PlanError", ran=False)
  assert restart_refused(-9, "", ran=False) == ""            # killed: restart
  assert restart_refused(1, "PeerError", ran=True) == ""     # lost a peer mid-training
  # before the first step even a lost peer is not restarted: a peer that stalls the first
  # step (mismatched collectives) would fail the same way on every start
  assert "(PeerError)" in restart_refused(1, "PeerError", ran=False)
  assert "StartupError" in restart_refused(1, "StartupError", ran=False)
  assert "before the job's first step (ValueError)" in restart_refused(1, "ValueError",
                                                                        ran=False)
  now = [0.0]
  budget = Restarts(2, 100, clock=lambda: now[0])
  assert budget.allow() and budget.allow() and not budget.allow()
  now[0] = 150.0                                             # the first two left the window
  assert budget.allow()
  whole = Restarts(1, 0, clock=lambda: now[0])
  assert whole.allow()
  now[0] = 1e9
  assert not whole.allow()


def test_a_restart_on_localhost_starts_every_worker_again_on_fresh_ports(monkeypatch, tmp_path):
  """The first start fails (a worker killed), the restart gets ports picked anew and the same
  command; the job's other settings stay."""
  import json as _json
  from epl.launch import cli
  starts = []

  class FakeJob:
    def __init__(self, specs, debug=False, status_files=None, guard=None):
      self.specs = {s.index: s for s in specs}
      self.failure = None
      starts.append(specs)

    def start(self):
      pass

    def watch(self, on_status=None, stop_when=None):
      if len(starts) == 1:
        self.failure = (1, -9)
        return 1
      return 0

    def summary(self):
      return ""

    def log_text(self, index):
      return ""

    def ran(self):
      return True

    def stop(self):
      pass

  picked = iter([[41001, 41002]])
  monkeypatch.setattr(cli, "Job", FakeJob)
  monkeypatch.setattr(cli, "free_ports", lambda n, port_range=None: next(picked))
  monkeypatch.setattr(cli, "RESTART_PAUSE", 0.0)
  monkeypatch.setattr(cli, "_gpus_on_host", lambda: 0)
  monkeypatch.setattr(cli.signal, "signal", lambda *a: None)   # keep pytest's handlers
  script = tmp_path / "train.py"
  script.write_text("")
  assert cli.main(["--num_workers", "2", "--max_restarts", "1", "--log_dir", str(tmp_path),
                   str(script), "--flag"]) == 0
  assert len(starts) == 2
  (first, second) = [[_json.loads(s.env["TF_CONFIG"])["cluster"]["worker"] for s in specs]
                     for specs in starts]
  assert second[0] == second[1] == ["localhost:41001", "localhost:41002"]
  assert first[0] != second[0]
  assert [s.env["EPL_LAUNCH_ATTEMPT"] for s in starts[1]] == ["1", "1"]
  assert [s.argv for s in starts[0]] == [s.argv for s in starts[1]]



@pytest.mark.parametrize("list_given,races,code", [
    (False, 1, 0), (False, 3, 0), (False, 4, 1), (True, 1, 1)])
def test_a_port_race_starts_again_on_fresh_ports_only_on_picked_ports_and_at_most_thrice(
    monkeypatch, tmp_path, capsys, list_given, races, code):
  """A start lost to a taken port (AddressTakenError before the first step) is repeated on
  fresh ports without --max_restarts, at most 3 times; ports the user gave are not moved."""
  from epl.launch import cli
  starts = []

  class RacedJob:
    def __init__(self, specs, debug=False, status_files=None, guard=None):
      self.specs = {s.index: s for s in specs}
      self.failure = (0, 1)
      starts.append(specs)

    def start(self):
      pass

    def watch(self, on_status=None, stop_when=None):
      return 1 if len(starts) <= races else 0

    def summary(self):
      return ""

    def log_text(self, index):
      return ("Traceback (most recent call last):\n  File \"x\"\nepl.runtime.server."
              "AddressTakenError: worker 0 could not start its server")

    def ran(self):
      return False

    def stop(self):
      pass

  monkeypatch.setattr(cli, "Job", RacedJob)
  monkeypatch.setattr(cli, "_gpus_on_host", lambda: 0)
  monkeypatch.setattr(cli.signal, "signal", lambda *a: None)   # keep pytest's handlers
  script = tmp_path / "train.py"
  script.write_text("")
  given = ["--machine_list", "localhost:41001,localhost:41002"] if list_given else []
  assert cli.main(["--num_workers", "2", "--log_dir", str(tmp_path)] + given +
                  [str(script)]) == code
  out = capsys.readouterr().out
  assert len(starts) == (1 if list_given else min(races, 3) + 1)
  assert out.count("on fresh ports") == len(starts) - 1
  hosts = [tuple(s.env["TF_CONFIG"] for s in specs) for specs in starts]
  assert len(set(hosts)) == len(hosts)                        # every start on fresh ports
  if code:
    assert "epl-launch: failed; logs in" in out, out

_INTERRUPTED_WHILE_POLLING = r'''
import os, signal, subprocess, sys
from epl.launch import cli

class Popen(subprocess.Popen):
  """The launcher's worker process; its 3rd poll sends the launcher a SIGINT while the
  poll holds the process's wait lock (between its acquire and release)."""
  polls = 0

  def _internal_poll(self, _deadstate=None, **kwargs):
    def waitpid(pid, options):
      Popen.polls += 1
      if Popen.polls == 3:
        os.kill(os.getpid(), signal.SIGINT)
      return os.waitpid(pid, options)
    return super()._internal_poll(_deadstate, _waitpid=waitpid)

cli.subprocess.Popen = Popen
sys.exit(cli.main(sys.argv[1:]))
'''


def test_a_ctrl_c_that_lands_inside_a_poll_of_a_worker_stops_the_job(tmp_path):
  """The interrupt arrives while the launcher polls a worker (its wait lock held): every
  worker is stopped and the launcher exits 130 at once (it used to wait for ever)."""
  worker = tmp_path / "worker.py"
  worker.write_text("import time\ntime.sleep(600)\n")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root, CUDA_VISIBLE_DEVICES="")
  launcher = subprocess.Popen(
      [sys.executable, "-c", _INTERRUPTED_WHILE_POLLING, "--num_workers", "1", "--log_dir",
       str(tmp_path / "logs"), str(worker)], env=env, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)
  try:
    out, err = launcher.communicate(timeout=30)
  except subprocess.TimeoutExpired:
    launcher.kill()                      # its worker gets SIGKILL from the kernel (pdeathsig)
    out, err = launcher.communicate()
    raise AssertionError("the launcher did not end 30 s after the interrupt:\n%s%s" % (out, err))
  assert launcher.returncode == 128 + signal.SIGINT, (out, err)
  assert "epl-launch: interrupted (SIGINT); all workers stopped" in err, (out, err)
  pid = int(re.search(r"worker 0 started \(pid (\d+)\)", out).group(1))
  with pytest.raises(ProcessLookupError):
    os.kill(pid, 0)
