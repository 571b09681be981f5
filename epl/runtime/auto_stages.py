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
cost model) chooses the stages, their layers and each stage's device count for the job's
devices from the same profile, among the plans epl runs (``epl_layout``: e.g. 3:1 on 4
devices); one stage is plain data parallelism. The model stays that of data parallelism over
every device with the configured ``pipeline.num_micro_batch`` M: a plan with R model
replicas of sum(d) devices runs sum(d) x M micro-batches, so every step reads the same
R x sum(d) x M batches (the global batch) whatever the planner picks; each plan is scored
by the cost model at that micro-batch count. With ``pipeline.num_stages`` given, the
micro-batch count is the configured one.
"""
import functools
import logging
import math

import numpy as np
import tensorflow.compat.v1 as tf

from epl import profiler
from epl.errors import PlanError
from epl.op_tables import READ_OPS, VARIABLE_OPS
from epl.plan.auto.balance import balance_stages
from epl.plan.split import op_ranks
from epl.runtime import auto_tp, server

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
  if k != -1 and config.auto.device_memory:
    raise PlanError("auto.device_memory=%s is the planner's budget, but pipeline.num_stages=%d "
                    "fixes the stages without it: drop one of the two keys"
                    % (config.auto.device_memory, k))
  layering = profiler.Layering(graph, [v.op for v in graph.get_collection(
      tf.GraphKeys.TRAINABLE_VARIABLES)])
  decide = functools.partial(_decide, state, layering, k)
  if state.server is None or state.cluster.worker_num == 1:
    decision = decide()
  else:     # a plan from measured times: worker 0's, on every worker
    decision = server.agreed(state.server, state.cluster, decide, state.start_round,
                             config.cluster.startup_timeout + 120)
    if "error" in decision:
      raise PlanError("auto.auto_parallel on worker 0: %s" % decision["error"])
  if "layout" in decision:
    auto_tp.relaunch(decision["layout"], state.cluster)
  k, counts, stages, ms, names = (decision[key] for key in ("k", "counts", "cut", "ms",
                                                            "layers"))
  if decision["micro"]:
    recorder.micro_batches = decision["micro"]
  _, rank = op_ranks(graph, graph.version)
  first = {}
  for op in graph.get_operations():
    layer, backward = layering.of(op.name)
    if layer is not None and not backward:
      first[layer] = min(first.get(layer, rank[op]), rank[op])
  missing = [n for n in names if n not in first]
  if missing:
    raise PlanError("auto.auto_parallel: worker 0 planned the layers %s; this worker has no "
                    "forward ops in %s: every worker must build the same model"
                    % (", ".join(names), ", ".join(missing)))
  starts = [0] + [first[names[a]] - 1 for a, _ in stages[1:]]
  recorder.auto_stages(starts, "auto.auto_parallel", counts)
  log.info("auto.auto_parallel: %d stage(s): %s", k, "; ".join(
      "%s (%.2f ms%s)" % (",".join(names[a:b + 1]), sum(ms[a:b + 1]),
                          ", device_count %d" % counts[i] if counts else "")
      for i, (a, b) in enumerate(stages)))


def _decide(state, layering, k):
  """The stages from this worker's profile: {"layers", "ms" (each layer's forward + backward),
  "k", "counts" (None: one device each), "cut" ([first, last] layer per stage), "micro"
  (None: the configured)}, or {"layout": ...} where only tensor parallelism fits."""
  profile = _profile(state.graph, state.recorder)
  names, ms = [n.name for n in profile.nodes], [n.compute_ms for n in profile.nodes]
  counts = micro = None
  if k == -1:
    readers = _readers(state.graph, layering, set(names))
    ids = {n.name: n.id for n in profile.nodes}
    groups = [frozenset(ids[l] for l in layers) for layers in readers.values()
              if len(layers) > 1]
    if groups:
      log.info("auto.auto_parallel: %s read in several layers: their stages keep as many "
               "devices", ", ".join(sorted(n for n, l in readers.items() if len(l) > 1)))
    try:
      k, counts, cut, micro = _planner_stages(profile, state, same_copies(groups))
    except PlanError as e:
      return {"layout": _split_instead(profile, state, layering, e)}
  if len(names) < k:
    raise PlanError(
        "auto.auto_parallel: the model has %d layer(s) (its name scopes: %s) but "
        "pipeline.num_stages is %d; build the model under name scopes (one per block) or lower "
        "num_stages" % (len(names), ", ".join(names) or "none", k))
  if not counts:
    cut = balance_stages(ms, k)
  return {"layers": names, "ms": ms, "k": k, "counts": list(counts) if counts else None,
          "cut": [list(c) for c in cut], "micro": micro}


def epl_layout(counts, per_worker, workers):
  """How epl runs a plan whose stage i uses ``counts[i]`` of the job's devices: (model
  replicas R, device_count per stage d with counts[i] = R * d[i]), or None when it cannot.
  epl's rules: each device_count divides the largest; a replica's sum(d) devices fit a
  worker a whole number of times, or span workers (the job's devices a multiple of them:
  its first device's worker drives it). The most replicas win (data parallelism needs no
  bridging)."""
  total = per_worker * workers
  if sum(counts) != total:
    return None
  common = functools.reduce(math.gcd, counts)
  for replicas in sorted((r for r in range(1, common + 1) if common % r == 0), reverse=True):
    d = tuple(n // replicas for n in counts)
    if any(max(d) % x for x in d):
      continue
    per = sum(d)
    if (per <= per_worker and per_worker % per == 0) or (per > per_worker and
                                                          total % per == 0):
      return replicas, d
  return None


def runnable(per_worker, workers=1):
  """The planner's ``accept`` for what epl runs (``epl_layout``): stages replicated on
  device counts that divide one another (e.g. 2:1 per model replica), the replicas data
  parallel over the rest of the job's devices."""
  def accept(counts):
    return epl_layout(counts, per_worker, workers) is not None
  return accept


