"""One worker of tests/test_graphkeys.py: fetches every GraphKeys kind in one training step,
then votes (worker index + 1) in a run with no train op.

usage: graphkeys_worker.py OUT_DIR STAGES MICRO
Reads OUT_DIR/job.npz (initial weights, the job's rows); feeds this worker's share (the rows
cut evenly over the clients, in worker order); writes OUT_DIR/worker_<i>.npz.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()

import epl  # noqa: E402
from tests import graphkeys_model as m  # noqa: E402


def main():
  out, stages, micro = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
  job = dict(np.load(os.path.join(out, "job.npz")))
  x, y, clients = job.pop("__x__"), job.pop("__y__"), int(job.pop("__clients__"))
  config = epl.Config({"pipeline.num_micro_batch": micro})
  index = epl.cluster.Cluster.from_environment(1, os.environ["TF_CONFIG"], 0).worker_index
  share = slice(index * len(x) // clients, (index + 1) * len(x) // clients)
  values = m.fetch_under_epl(config, stages, job, x[share], y[share], vote=index + 1.0)
  np.savez(os.path.join(out, "worker_%d.npz" % index), **values)


if __name__ == "__main__":
  main()
