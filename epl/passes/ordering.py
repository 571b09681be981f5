"""writes_after_reads: the one ordering invariant of a training step, enforced once, after
every other pass.

**Invariant.** In a training step, every write of a variable's storage runs after every read
of that storage in the same step -- across model copies, pipeline stages and micro-batches,
and through every alias of the read (``op_tables.buffer_readers``: Identity, Reshape,
StopGradient, slices, ...; a resource variable's ``ReadVariableOp`` and ``ResourceGather``) --
except the reads that come after the write by the graph's own edges (they mean to see the new
value: ZeRO's copy of the owner's updated weight, an ``ExponentialMovingAverage`` applied after
the update). A ref variable's read is its buffer: a reader that ran after an update saw the
next step's weights, and which one did changed from run to run.

The step is derived from the graph, not from what each pass says it did: the ops the train
ops (``StepAnalysis.train_ends``, the ends downstream of the user's updates) depend on, as
they are once every pass has run. Its writes are every op in it that changes a variable
(``op_tables.mutates`` with a variable among its inputs: every input, Adam's ``m`` and ``v``
too), whichever pass built it. ``WRITE_KINDS`` names them for the report and the docs:

  apply       the optimizer's update of a weight or a slot (dense and sparse, each copy's)
  zero        ZeRO: a copy's weight set from its owner's updated value, or from the owner
              worker's broadcast (v0 / v1); v2's one update per weight (an ``apply``)
  sums        gradient accumulation as session runs: a run's gradient added into its sum, the
              sums zeroed after the update
  shared      a shared variable's one write (``global_step += 1``; its reads are made to see
              one value by ``step_reads``)
  user        the script's own assigns in the step: batch norm's moving averages,
              ``ExponentialMovingAverage``, AMP's loss scale, hand-written optimizers

An edge is added as a control input of the write unless the read already feeds it directly
or runs after a write of its variable by the step's own edges (then it means to read the
new value). Such edges never close a cycle on their own; two together can only through a
read that runs after some other write (a batch norm's moving average updated in the
forward pass, the train op under ``control_dependencies`` of it; two writes that read each
other's variable): what runs after the writes that got an edge is sorted topologically, and
a cycle is an internal error naming the edges.

``verify(graph, train_ends)`` lists the (read, write) pairs of a graph that break the
invariant, and the race amplifier (``testing.race_delay_ms``, passes/race_delay.py, the pass
before this one) makes every read this pass orders start late, so that an edge missing or
lost turns into a wrong result in almost every run.

Expects: every other pass run (the race amplifier's delays included). Adds: control edges read -> write. Returns ``Ordering``.
"""
import collections
import dataclasses
from typing import Mapping

from epl import _tf_compat as compat
from epl.errors import EplError
from epl.op_tables import READ_OPS, VARIABLE_OPS, buffer_readers, mutates
from epl.passes.slots import ancestors

WRITE_KINDS = ("apply", "zero", "sums", "shared", "user")
# a read inside a tf.while_loop / tf.cond enters it through these; a write outside cannot
# wait for an op of another frame (TF: "has inputs from different frames")
_CONTROL_FLOW = frozenset({"Enter", "RefEnter", "Switch", "RefSwitch", "Merge", "RefMerge",
                           "Exit", "RefExit", "NextIteration", "RefNextIteration", "LoopCond"})
_BACK_EDGES = frozenset({"NextIteration", "RefNextIteration"})
_CHECKS = frozenset({"IsVariableInitialized", "VarIsInitializedOp"})


@dataclasses.dataclass(frozen=True)
class Ordering:
  writes: Mapping[str, int]      # write kind -> writes of that kind in the steps
  edges: int                     # read -> write edges added

  def __str__(self):
    kinds = ", ".join("%s %d" % (k, self.writes[k]) for k in WRITE_KINDS if self.writes.get(k))
    return "Ordering(%d write(s) after every read of their variable in the step [%s]; %d " \
        "edge(s) added)" % (sum(self.writes.values()), kinds or "none", self.edges)


def writes_of(op):
  """The variable ops whose storage ``op`` writes (every variable input of a mutating op:
  ``ApplyAdam`` writes the weight, ``m`` and ``v``), else ()."""
  if not mutates(op):
    return ()
  return tuple(dict.fromkeys(t.op for t in op.inputs if t.op.type in VARIABLE_OPS))


def readers_of(var):
  """Every op that reads ``var``'s storage: the consumers of its reads and of whatever hands
  a read's buffer on (``buffer_readers``), and the non-writing ops that take the variable
  itself (``ResourceGather``, a ref consumed directly)."""
  out = []
  for consumer in var.outputs[0].consumers():
    if consumer.type in _CHECKS:
      continue
    if consumer.type in READ_OPS:
      out.append(consumer)
      out.extend(op for op, _ in buffer_readers(consumer.outputs[0]))
    elif var not in writes_of(consumer):
      out.append(consumer)
  return list(dict.fromkeys(out))


