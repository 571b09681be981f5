"""Build the job's ``ParallelPlan`` from the user's annotations, and validate it first.

Nothing here edits the graph: the plan records, by name, what the passes will build
(``epl.plan.attribution`` says which TaskGraph and phase each op joins).
"""
import dataclasses

import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl.annotate import REPLICATE, SPLIT
from epl.config import IMPLICIT, KEYS, REFUSED
from epl.errors import NotImplementedYetError, PlanError
from epl.plan import split as split_facts
from epl.plan.attribution import attribute_ops
from epl.plan.placement import Replicate, Split
from epl.plan.plan import (PHASES, Communication, Copy, Gradient, Memory, ParallelPlan,
                           TaskGraphPlan)
from epl.plan.micro_batches import accumulate_runs, stage_functions
from epl.plan.schedule import make_schedule


def communication(config):
  c = config.communication
  return Communication(reduce_method=c.gradients_reduce_method, max_splits=c.max_splits,
                       sparse_as_dense=c.sparse_as_dense,
                       clip_after_allreduce=c.clip_after_allreduce,
                       timeout=c.collective_timeout, num_communicators=c.num_communicators,
                       fp16=c.fp16, fp16_scale=c.fp16_scale)


def _memory(graph, config):
  gc = config.gradient_checkpoint
  names = ()
  if gc.type == "collection":
    names = tuple(t.name for t in graph.get_collection("checkpoints")
                  if isinstance(t, tf.Tensor))
    if not names:
      raise PlanError(
          "gradient_checkpoint.type is 'collection' but the graph's \"checkpoints\" collection "
          "holds no tensor; add the tensors to keep with tf.add_to_collection(\"checkpoints\", "
          "tensor), or use gradient_checkpoint.type 'auto'")
  return Memory(offload=config.offload.level, num_apply_group=config.optimizer.num_apply_group,
                gradient_checkpoint=gc.type, checkpoint_end_taskgraph=gc.end_taskgraph,
                checkpoints=names, check_gradients=gc.check_gradients, zero=config.zero.level)


def _unannotated_keys(config, cluster):
  """The keys set away from their default that act on the one copy of an unannotated graph
  (``Key.unannotated == IMPLICIT``); raises PlanError for a key that cannot act there."""
  changed = [k for name, k in sorted(KEYS.items()) if config.get(name) != k.default]
  for key in changed:
    if key.unannotated == REFUSED:
      raise PlanError(
          "Config key %r=%r partitions state over data-parallel model copies, but the graph "
          "has no epl annotation, so it trains as one copy (the local script): add "
          "epl.set_default_strategy(epl.replicate(1)) before building the model (data "
          "parallelism over the job's devices), or remove %r" % (
              key.name, config.get(key.name), key.name))
  keys = ["%s=%r" % (k.name, config.get(k.name)) for k in changed if k.unannotated == IMPLICIT]
  if keys and cluster.worker_num > 1:
    raise PlanError(
        "Config %s act on the model's copies, but the graph has no epl annotation, and "
        "without one every worker of this %d-worker job runs its own local script: add "
        "epl.set_default_strategy(epl.replicate(1)) before building the model to train one "
        "model over the workers" % (", ".join(keys), cluster.worker_num))
  return keys


