"""A replicated trunk + a split model part on 2 workers.

With 1 device per worker one model replica spans both workers (worker 0 drives it, worker 1
only serves its devices). With 2 devices per worker each worker holds one replica (trunk
copies and split parts on its 2 devices) and the replicas are data parallel across the
workers: each worker feeds its half of every step's rows.

usage: split_worker.py OUT_DIR STEPS ROWS [DEVICES_PER_WORKER [classifier|moe]]
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


def main():
  out, steps, rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
  devices = int(sys.argv[4]) if len(sys.argv) > 4 else 1
  model = sys.argv[5] if len(sys.argv) > 5 else "classifier"
  raw = np.load(os.path.join(out, "data.npz"))
  initial = dict(np.load(os.path.join(out, "initial.npz")))
  config = epl.Config({"cluster.colocate_split_and_replicate": True})
  total = 2 if devices == 1 else devices             # devices of one model replica
  trunk = lambda: epl.replicate(total, name="trunk")            # noqa: E731
  head = lambda: epl.split(total, name="split")                 # noqa: E731
  data = (raw["x"], raw["y"])
  if devices > 1:                                    # one replica per worker: its half
    me = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    half = rows // 2
    data = tuple(np.concatenate([d[s * rows + me * half:s * rows + (me + 1) * half]
                                 for s in range(steps)]) for d in data)
    rows = half
  if model == "moe":
    build = lambda: sm.moe_model(4, 4, trunk, head)             # noqa: E731
    fetch = ("loss", "moe")
  else:
    build = lambda: sm.classifier(1000, trunk, head)            # noqa: E731
    fetch = ("loss", "accuracy", "logits")
  run = sm.train(build, data, steps, rows, config=config, initial=initial, fetch=fetch)
  # only a client gets here; a serving worker ends inside epl
  plan = run.parallel.plan
  fetched = {"__%s__" % k: np.array([f[k] for f in run.fetched]) for k in run.fetched[0]}
  name = "client%d.npz" % epl.Env.get().cluster.worker_index
  np.savez(os.path.join(out, name),
           __devices__=np.array([d for copy in plan.copies for t in copy.devices for d in t]),
           **fetched, **run.variables)


if __name__ == "__main__":
  main()
