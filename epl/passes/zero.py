"""ZeRO pass (``zero.level``): each data-parallel copy keeps and updates the optimizer state
(v0), and also the weights (v2), of its share of the variables only.

Expects: the replicate clones (the copies' variables; ``replicate`` leaves the slots out of
the replica sync), the synchronised gradients (``gradient_sync``) and the plan's apply phase.
For each TaskGraph, its trained variables are given owners among the worker's copies,
balanced by size within the TaskGraph (largest first, each to the lightest copy). For a
variable v owned by copy j:

* v's optimizer slots (``<v>/Momentum``, Adam's ``m`` / ``v``, a hand-written ``<v>/adam_m``)
  exist once: the user's slot variables, placed on copy j's device. Copy j's update reads and
  writes them; the other copies' slot clones are never initialised nor read (no memory).
  Checkpoints keep saving and restoring the user's slot variables: a checkpoint is the same as
  without ZeRO;
* only copy j runs v's update (on the all-reduced gradient, as before); every other copy c
  instead copies the updated value, ``v_c := v_j``, once copy j's update ran -- it waits for
  that where it waited for its own update (the optimizer's finish op, ``global_step``).

The optimizer's per-step bookkeeping that is not a slot (Adam's beta powers) stays per copy.

v2 (ZeRO stage 3 inside one worker): the trained variable itself exists once too. The user's
variable, its slots and copy 0's update of it move to the owner's device; every copy and
micro-batch reads the weight through copy 0's read of it, so TF sends the weight to each device
that uses it in the step (gathered just in time) and no device holds another's weights between
steps. The other copies' variable clones are never initialised, and their updates never run
(what waited for them waits for the one update). Checkpoints are the local script's.
Across workers the owner's worker broadcasts the weights it owns at the start of each step,
the other workers' copies read the received values, and a step ends once every worker's
updates ran (zero_v2.py). Returns ``Zero``.
"""
import dataclasses
from typing import Dict, Tuple

import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl.op_tables import VARIABLE_OPS
from epl.plan.plan import ZeroLevel
from epl.passes.slots import slots
from epl.passes.zero_v2 import (CHECKPOINT_OPS, bucket, data_chain, partition_across,
                                partition_weights, read_var, replace_update)


@dataclasses.dataclass(frozen=True)
class Zero:
  owners: Dict[str, int] = dataclasses.field(default_factory=dict)  # variable -> owner copy
  slots: Tuple[str, ...] = ()                                       # partitioned slots
  level: ZeroLevel = ZeroLevel.OFF

  def __str__(self):
    return "Zero(%s: %d variables over their owners, %d slots partitioned%s)" % (
        self.level, len(self.owners), len(self.slots),
        ", weights too" if self.level.partitions_weights else "")


def _assign(var_op, value):
  if var_op.type == "VarHandleOp":
    return tf.raw_ops.AssignVariableOp(resource=var_op.outputs[0], value=value)
  return tf.assign(var_op.outputs[0], value).op


def _stand_in(graph, slot, device):
  """A variable like ``slot`` on ``device`` that nothing initialises (it holds no memory)."""
  dtype = tf.as_dtype(slot.get_attr("dtype"))
  shape = slot.get_attr("shape")
  with graph.as_default(), tf.name_scope(None), tf.control_dependencies(None), \
      tf.device(device), tf.name_scope("epl_zero/unused"):
    if slot.type == "VarHandleOp":
      return tf.raw_ops.VarHandleOp(dtype=dtype, shape=shape,
                                    shared_name="epl_zero/unused/" + slot.name).op
    return tf.raw_ops.VariableV2(shape=shape, dtype=dtype.base_dtype).op


def zero(ctx):
  """Runs the pass; see the module docstring."""
  level = ctx.plan.memory.zero
  if not level.partitions_slots:
    return Zero()
  graph, worker, plan = ctx.graph, ctx.worker, ctx.plan
  job = plan.copies
  if len(job) < 2:
    return Zero()
  local = {k: sum(1 for other in job[:k] if other.client == copy.client)
           for k, copy in enumerate(job)}      # a job-wide copy -> its index on its worker
  get = graph.get_operation_by_name
  mirrored = ctx.result("replicate").mirrored
  partitioned = slots(mirrored, sorted({g.variable for g in plan.gradients}))
  owners, updates = ctx.result("owners").resolve(graph)
  colocated = {}
  for op in graph.get_operations():
    for group in op.colocation_groups():
      colocated.setdefault(group.decode()[len("loc:@"):], []).append(op)
  if level.partitions_weights:
    if len(plan.clients) > 1:
      partition_across(ctx, owners, updates, partitioned, colocated, local)
    else:
      partition_weights(ctx, owners, updates, partitioned, colocated)
    return Zero(owners, tuple(sorted(partitioned)), level)
  buckets = {}                    # (TaskGraph, dtype, owner worker) -> variables
  for name, k in owners.items():
    tg = ctx.owner.get(get(name))
    here = job[k].client == worker.index
    j = local[k] if here else None
    device = ctx.clones().op(j, get(name)).device if here else \
        job[k].devices[tg][plan.part_of(name)]
    for slot in (s for s, v in partitioned.items() if v == name):
      _move_slot(ctx, get(slot), get(name), j, device, updates[name], colocated.get(slot, []),
                 mirrored)
    if len(plan.clients) > 1:
      dtype = tf.as_dtype(get(name).get_attr("dtype")).base_dtype.name
      buckets.setdefault((tg, dtype, job[k].client), []).append(name)
    if here:
      _copy_from_owner(ctx, name, j, updates[name])
  for key in sorted(buckets):
    _broadcast_bucket(ctx, key, sorted(buckets[key]), owners, local, updates)
  return Zero(owners, tuple(sorted(partitioned)), level)