def build_plan(graph, recorder, config, cluster, upto_version=None):
  """Returns the ParallelPlan of ``graph``'s first ``upto_version`` ops (default: all).

  Raises:
    PlanError: the annotations do not fit the devices, or (split.gather_fallback "refuse")
      the training step reads a split value whole (the message names scope, op and numbers).
    NotImplementedYetError: a combination this version does not build.
  """
  micro = recorder.micro_batches or config.pipeline.num_micro_batch   # planner's, if any
  common = dict(num_micro_batch=micro,
                pipeline_strategy=config.pipeline.strategy,
                hosts=tuple(cluster.host(w) for w in range(cluster.worker_num)),
                communication=communication(config), has_gpu=cluster.has_gpu,
                memory=_memory(graph, config), race_delay_ms=config.testing.race_delay_ms)
  if not recorder.specs:
    keys = _unannotated_keys(config, cluster)
    if not keys:
      return ParallelPlan(taskgraphs=(), copies=(), shards=1, schedule=(), **common)
    # the keys act on the one model copy the local script is: the whole graph as a
    # replicate(1) TaskGraph on one device
    recorder = recorder.whole_graph("the whole model (no epl annotation; %s)" % ", ".join(keys),
                                    "epl.init")
    cluster = dataclasses.replace(cluster, gpu_num_per_worker=1)
  upto = graph.version if upto_version is None else upto_version
  compat.adopt_part_slots(graph, recorder.shard_ops)    # a hand-written optimizer's slots
  specs, owner, phase, ops, rank = _attribute(graph, recorder, upto)
  placements = _placements(specs, config, cluster)
  phases = _phases(owner, phase, len(specs))
  tgs = tuple(TaskGraphPlan(index=i, name=s.name, placement=placements[i], location=s.location,
                            ops=phases[i]) for i, s in enumerate(specs))
  parts, crossings, gathers, step = _split_facts(ops, rank, owner, phase, recorder, specs,
                                                 placements)
  if config.split.gather_fallback == "refuse":
    split_facts.refuse_gathers(gathers)
  reductions = _reductions(recorder, specs, {op.name for op in step})
  copies = _layout(placements, config.cluster.colocate_split_and_replicate, cluster)
  gradients = _gradients(recorder)
  runs = accumulate_runs(config, placements, micro, gradients)
  if runs > 1:
    common.update(num_micro_batch=1, accumulate_runs=runs)
    micro = 1
  functions = stage_functions(config, placements, micro, crossings, _shards(placements))
  if functions:
    common.update(stage_functions=functions)
  schedule = make_schedule(config.pipeline.strategy, len(tgs), micro)
  _refuse_sparse_zero(gradients, config, cluster)
  return ParallelPlan(
      taskgraphs=tgs, copies=copies, shards=_shards(placements),
      schedule=tuple(tuple(str(a) for a in stage) for stage in schedule),
      gradients=gradients, shared_variables=tuple(sorted(
          v.op.name for v in graph.get_collection(tf.GraphKeys.GLOBAL_STEP))),
      parts=parts, crossings=crossings, reductions=reductions, gathers=gathers,
      wholes=tuple(sorted(t.op.name for t in recorder.sharded)), **common)


def _attribute(graph, recorder, upto):
  """The TaskGraph (renumbered over those that hold ops) and phase of every op of the first
  ``upto`` versions; returns (their specs, owner, phase, ops by name, ranks)."""
  owner, phase = attribute_ops(graph, recorder, upto)
  ops, rank = split_facts.op_ranks(graph, upto)
  ops = [op for op in ops if op in phase]          # not the ops a relayout left unread
  kinds = {i: s.kind for i, s in enumerate(recorder.specs)}
  split_facts.move_inputs_to_copies(ops, owner, kinds, {
      i: s.device_count or 1 for i, s in enumerate(recorder.specs) if s.kind == REPLICATE})
  used = sorted({t for t in owner.values() if t is not None})
  renumber = {old: new for new, old in enumerate(used)}
  owner = {op: renumber[t] for op, t in owner.items() if t is not None}
  return [recorder.specs[i] for i in used], owner, phase, ops, rank


def _phases(owner, phase, count):
  """[{phase: op names in graph order}] of each of the ``count`` TaskGraphs."""
  out = [{p: [] for p in PHASES} for _ in range(count)]
  for op, t in owner.items():
    out[t][phase[op]].append(op.name)
  return [{p: tuple(names) for p, names in tg.items()} for tg in out]


