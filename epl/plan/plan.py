"""``ParallelPlan``: one frozen, printable description of the parallel job.

Manual annotations (``epl.plan.build``) and, later, the automatic planner produce this same
type; every pass receives it as an argument. It round-trips through JSON (``to_json`` /
``from_json``) so a plan can be dumped, inspected and reloaded.
"""
import dataclasses
import json
from typing import Dict, Tuple

PHASES = ("forward", "backward", "apply")


@dataclasses.dataclass(frozen=True)
class TaskGraphPlan:
  """One TaskGraph: the ops it owns (by phase) and where each model replica places it."""
  index: int
  name: str
  kind: str                      # "replicate" or "split"
  device_count: int
  location: str                  # where the user opened the scope
  ops: Dict[str, Tuple[str, ...]]  # phase -> op names (the user's graph, before rewriting)

  def op_count(self, phase):
    return len(self.ops.get(phase, ()))

  def __str__(self):
    counts = ", ".join("%s %d" % (p, self.op_count(p)) for p in PHASES)
    return "TaskGraph %d %r: %s(device_count=%d) [%s]" % (
        self.index, self.name, self.kind, self.device_count, counts)


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
  """The whole job's plan on this worker.

  ``devices[c][t]`` lists the devices of TaskGraph ``t`` in model copy ``c``; a model copy is
  one (replica, shard) pair: ``c = replica * shards + shard``. Shards exist when a
  ``replicate(device_count=k)`` splits each replica's batch over k devices.
  """
  taskgraphs: Tuple[TaskGraphPlan, ...]
  num_replicas: int              # model replicas on this worker
  shards: int                    # devices that split one replica's batch (k)
  num_micro_batch: int
  pipeline_strategy: str
  devices: Tuple[Tuple[Tuple[str, ...], ...], ...]
  host: str
  reduce_method: str             # "mean" or "sum"
  max_splits: int
  sparse_as_dense: bool
  collective_timeout: int
  worker_num: int = 1
  worker_index: int = 0
  peer_devices: Tuple[Tuple[str, ...], ...] = ()   # per TaskGraph: its device in every copy
                                                    # of every worker (worker-major)
  hosts: Tuple[str, ...] = ()                       # host device of every worker
  clients: Tuple[Tuple[int, int], ...] = ()         # (worker, its first copy's global index)
                                                    # for every worker that drives copies

  @property
  def num_copies(self):
    """Model copies on this worker."""
    return self.num_replicas * self.shards

  @property
  def total_copies(self):
    """Model copies in the whole job."""
    return len(self.peer_devices[0]) if self.peer_devices else self.num_copies

  @property
  def serve_only(self):
    """True on a worker that holds no model replica's first stage: it only serves."""
    return not self.is_local and self.num_copies == 0

  def client_group(self, taskgraph):
    """Copy 0 of ``taskgraph`` on every client worker (broadcast group), and my position."""
    group = tuple(self.group_of(taskgraph)[i] for _, i in self.clients) if self.clients \
        else (self.device_of(0, taskgraph),)
    workers = [w for w, _ in self.clients] or [self.worker_index]
    return group, workers.index(self.worker_index)

  def remote_tasks(self):
    """Tasks (other than this one) whose devices this worker's copies use."""
    import re
    tasks = {int(m) for copy in self.devices for devs in copy for d in devs
             for m in re.findall(r"/task:(\d+)", d)}
    return sorted(tasks - {self.worker_index})

  def group_of(self, taskgraph):
    """Every device that holds ``taskgraph`` in the job (all workers), for collectives."""
    return self.peer_devices[taskgraph] if self.peer_devices else tuple(
        self.device_of(c, taskgraph) for c in range(self.num_copies))

  @property
  def is_local(self):
    """True when there is nothing to rewrite (no annotation)."""
    return not self.taskgraphs

  def device_of(self, copy, taskgraph):
    """The device of ``taskgraph`` in model copy ``copy``."""
    return self.devices[copy][taskgraph][0]

  def to_json(self):
    return json.dumps(dataclasses.asdict(self), sort_keys=True)

  @classmethod
  def from_json(cls, text):
    raw = json.loads(text)
    raw["taskgraphs"] = tuple(
        TaskGraphPlan(**dict(t, ops={p: tuple(n) for p, n in t["ops"].items()}))
        for t in raw["taskgraphs"])
    raw["devices"] = tuple(tuple(tuple(d) for d in copy) for copy in raw["devices"])
    raw["peer_devices"] = tuple(tuple(d) for d in raw.get("peer_devices", ()))
    raw["hosts"] = tuple(raw.get("hosts", ()))
    raw["clients"] = tuple(tuple(c) for c in raw.get("clients", ()))
    return cls(**raw)

  def __str__(self):
    if self.is_local:
      return "ParallelPlan(local: no annotation, one replica as in the local script)"
    lines = ["ParallelPlan: %d replica(s) x %d shard(s) on this worker, %d worker(s), "
             "micro-batches %d, gradients reduced by %s" % (
                 self.num_replicas, self.shards, self.worker_num, self.num_micro_batch,
                 self.reduce_method)]
    for t in self.taskgraphs:
      lines.append("  " + str(t))
      for c in range(self.num_copies):
        lines.append("    copy %d (replica %d, shard %d): %s" % (
            c, c // self.shards, c % self.shards, ", ".join(self.devices[c][t.index])))
    return "\n".join(lines)
