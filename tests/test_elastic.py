"""Elastic jobs (epl-launch --min_workers): the launchers' membership protocol on real sockets
(several launchers in this process, each on its own port), the worker's side (the global
batch kept in micro-batches, the chief's stop after a checkpoint), the flags -- and the whole
job on the namespace testbed: 3 hosts, one's network removed for good at step K, the job
going on with 2 and growing back to 3 when it returns, trained to the local model's losses
and weights (1e-5).
"""
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from epl.config import Config
from epl.errors import ConfigError
from epl.launch import elastic
from epl.launch.restarts import Restarts
from epl.launch.spec import parser, settings_from_args
from epl.runtime.elastic import keep_global_batch, resize_asked
from epl.testing import cluster
from tests.ports import private_ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "workers", "elastic_worker.py")


# ---- the membership protocol ---------------------------------------------------------------
def _hosts(n):
  """Hosts whose launcher ports are this test process's own free ports below the ephemeral
  range (their worker ports, 10000 lower, are never bound here)."""
  return ["127.0.0.1:%d" % (p - elastic.PORT_OFFSET) for p in private_ports(n)]


class _Launchers:
  """Rendezvous of ``n`` hosts in this process (``up``: which answer)."""

  def __init__(self, n, min_workers=2, host_timeout=1.0, give_up=20, up=None):
    self.hosts = _hosts(n)
    self.joined = []
    self.args = dict(min_workers=min_workers, host_timeout=host_timeout, give_up=give_up)
    self.rdv = {r: self.make(r) for r in (range(n) if up is None else up)}

  def make(self, rank):
    return elastic.Rendezvous(self.hosts, rank, on_joiner=self.joined.append, **self.args)

  def rejoin(self, rank):
    """A new launcher on host ``rank`` looks for its membership in a thread, until a
    coordinator heard it ask to join (or 20 s): (the thread, {"found": its result})."""
    self.rdv[rank] = self.make(rank)
    back = {}
    t = threading.Thread(target=lambda: back.update(found=self.rdv[rank].next_membership()))
    t.start()
    deadline = time.time() + 20
    while not self.joined and time.time() < deadline:
      time.sleep(0.1)
    return t, back

  def gather(self, ranks, failed=True):
    """Every launcher of ``ranks`` looks for its next membership at once; their results."""
    found = {}
    threads = [threading.Thread(target=lambda r=r: found.__setitem__(
        r, self._next(r, failed))) for r in ranks]
    for t in threads:
      t.start()
    for t in threads:
      t.join(60)
    return found

  def _next(self, rank, failed):
    try:
      return self.rdv[rank].next_membership(failed)
    except elastic.GaveUp as e:
      return e

  def close(self):
    for r in self.rdv.values():
      r.close()


@pytest.fixture
def launchers():
  made = []

  def make(*args, **kwargs):
    made.append(_Launchers(*args, **kwargs))
    return made[-1]
  yield make
  for m in made:
    m.close()


def test_the_launcher_port_is_the_workers_plus_10000():
  assert elastic.launcher_port("10.0.0.1:23456") == 33456
  assert elastic.launcher_port("h:60000") == 50000


def test_a_launcher_port_in_use_is_one_clear_error(launchers):
  job = launchers(2)
  with pytest.raises(SystemExit, match=r"--min_workers: this host's launcher cannot listen on "
                     r"port \d+, its worker's port 127.0.0.1:\d+ \+/- 10000"):
    job.make(0)                                  # host 0's launcher already listens there


def test_hosts_that_all_answer_agree_at_once(launchers):
  job = launchers(3, host_timeout=30)
  started = time.time()
  found = job.gather([0, 1, 2])
  assert time.time() - started < 10                      # nobody waited for a timeout
  assert set(found.values()) == {elastic.Membership(1, (0, 1, 2))}


def test_a_silent_host_is_dropped_after_the_timeout_and_grows_back_at_the_next_gather(
    launchers):
  job = launchers(3, host_timeout=2, up=[0, 1])
  started = time.time()
  found = job.gather([0, 1])
  assert time.time() - started >= 2
  assert found == {0: elastic.Membership(1, (0, 1)), 1: elastic.Membership(1, (0, 1))}
  # host 2 comes back (a new launcher on it, or the old one reachable again): it learns it is
  # not a member, waits, and the coordinator (host 0) hears it asking to join
  t, back = job.rejoin(2)
  assert job.joined == [2]
  assert job.rdv[2].phase == elastic.WAITING
  # the chief stopped at its checkpoint: 0 and 1 gather again, now with 2
  found = job.gather([0, 1])
  t.join(30)
  assert found == {0: elastic.Membership(2, (0, 1, 2)), 1: elastic.Membership(2, (0, 1, 2))}
  assert back == {"found": elastic.Membership(2, (0, 1, 2))}