def _split_facts(ops, rank, owner, phase, recorder, specs, placements):
  """(parts, crossings, gathers, step): which part of a split TaskGraph each op's output is,
  the tensors that cross between TaskGraphs of different layouts, the ops that read a split
  value whole (no rule covers them), and the ops of the training step (when there is a split
  TaskGraph: its rules' all-reduces are counted there)."""
  kinds = {i: p.kind for i, p in enumerate(placements)}
  split_tgs = {i for i, k in kinds.items() if k == SPLIT}
  parts, crossings, gathers, step = {}, (), (), set()
  if split_tgs:
    step = split_facts.training_step(ops, phase)
    gathers = split_facts.gathers(ops, rank, owner, phase, recorder, split_tgs, specs, step)
    parts = split_facts.assign_parts(ops, rank, owner, phase, recorder, split_tgs)
  if split_tgs or len({p.devices for p in placements if p.kind == REPLICATE}) > 1:
    crossings = split_facts.crossings(ops, owner, phase, kinds, specs, placements,
                                      recorder.exchange_axes)
  return parts, crossings, gathers, step


def _shards(placements):
  """Copies per model replica: the largest device_count of the replicated TaskGraphs (1 if
  none); a replicated TaskGraph with fewer devices runs in every ``shards // devices``-th
  copy on the rows of that many copies."""
  return max((p.devices for p in placements if p.kind == REPLICATE), default=1)


def _replica_devices(placements, colocate):
  """Devices one model replica needs: the sum over TaskGraphs, or the largest with
  ``cluster.colocate_split_and_replicate``."""
  counts = [p.devices for p in placements]
  return max(counts) if colocate else sum(counts)


def _placements(specs, config, cluster):
  """Each TaskGraph's placement; raises when the annotations do not fit the devices."""
  total = cluster.gpu_num_per_worker * cluster.worker_num
  out = [_placement(spec, total) for spec in specs]
  _refuse_combinations(specs, out, config, cluster)
  _check_fit(specs, out, config, cluster)
  return out


def _placement(spec, total):
  """The placement of one annotation on a job of ``total`` devices."""
  if spec.kind == SPLIT:
    k = spec.device_count or total
    if k > total:
      raise PlanError(
          "split %r asks for device_count=%d but the job has %d device(s); lower "
          "device_count or launch more workers / --gpu_per_worker" % (spec.name, k, total))
    return Split(k)
  k = spec.device_count or 1
  if k > total:
    raise PlanError(
        "%s %r asks for device_count=%d but the job has %d device(s); lower device_count or "
        "launch more workers / --gpu_per_worker %d" % (spec.kind, spec.name, k, total, k))
  return Replicate(k)


def _refuse_combinations(specs, placements, config, cluster):
  """PlanError for the feature combinations that cannot run."""
  counts = [p.devices for p in placements if p.kind == REPLICATE]
  if len(set(counts)) > 1:
    mixed = ", ".join("%s=%d" % (s.name, p.devices) for s, p in zip(specs, placements)
                      if p.kind == REPLICATE)
    if any(max(counts) % k for k in counts):
      raise PlanError(
          "replicate scopes with device_count %s: each device_count must divide the largest "
          "(%d), so that every copy of a stage with fewer devices takes the rows of a whole "
          "number of the widest stage's copies; change device_count" % (mixed, max(counts)))


def _check_fit(specs, placements, config, cluster):
  """PlanError unless the job's devices are a whole number of model replicas."""
  devices_here = cluster.gpu_num_per_worker
  total = devices_here * cluster.worker_num
  colocate = config.cluster.colocate_split_and_replicate and any(
      p.kind == SPLIT for p in placements)
  per_replica = _replica_devices(placements, colocate)
  detail = " + ".join("%s: %d" % (s.name, p.devices) for s, p in zip(specs, placements))
  if colocate:
    detail = "the largest of " + detail.replace(" + ", ", ")
  if per_replica <= devices_here and devices_here % per_replica:
    raise PlanError(
        "one model replica needs %d device(s) (%s) but the worker has %d; the job's devices "
        "must be a multiple of a replica's needs: launch with --gpu_per_worker %d (or a "
        "multiple), or change device_count" % (per_replica, detail, devices_here, per_replica))
  if per_replica > devices_here and total % per_replica:
    raise PlanError(
        "one model replica needs %d device(s) (%s): more than a worker's %d, and the job's %d "
        "device(s) are not a multiple of it" % (per_replica, detail, devices_here, total))