def _move_slot(ctx, user, variable, j, device, updates, colocated, mirrored):
  """The user's slot ``user`` of ``variable``, owned by this worker's copy ``j`` (None: another
  worker's) goes to the owner's ``device``; the owner's update reads it."""
  graph = ctx.graph
  if j != 0:
    # copy 0's own (never run) update must stay placeable next to copy 0's variable:
    # it gets a stand-in slot that is never initialised
    dead = [op for op in updates if any(t.op is user for t in op.inputs)]
    if dead:
      stand_in = _stand_in(graph, user, dead[0].device or variable.device)
      for op in dead:
        for i, t in enumerate(op.inputs):
          if t.op is user:
            compat.update_input(op, i, stand_in.outputs[0])
  # the user's slot lives on the owner's device -- another worker's when the owner is
  # there: every worker's graph then names the one slot (TF finds it by name on that
  # task), so the chief's checkpoint saves, and every restore sets, the owner's state
  for op in [user] + list(user.outputs[0].consumers()) + colocated:
    if not op.type.startswith(CHECKPOINT_OPS):     # the Saver's ops stay on the host
      compat.set_device(op, device)
  if j:                                      # the owner's ops use the user's slot
    clone = ctx.clones().op(j, user)      # (mirrored lists only the copies that have it)
    for consumer in list(clone.outputs[0].consumers()):
      for i, t in enumerate(consumer.inputs):
        if t is clone.outputs[0]:
          compat.update_input(consumer, i, user.outputs[0])


def _copy_from_owner(ctx, name, j, updates):
  """Every other copy of variable ``name`` on this worker takes the value its owner, copy
  ``j``, updated (after the owner's update)."""
  graph, clones = ctx.graph, ctx.clones()
  variable = graph.get_operation_by_name(name)
  owner_var = clones.op(j, variable)
  owner_updates = [clones.op(j, op) for op in updates]
  for c in range(ctx.worker.num_copies):
    var_c = clones.op(c, variable)
    if c == j or var_c is None:        # (a stage on fewer devices has no copy in c)
      continue
    with graph.as_default(), tf.name_scope(None), tf.device(var_c.device), \
        tf.control_dependencies(owner_updates), tf.name_scope("epl_zero"):
      copied = _assign(var_c, read_var(owner_var))
    replace_update(name, [clones.op(c, op) for op in updates], copied, live=(var_c,))


def _broadcast_bucket(ctx, key, names, owners, local, updates):
  """Across workers: the variables one worker owns (of one TaskGraph and dtype), updated,
  broadcast from it in one fused collective; every other worker assigns them to its copies."""
  graph, worker, clones = ctx.graph, ctx.worker, ctx.clones()
  get = graph.get_operation_by_name
  tg, _, sender = key
  group, me, root, shapes, sizes = bucket(ctx, key, names)
  dtype = tf.as_dtype(get(names[0]).get_attr("dtype")).base_dtype
  with graph.as_default(), tf.name_scope(None), tf.control_dependencies(None), \
      tf.device(group[me]), tf.name_scope("epl_zero"):
    if worker.index == sender:
      owner_updates = [clones.op(local[owners[v]], op) for v in names for op in updates[v]]
      chain = data_chain(owner_updates)         # a sparse update's own steps wait inside it
      waiters = {w for u in owner_updates for w in compat.control_outputs(u)} - chain
      with tf.control_dependencies(owner_updates):
        flat = tf.concat([tf.reshape(read_var(clones.op(local[owners[v]], get(v))), [-1])
                          for v in names], axis=0)
      sent = ctx.collectives.broadcast(flat, group[me], group, root)
      for waiter in waiters:                     # the step sends them
        compat.add_control_inputs(waiter, [sent.op])
      return
    # start receiving once this worker's gradients for them are reduced (what its own
    # update would have read): a receive launched at the start of the step waits for the
    # sender's update while TF resolves collective instances, and the step stalls
    # (not what a sparse update chain computes from the slots: it never runs here)
    chain = data_chain([op for v in names for op in updates[v]])
    ready = [t.op for v in names for op in updates[v] for t in op.inputs
             if t.op.type not in VARIABLE_OPS and t.op not in chain and
             not any(i.op.type in VARIABLE_OPS for i in t.op.inputs)]
    exchanged = ctx.result("gradient_sync").exchanged.get((tg, key[1]))
    if exchanged is not None:         # v1: this worker's share of the reduce-scatter is done
      ready.append(exchanged)
    with tf.control_dependencies(ready):
      received = ctx.collectives.broadcast(tf.zeros([sum(sizes)], dtype), group[me], group,
                                           root)
    pieces = tf.split(received, sizes) if len(names) > 1 else [received]
  for v, piece, shape in zip(names, pieces, shapes):
    for c in range(worker.num_copies):
      var_c = clones.op(c, get(v))
      if var_c is None:                # (a stage on fewer devices has no copy in c)
        continue
      with graph.as_default(), tf.name_scope(None), tf.control_dependencies(None), \
          tf.device(var_c.device), tf.name_scope("epl_zero"):
        copied = _assign(var_c, tf.reshape(piece, shape))
      replace_update(v, [clones.op(c, op) for op in updates[v]], copied, live=(var_c,))

