"""What a person sees: the plan summary and picture, progress, the console, --debug, timelines."""
import logging
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.testing import run_model
from tests import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = models.regression_data(64)
TWO = [lambda: epl.replicate(1, name="stage_0"), lambda: epl.replicate(1, name="stage_1")]


class _Capture(logging.Handler):
  def __init__(self):
    super().__init__()
    self.lines = []

  def emit(self, record):
    self.lines.append(record.getMessage())


@pytest.fixture
def epl_log():
  handler = _Capture()
  logging.getLogger("epl").addHandler(handler)
  yield handler.lines
  logging.getLogger("epl").removeHandler(handler)


def _png_size(path):
  with open(path, "rb") as f:
    head = f.read(24)
  assert head[:8] == b"\x89PNG\r\n\x1a\n"
  return struct.unpack(">II", head[16:24])


def test_worker_0_prints_a_short_plan_summary(epl_log):
  run_model(models.mlp_two_stages, DATA, 4, 1, strategies=TWO, config=epl.Config(
      {"cluster.devices_per_worker": 4, "pipeline.num_micro_batch": 2}))
  summary = [line for line in epl_log if line.startswith("plan:")]
  assert len(summary) == 1
  lines = summary[0].splitlines()
  assert len(lines) <= 6
  assert lines[0] == ("plan: 1 worker(s) x 4 virtual CPU device(s); 2 model copies (2 "
                      "replica(s) x 1 shard(s)); 2 micro-batches, PreferBackward")
  assert "TaskGraph 0 'stage_0' (replicate(device_count=1)): copies on CPU:1, CPU:3" in lines[1]
  assert "gradients:" in lines[3] and "fused all-reduce" in lines[3]


