"""A GPT-2-style script for auto.auto_parallel's tensor-parallel second pass (tests/test_auto_tp.py).

usage: auto_tp_worker.py INITIAL.npz OUT.npz BUDGET

The language model of tests/real_scripts/gpt2_lm.py with one wide block (hidden 128: its
weights are most of the model, so no pipeline cut lowers the peak), trained as the script is
written (``tf.gradients`` + clipping + Adam), from the weights in INITIAL.npz, with
``auto.auto_parallel`` and ``auto.device_memory`` BUDGET on 8 devices. OUT.npz gets the
losses, every variable (whole) and the pid of each pass (``pids``: the re-executed process
keeps its pid).
"""
import contextlib
import os
import sys

import numpy as np
import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()

import epl  # noqa: E402
from tests import split_models as sm  # noqa: E402
from tests.real_scripts import gpt2_lm  # noqa: E402

ROWS, STEPS, EMBD = 64, 3, 128


def build():
  gpt2_lm.EMBD, gpt2_lm.LAYERS = EMBD, 1
  t = gpt2_lm.build(ROWS, lambda i: contextlib.nullcontext())
  return dict(inputs=(t["placeholders"]["context"],), loss=t["loss"], train_op=t["train_op"])


def data():
  return (gpt2_lm.make_data(ROWS * STEPS)["context"],)


def main(initial_path, out_path, budget):
  pids = os.environ.get("TEST_PIDS", "")
  os.environ["TEST_PIDS"] = (pids + " " if pids else "") + str(os.getpid())
  initial = dict(np.load(initial_path))
  config = epl.Config({"auto.auto_parallel": True, "pipeline.num_micro_batch": 2,
                       "cluster.devices_per_worker": 8, "auto.device_memory": budget,
                       "log.level": "info"})
  run = sm.train(build, data(), STEPS, ROWS, config=config, initial=initial)
  kinds = ["%s:%s" % (t.name, t.placement.kind) for t in run.parallel.plan.taskgraphs]
  np.savez(out_path, losses=[f["loss"] for f in run.fetched], pids=os.environ["TEST_PIDS"],
           kinds=kinds, **{"var:" + k: v for k, v in run.variables.items()})


if __name__ == "__main__":
  main(*sys.argv[1:])
