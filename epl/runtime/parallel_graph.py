"""``ParallelGraph`` (what ``epl.Graph.get()`` returns): the rewritten graph, for the runtime
and for users."""
import dataclasses
from typing import Any, Mapping

import tensorflow.compat.v1 as tf

from epl.cluster import worker_of
from epl.passes.context import Clones
from epl.plan.gather import size_text
from epl.plan.plan import PHASES, ParallelPlan, WorkerView


@dataclasses.dataclass(frozen=True)
class ParallelGraph:
  """The plan, this worker's view of it and, once rewritten, every pass's result by name.
  ``format()`` prints it for a person."""
  plan: ParallelPlan
  graph: tf.Graph
  worker: WorkerView
  results: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  rewritten: bool = False
  collectives: Any = None      # the graph's Collectives: its keys are unique within the graph

  @property
  def num_copies(self):
    return self.worker.num_copies

  @property
  def analysis(self):
    return self.results.get("analyze")

  @property
  def replication(self):
    return self.results.get("replicate")

  @property
  def sync_report(self):
    return self.results.get("gradient_sync")

  @property
  def schedule(self):
    """{(copy, stage): [(action, ops)]} when micro-batches are used."""
    placed = self.results.get("schedule")
    return placed.placed if placed is not None else {}

  def clones(self):
    micro = self.results.get("micro_batch")
    return Clones(self.replication.copies, micro.clones if micro else {},
                  self.plan.num_micro_batch, micro.calls if micro else None)

  def format(self):
    """A readable description: TaskGraphs, devices, op counts per phase, replicas."""
    lines = [str(self.plan)]
    if self.plan.is_local:
      return lines[0]
    if not self.rewritten:
      lines.append("(not rewritten yet: epl rewrites before the first step)")
      return "\n".join(lines)
    a = self.analysis
    if a is None:
      return "\n".join(lines + ["worker %d only serves its devices" % self.worker.index])
    lines.append("Step: %d ops per model copy (%d mirrored variables), %d singleton op(s) "
                 "run once per step, %d data source(s) cloned per replica" % (
                     len(a.cloned), len(a.mirrored), len(a.singletons), len(a.sources)))
    if self.num_copies > 1:
      lines.append("Copies: 0 = your ops; 1..%d under EPL_REPLICA_<c>/" % (self.num_copies - 1))
    sync = self.sync_report
    if sync is not None and sync.buckets + sync.gathered:
      lines.append("Gradient sync: %d variable(s) in %d all-reduce bucket(s)%s, %s" % (
          sum(len(b) for b in sync.buckets), len(sync.buckets),
          ", %d all-gathered (sparse)" % len(sync.gathered) if sync.gathered else "",
          self.plan.communication.reduce_method))
    for t in self.plan.taskgraphs:
      counts = {p: t.op_count(p) for p in PHASES}
      if t.placement.kind == "split":
        where = "; ".join("replica %d: parts on %s" % (
            self.worker.copies[c].replica, ", ".join(self.worker.copies[c].devices[t.index]))
            for c in range(self.num_copies) if self.worker.runs(c, t.index))
        if t.index in self.plan.reductions:
          where += "; %d + %d all-reduce(s) of the parts forward + backward per " \
              "micro-batch" % self.plan.reductions[t.index]
      else:
        where = "devices " + ", ".join(self.worker.device_of(c, t.index)
                                       for c in range(self.num_copies)
                                       if self.worker.runs(c, t.index))
      lines.append("TaskGraph %d %r: forward %d, backward %d, apply %d ops; %s" % (
          t.index, t.name, counts["forward"], counts["backward"], counts["apply"], where))
    lines.extend(self._split_lines())
    lines.extend(gather_lines(self.plan.gathers))
    return "\n".join(lines)

  def _split_lines(self):
    """Each boundary of a split TaskGraph, or of a stage on fewer devices than the widest: the
    tensors crossing it and what carries them."""
    plan, bridges = self.plan, self.results.get("bridge")
    if not plan.crossings:
      return []
    split = any(plan.is_split(t.index) for t in plan.taskgraphs)
    out = ["%s boundaries (%d crossing tensor(s); %s):" % (
        "Split" if split else "Stage", len(plan.crossings),
        "one copy per replica: TF send/recv" if bridges is None or not bridges.built else
        "%d gather(s) into %s, %d scatter(s) out" % (
            bridges.count("gather"), "split parts" if split else "stages on fewer devices",
            bridges.count("scatter")))]
    for x in plan.crossings:
      out.append("  %s -> %s: %s" % (plan.taskgraphs[x.source].name,
                                     plan.taskgraphs[x.destination].name, x))
    return out

  def summary(self):
    """A few lines for the start of a job: workers, copies, micro-batches, gradient sync."""
    plan = self.plan
    if plan.is_local:
      return "plan: no epl.replicate / epl.split annotation: the graph runs as the local " \
          "script (one copy)"
    kind = "GPU" if plan.has_gpu else "virtual CPU"
    per_worker = len({d for c in plan.copies for ds in c.devices for d in ds}) // max(
        1, plan.worker_num)
    lines = ["plan: %d worker(s) x %d %s device(s); %d model copies (%d replica(s) x %d "
             "shard(s)); %s" % (
                 plan.worker_num, per_worker, kind, plan.total_copies,
                 len({c.replica for c in plan.copies}), plan.shards,
                 "%d micro-batches, %s" % (plan.num_micro_batch, plan.pipeline_strategy)
                 if plan.num_micro_batch > 1 else
                 "%d micro-batches, one session run each" % plan.accumulate_runs
                 if plan.accumulate_runs > 1 else "1 micro-batch")]
    def place(d):
      return "%s%s" % ("w%d:" % worker_of(d) if plan.worker_num > 1 else "",
                       d.rsplit("/device:", 1)[-1])
    for t in plan.taskgraphs:
      if t.placement.kind == "split":
        where = "parts on " + ", ".join("+".join(place(d) for d in c.devices[t.index])
                                        for c in plan.copies if c.shard == 0)
      else:
        where = "copies on " + ", ".join(place(d) for d in plan.group_of(t.index))
      if t.index in plan.reductions:
        where += "; %d + %d all-reduce(s) of the parts forward + backward per micro-batch" % (
            plan.reductions[t.index])
      lines.append("  TaskGraph %d %r (%s): %s" % (t.index, t.name, t.placement, where))
    sync = self.sync_report
    if sync is not None and sync.buckets + sync.gathered:
      lines.append("  gradients: %d variable(s) in %d fused all-reduce(s)%s%s, %s, clipping "
                   "%s the all-reduce" % (
                       sum(len(b) for b in sync.buckets), len(sync.buckets),
                       " (%d streamed in blocks of rows)" % len(sync.streamed)
                       if sync.streamed else "",
                       ", %d sparse all-gathered" % len(sync.gathered) if sync.gathered else "",
                       plan.communication.reduce_method,
                       "after" if plan.communication.clip_after_allreduce else "before"))
    lines.extend("  " + line for line in gather_lines(plan.gathers, most=5))
    return "\n".join(lines)

  def draw(self, path):
    """Draws the plan (workers x devices, TaskGraphs and copies, collectives) to a PNG."""
    from epl.plan.picture import draw
    return draw(self.plan, path)

  def __str__(self):
    return self.format()


def gather_lines(gathers, most=None):
  """The split values read whole (the gather fallback): a count, then one line per op."""
  if not gathers:
    return []
  step = [g for g in gathers if g.in_step]
  known = [g.bytes for g in step if g.bytes >= 0]
  sizes = [size_text(sum(known)) + " per micro-batch"] if known else []
  if len(known) < len(step):
    sizes.append("%d of shape not static" % (len(step) - len(known)))
  out = ["Gathers (ops no split rule covers, run on the whole value): %d in the training "
         "step%s, %d outside it (run only when fetched)" % (
             len(step), " (%s)" % ", ".join(sizes) if sizes else "",
             len(gathers) - len(step))]
  shown = sorted(gathers, key=lambda g: not g.in_step)
  for g in shown[:most]:
    out.append("  %s: %s" % (g.taskgraph, g))
  if most is not None and len(shown) > most:
    out.append("  ... and %d more (ParallelGraph.format() lists them)" % (len(shown) - most))
  return out
