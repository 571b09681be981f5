"""examples/gpt (the large-model recipe: DP x PP x TP with ZeRO v1 and checkpointing on a
GPT-2-style LM) trains the local script's model, and runs under epl-launch on 2 workers."""
import re
import subprocess
import sys

import numpy as np

from tests.manual.test_ch9_moe_tensor_parallelism import (EXAMPLES, STEP, local_script,
                                                          run_script)
from tests.test_multiworker import launch


def test_the_gpt_example_on_8_devices_trains_the_local_model(monkeypatch, tmp_path):
  """2 replicas of 2 stages x 2 parts; each step's fed batch is cut into the replicas' and
  micro-batches' rows."""
  path = EXAMPLES + "/gpt/train.py"
  steps, losses, _ = run_script(path, monkeypatch, 8)
  local_steps, local_losses, _ = run_script(local_script(path, tmp_path), monkeypatch, 8)
  assert steps == local_steps == list(range(5, 31, 5))
  np.testing.assert_allclose(losses, local_losses, rtol=1e-5, atol=1e-5)


def test_the_gpt_example_under_epl_launch_on_two_workers(tmp_path):
  """DP 2 x PP 2 x TP 2 with ZeRO v1 (the optimizer state partitioned across the workers)
  and checkpointing: every worker feeds the script's batch, so the mean gradient is the
  local script's and so is every printed loss (the clipping's global norm reads every
  gradient: ZeRO all-reduces them rather than reduce-scattering)."""
  out = launch(["--num_workers", "2", "--gpu_per_worker", "4", "--log_dir",
                str(tmp_path / "logs"), "examples/gpt/run.sh"], timeout=400)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "step 30 loss" in out.stdout and "all workers finished" in out.stdout
  printed = {}
  for line in out.stdout.splitlines():
    found = re.match(r"\[(\d)\] step (\d+) loss ([\d.]+)$", line.strip())
    if found:
      printed.setdefault(int(found.group(2)), {})[int(found.group(1))] = float(found.group(3))
  # the local script as a user runs it (a process of its own: TF's default graph seed)
  local = subprocess.run([sys.executable, local_script(EXAMPLES + "/gpt/train.py", tmp_path)],
                         capture_output=True, text=True, timeout=300, check=True)
  found = STEP.findall(local.stdout)
  local_steps, local_losses = [int(s) for s, _ in found], [float(v) for _, v in found]
  assert sorted(printed) == local_steps == list(range(5, 31, 5))
  for step, loss in zip(local_steps, local_losses):
    assert sorted(printed[step]) == [0, 1], printed[step]
    np.testing.assert_allclose(list(printed[step].values()), [loss] * 2, rtol=1e-5, atol=1e-5)
