"""The manual's quick-start script, unchanged apart from the TF port, on 2 devices."""
import contextlib
import io
import os
import re
import runpy

import numpy as np
import tensorflow.compat.v1 as tf

import epl

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "examples", "quickstart",
                      "local_model.py")


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