def test_a_dropped_host_with_the_lowest_rank_rejoins_and_host_1_coordinates(launchers):
  job = launchers(3, host_timeout=1, up=[1, 2])
  assert set(job.gather([1, 2]).values()) == {elastic.Membership(1, (1, 2))}
  t, back = job.rejoin(0)
  assert job.joined == [0]                              # heard by host 1, the coordinator
  found = job.gather([1, 2])
  t.join(30)
  assert set(found.values()) == {elastic.Membership(2, (0, 1, 2))}
  assert back == {"found": elastic.Membership(2, (0, 1, 2))}


def test_fewer_hosts_than_min_workers_wait_then_give_up_naming_who_answered(launchers):
  job = launchers(3, min_workers=3, host_timeout=0.5, give_up=3, up=[0, 1])
  found = job.gather([0, 1])
  for r in (0, 1):
    assert isinstance(found[r], elastic.GaveUp)
    assert re.search(r"no job of at least 3 host\(s\) could be formed within 3 s \(heard "
                     r"from host %d\)" % (1 - r), str(found[r])), found[r]


def test_a_launcher_that_ends_the_job_tells_the_others(launchers):
  job = launchers(3, host_timeout=30)
  job.rdv[2].phase = elastic.FAILED
  assert job.gather([0, 1]) == {0: elastic.FAILED, 1: elastic.FAILED}
  done = launchers(2, host_timeout=30)
  done.rdv[0].phase = elastic.DONE
  assert done.gather([1], failed=False) == {1: elastic.DONE}


def test_another_jobs_launcher_on_a_hosts_port_is_not_that_host(launchers):
  job = launchers(2, min_workers=1, host_timeout=1, up=[0])
  job.rdv[0].job = "a"
  other = elastic.Rendezvous(job.hosts, 1, 1, 1, job="b")  # job b's launcher on host 1's port
  try:
    started = time.time()
    assert job.gather([0]) == {0: elastic.Membership(1, (0,))}
    assert time.time() - started >= 1                        # host 1 counted as silent
    assert other.phase == elastic.RUNNING and not other.joiners
  finally:
    other.close()


def test_a_launcher_whose_job_ended_waits_until_its_peers_know(launchers):
  # host 1's worker finished its last step while the chief stopped at that step's
  # checkpoint for a resize: host 0 gathers and learns that the job is over
  job = launchers(2, host_timeout=30)
  started = time.time()
  t = threading.Thread(target=job.rdv[1].finish, args=(elastic.DONE,))
  t.start()
  time.sleep(1)
  assert t.is_alive()                            # host 0 has not heard it yet
  assert job.gather([0]) == {0: elastic.DONE}
  t.join(15)
  assert not t.is_alive() and time.time() - started < 8
  # peers that ended too need not ask
  both = launchers(2, host_timeout=30)
  both.rdv[0].phase = elastic.DONE
  started = time.time()
  both.rdv[1].finish(elastic.DONE)
  assert time.time() - started < 3


def test_a_peer_still_running_the_old_epoch_is_waited_for(launchers):
  job = launchers(2, host_timeout=0.2)
  found = {}
  t = threading.Thread(target=lambda: found.update(zero=job.rdv[0].next_membership()))
  t.start()
  time.sleep(2)                                  # host 1's worker has not failed yet
  assert not found
  job.gather([1])
  t.join(30)
  assert found == {"zero": elastic.Membership(1, (0, 1))}


# ---- the resizer: what the launcher says and does ------------------------------------------
def _settings(tmp_path, *flags):
  script = tmp_path / "train.py"
  script.write_text("")
  return settings_from_args(parser().parse_args(list(flags) + [str(script)]), environ={})


