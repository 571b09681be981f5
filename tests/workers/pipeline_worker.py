"""2 stages on 2 workers x 1 device: worker 0 drives the pipeline, worker 1 only serves.

usage: pipeline_worker.py OUT_DIR STEPS BATCH MICRO
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()

import epl  # noqa: E402
from epl.testing import run_model  # noqa: E402
from tests import models  # noqa: E402


def main():
  out, steps, batch, micro = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
  raw = np.load(os.path.join(out, "data.npz"))
  initial = dict(np.load(os.path.join(out, "initial.npz")))
  config = epl.Config({"pipeline.num_micro_batch": micro})
  stages = [lambda: epl.replicate(1, name="stage_0"), lambda: epl.replicate(1, name="stage_1")]
  res = run_model(models.mlp_two_stages, (raw["x"], raw["y"]), batch, steps, config=config,
                  strategies=stages, initial=initial)
  # only the client gets here; the serving worker ended inside epl
  plan = res.parallel.plan
  np.savez(os.path.join(out, "client.npz"), __losses__=np.array(res.losses),
           __devices__=np.array([d for copy in plan.copies for t in copy.devices for d in t]),
           **res.variables)


if __name__ == "__main__":
  main()
