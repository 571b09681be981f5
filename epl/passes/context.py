"""What every pass receives: one ``RewriteContext``.

It holds the graph, the frozen plan, this worker's view of it, the collectives builder, the
serialised-node cache, and the frozen results of the passes that ran before (by pass name).
A pass reads only these; it never reads global state.
"""
import dataclasses
import functools
import types
from typing import Any, Dict, Mapping

import tensorflow.compat.v1 as tf

from epl.collectives import Collectives
from epl.passes.clone import NodeDefCache
from epl.plan.plan import ParallelPlan, WorkerView


@dataclasses.dataclass(frozen=True)
class RewriteContext:
  graph: tf.Graph
  plan: ParallelPlan
  worker: WorkerView
  collectives: Collectives
  nodes: NodeDefCache
  results: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @classmethod
  def create(cls, graph, plan, worker_index):
    return cls(graph, plan, plan.for_worker(worker_index), Collectives(on_gpu=plan.has_gpu),
               NodeDefCache(graph))

  def with_result(self, name, value):
    results = dict(self.results)
    results[name] = value
    return dataclasses.replace(self, results=types.MappingProxyType(results))

  def result(self, name):
    assert name in self.results, "pass %r has not run before this one" % name
    return self.results[name]

  @functools.cached_property
  def owner(self) -> Dict[tf.Operation, int]:
    """{op: TaskGraph index} for the ops the plan attributes (the user's graph)."""
    get = self.graph.get_operation_by_name
    return {get(name): tg for name, (tg, _) in self.plan.op_index.items()}

  @functools.cached_property
  def phase(self) -> Dict[tf.Operation, str]:
    get = self.graph.get_operation_by_name
    return {get(name): phase for name, (_, phase) in self.plan.op_index.items()}

  def clones(self):
    """The Clones of the passes that ran (replicate, and micro_batch when it ran)."""
    micro = self.results.get("micro_batch")
    return Clones(self.result("replicate").copies, micro.clones if micro else {},
                  self.plan.num_micro_batch, micro.calls if micro else None)


class Clones:
  """Where each original op lives in copy ``c`` and micro-batch ``m``.

  Copy 0, micro-batch 0 is the user's own op; ``None`` when the op is not cloned there.
  With stage functions (``calls``), a tensor a stage's call returns is that call's result in
  every (copy, micro-batch), micro-batch 0 included; the other ops of a stage's body have no
  op in any micro-batch but the user's own (copy-level: ``original``).
  """

  def __init__(self, copies, micro, num_micro_batch, calls=None):
    self._copies = copies          # [{original op name: op}] per copy (copy 0: {})
    self._micro = micro            # {(copy, m >= 1): {original op name: op}}
    self.num_micro_batch = num_micro_batch
    self.calls = calls             # stage_functions.StageCalls or None
    self._exported = calls.exported if calls is not None else {}

  @property
  def num_copies(self):
    return len(self._copies)

  def op(self, copy, original, micro_batch=0):
    if micro_batch:
      return self._micro[(copy, micro_batch)].get(original.name)
    return original if copy == 0 else self._copies[copy].get(original.name)

  def tensor(self, copy, original, micro_batch=0):
    if self._exported:
      made = self._exported[(copy, micro_batch)].get(original.name)
      if made is not None:
        return made
    return self.original(copy, original, micro_batch)

  def original(self, copy, original, micro_batch=0):
    """``tensor`` without the calls' results: the copy's own op's output."""
    op = self.op(copy, original.op, micro_batch)
    return None if op is None else op.outputs[original.value_index]

  def in_body(self, op):
    """True for an op of the user's graph that runs inside a stage function's body."""
    return self.calls is not None and op.name in self.calls.body_ops

  def every(self, original):
    """The tensor ``original`` in every (copy, micro-batch), copy-major; None if missing."""
    return [self.tensor(c, original, m) for c in range(self.num_copies)
            for m in range(self.num_micro_batch)]
