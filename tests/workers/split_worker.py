"""A replicated trunk + split classifier on 2 workers x 1 device: one model replica spans
both workers (worker 0 drives it, worker 1 only serves its devices).

usage: split_worker.py OUT_DIR STEPS ROWS
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()

import epl  # noqa: E402
from tests import split_models as sm  # noqa: E402


def main():
  out, steps, rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
  raw = np.load(os.path.join(out, "data.npz"))
  initial = dict(np.load(os.path.join(out, "initial.npz")))
  total = 2
  trunk = lambda: epl.replicate(total, name="trunk")            # noqa: E731
  head = lambda: epl.split(total, name="classifier")            # noqa: E731
  config = epl.Config({"cluster.colocate_split_and_replicate": True})
  run = sm.train(lambda: sm.classifier(1000, trunk, head), (raw["x"], raw["y"]), steps, rows,
                 config=config, initial=initial, fetch=("loss", "accuracy", "logits"))
  # only the client gets here; the serving worker ended inside epl
  plan = run.parallel.plan
  fetched = {"__%s__" % k: np.array([f[k] for f in run.fetched]) for k in run.fetched[0]}
  np.savez(os.path.join(out, "client.npz"),
           __devices__=np.array([d for copy in plan.copies for t in copy.devices for d in t]),
           **fetched, **run.variables)


if __name__ == "__main__":
  main()
