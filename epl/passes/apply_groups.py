"""Grouped apply pass (``optimizer.num_apply_group: g``): the optimizer's update runs in g
sequential groups, so the temporaries of only one group are alive at a time.

Expects: the plan's gradients (the trained variables) and apply phase, and the clones.
For each TaskGraph, its trained variables are split into g groups balanced by size (largest
first, each to the lightest group); a variable's *unit* is every apply-phase write of the
variable or of its slots (a variable named ``<var>/...`` written in the apply phase: Adam's
``m`` and ``v``, BERT's ``adam_m``) and the apply-phase ops that only feed those writes. In
every model copy, the first ops of group k wait (a control dependency on one ``NoOp`` per
group) until every write of group k-1 has run. Ops that feed several groups (a learning-rate
schedule, a global norm) and the optimizer's once-per-step bookkeeping (Adam's beta powers,
``global_step``, which already wait for every update) are left as they are. With ZeRO
(zero.level) a copy's groups hold only the updates it runs: v1, the variables it owns (the
others it copies from their owners); v2, copy 0's updates of the variables it owns, which
ran on its device. Returns ``ApplyGroups``.
"""
import dataclasses
from typing import Tuple

import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl.op_tables import variable_size
from epl.passes.slots import ancestors, owner_of, written


@dataclasses.dataclass(frozen=True)
class ApplyGroups:
  groups: Tuple[Tuple[Tuple[str, ...], ...], ...] = ()  # per TaskGraph: variables per group
  barriers: int = 0                                     # NoOps built (all copies)

  def __str__(self):
    return "ApplyGroups(%s)" % "; ".join(
        " | ".join(",".join(g) for g in groups) for groups in self.groups)


def _balance(sizes, g):
  """Variables (name -> size) into at most g groups: largest first, each to the lightest."""
  groups, loads = [[] for _ in range(g)], [0] * g
  for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
    i = loads.index(min(loads))
    groups[i].append(name)
    loads[i] += sizes[name]
  return [sorted(grp) for grp in groups if grp]


def apply_groups(ctx):
  """Runs the pass; see the module docstring."""
  g = ctx.plan.memory.num_apply_group
  if g <= 1:
    return ApplyGroups()
  graph, clones, lane = ctx.graph, ctx.clones(), _Lanes(ctx)
  get = graph.get_operation_by_name
  trained = {gr.variable for gr in ctx.plan.gradients}
  initialisers = {v.initializer for key in (tf.GraphKeys.GLOBAL_VARIABLES,
                                            tf.GraphKeys.LOCAL_VARIABLES)
                  for v in graph.get_collection(key)}      # built with the slots: not the step
  applied = [op for op, phase in ctx.phase.items()
             if phase == "apply" and op not in initialisers]
  plan_groups, barriers = [], 0
  for tg in sorted({ctx.owner[get(v)] for v in trained}):
    members = {op for op in applied if ctx.owner.get(op) == tg}
    writes = {}                                   # trained variable -> its unit's writes
    for op in members:
      var = written(op)
      owner = owner_of(var.name, trained) if var is not None else None
      if owner is not None and ctx.owner.get(get(owner)) == tg:
        writes.setdefault(owner, []).append(op)
    groups = _balance({v: variable_size(get(v)) for v in writes}, g)
    if len(groups) < 2:
      plan_groups.append(tuple(tuple(grp) for grp in groups))
      continue
    reach = [ancestors([w for v in grp for w in writes[v]], members) for grp in groups]
    units = []
    for k, ops in enumerate(reach):
      others = set().union(*(r for j, r in enumerate(reach) if j != k))
      # constants and other input-less ops stay out: a control input on them is not work
      # (and TF's graph optimiser may merge them with constants the initialisers use)
      units.append({op for op in ops - others if op.inputs or op.control_inputs})
    for c in range(ctx.worker.num_copies):
      if any(clones.op(c, w) is None for ws in writes.values() for w in ws):
        continue                                   # the TaskGraph has no copy here
      chain = [_lane(unit, [w for v in grp if lane.updates(c, v) for w in writes[v]])
               for unit, grp in zip(units, groups)]
      chain = [(roots, ws) for roots, ws in chain if ws]
      for k in range(1, len(chain)):
        previous = [lane.op(c, w) for w in chain[k - 1][1]]
        with graph.as_default(), tf.name_scope(None), tf.device(previous[0].device), \
            tf.control_dependencies(previous):
          barrier = tf.no_op(name="epl_apply_group_%d" % k)
        barriers += 1
        for root in chain[k][0]:
          compat.add_control_inputs(lane.op(c, root), [barrier])
    plan_groups.append(tuple(tuple(grp) for grp in groups))
  return ApplyGroups(tuple(plan_groups), barriers)


def _lane(unit, lane_writes):
  """(the roots of ``unit``'s ops that feed ``lane_writes``, those writes)."""
  mine = ancestors(lane_writes, unit)
  roots = [op for op in mine if not compat.in_control_flow(op) and
           not any(t.op in mine for t in op.inputs) and
           not any(c in mine for c in op.control_inputs)]
  return roots, lane_writes


class _Lanes:
  """Which updates run in this worker's copy ``c`` (a *lane*: its groups run in sequence).
  Without ZeRO every copy updates every variable (its own clone). With zero.level v1 only the
  owner copy runs a variable's update (the others copy its value); with v2 copy 0's update
  runs, moved to the owner copy's device: the owner's lane."""

  def __init__(self, ctx):
    self.clones, self.v2 = ctx.clones(), ctx.plan.memory.zero.partitions_weights
    self.owner = {}
    if ctx.plan.memory.zero.partitions_slots and len(ctx.plan.copies) > 1:
      found, _ = ctx.result("owners").resolve(ctx.graph)
      job, me = ctx.plan.copies, ctx.worker.index
      local = {k: sum(1 for other in job[:k] if other.client == copy.client)
               for k, copy in enumerate(job)}
      self.owner = {v: local[k] if job[k].client == me else None for v, k in found.items()}

  def updates(self, c, variable):
    return not self.owner or self.owner.get(variable) == c

  def op(self, c, op):
    return op if self.owner and self.v2 else self.clones.op(c, op)
