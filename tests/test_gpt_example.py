"""examples/gpt (the large-model recipe: DP x PP x TP with ZeRO v1 and checkpointing on a
GPT-2-style LM) trains the local script's model, and runs under epl-launch on 2 workers."""
import numpy as np

from tests.manual.test_ch9_moe_tensor_parallelism import EXAMPLES, local_script, run_script
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
  out = launch(["--num_workers", "2", "--gpu_per_worker", "4", "--log_dir",
                str(tmp_path / "logs"), "examples/gpt/run.sh"], timeout=400)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "step 30 loss" in out.stdout and "all workers finished" in out.stdout
