"""The GPT-2-style LM (tests/real_scripts/gpt2_lm.py) tensor parallel on 2 workers: each worker
holds one model replica (the data-parallel copies are across the workers) and feeds its half
of every step's rows; ``STAGES`` split scopes of 2 parts each (2: a pipeline of tensor-parallel
stages; -2: 2 replicated stages, no split), Config keys from the JSON argument.

usage: tp_worker.py OUT_DIR STEPS ROWS STAGES CONFIG_JSON
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()

import epl  # noqa: E402
from tests import split_models as sm  # noqa: E402
from tests.test_tensor_parallel import _build  # noqa: E402


def main():
  out, steps, rows, stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
  config = epl.Config(json.loads(sys.argv[5]))
  raw = np.load(os.path.join(out, "data.npz"))["context"]
  initial = dict(np.load(os.path.join(out, "initial.npz")))
  me = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
  half = rows // 2
  data = (np.concatenate([raw[s * rows + me * half:s * rows + (me + 1) * half]
                          for s in range(steps)]),)
  stage = (lambda i: epl.split(2, name="tp")) if stages == 1 else \
      (lambda i: epl.split(2, name="stage%d" % i))
  if stages == 0:                                   # data parallel only
    stage = lambda i: epl.replicate(1, name="dp")                # noqa: E731
  if stages < 0:                                    # -k: k replicated stages, no split
    stage = lambda i: epl.replicate(1, name="stage%d" % i)       # noqa: E731
  run = sm.train(lambda: _build(stage, 2), data, steps, half, config=config, initial=initial)
  plan = run.parallel.plan
  zero = run.parallel.results.get("zero")
  np.savez(os.path.join(out, "client%d.npz" % me),
           __owned__=np.array(sorted(zero.owners) if zero is not None else [], dtype=str),
           __devices__=np.array([d for copy in plan.copies for t in copy.devices for d in t]),
           __loss__=np.array([f["loss"] for f in run.fetched]), **run.variables)


if __name__ == "__main__":
  main()
