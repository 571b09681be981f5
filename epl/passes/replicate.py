"""Replica clone pass: one copy of the step per (model replica, shard) on this worker.

Expects: the plan (this worker's copies) and the ``analyze`` result. Adds:
  * copy 0 = the user's own ops, placed on copy 0's devices (a lone copy of a lone TaskGraph
    is left to TF's placer, exactly as the local script);
  * copies 1..n-1 = clones under ``EPL_REPLICA_<c>/``, placed on their devices (a split
    TaskGraph's ops on the part of its devices the plan gives them, once per model replica:
    in the replica's first copy); data sources
    (``get_next``) are cloned per replica, so N replicas read N batches per step; placeholders
    are cloned too (the runtime feeds each copy its piece of a fed batch); with ``shards``
    k > 1 each replica's batch from an iterator is split k ways;
  * singletons (the optimizer's finish group, ``global_step += 1``) wait for every copy;
  * ``sync_op``: copies replica 0's variables to the other copies (run after init/restore).
Returns a ``Replication`` record.
"""
import dataclasses
from typing import Dict, List, Mapping, Optional, Tuple

import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl.passes.clone import clone_ops, rewire, wait_for_clones
from epl.passes.slots import slots
from epl.op_tables import is_host_op


@dataclasses.dataclass(frozen=True)
class Replication:
  copies: List[Dict[str, tf.Operation]]   # copies[c][original op name] -> op (copy 0: {})
  sync_op: tf.Operation                   # None when there is nothing to sync
  mirrored: Mapping[str, List[tf.Operation]]  # original variable op name -> op in every copy
  # [copies x micro-batches] weights of each piece's gradient; the runtime feeds rows-based
  # weights when a fed batch does not split evenly (None without batch placeholders)
  row_weights: Optional[tf.Tensor] = None
  # (the Split op that cuts a source's output into the replica's k pieces, the source op)
  source_splits: Tuple[Tuple[tf.Operation, tf.Operation], ...] = ()

  def __str__(self):
    return "Replication(%d copies, %d mirrored variables, sync %s)" % (
        len(self.copies), len(self.mirrored), "built" if self.sync_op is not None else "none")


def device_function(ctx, copy):
  """op -> the device of its clone in local copy ``copy`` (the user's own host placements
  and the input pipeline stay where they are)."""
  owner, worker = ctx.owner, ctx.worker
  pinned = ctx.result("analyze").pinned

  def device(op):
    if is_host_op(op) or op in pinned:
      return op.device
    t = owner.get(op)
    if t is None:
      return op.device
    return worker.device_of(copy, t, ctx.plan.part_of(op.name) if ctx.plan.is_split(t) else 0)
  return device


def replicate(ctx):
  """Runs the pass; see the module docstring."""
  graph, plan, worker = ctx.graph, ctx.plan, ctx.worker
  analysis = ctx.result("analyze")
  n, k = worker.num_copies, plan.shards
  if n > 1 or len(plan.taskgraphs) > 1 or plan.worker_num > 1 or plan.micro_batches > 1 \
      or any(plan.is_split(t.index) for t in plan.taskgraphs):
    # One copy of one replicated TaskGraph is the local script: TF's placer already puts it
    # on the first accelerator, and explicit placement would only add host <-> device edges.
    # A split TaskGraph has its parts on several devices even in one copy.
    place_copy0 = device_function(ctx, 0)
    for op in analysis.cloned:
      compat.set_device(op, place_copy0(op))
  pieces = n * plan.num_micro_batch                 # per run (accumulate_runs: one per run)
  weights = None
  if analysis.batch_placeholders and pieces * plan.accumulate_runs > 1:
    with graph.as_default(), tf.name_scope(None), tf.control_dependencies(None), \
        tf.device(worker.host):
      weights = tf.placeholder_with_default(tf.ones([pieces], tf.float64), [pieces],
                                            name="epl_row_weights")
  if n == 1:
    mirrored = {v.name: [v] for v in analysis.mirrored}
    sync_op = _build_sync(ctx, _synced(plan, mirrored)) if plan.worker_num > 1 else None
    return Replication([{}], sync_op, mirrored, weights)
  cloned = list(analysis.cloned)
  members = set(cloned)
  source_splits = []                              # (split op, source op) for shards > 1
  if k > 1:
    with graph.as_default(), tf.name_scope(None), tf.control_dependencies(None):
      for src in analysis.sources:
        for t in src.outputs:
          with tf.device(worker.host):
            pieces = tf.split(t, k, axis=0, name="epl_shard/%s_%d" % (src.name, t.value_index))
          rewire(t, pieces[0], members)
          source_splits.append((pieces[0].op, src))
    cloned += [s for s, _ in source_splits]
  copies = [{}]
  for c in range(1, n):
    r, j = divmod(c, k)
    input_map = {}
    ops = cloned
    if j > 0:       # the replica's batch pieces and split TaskGraphs come with its first copy
      skip = {s for s, _ in source_splits} | set(analysis.sources) | {
          op for op in analysis.split_ops if j % plan.stride(ctx.owner[op])}
      ops = [op for op in cloned if op not in skip]
      for split_op, _ in source_splits:
        replica_split = split_op if r == 0 else copies[r * k][split_op.name]
        input_map[split_op.outputs[0]] = replica_split.outputs[j]
    copies.append(clone_ops(graph, ops, "EPL_REPLICA_%d" % c, device_function(ctx, c),
                            input_map, ctx.nodes))
  wait_for_clones(analysis.singletons, copies[1:], members)   # run once, after every copy
  mirrored = {v.name: [v] + [copies[c][v.name] for c in range(1, n) if v.name in copies[c]]
              for v in analysis.mirrored}
  return Replication(copies, _build_sync(ctx, _synced(plan, mirrored)), mirrored, weights,
                     tuple(source_splits))