def test_the_plan_picture_has_the_documented_size(tmp_path):
  pytest.importorskip("matplotlib")
  res = run_model(models.mlp_two_stages, DATA, 4, 1, strategies=TWO, config=epl.Config(
      {"cluster.devices_per_worker": 4, "pipeline.num_micro_batch": 2}))
  size = res.parallel.draw(str(tmp_path / "plan.png"))
  assert _png_size(tmp_path / "plan.png") == size == (round((1.6 + 2.4 * 4) * 100),
                                                       round((1.4 + 1.6 * 1) * 100))
  # the same picture from the plan's JSON, without TensorFlow
  (tmp_path / "plan.json").write_text(res.parallel.plan.to_json())
  out = subprocess.run([sys.executable, "-m", "epl.plan.picture", str(tmp_path / "plan.json"),
                        str(tmp_path / "again.png")], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
  assert out.returncode == 0, out.stderr
  assert _png_size(tmp_path / "again.png") == size


def test_progress_reports_steps_and_samples_per_second(epl_log):
  run_model(models.mlp, DATA, 4, 30, strategies=[lambda: epl.replicate(1)], config=epl.Config(
      {"cluster.devices_per_worker": 2, "log.progress_secs": 0}))
  assert not [line for line in epl_log if "steps/s" in line]            # off
  from epl.runtime.progress import Progress
  clock = iter([i * 0.07 for i in range(1000)])    # 0.07 "s" per call: due at the 2nd step
  res = run_model(models.mlp, DATA, 4, 1, strategies=[lambda: epl.replicate(1)],
                  config=epl.Config({"cluster.devices_per_worker": 2}))
  progress = Progress(res.parallel, every=0.1, clock=lambda: next(clock))
  progress.step(8, progress.due())
  progress.step(8, progress.due())
  line = [line for line in epl_log if "steps/s" in line][-1]
  assert line.startswith("step 2:") and "samples/s" in line
  steps, samples = _rates(line)
  assert samples == pytest.approx(8 * steps, rel=0.01)


def _rates(line):
  import re
  found = re.search(r"([\d.]+) steps/s, ([\d.]+) samples/s", line)
  assert found, line
  return float(found.group(1)), float(found.group(2))


def test_progress_line_in_a_real_run(epl_log):
  import time
  g = tf.Graph()
  with g.as_default():
    epl.init(epl.Config({"cluster.devices_per_worker": 2, "log.progress_secs": 1}))
    epl.set_default_strategy(epl.replicate(1))
    x, y = tf.data.make_one_shot_iterator(
        tf.data.Dataset.from_tensor_slices(DATA).batch(4).repeat()).get_next()
    loss = models.mlp(x, y, lambda i: _Null())
    train = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      signatures, tf_run = [], sess._do_run          # what reaches TF's own run, per step

      def spy(handle, targets, fetches, *args):
        signatures.append((tuple(sorted(str(t) for t in targets)),
                           tuple(sorted(str(f) for f in fetches))))
        return tf_run(handle, targets, fetches, *args)
      sess._do_run = spy
      start = time.time()
      while time.time() - start < 1.6:
        sess.run(train)
  lines = [line for line in epl_log if "steps/s" in line]
  assert lines and "samples/s" in lines[0]
  steps, samples = _rates(lines[0])
  assert samples == pytest.approx(8 * steps, rel=0.01)     # 2 copies x 4 rows per step
  # the report measured its batch without changing the step's fetches: TF compiled once
  assert len(signatures) > 2 and len(set(signatures)) == 1, set(signatures)


class _Null:
  def __enter__(self):
    return self

  def __exit__(self, *a):
    return False


@pytest.mark.parametrize("micro", [1, 4])
def test_the_timeline_of_any_step_is_drawn(tmp_path, micro):
  pytest.importorskip("matplotlib")
  strategies = TWO if micro > 1 else [lambda: epl.replicate(1)]
  model = models.mlp_two_stages if micro > 1 else models.mlp
  res = run_model(model, DATA, 4, 1, strategies=strategies, config=epl.Config(
      {"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": micro}))
  with res.graph.as_default(), tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    for trace in (False, True):                      # trace the second (warm) step
      meta = tf.RunMetadata()
      sess.run(res.graph.get_operation_by_name("Momentum"), options=tf.RunOptions(
          trace_level=tf.RunOptions.FULL_TRACE if trace else 0), run_metadata=meta)
  spans = epl.timeline.save(meta, res.parallel, str(tmp_path / "t.json"),
                            str(tmp_path / "t.png"))
  names = {name for _, name, _, _ in spans}
  if micro == 1:                                     # data parallel: compute and all-reduce
    assert {"forward", "backward", "update"} <= names and any(n.startswith("AR") for n in names)
  else:                           # pipeline: actions; stage 1's F0 ends after stage 0's
    # (its first op may be an input-less one -- a constant, a weight read -- that runs at
    # once: seen once in CI; the end waits for stage 0's output through the data)
    ends = {row: end for row, name, _, end in spans if name == "F0"}
    stage0, stage1 = sorted(ends, key=lambda r: r)
    assert ends[stage1] > ends[stage0]
  assert _png_size(tmp_path / "t.png")[0] > 0
  assert '"traceEvents": [{' in (tmp_path / "t.json").read_text()


def test_an_empty_trace_warns_instead_of_drawing(tmp_path, epl_log):
  res = run_model(models.mlp, DATA, 4, 1, strategies=[lambda: epl.replicate(1)],
                  config=epl.Config({"cluster.devices_per_worker": 2}))
  assert epl.timeline.save(tf.RunMetadata(), res.parallel, str(tmp_path / "t.json"),
                           str(tmp_path / "t.png")) == []
  assert not (tmp_path / "t.png").exists()
  assert any("nothing written" in line for line in epl_log)


def _launch(tmp_path, script, *flags):
  env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
  env.pop("TF_CPP_MIN_LOG_LEVEL", None)
  return subprocess.run([sys.executable, "-m", "epl.launch.cli", "--num_workers", "2",
                         "--gpu_per_worker", "1", "--log_dir", str(tmp_path / "logs")] +
                        list(flags) + [script], env=env, cwd=ROOT, capture_output=True,
                        text=True, timeout=180)


def test_the_console_shows_every_worker_prefixed_and_no_startup_noise(tmp_path):
  out = _launch(tmp_path, os.path.join(ROOT, "examples", "quickstart", "run.sh"))
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  for rank in (0, 1):
    assert "[%d] Iteration 10 , Loss:" % rank in out.stdout
  assert "[0] [epl w0] plan: 2 worker(s)" in out.stdout
  assert "[epl w1] plan:" not in out.stdout          # the summary once, from worker 0
  for noise in ("cuInit", "oneDNN", "absl::InitializeLog", "is deprecated"):
    assert noise not in out.stdout, noise
  assert "cuInit" in (tmp_path / "logs" / "worker_0.log").read_text()  # the log keeps it all
  assert "epl-launch: all workers finished" in out.stdout


def test_debug_shows_epl_debug_logs_and_tensorflow_noise(tmp_path):
  out = _launch(tmp_path, os.path.join(ROOT, "examples", "quickstart", "run.sh"), "--debug")
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  for line in ("[epl w0] pass analyze:", "[epl w0] barrier: all 2 workers joined",
               "[epl w1] collectives:", "[epl w0] rewrite done"):
    assert line in out.stdout, line
  assert "cuInit" in out.stdout


def _two_train_ops(progress_secs):
  """A GAN-shaped pair: train_d reads the dataset, train_g only its own noise; alternate."""
  g = tf.Graph()
  with g.as_default():
    tf.set_random_seed(3)
    epl.init(epl.Config({"cluster.devices_per_worker": 2, "log.progress_secs": progress_secs}))
    epl.set_default_strategy(epl.replicate(1))
    data = np.random.RandomState(0).randn(400, 8).astype(np.float32)
    x = tf.data.make_one_shot_iterator(
        tf.data.Dataset.from_tensor_slices(data).batch(4)).get_next()
    with tf.variable_scope("d"):
      d_loss = tf.reduce_mean(tf.square(tf.layers.dense(x, 1)))
    with tf.variable_scope("g"):
      g_loss = tf.reduce_mean(tf.square(tf.layers.dense(tf.random_normal([4, 8], seed=1), 1)))
    opt = tf.train.GradientDescentOptimizer(0.1)
    train_d = opt.minimize(d_loss, var_list=tf.trainable_variables("d"))
    train_g = opt.minimize(g_loss, var_list=tf.trainable_variables("g"))
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      for _ in range(20):
        sess.run(train_d)
        sess.run(train_g)
      return sess.run(tf.trainable_variables("d"))


def test_progress_never_pulls_a_batch_the_step_does_not_read():
  """The rows the progress report counts come from an input the step reads anyway: a
  generator step must not pull a batch of the discriminator's dataset (its data would
  shift, and the model with it)."""
  quiet, counted = _two_train_ops(0), _two_train_ops(1)
  for a, b in zip(quiet, counted):
    np.testing.assert_array_equal(a, b)
