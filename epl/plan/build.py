"""Build the job's ``ParallelPlan`` from the user's annotations, and validate it first.

Nothing here edits the graph: the plan records, by name, what the passes will build
(``epl.plan.attribution`` says which TaskGraph and phase each op joins).
"""
import tensorflow.compat.v1 as tf

from epl.annotate import SPLIT
from epl.errors import NotImplementedYetError, PlanError
from epl.plan.attribution import attribute_ops
from epl.plan.placement import Replicate
from epl.plan.plan import PHASES, Communication, Copy, Gradient, ParallelPlan, TaskGraphPlan
from epl.plan.schedule import make_schedule


def communication(config):
  c = config.communication
  return Communication(c.gradients_reduce_method, c.max_splits, c.sparse_as_dense,
                       c.clip_after_allreduce, c.collective_timeout)


def build_plan(graph, recorder, config, cluster, upto_version=None):
  """Returns the ParallelPlan of ``graph``'s first ``upto_version`` ops (default: all).

  Raises:
    PlanError: the annotations do not fit the devices (message names scope and numbers).
    NotImplementedYetError: a strategy this version does not build (split, mixed shards).
  """
  common = dict(num_micro_batch=config.pipeline.num_micro_batch,
                pipeline_strategy=config.pipeline.strategy,
                hosts=tuple(cluster.host(w) for w in range(cluster.worker_num)),
                communication=communication(config), has_gpu=cluster.has_gpu)
  if not recorder.specs:
    return ParallelPlan((), (), 1, schedule=(), **common)
  upto = graph.version if upto_version is None else upto_version
  owner, phase = attribute_ops(graph, recorder, upto)
  used = sorted({t for t in owner.values() if t is not None})
  renumber = {old: new for new, old in enumerate(used)}
  specs = [recorder.specs[i] for i in used]
  per_tg = {new: {p: [] for p in PHASES} for new in range(len(specs))}
  for op, t in owner.items():
    per_tg[renumber[t]][phase[op]].append(op.name)
  counts = _check_devices(specs, config, cluster)
  tgs = tuple(TaskGraphPlan(i, s.name, Replicate(counts[i]), s.location,
                            {p: tuple(per_tg[i][p]) for p in PHASES})
              for i, s in enumerate(specs))
  copies = _layout(counts, cluster)
  schedule = make_schedule(config.pipeline.strategy, len(tgs), config.pipeline.num_micro_batch)
  return ParallelPlan(
      tgs, copies, counts[0],
      schedule=tuple(tuple(str(a) for a in stage) for stage in schedule),
      gradients=_gradients(recorder), shared_variables=tuple(sorted(
          v.op.name for v in graph.get_collection(tf.GraphKeys.GLOBAL_STEP))),
      **common)


def _check_devices(specs, config, cluster):
  """Devices per replica of each TaskGraph; raises when the annotations do not fit."""
  for spec in specs:
    if spec.kind == SPLIT:
      raise NotImplementedYetError(
          "epl.split at %s: tensor/MoE parallelism is not implemented yet in epl; use "
          "epl.replicate for now" % spec.location)
  counts = [spec.device_count or 1 for spec in specs]
  devices_here = cluster.gpu_num_per_worker
  for spec, k in zip(specs, counts):
    if k > devices_here:
      raise PlanError(
          "%s %r asks for device_count=%d but the worker has %d device(s); lower device_count "
          "or launch with --gpu_per_worker %d" % (spec.kind, spec.name, k, devices_here, k))
  if len(set(counts)) > 1:
    raise NotImplementedYetError(
        "TaskGraphs with different device_count (%s) are not implemented yet in epl; give "
        "every scope the same device_count" % ", ".join(
            "%s=%d" % (s.name, k) for s, k in zip(specs, counts)))
  if config.pipeline.num_micro_batch > 1 and any(k > 1 for k in counts):
    raise NotImplementedYetError(
        "pipeline.num_micro_batch > 1 with replicate(device_count > 1) is not implemented yet "
        "in epl; use device_count=1 per stage")
  per_replica = sum(counts)
  total = devices_here * cluster.worker_num
  detail = " + ".join("%s: %d" % (s.name, k) for s, k in zip(specs, counts))
  if per_replica <= devices_here and devices_here % per_replica:
    raise PlanError(
        "one model replica needs %d device(s) (%s) but the worker has %d; the job's devices "
        "must be a multiple of a replica's needs: launch with --gpu_per_worker %d (or a "
        "multiple), or change device_count" % (per_replica, detail, devices_here, per_replica))
  if per_replica > devices_here and (total % per_replica or counts[0] > 1):
    raise PlanError(
        "one model replica needs %d device(s) (%s): more than a worker's %d, and the job's %d "
        "device(s) are not a multiple of it%s" % (
            per_replica, detail, devices_here, total,
            "" if counts[0] == 1 else " (device_count > 1 cannot span workers)"))
  return counts


def _layout(counts, cluster):
  """Every copy of the job. Replicas fill the job's devices in order (worker-major): a
  replica that fits in a worker stays inside it; a larger one spans consecutive workers, and
  the worker holding its first device is its client."""
  shards, per_replica = counts[0], sum(counts)
  every_device = cluster.all_devices()
  devices_here = cluster.gpu_num_per_worker
  copies = []
  for r in range(len(every_device) // per_replica):
    base = r * per_replica
    for j in range(shards):
      copies.append(Copy(r, j, base // devices_here, tuple(
          (every_device[base + t * shards + j],) for t in range(len(counts)))))
  return tuple(copies)


def _gradients(recorder):
  """The raw gradient of every variable (what tf.gradients returned), with what
  apply_gradients was handed for it; gradients an optimizer got from elsewhere count as raw."""
  applied = {}
  for grad, var in recorder.grads_and_vars:
    if grad is not None:
      applied.setdefault(var.op.name, _tensor_names(grad))
  out, seen = [], set()
  for grad, var_op in recorder.gradients:
    key = (var_op.name, _tensor_names(grad))
    if key not in seen:
      seen.add(key)
      out.append(Gradient(key[0], key[1], applied.get(key[0], ())))
  computed = {g.variable for g in out}
  out.extend(Gradient(name, names, names) for name, names in applied.items()
             if name not in computed)
  return tuple(out)


def _tensor_names(grad):
  if isinstance(grad, tf.IndexedSlices):
    shape = grad.dense_shape.name if grad.dense_shape is not None else ""
    return (grad.values.name, grad.indices.name, shape)
  return (grad.name,)