def _layout(placements, colocate, cluster):
  """Every copy of the job. Replicas fill the job's devices in order (worker-major): a
  replica that fits in a worker stays inside it; a larger one spans consecutive workers, and
  the worker holding its first device is its client. Inside a replica each TaskGraph takes
  the next block of devices (all start at the replica's first device with
  ``cluster.colocate_split_and_replicate``); copy j of a replicated TaskGraph runs on its
  block's j-th device, a split TaskGraph on its whole block."""
  colocate = colocate and any(p.kind == SPLIT for p in placements)
  per_replica = _replica_devices(placements, colocate)
  offsets, at = [], 0
  for p in placements:
    offsets.append(0 if colocate else at)
    at += p.devices
  every_device = cluster.all_devices()
  devices_here = cluster.gpu_num_per_worker
  copies = []
  for r in range(len(every_device) // per_replica):
    base = r * per_replica
    group = every_device[base:base + per_replica]
    shards = _shards(placements)
    for j in range(shards):          # copy j of a narrower TaskGraph: that of its run's rows
      copies.append(Copy(replica=r, shard=j, client=base // devices_here, devices=tuple(
          tuple(group[o:o + p.devices]) if p.kind == SPLIT else
          (group[o + j // (shards // p.devices)],) for p, o in zip(placements, offsets))))
  return tuple(copies)


def _reductions(recorder, specs, kept):
  """{split TaskGraph (plan index): (forward, backward) tensor-parallel sums} of the training
  step (``kept``: its ops; a relayout's unread ops, evaluation and sampling do not count)."""
  index = {s.index: i for i, s in enumerate(specs)}
  out = {}
  for taskgraph, direction, op in recorder.reductions:
    if op in kept and taskgraph in index:
      fwd, bwd = out.get(index[taskgraph], (0, 0))
      out[index[taskgraph]] = (fwd + 1, bwd) if direction == "forward" else (fwd, bwd + 1)
  return out


def _refuse_sparse_zero(gradients, config, cluster):
  """NotImplementedYetError for ZeRO across workers with communication.sparse_as_dense and a
  sparse gradient (TF's collective setup failed: "ValidateDevices called before
  initialization"). Without sparse_as_dense such a variable stays unowned (passes/owners.py)."""
  sparse = [g.variable for g in gradients if g.sparse]
  if config.zero.level and cluster.worker_num > 1 and sparse and \
      config.communication.sparse_as_dense:
    raise NotImplementedYetError(
        "zero.level %r across workers is not implemented yet in epl with "
        "communication.sparse_as_dense for variables whose gradient is sparse "
        "(tf.IndexedSlices, from a tf.gather: %s); unset communication.sparse_as_dense (ZeRO "
        "then leaves those variables unpartitioned), or unset zero.level" % (
            config.zero.level, ", ".join(sorted(sparse)[:3])))


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
      out.append(Gradient(variable=key[0], tensors=key[1], applied=applied.get(key[0], ())))
  computed = {g.variable for g in out}
  out.extend(Gradient(variable=name, tensors=names, applied=names)
             for name, names in applied.items()
             if name not in computed)
  return tuple(out)


def _tensor_names(grad):
  if isinstance(grad, tf.IndexedSlices):
    shape = grad.dense_shape.name if grad.dense_shape is not None else ""
    return (grad.values.name, grad.indices.name, shape)
  return (grad.name,)