def same_copies(groups):
  """The planner's ``accept_stages`` (None without ``groups``): every group of layers that
  reads one variable (a tied embedding) lies in stages on as many devices -- epl cannot read
  a variable across different replica counts."""
  if not groups:
    return None

  def accept(stages):
    return all(len({count for layers, count in stages if layers & group}) <= 1
               for group in groups)
  return accept


def tied(graph, layering, model_layers):
  """The trainable variables read in more than one of ``model_layers`` (sorted names):
  GPT-2's ``wte``, read by the embedding and by the logits."""
  return sorted(n for n, layers in _readers(graph, layering, model_layers).items()
                if len(layers) > 1)


def _readers(graph, layering, model_layers):
  """Each trainable variable -> the ``model_layers`` whose forward ops read it (reads,
  initialisers and the optimizer's updates are not readers)."""
  layers = {}
  for op in graph.get_operations():
    layer, backward = layering.of(op.name)
    if layer not in model_layers or backward or op.type in READ_OPS or \
        op.type.startswith("Assign"):
      continue
    for t in op.inputs:
      source = t.op
      if source.type in READ_OPS and source.inputs and source.inputs[0].op.type in VARIABLE_OPS:
        source = source.inputs[0].op
      if source.type in VARIABLE_OPS:
        layers.setdefault(source.name, set()).add(layer)
  trainable = {v.op.name for v in graph.get_collection(tf.GraphKeys.TRAINABLE_VARIABLES)}
  return {n: found for n, found in layers.items() if n in trainable}


