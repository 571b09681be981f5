"""One worker of a multi-worker parity run (started by epl-launch from the tests).

usage: dp_worker.py OUT_DIR MODEL STEPS BATCH [COUNTS]
Reads OUT_DIR/data.npz and OUT_DIR/initial.npz, trains on this worker's shard (by
worker_index), writes OUT_DIR/worker_<i>.npz with the per-step losses and final variables.
COUNTS (e.g. ``2,1``): the model's stages, each ``epl.replicate`` on that many devices;
``auto``: no annotation (auto.auto_parallel from the environment, 2 stages of 1 device
expected). TEST_SKEW_PLAN=1: workers other than 0 would cut the stages elsewhere.
TEST_PIECE_BYTES: the size of the pieces a cross-worker all-reduce is cut into (default
epl.collectives.PIECE_BYTES, 2 MiB: the test models' gradients are smaller).
TEST_EVERY_STEP=1: also read every variable right after each step and save them as
``__step<k>__/<variable>``. TEST_ALTERNATE=1: two train ops in alternate steps (run_model's
``alternate``). TEST_CLIP_NORM=c: the gradients clipped by their global norm c
(run_model's ``clip_norm``). TEST_LR: the learning rate (default 0.01).
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()

import epl  # noqa: E402
import epl.collectives  # noqa: E402
from epl.testing import run_model  # noqa: E402
from tests import models  # noqa: E402


def shard(data, workers, index, copies, batch, steps):
  """The samples worker ``index`` reads: its part of every step's global batch."""
  per_worker = copies * batch
  rows = []
  for s in range(steps):
    start = s * workers * per_worker + index * per_worker
    rows.extend(range(start, start + per_worker))
  return tuple(a[rows] for a in data)


def _skew_plan():
  """This worker's own balance of the stages moves the first cut by one layer: it plans
  differently from worker 0 (as close timings can), which a job must not act on."""
  from epl.runtime import auto_stages
  balance = auto_stages.balance_stages

  def skewed(costs, k):
    cut = balance(costs, k)
    end = cut[0][1] + (1 if cut[0][1] == 0 else -1)
    return ((0, end), (end + 1, len(costs) - 1))
  auto_stages.balance_stages = skewed


def main():
  out, model, steps, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
  raw = np.load(os.path.join(out, "data.npz"))
  initial = dict(np.load(os.path.join(out, "initial.npz")))
  if os.environ.get("TEST_PIECE_BYTES"):
    epl.collectives.PIECE_BYTES = int(os.environ["TEST_PIECE_BYTES"])
  config = epl.Config()
  cluster, _ = epl.cluster.Cluster.from_process(        # TF_CONFIG, or Slurm's / MPI's
      config.cluster.devices_per_worker, os.environ, 0)
  auto = len(sys.argv) > 5 and sys.argv[5] == "auto"
  if auto and os.environ.get("TEST_SKEW_PLAN") and cluster.worker_index > 0:
    _skew_plan()
  counts = [1, 1] if auto else \
      [int(c) for c in sys.argv[5].split(",")] if len(sys.argv) > 5 else [1]
  per, here = sum(counts), cluster.gpu_num_per_worker
  if per > here:     # a replica spans workers: the worker of its first device reads its batch
    data = shard((raw["x"], raw["y"]), cluster.worker_num * here // per,
                 cluster.worker_index // (per // here), config.pipeline.num_micro_batch,
                 batch, steps)
  else:
    data = shard((raw["x"], raw["y"]), cluster.worker_num, cluster.worker_index,
                 here // per * config.pipeline.num_micro_batch, batch, steps)
  res = run_model(getattr(models, model), data, batch, steps, config=config, initial=initial,
                  strategies=None if auto else
                  [(lambda i=i, k=k: epl.replicate(k, name="stage_%d" % i))
                   for i, k in enumerate(counts)],
                  every_step=bool(os.environ.get("TEST_EVERY_STEP")),
                  alternate=bool(os.environ.get("TEST_ALTERNATE")),
                  clip_norm=float(os.environ["TEST_CLIP_NORM"]) if os.environ.get(
                      "TEST_CLIP_NORM") else None, lr=float(os.environ.get("TEST_LR", 0.01)))
  zero = res.parallel.results.get("zero") if res.parallel is not None else None
  owners = sorted((zero.owners if zero is not None else {}).values())
  # bytes of the user's trained variables placed on this worker's task (ZeRO v2: its share)
  task = "/task:%d/" % cluster.worker_index
  trained = {g.variable for g in res.parallel.plan.gradients} if res.parallel else set()
  sizes = {op.name: tf.TensorShape(op.get_attr("shape")).num_elements()
           for op in res.graph.get_operations() if op.name in trained}
  here = sum(n for name, n in sizes.items()
             if task in res.graph.get_operation_by_name(name).device)
  reduces = [op for op in res.graph.get_operations() if op.type == "CollectiveReduceV2"]
  sync = res.parallel.sync_report if res.parallel is not None else None
  np.savez(os.path.join(out, "worker_%d.npz" % cluster.worker_index),
           __losses__=np.array(res.losses), __zero_owners__=np.array(owners, np.int64),
           __weights_here__=np.array(here), __weights_total__=np.array(sum(sizes.values())),
           __exchanges__=np.array(sum(op.type == "CollectiveAllToAllV2"
                                      for op in res.graph.get_operations())),
           __reduce_dtypes__=np.array([op.inputs[0].dtype.name for op in reduces]),
           __reduce_sizes__=np.array([op.inputs[0].shape.num_elements() for op in reduces]),
           __streamed__=np.array(sync.streamed if sync is not None else [], dtype=str),
           __reduce_groups__=np.array([op.inputs[2].op.get_attr("value").int_val[0]
                                       for op in reduces]),
           **res.variables,
           **{"__step%d__/%s" % (k, name): value for k, values in enumerate(res.steps or [])
              for name, value in values.items()})
  print("worker %d done: losses %s" % (cluster.worker_index, res.losses))


if __name__ == "__main__":
  main()
