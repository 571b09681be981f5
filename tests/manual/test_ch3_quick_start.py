"""EPL's manual, chapter 3 (Quick Start).

  3.1  local_model.py with the three epl lines (examples/quickstart/local_model.py: the
       manual's script, ported to tensorflow.compat.v1 and seeded) -> on 2 devices it trains
       the local script at batch 20, and prints the mean loss of the copies
  3.2  run.sh + ``epl-launch --num_workers 1 --gpu_per_worker 2 run.sh`` -> 1 worker with 2
       (virtual) devices
"""
import contextlib
import io
import os
import re
import runpy
import subprocess
import sys

import numpy as np
import tensorflow.compat.v1 as tf

import epl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "quickstart", "local_model.py")


def _run(path, monkeypatch, devices):
  monkeypatch.setenv("EPL_CLUSTER_DEVICES_PER_WORKER", str(devices))
  out = io.StringIO()
  np.random.seed(0)
  with tf.Graph().as_default(), contextlib.redirect_stdout(out):
    tf.set_random_seed(0)
    runpy.run_path(path, run_name="__main__")
    copies = epl.Graph.get().num_copies if "epl.init" in open(path).read() else None
  steps = re.findall(r"Iteration (\d+) , Loss: ([0-9.e+-]+) \.", out.getvalue())
  return [int(s) for s, _ in steps], [float(v) for _, v in steps], copies


def test_quickstart_on_two_devices_matches_local_batch_20(monkeypatch, tmp_path):
  steps, losses, copies = _run(SCRIPT, monkeypatch, 2)
  assert steps[-1] == 10 and len(losses) == 10 and copies == 2
  # The local script: the same file without the epl lines, with batch 2 x 10.
  local_src = "\n".join(line for line in open(SCRIPT).read().splitlines()
                        if not line.rstrip().endswith("# epl"))
  local_src = local_src.replace(".batch(10)", ".batch(20)")
  local = tmp_path / "local.py"
  local.write_text(local_src)
  local_steps, local_losses, _ = _run(str(local), monkeypatch, 2)
  assert local_steps == steps
  np.testing.assert_allclose(losses, local_losses, rtol=1e-5, atol=1e-5)


def test_3_2_epl_launch_runs_the_launch_script_on_one_worker_with_two_devices(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
  out = subprocess.run(
      [os.path.join(os.path.dirname(sys.executable), "epl-launch"), "--num_workers", "1",
       "--gpu_per_worker", "2", "--log_dir", str(tmp_path),
       os.path.join(ROOT, "examples", "quickstart", "run.sh")],
      capture_output=True, text=True, timeout=300, env=env)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  assert "1 worker(s) x 2 device(s)" in out.stdout + out.stderr
  assert len(re.findall(r"Iteration \d+ , Loss", out.stdout)) == 10
  assert "Train Finished." in out.stdout