def test_min_workers_needs_a_launcher_per_host_and_a_size_in_range(tmp_path):
  for flags, message in [
      (["--num_workers", "2", "--min_workers", "1"], r"--min_workers needs one epl-launch per "
       r"host"),
      (["--num_workers", "2", "--machine_list", "a:1,b:2", "--machine_rank", "0",
        "--min_workers", "3"], r"--min_workers 3: expected 1 to 2"),
      (["--num_workers", "2", "--machine_list", "a:1,b:2", "--machine_rank", "0",
        "--min_workers", "1", "--host_timeout", "0"], r"--host_timeout must be >= 1")]:
    with pytest.raises(SystemExit, match=message):
      _settings(tmp_path, *flags)
  s = _settings(tmp_path, "--num_workers", "3", "--machine_list", "a:1,b:2,c:3",
                "--machine_rank", "2", "--min_workers", "2", "--host_timeout", "9",
                "--log_dir", str(tmp_path / "logs"))
  assert (s.min_workers, s.host_timeout, s.elastic_workers) == (2, 9, 3)
  assert s.resize_file == str(tmp_path / "logs" / "resize.2")


def test_min_workers_of_half_the_hosts_or_fewer_warns_of_split_networks(tmp_path, capsys):
  _settings(tmp_path, "--num_workers", "4", "--machine_list", "a:1,b:2,c:3,d:4",
            "--machine_rank", "0", "--min_workers", "2")
  assert "--min_workers 2 of 4 hosts: both sides of a split network may train on" in \
      capsys.readouterr().err
  _settings(tmp_path, "--num_workers", "4", "--machine_list", "a:1,b:2,c:3,d:4",
            "--machine_rank", "0", "--min_workers", "3")
  assert "split network" not in capsys.readouterr().err


def test_the_resizer_gives_each_membership_its_hosts_and_ranks_and_says_each_change(tmp_path):
  s = _settings(tmp_path, "--num_workers", "3", "--machine_list", "a:1,b:2,c:3",
                "--machine_rank", "2", "--min_workers", "2", "--log_dir", str(tmp_path))
  said = []

  class Fake:                                    # the rendezvous, deciding what it is told
    current = elastic.Membership(0, (0, 1, 2))
    told, why, outcome = None, "", []

    def next_membership(self, allow=None):
      found = self.outcome.pop(0)
      if found == "same hosts":                  # as the coordinator does (Rendezvous._decide)
        if allow is not None and not allow():
          self.why = "the same hosts failed again, past --max_restarts"
          return elastic.FAILED
        found = elastic.Membership(self.current.epoch + 1, self.current.members)
      self.current = found
      return found

    def finish(self, phase, linger=None):
      said.append(phase)
  rdv = Fake()
  resizer = elastic.Resizer(s, said.append, rendezvous=rdv)
  assert resizer.settings().hosts == ("a:1", "b:2", "c:3")
  rdv.outcome = [elastic.Membership(1, (0, 2))]
  assert resizer.after_run(False, "", Restarts(0, 0)) is None
  assert re.search(r"epoch 1 on 2 of 3 host\(s\) \(0, 2\); dropped host 1 \(b:2\); this host "
                   r"is worker 1 of 2", said[-1]), said
  new = resizer.settings()
  assert (new.num_workers, new.hosts, new.machine_rank) == (2, ("a:1", "c:3"), 1)
  # a planned resize takes no restart; the same hosts after a failure take one, which
  # --max_restarts 0 does not have
  rdv.outcome = ["same hosts"]
  assert resizer.after_run(True, "", Restarts(0, 0)) is None
  rdv.outcome = ["same hosts"]
  assert resizer.after_run(False, "", Restarts(0, 0)) == 1
  assert said[-2].endswith("the job ended (failed: the same hosts failed again, past "
                           "--max_restarts)") and said[-1] == elastic.FAILED
  rdv.outcome = [elastic.Membership(3, (0, 1, 2))]
  rdv.current = elastic.Membership(2, (0, 2))
  assert resizer.after_run(True, "", Restarts(0, 0)) is None
  assert "back: host 1" in said[-1]
  # an error that repeats ends every host; so does a host of the epoch that ended the job
  assert resizer.after_run(False, "a ConfigError repeats on every start",
                           Restarts(5, 0)) == 1
  assert said[-1] == elastic.FAILED
  rdv.told = elastic.FAILED
  assert resizer.told() == elastic.FAILED
  assert resizer.after_run(False, "", Restarts(5, 0)) == 1
  assert "the job ended on another host (failed)" in said[-2]
  # a host back asks to join: the chief's resize file appears; the next epoch clears it
  resizer._joiner(1)
  assert os.path.exists(s.resize_file)
  assert "host 1 (b:2) is back" in said[-1]


