"""EPL's manual, chapter 8 (Pipeline Parallelism), the BERT tutorial.

  8.2.1  epl.init(epl.Config({"pipeline.num_micro_batch": 4}));
         set_default_strategy(replicate(1)); model_stage0();
         set_default_strategy(replicate(1)); model_stage1()
         -- tests/real_scripts/bert_like.py (run_classifier's BERT, published optimizer) with
         those two calls: a 2-stage pipeline with 4 micro-batches trains the local model
  8.2.1  epl-launch --num_workers 1 --gpu_per_worker 2 <script> -> one pipeline on 2 devices
  (8.1 downloads and 8.3's SQuAD evaluation need the network and a GPU week: not tests here)
"""
import os
import subprocess
import sys

import epl
from tests.real_scripts import bert_like
from tests.real_scripts.harness import Mode, assert_same_training, run, steps_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class DefaultStrategyStages:
  """The tutorial's annotation: ``epl.set_default_strategy(epl.replicate(1))`` before each of
  model_stage0() and model_stage1() (the script enters stage 0's ops, then stage 1's)."""

  def __init__(self):
    self.current = -1

  def __call__(self, i):
    if i > self.current:
      epl.set_default_strategy(epl.replicate(1))
      self.current = i
    return _Nothing()


class _Nothing:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


def test_8_2_1_two_default_strategies_are_a_pipeline_that_trains_the_local_model():
  batch, steps, micro = 2, 3, 4
  rows = micro * batch
  data = bert_like.make_data(rows * steps)
  local = run(bert_like.Reference, rows, data, steps_of(rows, steps))
  dist = run(bert_like.Published, batch, data, steps_of(rows, steps), mode=Mode(2, micro, 2),
             initial=local.initial, stage=DefaultStrategyStages())
  assert_same_training(local, dist)
  plan = dist.parallel.plan
  assert len(plan.taskgraphs) == 2 and plan.num_micro_batch == 4 and plan.total_copies == 1


SCRIPT = '''
import sys
sys.path.insert(0, %r)
import tensorflow.compat.v1 as tf
tf.disable_v2_behavior()
import epl
epl.init(epl.Config({"pipeline.num_micro_batch": 4}))
from tests.manual.test_ch8_bert_pipeline import DefaultStrategyStages
from tests.real_scripts import bert_like
t = bert_like.build(2, DefaultStrategyStages(), published=True)
data = bert_like.make_data(8)
with tf.train.MonitoredTrainingSession() as sess:
  for step in range(3):
    loss, _ = sess.run([t["loss"], t["train_op"]],
                       {t["placeholders"][k]: v for k, v in data.items()})
    print("step %%d loss %%.4f" %% (step, loss))
print(len(epl.Graph.get().plan.taskgraphs), "stages")
'''


def test_8_2_1_epl_launch_one_worker_two_devices_runs_the_pipeline(tmp_path):
  script = tmp_path / "train_bert_pipeline.py"
  script.write_text(SCRIPT % ROOT)
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
  out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "epl-launch"),
                        "--num_workers", "1", "--gpu_per_worker", "2", "--log_dir",
                        str(tmp_path / "logs"), str(script)],
                       capture_output=True, text=True, timeout=300, env=env)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "step 2 loss" in out.stdout and "2 stages" in out.stdout
