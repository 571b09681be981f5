"""One worker of the published-BERT-optimizer test (tests/test_bert_optimizer.py).

usage: bert_worker.py OUT_DIR BATCH STEPS
Reads OUT_DIR/initial.npz, trains google-research BERT's classifier with its optimizer as
published on this worker's rows of every step (worker i of W: rows [i*B, (i+1)*B) of each
step's W*B), writes OUT_DIR/worker_<i>.npz with the losses and every variable.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()

import epl  # noqa: E402
from tests.real_scripts import bert_like  # noqa: E402
from tests.real_scripts.harness import Mode, run  # noqa: E402


def main():
  out, batch, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
  initial = dict(np.load(os.path.join(out, "initial.npz")))
  cluster = epl.cluster.Cluster.from_environment(1, os.environ["TF_CONFIG"], 0)
  workers, me = cluster.worker_num, cluster.worker_index
  data = bert_like.make_data(workers * batch * steps)
  rows = [slice(s * workers * batch + me * batch, s * workers * batch + (me + 1) * batch)
          for s in range(steps)]
  result = run(bert_like.Published, batch, data, rows, mode=Mode(1, 1, 1), initial=initial)
  np.savez(os.path.join(out, "worker_%d.npz" % me), __losses__=np.array(result.losses),
           **result.variables)


if __name__ == "__main__":
  main()