def test_the_coordinator_spends_the_restart_budget_for_everyone(launchers):
  job = launchers(2, host_timeout=30)
  found = {}
  threads = [threading.Thread(target=lambda r=r: found.__setitem__(
      r, job.rdv[r].next_membership(allow=lambda: False))) for r in (0, 1)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(30)
  assert found == {0: elastic.FAILED, 1: elastic.FAILED}
  assert "past --max_restarts" in job.rdv[0].why and "host 0's launcher failed" in job.rdv[1].why


def test_a_host_that_ends_the_job_for_good_tells_the_running_ones(launchers):
  job = launchers(2, host_timeout=30)
  job.rdv[1].finish(elastic.FAILED, linger=2)
  assert job.rdv[0].told == elastic.FAILED                # its launcher stops its workers
  done = launchers(2, host_timeout=30)
  done.rdv[1].finish(elastic.DONE, linger=1)
  assert done.rdv[0].told is None                         # a finished one lets them finish


def test_an_epoch_decided_without_this_host_makes_it_a_joiner(launchers):
  """Host 0 decided epoch 1 = (0, 1, 2) in the round that host 1 decided (1, 2) without
  hearing host 0: 1 and 2 run; host 0, gathering again, asks to join instead of waiting to
  coordinate an epoch nobody else is in."""
  job = launchers(3, host_timeout=1)
  job.rdv[1]._adopt(elastic.Membership(1, (1, 2)))
  job.rdv[2]._adopt(elastic.Membership(1, (1, 2)))
  job.rdv[0]._adopt(elastic.Membership(1, (0, 1, 2)))
  t = threading.Thread(target=job.rdv[0].next_membership, daemon=True)
  t.start()
  deadline = time.time() + 15
  while not job.joined and time.time() < deadline:
    time.sleep(0.1)
  assert job.rdv[0].phase == elastic.WAITING and job.joined == [0]


def test_a_bad_question_does_not_end_the_answering(launchers):
  import socket
  job = launchers(2, host_timeout=30)
  address = ("127.0.0.1", elastic.launcher_port(job.hosts[0]))
  for junk in (b"[1, 2]\n", b"{\"rank\": 99}\n", b"{\"rank\": null, \"phase\": \"waiting\"}\n",
               b"not json\n"):
    with socket.create_connection(address, 2) as c:
      c.sendall(junk)
      c.recv(4096)
  answer = elastic._ask(job.hosts[0], {"rank": 1, "job": "", "phase": elastic.RUNNING,
                                       "epoch": 0})
  assert answer["rank"] == 0 and answer["phase"] == elastic.RUNNING


# ---- the worker's side ----------------------------------------------------------------------
def test_fewer_workers_run_more_micro_batches_so_the_global_batch_is_kept():
  config = Config({"pipeline.num_micro_batch": 2, "launch.elastic_workers": 3}, environ={})
  assert keep_global_batch(config, 3) is config
  assert keep_global_batch(config, 2).pipeline.num_micro_batch == 3
  assert keep_global_batch(config, 1).pipeline.num_micro_batch == 6
  plain = Config({"pipeline.num_micro_batch": 2}, environ={})
  assert keep_global_batch(plain, 1) is plain             # not elastic: left alone
  odd = Config({"launch.elastic_workers": 3}, environ={})
  with pytest.raises(ConfigError, match=r"3 worker\(s\) x pipeline.num_micro_batch=1 "
                     r"micro-batches cannot be shared by the 2 worker\(s\) left.*set "
                     r"pipeline.num_micro_batch to a multiple of 2"):
    keep_global_batch(odd, 2)


def test_the_chief_stops_after_a_checkpoint_once_the_launcher_asks(tmp_path):
  resize = tmp_path / "resize.0"
  config = Config({"launch.resize_file": str(resize)}, environ={})
  assert not resize_asked(config, True)                    # not asked: goes on
  resize.write_text("2\n")
  assert not resize_asked(config, False)                   # not the chief: goes on
  assert resize_asked(config, True)
  assert not resize_asked(Config(environ={}), True)        # not elastic


# ---- the whole job on 3 hosts ---------------------------------------------------------------
STEPS = 60


def _local(tmp_path):
  out = tmp_path / "local"
  out.mkdir()
  subprocess.run([sys.executable, WORKER, "", str(out), str(STEPS), "local"], check=True,
                 env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
                          CUDA_VISIBLE_DEVICES=""), capture_output=True, timeout=120)
  return _losses(out), dict(np.load(out / "final.npz"))