def step_ops(ends):
  """Every op the ops ``ends`` depend on (data and control edges), ``ends`` included."""
  return ancestors(ends)


class Step:
  """A training step: the ops its ends depend on, each with the ops it waits for (data and
  control inputs; read once: TF builds the list on every access), and its writes by
  variable -- found from the variables' consumers, not by asking every op."""

  def __init__(self, ends):
    self.inputs = {}
    work = list(ends)
    while work:
      op = work.pop()
      if op in self.inputs:
        continue
      ins = [t.op for t in op.inputs]
      ins.extend(op.control_inputs)
      self.inputs[op] = ins
      work.extend(ins)
    self.writes = {}
    for var in (op for op in self.inputs if op.type in VARIABLE_OPS):
      ws = [c for c in var.outputs[0].consumers() if c in self.inputs and var in writes_of(c)]
      if ws:
        self.writes[var] = ws

  def __contains__(self, op):
    return op in self.inputs

  def after(self, ops):
    """The ops of the step that run after ``ops`` by its edges (``ops`` included)."""
    return compat.downstream(ops, within=self.inputs)


def _kind(op, var, shared):
  if var.name in shared:
    return "shared"
  name = op.name
  if "epl_zero" in name.split("/"):
    return "zero"
  if name.startswith("epl_") and "sum" in name:
    return "sums"
  return "apply" if op.type.startswith(("Apply", "ResourceApply", "SparseApply",
                                        "ResourceSparseApply")) else "user"


def missing_edges(steps):
  """[(read, write)] of each step in ``steps`` (``Step``s) whose write the graph does not
  already order after the read. A read after any write of its variable (by the step's own
  edges) means to see the written value: it is never moved before another write of it."""
  out = []
  for step in steps:
    for var in sorted(step.writes, key=lambda v: v.name):
      ws = step.writes[var]
      reads = [r for r in readers_of(var) if r in step and r not in ws and
               r.type not in _CONTROL_FLOW and not compat.in_control_flow(r)]
      if not reads:
        continue
      after = step.after(ws)
      for w in ws:
        if compat.in_control_flow(w):
          continue
        direct = set(step.inputs[w])
        out.extend((r, w) for r in reads if r not in direct and r not in after)
  return out


def writes_after_reads(ctx):
  """Runs the pass; see the module docstring."""
  analysis = ctx.result("analyze")
  steps = [Step(ends) for ends in analysis.train_ends]
  shared = ctx.plan.shared_variables
  kinds = collections.Counter(_kind(w, var, shared) for var, ws in dict(
      kv for step in steps for kv in step.writes.items()).items() for w in ws)
  added = collections.defaultdict(list)
  for r, w in missing_edges(steps):
    if r not in added[w]:
      added[w].append(r)
  for w, readers in added.items():
    compat.add_control_inputs(w, sorted(readers, key=lambda o: o.name))
  _check_acyclic(steps, added)
  return Ordering(dict(kinds), sum(len(r) for r in added.values()))


def _check_acyclic(steps, added):
  """Raises if the edges ``added`` ({write: reads}) closed a cycle. Every op of such a cycle
  runs after one of the writes that got an edge, so only that region (small: the writes end
  the step) is sorted."""
  region = set().union(*(step.after(added) for step in steps)) if added else set()
  preds = {op: [x for x in [t.op for t in op.inputs] + list(op.control_inputs)
                if x in region and x.type not in _BACK_EDGES] for op in region}
  pending = {op: len(p) for op, p in preds.items()}
  users = {}
  for op, p in preds.items():
    for x in p:
      users.setdefault(x, []).append(op)
  ready = [op for op, n in pending.items() if n == 0]
  while ready:
    for u in users.get(ready.pop(), ()):
      pending[u] -= 1
      if pending[u] == 0:
        ready.append(u)
  stuck = {op for op, n in pending.items() if n > 0}
  if stuck:
    pairs = sorted((r.name, w.name) for w, rs in added.items() if w in stuck for r in rs
                   if r in stuck)
    raise EplError(
        "epl could not order the step's writes after their reads without a cycle: %s "
        "(read, write). Please report this graph." % pairs[:4])


def verify(graph, train_ends):
  """[(read name, write name)]: the reads of a variable in a training step (ops the ends
  ``train_ends``, op names or ops, depend on) that the graph does not order before a write
  of that variable in the step. Empty when the invariant holds."""
  get = lambda x: graph.get_operation_by_name(x) if isinstance(x, str) else x   # noqa: E731
  steps = [Step([get(e) for e in ends]) for ends in train_ends]
  return [(r.name, w.name) for r, w in missing_edges(steps)]
