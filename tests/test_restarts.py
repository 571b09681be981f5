"""epl-launch --max_restarts, for real: a worker killed with SIGKILL mid-training, a worker that
fails on every start, errors that a restart would only repeat.

The jobs are 2 workers on localhost running tests/workers/restart_worker.py (checkpoints
every 4 steps, input keyed by the global step), each started by epl-launch.
"""
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "workers", "restart_worker.py")


class Launch:
  """One epl-launch of restart_worker.py, its console collected line by line."""

  def __init__(self, tmp_path, name, steps, max_restarts=2, env=None, via_environment=False):
    """``via_environment``: the budget as a scheduler gives it (EPL_LAUNCH_MAX_RESTARTS),
    no flag."""
    self.out_dir = tmp_path / name
    self.out_dir.mkdir()
    full_env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
                    CUDA_VISIBLE_DEVICES="", **(env or {}))
    full_env.pop("EPL_LAUNCH_MAX_RESTARTS", None)
    flag = ["--max_restarts", str(max_restarts)]
    if via_environment:
      full_env["EPL_LAUNCH_MAX_RESTARTS"], flag = str(max_restarts), []
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "epl.launch.cli", "--num_workers", "2"] + flag + [
         "--log_dir", str(self.out_dir / "logs"), SCRIPT,
         str(self.out_dir / "ckpt"), str(self.out_dir), str(steps)],
        env=full_env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    self.lines = []
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for line in self.proc.stdout:
      self.lines.append(line)

  @property
  def out(self):
    return "".join(self.lines)

  def wait_for(self, pattern, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
      for line in list(self.lines):
        found = re.search(pattern, line)
        if found:
          return found
      if self.proc.poll() is not None and not self._reader.is_alive():
        break
      time.sleep(0.05)
    raise AssertionError("never printed %r:\n%s" % (pattern, self.out[-4000:]))

  def wait(self, timeout=300):
    try:
      self.proc.wait(timeout=timeout)
    finally:
      if self.proc.poll() is None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
    self._reader.join(10)
    return self.proc.returncode

  def final(self, worker=0):
    return dict(np.load(self.out_dir / ("final_%d.npz" % worker)))


@pytest.mark.parametrize("victim,via_environment", [(1, False), (0, True)],
                         ids=["worker 1, --max_restarts", "the chief, EPL_LAUNCH_MAX_RESTARTS"])
def test_a_worker_killed_mid_training_is_restarted_and_trains_the_uninterrupted_model(
    tmp_path, victim, via_environment):
  """Killing the chief also kills the writer of the checkpoints (one may be half written);
  the budget given through the environment is the scheduler's way (no flag)."""
  steps = 160                                  # ~3 s of steps: the kill lands mid-training
  seed = int(time.time())
  kill_after = random.Random(seed).randint(6, 60)
  job = Launch(tmp_path, "killed", steps, via_environment=via_environment)
  try:
    pid = int(job.wait_for(r"epl-launch: worker %d started \(pid (\d+)\)" % victim).group(1))
    job.wait_for(r"^\[0\] worker 0 step %d$" % kill_after)
    os.kill(pid, signal.SIGKILL)
    assert job.wait() == 0, (seed, job.out[-4000:])
  finally:
    if job.proc.poll() is None:
      os.killpg(job.proc.pid, signal.SIGKILL)
  out = job.out
  assert len(re.findall(r"epl-launch: restart \d+ of at most 2", out)) == 1, out[-4000:]
  assert re.search(r"epl-launch: restart 1 of at most 2: worker %d failed \(killed by "
                   r"SIGKILL\)" % victim, out), out[-4000:]
  resumed = int(re.search(r"epl-launch: restart 1 resumed at global_step (\d+)", out).group(1))
  before = out[:out.index("epl-launch: restart 1 of")]
  reached = max(int(n) for n in re.findall(r"worker 0 step (\d+)", before))
  # the last checkpoint (every 4 steps) before the kill -- worker 0 may have run on a little:
  # the chief saves inside a step's run, before its print, and TF names a checkpoint in its
  # state file only once written, so a chief killed after a step's save but before its print
  # resumes one past the last step it printed -- killed as the victim, or stopped by the
  # launcher when worker 1 was (seen: printed 31, resumed at 32)
  last = kill_after // 4 * 4
  assert resumed % 4 == 0 and last <= resumed <= reached + 1, (
      seed, kill_after, reached, resumed)
  assert "all workers finished (after 1 restart(s))" in out
  assert os.path.exists(job.out_dir / "logs" / ("worker_%d.restart1.log" % victim))

  reference = Launch(tmp_path, "uninterrupted", steps, max_restarts=0)
  assert reference.wait() == 0, reference.out[-4000:]
  for worker in (0, 1):
    restarted, uninterrupted = job.final(worker), reference.final(worker)
    assert restarted["global_step"] == uninterrupted["global_step"] == steps
    assert sorted(restarted) == sorted(uninterrupted)
    for name, value in uninterrupted.items():
      np.testing.assert_allclose(restarted[name], value, rtol=1e-6, atol=1e-7,
                                 err_msg="worker %d: %s (seed %d)" % (worker, name, seed))


def test_a_worker_that_fails_on_every_start_ends_the_job_after_the_restarts(tmp_path):
  job = Launch(tmp_path, "failing", 40, max_restarts=2, env={"TEST_FAIL_AT_STEP_1": "6"})
  assert job.wait() != 0
  out = job.out
  assert re.search(r"restart 1 of at most 2: worker 1 failed \(exit code 1\)", out), out[-4000:]
  assert re.search(r"restart 2 of at most 2: worker 1 failed", out), out[-4000:]
  assert "restart 3" not in out
  assert re.search(r"epl-launch: failed \(not restarted: --max_restarts 2 reached\)", out)
  assert out.count("RuntimeError: worker 1 fails at step 6") >= 3   # each run's error shown


def test_a_config_error_is_not_restarted(tmp_path):
  for name, env, why in (
      ("config", {"TEST_BAD_CONFIG": "1"}, r"a ConfigError repeats on every start"),
      ("early", {"TEST_FAIL_EARLY": "1"}, r"it failed before the job's first step "
                                          r"\(ValueError\), which a restart would repeat")):
    started = time.time()
    job = Launch(tmp_path, name, 20, max_restarts=2, env=env)
    assert job.wait() != 0
    out = job.out
    assert "restart 1" not in out, out[-4000:]
    assert re.search(r"epl-launch: failed \(not restarted: %s\)" % why, out), out[-4000:]
    assert time.time() - started < 60