def _planner_stages(profile, state, accept_stages=None):
  """The plan ``epl.plan.auto.plan_pipeline`` chooses for the job's devices (its
  ``simulate`` cost model, the profiled batch per micro-batch, the configured micro-batches),
  among the plans epl runs (``runnable``): (stage count, device_count per stage, each stage's
  (first, last) layer index)."""
  cluster, config = state.cluster, state.config
  per_worker, workers = cluster.gpu_num_per_worker, cluster.worker_num
  micro = config.pipeline.num_micro_batch
  def micro_batches(counts):           # the data-parallel model's global batch, kept
    layout = epl_layout(counts, per_worker, workers)
    return None if layout is None else sum(layout[1]) * micro
  plan = _plan(profile, state, per_worker, runnable(per_worker, workers), micro_batches,
               accept_stages)
  memory = _budget(config)
  k = len(plan.stages)
  copies, counts = epl_layout(plan.replicas, per_worker, workers)
  index = {n.id: i for i, n in enumerate(profile.nodes)}
  firsts = [0] + [min(index[node] for node in s.layers) for s in plan.stages[1:]]
  cut = [(a, b - 1) for a, b in zip(firsts, firsts[1:] + [len(profile.nodes)])]
  if any(a >= b for a, b in zip(firsts, firsts[1:])):              # not a chain
    cut = balance_stages([n.compute_ms for n in profile.nodes], k)
  log.info("auto.auto_parallel: the planner chose %d stage(s) (%s; %d model replica(s) with "
           "device_count %s, %d micro-batch(es); predicted speedup %.2f, pure data "
           "parallelism %.2f; predicted peak %d bytes per device%s)", k,
           ", ".join(str(s) for s in plan.stages), copies, ":".join(str(d) for d in counts),
           plan.micro_batches, plan.speedup, plan.data_parallel_speedup,
           max(plan.peak_memory_per_device),
           "" if memory is None else ", auto.device_memory %d" % memory)
  return k, counts, cut, plan.micro_batches


def _budget(config):
  """auto.device_memory in bytes, or None."""
  from epl.plan.auto import PlannerError
  from epl.plan.auto.devices import parse_bytes
  if not config.auto.device_memory:
    return None
  try:
    return parse_bytes(config.auto.device_memory)
  except PlannerError as e:
    raise PlanError("auto.device_memory: %s" % e) from None


def _devices(per_worker, workers):
  from epl.plan.auto import DeviceSpec
  return DeviceSpec.parse(",".join(str(per_worker * (w + 1)) for w in range(workers)))


def _plan(profile, state, per_worker, accept, micro_batches, accept_stages=None):
  """``plan_pipeline``'s plan (the ``simulate`` cost model) of ``profile`` on ``per_worker``
  devices of each of the job's workers, keeping the data-parallel model's global batch."""
  from epl.plan.auto import PlannerError, plan_pipeline
  config, workers = state.config, state.cluster.worker_num
  replicas = state.cluster.gpu_num_per_worker * workers
  try:
    return plan_pipeline(profile, UNKNOWN_DIM,
                         UNKNOWN_DIM * config.pipeline.num_micro_batch * replicas,
                         _devices(per_worker, workers), cost_model="simulate", accept=accept,
                         micro_batches=micro_batches, memory=_budget(config),
                         accept_stages=accept_stages)
  except PlannerError as e:
    raise PlanError("auto.auto_parallel: no plan fits auto.device_memory=%s on %d device(s) "
                    "(%s): raise auto.device_memory, add devices, or lower "
                    "pipeline.num_micro_batch's rows per micro-batch"
                    % (config.auto.device_memory, replicas, e)) from None


def _split_instead(profile, state, layering, error):
  """No data-parallel or pipeline plan fits auto.device_memory: the layout of the smallest
  tensor-parallel degree whose plan fits (epl.runtime.auto_tp re-executes the process with
  it), else ``error``."""
  config, cluster = state.config, state.cluster
  if not config.auto.device_memory:
    raise error
  per_worker, micro = cluster.gpu_num_per_worker, config.pipeline.num_micro_batch
  spec = _devices(per_worker, cluster.worker_num)
  trainable = [v.op for v in state.graph.get_collection(tf.GraphKeys.TRAINABLE_VARIABLES)]

  def plan_at(make_profile, degree):
    return _plan(make_profile(spec), state, per_worker // degree,
                 lambda counts: len(counts) == 1, lambda counts: degree * micro)

  found = auto_tp.choose(profile, plan_at, per_worker, layering, trainable)
  if found is None:
    raise PlanError("%s; nor does tensor parallelism (epl.split of degree %s)" % (
        error, " or ".join(map(str, auto_tp.degrees(per_worker))) or "none: 1 device"))
  degree, plan = found
  log.info("auto.auto_parallel: no data-parallel or pipeline plan fits auto.device_memory=%s; "
           "epl.split(%d) x %d model replica(s) does (predicted peak %d bytes per device, "
           "step %.3g s)", config.auto.device_memory, degree, plan.replicas[0],
           max(plan.peak_memory_per_device), plan.predicted_iteration_s)
  return {"split": degree, "micro_batches": degree * micro}


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
