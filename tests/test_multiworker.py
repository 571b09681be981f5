"""Multi-worker runs under epl-launch (localhost processes): parity, faults, resume."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from epl.testing import run_model
from tests import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "workers", "dp_worker.py")


class Launched:
  def __init__(self, returncode, stdout, stderr, seconds):
    self.returncode, self.stdout, self.stderr, self.seconds = returncode, stdout, stderr, seconds


def launch(args, timeout=180, env=None):
  """Runs epl-launch; on timeout it is stopped with SIGTERM so it stops its workers."""
  full_env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
                  CUDA_VISIBLE_DEVICES="", **(env or {}))
  start = time.time()
  proc = subprocess.Popen([sys.executable, "-m", "epl.launch.cli"] + args, env=full_env,
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.terminate()
    out, err = proc.communicate(timeout=30)
    raise AssertionError("epl-launch did not finish in %d s:\n%s\n%s" % (timeout, out[-2000:],
                                                                        err[-2000:]))
  return Launched(proc.returncode, out, err, time.time() - start)


@pytest.mark.parametrize("workers,devices", [(2, 1), (2, 2)])
def test_multiworker_parity(tmp_path, workers, devices):
  steps, batch = 5, 4
  global_batch = workers * devices * batch
  rng = np.random.RandomState(1)
  x = rng.randn(steps * global_batch, 8).astype(np.float32)
  y = rng.randint(0, 4, steps * global_batch).astype(np.int64)
  local = run_model(models.mlp, (x, y), global_batch, steps)
  np.savez(tmp_path / "data.npz", x=x, y=y)
  np.savez(tmp_path / "initial.npz", **local.initial)
  out = launch(["--num_workers", str(workers), "--gpu_per_worker", str(devices),
                "--log_dir", str(tmp_path / "logs"), WORKER, str(tmp_path), "mlp", str(steps),
                str(batch)])
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  results = [dict(np.load(tmp_path / ("worker_%d.npz" % w))) for w in range(workers)]
  # each worker's fetched loss is the mean over its copies; their mean is the global loss
  losses = np.mean([r["__losses__"] for r in results], axis=0)
  tol = 1e-5 * np.maximum(1, np.abs(local.losses))
  assert (np.abs(losses - local.losses) <= tol).all(), (losses, local.losses)
  for r in results:                                   # every worker holds the same model
    for name, value in local.variables.items():
      np.testing.assert_allclose(r[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
