"""Owners pass (``zero.level``): which copy owns each trained variable -- keeps and updates
its optimizer state (and with v2 the variable itself) -- computed once, before the gradient
sync (v1 sums a gradient at its owner) and the zero pass read it.

Per TaskGraph (a stage's devices) and part of a split one, largest variable first, each to
the lightest copy of the job. Deterministic: every worker finds the same. Across workers a
variable whose gradient is sparse (``tf.IndexedSlices``: an embedding read by ``tf.gather``)
has no owner: every copy keeps its slots and updates it, its gradient all-gathered as without
ZeRO (a sparse update reads rows its owner's copy alone would not have). Returns ``Owners``.
"""
import dataclasses
from typing import Dict, Tuple

from epl import _tf_compat as compat
from epl.op_tables import variable_size
from epl.passes.slots import owner_of, written


@dataclasses.dataclass(frozen=True)
class Owners:
  owners: Dict[str, int] = dataclasses.field(default_factory=dict)   # variable -> copy (job)
  updates: Dict[str, Tuple[str, ...]] = dataclasses.field(default_factory=dict)  # its apply ops

  def resolve(self, graph):
    """(owners, {variable: its update Operations (copy 0's)})."""
    get = graph.get_operation_by_name
    return dict(self.owners), {v: [get(n) for n in ops] for v, ops in self.updates.items()}

  def __str__(self):
    return "Owners(%d variables)" % len(self.owners)


def owners(ctx):
  """Runs the pass; see the module docstring."""
  if not ctx.plan.memory.zero.partitions_slots or len(ctx.plan.copies) < 2:
    return Owners()
  found, updates = assign_owners(ctx)
  return Owners(found, {v: tuple(op.name for op in ops) for v, ops in updates.items()})


def assign_owners(ctx):
  """({trained variable: owner copy, job-wide}, {trained variable: its update ops (copy 0)})."""
  graph, job = ctx.graph, ctx.plan.copies
  get = graph.get_operation_by_name
  trained = sorted({g.variable for g in ctx.plan.gradients})
  step = ctx.result("analyze").cloned_set
  apply_ops = [op for op, phase in ctx.phase.items() if phase == "apply" and op in step]
  updates = {}
  for op in sorted(apply_ops, key=compat.op_id):
    var = written(op)
    if var is not None and owner_of(var.name, trained) is not None:
      updates.setdefault(owner_of(var.name, trained), []).append(op)
  for name in sparse_across_workers(ctx.plan):
    updates.pop(name, None)
  loads, owners = {}, {}
  for name in sorted(updates, key=lambda v: (-variable_size(get(v)), v)):
    # per device of the stage: a split TaskGraph's parts each balance their own variables
    # (only copies that run the stage: a stage on fewer devices runs in some of them)
    tg = ctx.owner.get(get(name))
    stage = loads.setdefault((tg, ctx.plan.part_of(name)), [
        0 if tg is None or ctx.plan.runs_in(copy, tg) else float("inf") for copy in job])
    k = stage.index(min(stage))
    owners[name] = k
    stage[k] += variable_size(get(name))
  return owners, updates


def sparse_across_workers(plan):
  """The trained variables ZeRO leaves unowned: those with a sparse gradient (no
  ``communication.sparse_as_dense``) in a job of several workers."""
  if len(plan.clients) < 2 or plan.communication.sparse_as_dense:
    return []
  return sorted({g.variable for g in plan.gradients if g.sparse})


