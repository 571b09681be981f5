"""google-research BERT's optimizer exactly as published (tests/real_scripts/bert_like.py with
``published=True``): AdamWeightDecayOptimizer, which assigns its weights and slots itself,
polynomial decay with warm-up from ``global_step``, ``clip_by_global_norm(grads, 1.0)`` and
``tf.group(train_op, [global_step.assign(global_step + 1)])`` -- an assign nothing orders
against the learning rate's reads of ``global_step``. Under data parallelism on 2 devices, a
2-stage pipeline with 2 micro-batches and 2 workers x 1 device it must train the local model
(``bert_like.Reference``: the local run with its own race settled; every variable, the Adam
slots included, to 1e-5), in every run: each is repeated ``REPEATS`` times. Before
epl/passes/step_reads.py some copies used another learning rate than others."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.real_scripts import bert_like
from tests.real_scripts.harness import MODES, assert_same_training, run, steps_of
from tests import zygote
from tests.ports import private_ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, BATCH, REPEATS = 4, 4, 3


def _local(rows):
  return run(bert_like.Reference, rows, bert_like.make_data(rows * STEPS), steps_of(rows, STEPS))


@pytest.mark.parametrize("mode", ["dp2", "pipeline2_m2"])
def test_published_bert_optimizer_trains_the_local_model_in_every_run(mode):
  m = MODES[mode]
  rows = m.pieces * BATCH
  local = _local(rows)
  assert any(name.endswith("/adam_m") for name in local.variables)
  for _ in range(REPEATS):
    dist = run(bert_like.Published, BATCH, bert_like.make_data(rows * STEPS),
               steps_of(rows, STEPS), mode=m, initial=local.initial)
    assert_same_training(local, dist)


def test_published_bert_optimizer_on_two_workers_trains_the_local_model(tmp_path):
  local = _local(2 * BATCH)
  np.savez(tmp_path / "initial.npz", **local.initial)
  for attempt in range(REPEATS):
    hosts = ["localhost:%d" % p for p in private_ports(2)]
    procs = []
    for i in range(2):
      env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
                 CUDA_VISIBLE_DEVICES="", EPL_LOG_PROGRESS_SECS="0",
                 TF_CONFIG=json.dumps({"cluster": {"worker": hosts},
                                       "task": {"type": "worker", "index": i}}))
      procs.append(subprocess.Popen(
          zygote.python() + [os.path.join(ROOT, "tests", "workers", "bert_worker.py"),
           str(tmp_path), str(BATCH), str(STEPS)], env=env, stdout=subprocess.PIPE,
          stderr=subprocess.PIPE, text=True))
    errs = [p.communicate(timeout=240)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-3000:] for e in errs)
    results = [dict(np.load(tmp_path / ("worker_%d.npz" % i))) for i in range(2)]
    losses = [r.pop("__losses__") for r in results]
    np.testing.assert_allclose((losses[0] + losses[1]) / 2, local.losses, rtol=1e-5)
    for i, result in enumerate(results):
      assert sorted(result) == sorted(local.variables)
      for name, value in local.variables.items():
        np.testing.assert_allclose(result[name], value, rtol=1e-5, atol=1e-5,
                                   err_msg="%s (worker %d, run %d)" % (name, i, attempt))
