"""``auto.auto_parallel`` with ``pipeline.num_stages: k``: cut an un-annotated model into k
pipeline stages balanced by profiled cost.

Before the plan is built, the graph is copied into a scratch session (the user's session,
variables and input pipeline are not touched), its forward and backward ops are run a few
times under TF's trace with zero-filled feeds, and ``epl.profiler`` groups them into layers
(top-level name scopes). ``epl.plan.auto.balance_stages`` splits the layers' forward +
backward times into k contiguous stages with the smallest maximum; each stage becomes a
``replicate(device_count=1)`` TaskGraph named ``stage_<i>``, exactly as if the user had
written the scopes, and the normal rewrite follows (micro-batches from
``pipeline.num_micro_batch``, data parallelism over the rest of the devices).

Without ``pipeline.num_stages`` (-1), the planner (``epl.plan.auto.plan_pipeline``, simulate
cost model) chooses the number of stages for the job's devices from the same profile; one
stage is plain data parallelism. The micro-batch count stays the configured one: it decides
how many batches a step reads, i.e. which model is trained.
"""
import logging

import numpy as np
import tensorflow.compat.v1 as tf

from epl import profiler
from epl.errors import PlanError
from epl.plan.auto.balance import balance_stages
from epl.plan.split import op_ranks

log = logging.getLogger("epl")

PROFILE_STEPS = 2
UNKNOWN_DIM = 32         # rows fed for a placeholder's unknown batch dimension


def annotate_stages(state):
  """Records the stages in ``state.recorder`` (once; nothing without auto.auto_parallel)."""
  config, recorder, graph = state.config, state.recorder, state.graph
  if not config.auto.auto_parallel or recorder.specs:
    return
  k = config.pipeline.num_stages
  if k == 0 or k < -1:
    raise PlanError("pipeline.num_stages is %d: give the number of pipeline stages (>= 1) for "
                    "auto.auto_parallel, or leave it unset (-1) to let the planner choose" % k)
  profile = _profile(graph, recorder)
  if k == -1:
    k = _planner_stages(profile, state)
  if len(profile.nodes) < k:
    raise PlanError(
        "auto.auto_parallel: the model has %d layer(s) (top-level name scopes: %s) but "
        "pipeline.num_stages is %d; build the model under name scopes (one per block) or lower "
        "num_stages" % (len(profile.nodes), ", ".join(n.name for n in profile.nodes) or "none",
                        k))
  stages = balance_stages([n.compute_ms for n in profile.nodes], k)
  _, rank = op_ranks(graph, graph.version)
  first = {}
  for op in graph.get_operations():
    layer, backward = profiler.layer_of(op.name)
    if layer is not None and not backward:
      first[layer] = min(first.get(layer, rank[op]), rank[op])
  starts = [0] + [first[profile.nodes[a].name] - 1 for a, _ in stages[1:]]
  recorder.auto_stages(starts, "auto.auto_parallel")
  log.info("auto.auto_parallel: %d stage(s): %s", k, "; ".join(
      "%s (%.2f ms)" % (",".join(n.name for n in profile.nodes[a:b + 1]),
                        sum(n.compute_ms for n in profile.nodes[a:b + 1]))
      for a, b in stages))


def runnable(total_devices):
  """The planner's ``accept`` for what epl runs: every stage on one device per model replica
  (``replicate(device_count=1)`` stages), the replicas data parallel over the rest -- so
  every stage has the same device count and the stage count divides the job's devices."""
  def accept(counts):
    return len(set(counts)) == 1 and total_devices % len(counts) == 0 and \
        counts[0] * len(counts) == total_devices
  return accept


def _planner_stages(profile, state):
  """The stage count ``epl.plan.auto.plan_pipeline`` chooses for the job's devices (its
  ``simulate`` cost model, the profiled batch per micro-batch, the configured micro-batches),
  among the plans epl runs (``runnable``: DAPPLE's 15:1 replica counts are not among them)."""
  from epl.plan.auto import DeviceSpec, plan_pipeline
  cluster, config = state.cluster, state.config
  per_worker, workers = cluster.gpu_num_per_worker, cluster.worker_num
  devices = DeviceSpec.parse(",".join(str(per_worker * (w + 1)) for w in range(workers)))
  micro = config.pipeline.num_micro_batch
  replicas = per_worker * workers
  plan = plan_pipeline(profile, UNKNOWN_DIM, UNKNOWN_DIM * micro * replicas, devices,
                       cost_model="simulate", accept=runnable(replicas))
  k = len(plan.stages)
  log.info("auto.auto_parallel: the planner chose %d stage(s) (%s; predicted speedup %.2f, "
           "pure data parallelism %.2f)", k, ", ".join(str(s) for s in plan.stages),
           plan.speedup, plan.data_parallel_speedup)
  return k


def _profile(graph, recorder):
  """The per-layer profile of ``graph``'s forward + backward, run in a scratch copy."""
  gradients = set()
  for g, _ in recorder.gradients:
    gradients |= {g.values.name, g.indices.name} if isinstance(g, tf.IndexedSlices) else {g.name}
  gradients = sorted(gradients)
  if not gradients:
    raise PlanError("auto.auto_parallel found no gradients: build the training step "
                    "(optimizer.minimize or tf.gradients) before the session starts")
  trainable = [v.op.name for v in graph.get_collection(tf.GraphKeys.TRAINABLE_VARIABLES)]
  inits = [v.initializer.name for key in (tf.GraphKeys.GLOBAL_VARIABLES,
                                          tf.GraphKeys.LOCAL_VARIABLES)
           for v in graph.get_collection(key)]
  tables = [op.name for op in graph.get_collection(tf.GraphKeys.TABLE_INITIALIZERS)]
  copy = tf.Graph()
  with copy.as_default():
    tf.import_graph_def(graph.as_graph_def(), name="")
    feed = {}
    for op in copy.get_operations():
      if op.type == "Placeholder" and op.outputs[0].consumers():
        shape = [d if d is not None else UNKNOWN_DIM
                 for d in (op.outputs[0].shape.as_list() if op.outputs[0].shape.rank
                           is not None else [])]
        feed[op.outputs[0]] = np.zeros(shape, op.outputs[0].dtype.as_numpy_dtype)
    fetches = [copy.get_tensor_by_name(n) for n in gradients]
    with tf.Session(graph=copy) as sess:
      sess.run([copy.get_operation_by_name(n) for n in inits + tables])
      return profiler.profile(sess, fetches, feed, steps=PROFILE_STEPS, graph=copy,
                              trainable=[copy.get_operation_by_name(n) for n in trainable])