def _synced(plan, mirrored):
  """The mirrored variables the replica sync copies: not what ZeRO keeps once (optimizer
  slots; with v2 the trained variables too)."""
  if not plan.memory.zero:
    return mirrored
  trained = {g.variable for g in plan.gradients}
  partitioned = set(slots(mirrored, trained))
  if plan.memory.zero.partitions_weights:
    partitioned |= trained
  return {k: v for k, v in mirrored.items() if k not in partitioned}


def _read(var_op):
  if var_op.type == "VarHandleOp":
    from tensorflow.python.ops import resource_variable_ops
    return resource_variable_ops.read_variable_op(var_op.outputs[0], var_op.get_attr("dtype"))
  return tf.identity(var_op.outputs[0])


def _assign(var_op, value):
  if var_op.type == "VarHandleOp":
    from tensorflow.python.ops import resource_variable_ops
    return resource_variable_ops.assign_variable_op(var_op.outputs[0], value)
  return tf.assign(var_op.outputs[0], value, validate_shape=False).op


def _build_sync(ctx, mirrored):
  """One op that makes every copy's mirrored variables equal to worker 0's copy 0.

  Across workers the values travel in one broadcast per (TaskGraph, dtype); inside a worker
  copy 0's values are assigned to the other copies.
  """
  graph, plan, worker = ctx.graph, ctx.plan, ctx.worker
  groups = {}
  for name in sorted(mirrored):
    ops = mirrored[name]
    groups.setdefault((ctx.owner[ops[0]], ops[0].get_attr("dtype")), []).append(ops)
  assigns = []
  with graph.as_default(), tf.name_scope(None), tf.control_dependencies(None), \
      tf.name_scope("epl_sync_replicas"):
    for (tg, _), var_groups in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1].name)):
      device = var_groups[0][0].device or worker.device_of(0, tg)
      with tf.device(device):
        values = [_read(ops[0]) for ops in var_groups]
        if plan.worker_num > 1:
          values = _broadcast_from_worker0(ctx, tg, device, values)
          assigns += [v.op for v in values]         # the root must take part too
          if worker.client_group(tg)[1] != 0:
            assigns += [_assign(ops[0], v) for ops, v in zip(var_groups, values)]
      for ops, value in zip(var_groups, values):
        for copy_op in ops[1:]:
          with tf.device(copy_op.device):
            assigns.append(_assign(copy_op, value))
    return tf.group(*assigns, name="sync")


def _broadcast_from_worker0(ctx, tg, device, values):
  """Worker 0's values of one variable group, on every worker (one fused broadcast)."""
  group, me = ctx.worker.client_group(tg)               # copy 0 of each client worker
  flat = tf.concat([tf.reshape(v, [-1]) for v in values], axis=0)
  flat = ctx.collectives.broadcast(flat, group[me], group, root=0)
  sizes = [v.shape.num_elements() for v in values]
  return [tf.reshape(p, v.shape) for p, v in zip(tf.split(flat, sizes), values)]
