"""EPL's manual, chapter 9 (MoE Tensor Model Parallelism), and the runnable examples of §5.3.

  9.2   colocate_split_and_replicate; set_default_strategy(replicate(total_gpu_num));
        AttentionAndGating(); split(total_gpu_num): MOE_Variable_Define();
        MOE_Calculation_Define() -- examples/moe/train.py is that tutorial (the manual's §9.2
        uses total_gpu_num without defining it; the example takes it from epl.Env, as §5.3.2
        does) and trains the local model on 2 devices
  9.2   epl-launch --num_workers 2 --gpu_per_worker 1 train_moe_t5.sh -> examples/moe/run.sh
        on 2 workers x 1 device: one model replica over both workers (worker 1 serves)
  5.3.1 the large-scale classification example (examples/split_classification), both ways
  (9.1.1 t2t-datagen prepares a dataset from the network: not a test here)
"""
import contextlib
import io
import os
import re
import runpy

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from tests.test_multiworker import ROOT, launch

EXAMPLES = os.path.join(ROOT, "examples")
STEP = re.compile(r"^step (\d+) loss ([0-9.e+-]+)", re.M)


def local_script(path, tmp_path):
  """The example without its epl lines (``with epl...:`` scopes become ``if True:``)."""
  lines = []
  for line in open(path).read().splitlines():
    if not line.rstrip().endswith("# epl"):
      lines.append(line)
    elif line.lstrip().startswith("with "):
      lines.append(line[:len(line) - len(line.lstrip())] + "if True:")
  local = tmp_path / ("local_" + os.path.basename(path))
  local.write_text("\n".join(lines) + "\n")
  return str(local)


def run_script(path, monkeypatch, devices):
  monkeypatch.setenv("EPL_CLUSTER_DEVICES_PER_WORKER", str(devices))
  out = io.StringIO()
  with tf.Graph().as_default(), contextlib.redirect_stdout(out):
    tf.set_random_seed(0)
    runpy.run_path(path, run_name="__main__")
  steps = STEP.findall(out.getvalue())
  return [int(s) for s, _ in steps], np.array([float(v) for _, v in steps]), out.getvalue()


def assert_example_trains_the_local_model(name, monkeypatch, tmp_path):
  path = os.path.join(EXAMPLES, name, "train.py")
  steps, losses, out = run_script(path, monkeypatch, 2)
  local_steps, local_losses, _ = run_script(local_script(path, tmp_path), monkeypatch, 2)
  assert steps and steps == local_steps
  np.testing.assert_allclose(losses, local_losses, rtol=1e-5, atol=1e-5)
  return out


def test_split_classification_example_trains_the_local_model(monkeypatch, tmp_path):
  out = assert_example_trains_the_local_model("split_classification", monkeypatch, tmp_path)
  assert "'classification': split(device_count=2)" in out or "split(device_count=2)" in out
  assert "Split boundaries" in out


def test_moe_example_trains_the_local_model(monkeypatch, tmp_path):
  out = assert_example_trains_the_local_model("moe", monkeypatch, tmp_path)
  # the expert computation written after the split scope is split, not replicated; the
  # tokens reach their experts by an all-to-all (the attention output itself never crosses)
  boundaries = out[out.index("Split boundaries"):]
  assert "all_to_all" in boundaries and "(batch axis 1" in boundaries, boundaries
  assert "attention_norm/mul_1:0 ->" not in boundaries, boundaries


@pytest.mark.parametrize("example", ["split_classification", "moe"])
def test_example_under_epl_launch_on_two_workers(example, tmp_path):
  out = launch(["--num_workers", "2", "--gpu_per_worker", "1", "--log_dir",
                str(tmp_path / "logs"), "examples/%s/run.sh" % example])
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "step 30 loss" in out.stdout and "all workers finished" in out.stdout
