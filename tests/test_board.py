"""epl's figures in TensorBoard (log.summary_dir, #52): a 2-worker job writes epl's scalars,
each reported step's breakdown and the plan's picture into the chief's log directory, beside
the user's own summaries -- which reach the disk from the chief only."""
import glob
import os
import subprocess
import sys

import tensorflow.compat.v1 as tf

from epl.runtime.board import breakdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "workers", "board_worker.py")


def _events(logdir):
  """{tag: [(step, value or image)]} over every event file in ``logdir``, and the files."""
  files = sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*")))
  found = {}
  for path in files:
    for event in tf.train.summary_iterator(path):
      for value in event.summary.value:
        found.setdefault(value.tag, []).append(
            (event.step, value.image if value.HasField("image") else value.simple_value))
  return found, files


def test_a_two_worker_jobs_event_files_hold_epls_scalars_and_the_chiefs_summaries(tmp_path):
  logdir = str(tmp_path / "board")
  steps = 40
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
             EPL_LOG_SUMMARY_DIR=logdir, EPL_LOG_PROGRESS_SECS="1")
  env.pop("TF_CONFIG", None)
  out = subprocess.run([sys.executable, "-m", "epl.launch.cli", "--num_workers", "2",
                        "--gpu_per_worker", "2", "--log_dir", str(tmp_path / "logs"), WORKER,
                        logdir, str(steps)], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  found, files = _events(logdir)
  assert any(f.endswith(".epl") for f in files)
  # the user's loss: once per step, from the chief only (each worker's FileWriter ran)
  assert sorted(step for step, _ in found["loss"]) == list(range(1, steps + 1))
  # epl's scalars at each progress report, with the breakdown of the traced step
  for tag in ("epl/steps_per_sec", "epl/samples_per_sec", "epl/job_samples_per_sec",
              "epl/step_ms/wall", "epl/step_ms/forward", "epl/step_ms/backward"):
    assert tag in found and all(v > 0 for _, v in found[tag]), (tag, sorted(found))
  reports = [step for step, _ in found["epl/steps_per_sec"]]
  assert len(reports) >= 2 and reports == sorted(reports)
  job = dict(found["epl/job_samples_per_sec"])
  for step, rate in found["epl/samples_per_sec"]:
    assert abs(job[step] - 2 * rate) < 1e-3 * rate            # two workers drive copies
  (step, image), = found["epl/plan"]
  assert image.encoded_image_string.startswith(b"\x89PNG") and image.width > 100


def test_breakdown_sums_each_kind_per_device():
  spans = [("stage 0", "F0", 0, 1000), ("stage 0", "B0", 3000, 5000),
           ("stage 1", "F0", 1000, 2000), ("stage 1", "B0", 2000, 3000)]
  assert breakdown(spans) == {"forward": 1.0, "backward": 1.5, "wall": 5.0}
  spans = [("CPU:1", "forward", 0, 2000), ("CPU:1", "AR0", 2000, 2500),
           ("CPU:1", "AR1", 2500, 3000), ("CPU:1", "update", 3000, 3100)]
  assert breakdown(spans) == {"forward": 2.0, "allreduce": 1.0, "update": 0.1, "wall": 3.1}
  assert breakdown([]) == {}
