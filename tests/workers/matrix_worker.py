"""One cell of the feature-combination matrix with data parallelism across 2 workers
(tests/matrix_model.py): each worker holds one model replica and feeds its half of every
step's rows.

usage: matrix_worker.py OUT_DIR FEATURES STEPS ROWS [VARIANT [RACE_DELAY_MS]]
(FEATURES: comma-separated; VARIANT: ``matrix_model.Variant.code()``)
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()

import epl  # noqa: E402
from tests import matrix_model as mm  # noqa: E402
from tests import split_models as sm  # noqa: E402


def main():
  out, features = sys.argv[1], tuple(sys.argv[2].split(","))
  steps, rows = int(sys.argv[3]), int(sys.argv[4])
  raw = np.load(os.path.join(out, "data.npz"))
  initial = dict(np.load(os.path.join(out, "initial.npz")))
  me = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
  half = rows // 2
  data = tuple(np.concatenate([raw[k][s * rows + me * half:s * rows + (me + 1) * half]
                               for s in range(steps)]) for k in ("x", "y"))
  variant = mm.Variant.parse(sys.argv[5]) if len(sys.argv) > 5 else mm.Variant()
  delay = int(sys.argv[6]) if len(sys.argv) > 6 else 0
  config = dict(mm.config(features, workers=2), **{"testing.race_delay_ms": delay})
  run = sm.train(lambda: mm.build(features, variant=variant), data, steps, half,
                 config=epl.Config(config), initial=initial,
                 session_first=variant.session_first)
  np.savez(os.path.join(out, "client%d.npz" % me),
           __loss__=np.array([f["loss"] for f in run.fetched]), **run.variables)


if __name__ == "__main__":
  main()
