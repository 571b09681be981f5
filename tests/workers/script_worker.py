"""One worker of a multi-worker run of a real script (tests/real_scripts/), under epl-launch.

usage: script_worker.py OUT_DIR SCRIPT STEPS BATCH
Reads OUT_DIR/data.npz (every step's global batch, in order) and OUT_DIR/initial.npz; each
step feeds this worker's rows of the global batch (the workers' shares in rank order), the
script data-parallel over this worker's devices (``set_default_strategy(replicate(1))``);
writes OUT_DIR/worker_<i>.npz with the per-step losses and the final variables.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()

import epl  # noqa: E402
from tests.real_scripts import gpt2_lm  # noqa: E402
from tests.real_scripts.harness import Mode, run  # noqa: E402

SCRIPTS = {"gpt2_lm": gpt2_lm}


def main():
  out, script, steps, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
  data = dict(np.load(os.path.join(out, "data.npz")))
  initial = dict(np.load(os.path.join(out, "initial.npz")))
  config = epl.Config()
  cluster = epl.cluster.Cluster.from_environment(
      config.cluster.devices_per_worker, os.environ.get("TF_CONFIG", ""), 0)
  mode = Mode(cluster.gpu_num_per_worker, 1, 1)
  mine = mode.pieces * batch                    # this worker's rows of a step
  step_rows = mine * cluster.worker_num
  rows = [r for s in range(steps) for r in range(s * step_rows + cluster.worker_index * mine,
                                                  s * step_rows + (cluster.worker_index + 1) *
                                                  mine)]
  shard = {k: v[rows] for k, v in data.items()}
  res = run(SCRIPTS[script], batch, shard, [slice(s * mine, (s + 1) * mine)
                                            for s in range(steps)],
            mode=mode, initial=initial, config=config)
  np.savez(os.path.join(out, "worker_%d.npz" % cluster.worker_index),
           __losses__=np.array(res.losses), **res.variables)
  print("worker %d done: losses %s" % (cluster.worker_index, res.losses))


if __name__ == "__main__":
  main()
