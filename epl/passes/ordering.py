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

An edge that the graph's order does not already imply is added as a control input of the
write. A write that a read depends on (through other ops) keeps that order, and the pass never
makes a cycle: candidate edges against a topological order of the step (writes as late as
possible) are either forward, or checked for a path from the write to the read first; a cycle
left by two such edges together is an internal error naming them.

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
  backward: int = 0              # of those, edges against the first topological order

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
  seen, work = set(), list(ends)
  while work:
    op = work.pop()
    if op in seen:
      continue
    seen.add(op)
    work.extend(t.op for t in op.inputs)
    work.extend(op.control_inputs)
  return seen


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


def _order(step, is_write):
  """{op: index} a topological order of ``step`` (edges inside it) in which every write
  comes as late as it can: a read that does not follow a write then comes before it."""
  pending = {op: 0 for op in step}
  users = {}
  for op in step:
    for x in [t.op for t in op.inputs] + list(op.control_inputs):
      if x in step and x.type not in _BACK_EDGES:    # a while loop's edge back to its Merge
        pending[op] += 1
        users.setdefault(x, []).append(op)
  ready = collections.deque(op for op, n in pending.items() if n == 0 and not is_write(op))
  late = collections.deque(op for op, n in pending.items() if n == 0 and is_write(op))
  index = {}
  while ready or late:
    op = ready.popleft() if ready else late.popleft()
    index[op] = len(index)
    for u in users.get(op, ()):
      pending[u] -= 1
      if pending[u] == 0:
        (late if is_write(u) else ready).append(u)
  return index


def _reaches(src, dst, index, step):
  """True if a path of data / control edges inside ``step`` leads from ``src`` to ``dst``
  (only ops ordered before ``dst`` can be on it)."""
  limit, seen, work = index[dst], set(), [src]
  while work:
    op = work.pop()
    if op is dst:
      return True
    if op in seen:
      continue
    seen.add(op)
    for u in [c for t in op.outputs for c in t.consumers()] + compat.control_outputs(op):
      if u in step and index.get(u, limit + 1) <= limit:
        work.append(u)
  return False


def missing_edges(steps):
  """[(read, write)] of each step in ``steps`` (sets of ops) whose write the graph does not
  already order after the read, and the step's order {op: index} for each pair."""
  out = []
  for step in steps:
    writes = collections.defaultdict(list)
    for op in step:
      for var in writes_of(op):
        writes[var].append(op)
    if not writes:
      continue
    is_write = {op for ops in writes.values() for op in ops}.__contains__
    index = _order(step, is_write)
    for var in sorted(writes, key=lambda v: v.name):
      ws = writes[var]
      reads = [r for r in readers_of(var) if r in step and r not in ws and
               r.type not in _CONTROL_FLOW and not compat.in_control_flow(r)]
      for w in ws:
        if compat.in_control_flow(w):
          continue
        direct = {t.op for t in w.inputs} | set(w.control_inputs)
        for r in reads:
          if r in direct:
            continue
          if index[r] > index[w] and _reaches(w, r, index, step):
            continue                                   # it means to read the new value
          out.append((r, w, index))
  return out


def writes_after_reads(ctx):
  """Runs the pass; see the module docstring."""
  analysis = ctx.result("analyze")
  steps = [step_ops(ends) for ends in analysis.train_ends]
  shared = ctx.plan.shared_variables
  kinds = collections.Counter()
  for op in set().union(*steps) if steps else ():
    for var in writes_of(op):
      kinds[_kind(op, var, shared)] += 1
  pairs = missing_edges(steps)
  added = collections.defaultdict(list)
  backward = 0
  for r, w, index in pairs:
    if r not in added[w]:
      added[w].append(r)
      backward += index[r] > index[w]
  for w, readers in added.items():
    compat.add_control_inputs(w, sorted(readers, key=lambda o: o.name))
  if backward:
    _check_acyclic(steps, added)
  return Ordering(dict(kinds), sum(len(r) for r in added.values()), backward)


def _check_acyclic(steps, added):
  for step in steps:
    index = _order(step, lambda op: False)
    if len(index) < len(step):
      stuck = sorted((op for op in step if op not in index), key=lambda o: o.name)
      pairs = [(r.name, w.name) for w, rs in added.items() if w in stuck for r in rs
               if r in stuck]
      raise EplError(
          "epl could not order the step's writes after their reads without a cycle: %s "
          "(read, write). Please report this graph." % pairs[:4])


def verify(graph, train_ends):
  """[(read name, write name)]: the reads of a variable in a training step (ops the ends
  ``train_ends``, op names or ops, depend on) that the graph does not order before a write
  of that variable in the step. Empty when the invariant holds."""
  get = lambda x: graph.get_operation_by_name(x) if isinstance(x, str) else x   # noqa: E731
  steps = [step_ops([get(e) for e in ends]) for ends in train_ends]
  return [(r.name, w.name) for r, w, _ in missing_edges(steps)]
