"""Jobs across hosts: each worker on its own network-namespace host (epl.testing.cluster),
started by its own ``epl-launch --machine_list ... --machine_rank i``.

Parity across hosts (data parallel, a pipeline with a stage per host, split), a wrong address,
and what a network does to a job: a link taken down, a host killed, a host that starts late,
a link that turns slow. Every test deletes what it made (namespaces, veths, processes), also
when it fails; where namespaces cannot be made (no root) the tests are skipped with the reason.
"""
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from epl.testing import cluster
from tests import models
from tests.test_multiworker import local_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")
WHY_NOT = cluster.available()
# Not ``alone``: every testbed is its own bridge, namespaces and veths (named by pid and
# time), its workers listen inside their namespaces, and a capped link is the testbed's own;
# the tests that look for training processes by name are ``alone`` and so never see these.
pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]


@pytest.fixture
def bed(request):
  made = []

  def make(hosts=2, rate=None):
    made.append(cluster.Testbed(hosts, rate=rate))
    return made[-1]
  yield make
  for b in made:
    b.close()
  assert not [n for n in cluster.leftovers() if any(n.startswith(p) for b in made for p in (
      b.bridge, *b.names, *b.links))]


class Host:
  """One host's epl-launch (its output collected)."""

  def __init__(self, bed, rank, workers, devices, args, log_dir, env=None, port=23456):
    full_env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
                    CUDA_VISIBLE_DEVICES="", **(env or {}))
    self.rank = rank
    self.proc = bed.start(rank, [sys.executable, "-m", "epl.launch.cli", "--num_workers",
                                 str(workers), "--gpu_per_worker", str(devices),
                                 "--machine_list", bed.machine_list(port), "--machine_rank",
                                 str(rank), "--log_dir", str(log_dir)] + list(args),
                          env=full_env, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    self.lines = []
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for line in self.proc.stdout:
      self.lines.append(line)

  @property
  def out(self):
    return "".join(self.lines)

  def wait_for(self, pattern, count=1, timeout=120):
    """Waits until ``count`` output lines match ``pattern``."""
    deadline = time.time() + timeout
    while time.time() < deadline:
      if len([l for l in self.lines if re.search(pattern, l)]) >= count:
        return
      if self.proc.poll() is not None and not self._reader.is_alive():
        break
      time.sleep(0.2)
    raise AssertionError("host %d never printed %d x %r:\n%s" % (self.rank, count, pattern,
                                                                  self.out[-3000:]))

  def wait(self, timeout):
    try:
      self.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()
      self._reader.join(5)
      raise AssertionError("host %d's epl-launch did not end in %d s:\n%s" % (
          self.rank, timeout, self.out[-3000:]))
    self._reader.join(10)
    return self.proc.returncode


def _launch_all(bed, workers, devices, args, tmp_path, env=None, delays=None):
  hosts = []
  for rank in range(workers):
    if delays and delays.get(rank):
      time.sleep(delays[rank])
    hosts.append(Host(bed, rank, workers, devices, args, tmp_path / ("logs_%d" % rank), env))
  return hosts


def _assert_trains(results, local, rtol=1e-5):
  losses = np.mean([r["__losses__"] for r in results], axis=0)
  np.testing.assert_allclose(losses, local.losses, rtol=rtol, atol=rtol)
  for r in results:
    for name, value in local.variables.items():
      np.testing.assert_allclose(r[name], value, rtol=rtol, atol=rtol, err_msg=name)


# ---- the same model as on one machine ----------------------------------------------------
def test_data_parallel_over_two_hosts_with_two_devices_each(bed, tmp_path):
  b = bed(2)
  steps, batch = 5, 4
  local = local_run(tmp_path, models.mlp, 2 * 2 * batch, steps, seed=1)
  hosts = _launch_all(b, 2, 2, [os.path.join(WORKERS, "dp_worker.py"), str(tmp_path), "mlp",
                                str(steps), str(batch)], tmp_path)
  codes = [h.wait(240) for h in hosts]
  assert codes == [0, 0], "\n".join(h.out[-3000:] for h in hosts)
  _assert_trains([dict(np.load(tmp_path / ("worker_%d.npz" % w))) for w in range(2)], local)
  sent = [b.link_bytes(h)[1] for h in range(2)]
  assert min(sent) > 0                       # the gradients crossed the hosts' links


def test_a_pipeline_with_a_stage_per_host_and_four_micro_batches(bed, tmp_path):
  b = bed(2)
  steps, batch, micro = 5, 4, 4
  local = local_run(tmp_path, models.mlp_two_stages, batch * micro, steps, seed=3)
  hosts = _launch_all(b, 2, 1, [os.path.join(WORKERS, "dp_worker.py"), str(tmp_path),
                                "mlp_two_stages", str(steps), str(batch), "1,1"], tmp_path,
                      env={"EPL_PIPELINE_NUM_MICRO_BATCH": str(micro)})
  codes = [h.wait(240) for h in hosts]
  assert codes == [0, 0], "\n".join(h.out[-3000:] for h in hosts)
  _assert_trains([dict(np.load(tmp_path / "worker_0.npz"))], local)   # worker 1 serves
  assert "serves its devices" in hosts[1].out


def test_a_split_classifier_over_two_hosts(bed, tmp_path):
  from tests import test_split
  b = bed(2)
  local, data = test_split._local_classifier()          # pylint: disable=protected-access
  np.savez(tmp_path / "data.npz", x=data[0], y=data[1])
  np.savez(tmp_path / "initial.npz", **local.initial)
  hosts = _launch_all(b, 2, 1, [os.path.join(WORKERS, "split_worker.py"), str(tmp_path),
                                str(test_split.STEPS), str(test_split.ROWS), "1",
                                "classifier"], tmp_path)
  codes = [h.wait(240) for h in hosts]
  assert codes == [0, 0], "\n".join(h.out[-3000:] for h in hosts)
  res = dict(np.load(sorted(tmp_path.glob("client*.npz"))[0]))
  assert any("task:1" in d for d in res["__devices__"])     # a shard lives on the other host
  np.testing.assert_allclose(res["__loss__"], [f["loss"] for f in local.fetched], rtol=1e-5,
                             atol=1e-5)
  for name, value in local.variables.items():
    np.testing.assert_allclose(res[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


def test_a_wrong_address_in_the_machine_list_is_one_clear_error(bed, tmp_path):
  b = bed(2)
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
             EPL_CLUSTER_STARTUP_TIMEOUT="10")
  wrong = "10.%d.0.99:23456" % b.net                 # in the hosts' subnet, nobody there
  args = [sys.executable, "-m", "epl.launch.cli", "--num_workers", "2", "--gpu_per_worker",
          "1", "--machine_list", "%s:23456,%s" % (b.addresses[0], wrong), "--machine_rank",
          "0", "--log_dir", str(tmp_path / "logs"),
          os.path.join(WORKERS, "train_worker.py"), str(tmp_path / "ck"), str(tmp_path), "5",
          "0"]
  started = time.time()
  proc = b.start(0, args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                 text=True)
  out = proc.communicate(timeout=120)[0]
  assert proc.returncode != 0 and time.time() - started < 60, out[-3000:]
  assert re.search(r"worker 1 at %s (does not answer|is not reachable)" % re.escape(wrong),
                   out), out[-3000:]
  # an address that is not this host's own: its server cannot start there
  args[args.index("--machine_list") + 1] = "%s:23456,%s:23456" % (b.addresses[1],
                                                                  b.addresses[0])
  proc = b.start(0, args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                 text=True)
  out = proc.communicate(timeout=120)[0]
  assert proc.returncode != 0, out[-3000:]
  assert re.search(r"worker 0 could not start its server on %s:23456.*not an address of this "
                   r"host" % re.escape(b.addresses[1]), out), out[-3000:]


# ---- what a network does to a job ----------------------------------------------------------
def _training(b, tmp_path, env=None, delays=None, steps=100000, pause="0.05"):
  return _launch_all(b, 2, 1, [os.path.join(WORKERS, "train_worker.py"), str(tmp_path / "ck"),
                               str(tmp_path), str(steps), pause], tmp_path, env=env,
                     delays=delays)


def _all_end_with(b, hosts, pattern, within=60):
  started = time.time()
  codes = [h.wait(within + 30) for h in hosts]
  assert time.time() - started < within, [h.out[-2000:] for h in hosts]
  assert all(c != 0 for c in codes), [(c, h.out[-2000:]) for c, h in zip(codes, hosts)]
  assert any(re.search(pattern, h.out) for h in hosts), [h.out[-3000:] for h in hosts]
  for host in range(len(b.names)):                        # nothing left on any host
    assert not [p for p in b.pids_of(b.names[host])], host


def test_a_host_whose_link_goes_down_ends_the_job_with_one_error(bed, tmp_path):
  b = bed(2)
  hosts = _training(b, tmp_path)
  hosts[0].wait_for(r"worker 0 step", count=5)
  b.link_down(1)
  _all_end_with(b, hosts, r"lost worker 1: %s:23456 no longer accepts connections" %
                re.escape(b.addresses[1]))
  assert re.search(r"epl worker 1 stops: lost worker 0", hosts[1].out), hosts[1].out[-3000:]


def test_a_host_that_disappears_ends_the_job_with_one_error(bed, tmp_path):
  b = bed(2)
  hosts = _training(b, tmp_path)
  hosts[0].wait_for(r"worker 0 step", count=5)
  b.kill_host(1)
  _all_end_with(b, hosts[:1], r"lost worker 1: %s:23456" % re.escape(b.addresses[1]))


def test_a_host_that_starts_30_s_late_is_waited_for(bed, tmp_path):
  b = bed(2)
  hosts = _training(b, tmp_path, delays={1: 30}, steps=20, pause="0")
  assert [h.wait(180) for h in hosts] == [0, 0], [h.out[-2000:] for h in hosts]
  assert "worker 0 step 20" in hosts[0].out


def test_a_host_later_than_the_start_up_timeout_is_one_clear_error(bed, tmp_path):
  b = bed(2)
  hosts = _training(b, tmp_path, env={"EPL_CLUSTER_STARTUP_TIMEOUT": "10"}, delays={1: 25},
                    steps=20, pause="0")
  assert hosts[0].wait(90) != 0
  assert re.search(r"not every one of the 2 workers joined within 10 s \(worker 1 at "
                   r"%s:23456 does not answer" % re.escape(b.addresses[1]), hosts[0].out), \
      hosts[0].out[-3000:]
  assert hosts[1].wait(90) != 0


def test_a_link_capped_at_50_mbit_mid_training_slows_the_job_but_does_not_end_it(
    bed, tmp_path):
  # 8M floats of gradient: 32 MB each way per step, ~5.5 s a step at 50 Mbit/s -- longer
  # than the peer watch waits before it checks that every peer still answers
  b = bed(2)
  hosts = _training(b, tmp_path, steps=24, pause="0", env={"TEST_EXTRA_PARAMS": "8000000"})
  hosts[0].wait_for(r"worker 0 step", count=20)
  before = b.link_bytes(1)[1]
  capped = time.time()
  b.set_rate(1, "50mbit")
  assert [h.wait(300) for h in hosts] == [0, 0], [h.out[-2000:] for h in hosts]
  assert "worker 0 step 24" in hosts[0].out
  rate = (b.link_bytes(1)[1] - before) * 8 / (time.time() - capped)
  assert rate < 60e6                         # the steps after the cap crossed the slow link


# ---- who can reach a job -------------------------------------------------------------------
def test_a_worker_given_another_jobs_address_fails_at_once_naming_both_jobs(bed, tmp_path):
  b = bed(2)
  job_b = _training(b, tmp_path, steps=100000, pause="0.05")
  job_b[0].wait_for(r"worker 0 step", count=3)
  b_id = re.search(r"epl-launch: job (\S+):", job_b[0].out).group(1)
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
  script = [os.path.join(WORKERS, "train_worker.py"), str(tmp_path / "a_ck"), str(tmp_path),
            "20", "0"]
  for rank, machine_list, expected in (
      # job A's worker 1 is job B's worker 1 on host 1
      (0, "%s:23460,%s:23456" % (b.addresses[0], b.addresses[1]),
       r"worker 0 of job job-a: %s:23456, given for worker 1, is worker 1 of job %s\." % (
           re.escape(b.addresses[1]), re.escape(b_id))),
      # job A's worker 0 is job B's worker 1
      (1, "%s:23456,%s:23461" % (b.addresses[1], b.addresses[0]),
       r"worker 1 of job job-a: %s:23456, given for worker 0, is worker 1 of job %s\." % (
           re.escape(b.addresses[1]), re.escape(b_id)))):
    started = time.time()
    proc = b.start(0, [sys.executable, "-m", "epl.launch.cli", "--num_workers", "2",
                       "--machine_list", machine_list, "--machine_rank", str(rank),
                       "--job_id", "job-a", "--log_dir", str(tmp_path / "a_logs")] + script,
                   env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                   text=True)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0 and time.time() - started < 30, out[-3000:]
    assert re.search(expected, out), out[-3000:]
  assert job_b[0].proc.poll() is None and job_b[1].proc.poll() is None   # B trains on
  count = len([l for l in job_b[0].lines if "worker 0 step" in l])
  job_b[0].wait_for(r"worker 0 step", count=count + 5)


def test_epl_launch_prints_its_ports_and_keeps_to_the_port_range(bed, tmp_path):
  b = bed(2)
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
  blocker = b.start(0, [sys.executable, "-c", "import socket, time; s = socket.socket(); "
                        "s.bind(('', 30100)); s.listen(); time.sleep(600)"], env=env)
  time.sleep(1)
  # a localhost job on host 0: its two servers take free ports of the range (30100 is taken)
  host = Host.__new__(Host)
  host.rank, host.lines = 0, []
  host.proc = b.start(0, [sys.executable, "-m", "epl.launch.cli", "--num_workers", "2",
                          "--port_range", "30100-30109", "--log_dir", str(tmp_path / "logs"),
                          os.path.join(WORKERS, "train_worker.py"), str(tmp_path / "ck"),
                          str(tmp_path), "100000", "0.05"],
                      env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                      text=True)
  host._reader = threading.Thread(target=host._read, daemon=True)   # pylint: disable=protected-access
  host._reader.start()
  host.wait_for(r"worker 0 step", count=2)
  said = re.search(r"epl-launch: job (job-\w+): worker 0 on localhost:(\d+), worker 1 on "
                   r"localhost:(\d+)\. TensorFlow's servers listen on every interface without "
                   r"authentication", host.out)
  assert said, host.out[-3000:]
  ports = {int(said.group(2)), int(said.group(3))}
  assert ports <= set(range(30101, 30110)), ports
  listening = subprocess.run(["ip", "netns", "exec", b.names[0], "ss", "-ltnH"],
                             capture_output=True, text=True, check=True).stdout
  for port in ports:           # ... on every interface: host 1 reaches this localhost job
    assert re.search(r"(\*|0\.0\.0\.0|\[::\]):%d\b" % port, listening), listening
    reach = b.start(1, [sys.executable, "-c", "import socket; socket.create_connection(("
                        "'%s', %d), timeout=5)" % (b.addresses[0], port)], env=env)
    assert reach.wait(30) == 0
  host.proc.send_signal(2)                                      # Ctrl-C
  assert host.wait(60) != 0
  blocker.kill()


# ---- restarts across hosts -----------------------------------------------------------------
def test_a_worker_killed_on_one_host_restarts_the_job_on_every_host(bed, tmp_path):
  # each host's epl-launch restarts its own worker: host 0's when its worker loses the peer,
  # host 1's when its worker is killed; the new workers meet (waiting for a worker of the
  # previous start that has not yet noticed) and resume from the shared checkpoint directory
  b = bed(2)
  script = [os.path.join(WORKERS, "restart_worker.py"), str(tmp_path / "ck"), str(tmp_path),
            "400"]
  hosts = _launch_all(b, 2, 1, ["--max_restarts", "1"] + script, tmp_path)
  pid = int(re.search(r"worker 1 started \(pid (\d+)\)",
                      (hosts[1].wait_for(r"worker 1 started \(pid"), hosts[1].out)[1]).group(1))
  hosts[0].wait_for(r"worker 0 step 40\b")
  os.kill(pid, 9)
  assert [h.wait(240) for h in hosts] == [0, 0], [h.out[-3000:] for h in hosts]
  for h in hosts:
    assert re.search(r"restart 1 of at most 1: worker %d failed" % h.rank, h.out), h.out[-3000:]
  assert re.search(r"restart 1 resumed at global_step [1-9]\d*", hosts[0].out)
  assert dict(np.load(tmp_path / "final_0.npz"))["global_step"] == 400
