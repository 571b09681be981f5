"""``ParallelGraph`` (public as ``epl.Graph``): the rewritten graph, for the runtime and users."""
import dataclasses
from typing import Any, Dict

import tensorflow.compat.v1 as tf

from epl.plan.plan import PHASES, ParallelPlan


@dataclasses.dataclass
class ParallelGraph:
  """What the rewrite produced. ``format()`` prints it for a person."""
  plan: ParallelPlan
  graph: tf.Graph
  owner: Dict[Any, int] = dataclasses.field(default_factory=dict)
  phase: Dict[Any, str] = dataclasses.field(default_factory=dict)
  analysis: Any = None
  replication: Any = None
  sync_report: Any = None
  rewritten: bool = False
  collectives: Any = None      # the graph's Collectives: its keys are unique within the graph
  schedule: Any = None         # {(copy, stage): [(action, ops)]} when micro-batches are used

  @classmethod
  def get(cls):
    """The parallel graph of the graph ``epl.init`` was called for.

    Before the first step it shows the plan the annotations ask for; after it (or after
    ``MonitoredTrainingSession`` creation) it also shows the replicas epl built.
    """
    from epl.env import Env
    from epl.runtime import driver
    return driver.parallel_graph(Env.get().state())

  @property
  def num_copies(self):
    return self.plan.num_copies

  def taskgraph_ops(self, index, phase):
    return self.plan.taskgraphs[index].ops.get(phase, ())

  def format(self):
    """A readable description: TaskGraphs, devices, op counts per phase, replicas."""
    lines = [str(self.plan)]
    if self.plan.is_local:
      return lines[0]
    if not self.rewritten:
      lines.append("(not rewritten yet: epl rewrites before the first step)")
      return "\n".join(lines)
    a, rep = self.analysis, self.replication
    lines.append("Step: %d ops per model copy (%d mirrored variables), %d singleton op(s) "
                 "run once per step, %d data source(s) cloned per replica" % (
                     len(a.cloned), len(a.mirrored), len(a.singletons), len(a.sources)))
    if self.num_copies > 1:
      lines.append("Copies: 0 = your ops; 1..%d under EPL_REPLICA_<c>/" % (self.num_copies - 1))
      sync = self.sync_report
      lines.append("Gradient sync: %d variable(s) in %d all-reduce bucket(s)%s, %s" % (
          sum(len(b) for b in sync.buckets), len(sync.buckets),
          ", %d all-gathered (sparse)" % len(sync.gathered) if sync.gathered else "",
          self.plan.reduce_method))
    for t in self.plan.taskgraphs:
      counts = {p: t.op_count(p) for p in PHASES}
      lines.append("TaskGraph %d %r: forward %d, backward %d, apply %d ops; devices %s" % (
          t.index, t.name, counts["forward"], counts["backward"], counts["apply"],
          ", ".join(self.plan.devices[c][t.index][0] for c in range(self.num_copies))))
    return "\n".join(lines)

  def __str__(self):
    return self.format()