def _losses(out):
  """The last loss written for each step (a step redone after a restore overwrites)."""
  losses = {}
  with open(out / "losses.txt") as f:
    for line in f:
      step, value = line.split()
      losses.setdefault(int(step), []).append(float(value))
  return losses


@pytest.mark.skipif(cluster.available() is not None, reason=str(cluster.available()))
def test_a_job_that_loses_a_host_trains_on_and_grows_back_to_the_same_model(tmp_path):
  from tests.test_cluster import Host
  local_losses, local_final = _local(tmp_path)
  out = tmp_path / "out"
  out.mkdir()
  with cluster.Testbed(3) as bed:
    hosts = [Host(bed, r, 3, 1, ["--min_workers", "2", "--host_timeout", "5", WORKER,
                                 str(tmp_path / "ck"), str(out), str(STEPS)],
                  tmp_path / ("logs_%d" % r),
                  env={"TEST_PAUSE": "0.15", "EPL_COMMUNICATION_COLLECTIVE_TIMEOUT": "30"})
             for r in range(3)]
    try:
      hosts[0].wait_for(r"worker 0 step 10\b", timeout=180)
      bed.link_down(2)                                    # host 2's network, gone
      hosts[0].wait_for(r"elastic: epoch 1 on 2 of 3 host\(s\) \(0, 1\); dropped host 2",
                        timeout=180)
      hosts[0].wait_for(r"worker 0 of 2 starts at step", timeout=120)
      time.sleep(3)                                       # a few steps on 2 hosts
      bed.link_up(2)
      hosts[0].wait_for(r"elastic: host 2 \(.*\) is back", timeout=120)
      hosts[0].wait_for(r"elastic: epoch 2 on 3 of 3 host\(s\) \(0, 1, 2\); back: host 2",
                        timeout=180)
      codes = [h.wait(240) for h in hosts]
    finally:
      bed.close()
    assert codes == [0, 0, 0], [h.out[-3000:] for h in hosts]
    for host in range(3):
      assert not bed.pids_of(bed.names[host])
  logs = "\n".join(h.out for h in hosts)
  assert re.search(r"worker 2 of 3 starts at step [1-9]", hosts[2].out), hosts[2].out[-3000:]
  assert "dropped host 2" in hosts[1].out and "back: host 2" in hosts[1].out
  assert "pipeline.num_micro_batch 2 -> 3 keeps the global batch" in "".join(
      open(p).read() for p in (tmp_path / "logs_0").glob("worker_0.restart*.log"))
  losses = _losses(out)
  assert sorted(losses) == list(range(STEPS)), logs[-3000:]
  for step, values in losses.items():
    # a step run again after a restore computes what it did before: the same model
    np.testing.assert_allclose(values, [local_losses[step][0]] * len(values), rtol=1e-5,
                               atol=1e-5, err_msg="step %d" % step)
  final = dict(np.load(out / "final.npz"))
  for name, value in local_final.items():
    np.testing.assert_allclose(final[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


def test_a_question_that_comes_back_to_itself_is_no_answer(monkeypatch):
  """A launcher port nobody listens on, connected to itself (the source port forced equal):
  the echo of the question is not taken for that host's answer."""
  import socket
  from epl.launch.spec import free_ports
  host = "127.0.0.1:%d" % (free_ports(1)[0] - elastic.PORT_OFFSET)     # ephemeral: > 32767
  real = socket.create_connection
  monkeypatch.setattr(elastic.socket, "create_connection",
                      lambda addr, timeout=None: real(addr, timeout, source_address=addr))
  question = {"rank": 0, "phase": elastic.GATHERING, "epoch": 0}
  echo = elastic._ask(host, question)
  assert echo == question                                   # the question itself came back
  assert elastic._from(2, echo) is None


def test_the_resize_stop_is_an_exit_code_epls_exit_watch_sees():
  """The chief's stop skips the farewell (its peers wait in the step for it: a farewell that
  waited for them held the grow for its whole minute)."""
  from epl.runtime import heartbeat
  from epl.runtime.elastic import stop
  exits = heartbeat.ExitCode().install()
  try:
    with pytest.raises(SystemExit) as stopped:
      stop()
  finally:
    exits.uninstall()
  assert stopped.value.code == elastic.RESIZE_EXIT
  assert exits.code == elastic.RESIZE_EXIT and exits.failed
