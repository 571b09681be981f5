"""Build a ``ParallelPlan`` from the user's annotations, and validate it before any rewrite.

Attribution rule (which TaskGraph an op joins):
  1. forward ops (created outside gradient and optimizer calls): ``Recorder.taskgraph_of``;
  2. backward ops (created inside ``tf.gradients``/``compute_gradients``) and apply ops
     (created inside ``apply_gradients``): the TaskGraph of the op they are colocated with
     (epl forces ``colocate_gradients_with_ops=True``; optimizers colocate updates with their
     variable); failing that, the TaskGraph of their first input (data, then control) that
     has one; failing that, of their first consumer (data, then control) that has one;
     failing that, the last TaskGraph.
"""
import bisect

from epl import _tf_compat as compat
from epl.annotate import SPLIT
from epl.errors import NotImplementedYetError, PlanError
from epl.plan.plan import PHASES, ParallelPlan, TaskGraphPlan


def _phase_of_ids(recorder):
  """Returns a function op rank -> phase from the recorded (possibly nested) intervals."""
  intervals = sorted(recorder.phase_intervals, key=lambda iv: (iv[0], -iv[1]))
  if not intervals:
    return lambda op_id: "forward"
  starts = [iv[0] for iv in intervals]

  def phase(op_id):
    # The innermost interval containing op_id: scan back from the last start <= op_id.
    i = bisect.bisect_right(starts, op_id) - 1
    while i >= 0:
      first, last, name = intervals[i]
      if first <= op_id <= last:
        return name
      i -= 1
    return "forward"
  return phase


def attribute_ops(graph, recorder, upto_version):
  """Returns ({op: taskgraph index}, {op: phase}) for the first ``upto_version`` ops.

  The recorder speaks in ``graph.version`` (the op count when an event happened); the i-th
  op created has rank i, so ranks compare with recorded versions whatever ids TF assigns.
  """
  ops = sorted(graph.get_operations(), key=compat.op_id)[:upto_version]
  rank = {op: i + 1 for i, op in enumerate(ops)}
  phase_fn = _phase_of_ids(recorder)
  phase = {op: phase_fn(rank[op]) for op in ops}
  owner = {}
  for op in ops:
    if phase[op] == "forward":
      owner[op] = recorder.taskgraph_of(rank[op])
  by_name = {op.name: op for op in ops}
  pending = [op for op in ops if op not in owner]
  for op in pending:        # ops are in creation order, so inputs are usually decided first
    owner[op] = _from_colocation(op, by_name, owner)
    if owner[op] is None:
      sources = [t.op for t in op.inputs] + list(op.control_inputs)
      owner[op] = next((owner[x] for x in sources if owner.get(x) is not None), None)
  last = len(recorder.specs) - 1
  for op in pending:
    if owner[op] is None:
      users = [c for t in op.outputs for c in t.consumers()] + compat.control_outputs(op)
      owner[op] = next((owner[c] for c in users if owner.get(c) is not None), last)
  return owner, phase


def _from_colocation(op, by_name, owner):
  for group in op.colocation_groups():
    name = group.decode()[len("loc:@"):] if isinstance(group, bytes) else group[5:]
    target = by_name.get(name)
    if target is not None and target is not op and owner.get(target) is not None:
      return owner[target]
  return None


def build_plan(graph, recorder, config, cluster, upto_version):
  """Returns (ParallelPlan, {op: taskgraph}, {op: phase}).

  Raises:
    PlanError: the annotations do not fit the devices (message names scope and numbers).
    NotImplementedYetError: a strategy this version does not build (split, mixed shards).
  """
  common = dict(num_micro_batch=config.pipeline.num_micro_batch,
                pipeline_strategy=config.pipeline.strategy, host=cluster.host(cluster.worker_index),
                reduce_method=config.communication.gradients_reduce_method,
                max_splits=config.communication.max_splits,
                sparse_as_dense=config.communication.sparse_as_dense,
                collective_timeout=config.communication.collective_timeout,
                worker_num=cluster.worker_num, worker_index=cluster.worker_index,
                hosts=tuple(cluster.host(w) for w in range(cluster.worker_num)))
  if not recorder.specs:
    return ParallelPlan((), 1, 1, devices=(), **common), {}, {}
  owner, phase = attribute_ops(graph, recorder, upto_version)
  used = sorted({t for t in owner.values() if t is not None})
  renumber = {old: new for new, old in enumerate(used)}
  specs = [recorder.specs[i] for i in used]
  per_tg = {new: {p: [] for p in PHASES} for new in range(len(specs))}
  for op, t in owner.items():
    owner[op] = renumber[t]
    per_tg[owner[op]][phase[op]].append(op.name)

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
  shards = counts[0]
  per_replica = sum(counts)
  total = devices_here * cluster.worker_num
  detail = " + ".join("%s: %d" % (s.name, k) for s, k in zip(specs, counts))
  if per_replica <= devices_here and devices_here % per_replica:
    raise PlanError(
        "one model replica needs %d device(s) (%s) but the worker has %d; the job's devices "
        "must be a multiple of a replica's needs: launch with --gpu_per_worker %d (or a "
        "multiple), or change device_count" % (per_replica, detail, devices_here, per_replica))
  if per_replica > devices_here and (total % per_replica or shards > 1):
    raise PlanError(
        "one model replica needs %d device(s) (%s): more than a worker's %d, and the job's %d "
        "device(s) are not a multiple of it%s" % (
            per_replica, detail, devices_here, total,
            "" if shards == 1 else " (device_count > 1 cannot span workers)"))
  # Replicas fill the job's devices in order (worker-major): a replica that fits in a worker
  # stays inside it; a larger one spans consecutive workers, and the worker holding its first
  # device is its client.
  every_device = cluster.all_devices()
  layout = []                                  # (client worker, devices[taskgraph]) per copy
  for r in range(total // per_replica):
    base = r * per_replica
    for j in range(shards):
      layout.append((base // devices_here, tuple(
          (every_device[base + t * shards + j],) for t in range(len(specs)))))
  mine = tuple(devs for client, devs in layout if client == cluster.worker_index)
  clients = []
  for index, (client, _) in enumerate(layout):
    if not clients or clients[-1][0] != client:
      clients.append((client, index))
  peers = tuple(tuple(devs[t][0] for _, devs in layout) for t in range(len(specs)))
  tgs = tuple(TaskGraphPlan(i, s.name, s.kind, counts[i], s.location,
                            {p: tuple(per_tg[i][p]) for p in PHASES})
              for i, s in enumerate(specs))
  plan = ParallelPlan(tgs, len(mine) // shards, shards, devices=mine, peer_devices=peers,
                      clients=tuple(clients), **common)
  return plan, owner, phase
