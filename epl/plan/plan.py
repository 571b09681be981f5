"""``ParallelPlan``: the whole job's plan -- one frozen, printable, JSON-round-trippable value.

The plan is the complete input of the rewrite besides the user's graph: which TaskGraph and
phase every op belongs to (by op name), each TaskGraph's typed placement, every model copy of
the job with its devices, the pipeline schedule as data, the gradients to synchronise (by
tensor name) and the communication settings. Manual annotations (``epl.plan.build``) and the
automatic planner produce this same type; ``ParallelPlan.from_json(plan.to_json())`` drives an
identical rewrite. A worker's own part is derived from it: ``plan.for_worker(i)``.

Example:
  >>> plan.for_worker(0).num_copies
  2
  >>> print(plan)                       # a few lines per TaskGraph
"""
import dataclasses
import enum
import functools
import json
from typing import Dict, FrozenSet, Mapping, Tuple

from epl.cluster import worker_of
from epl.plan.gather import Gather
from epl.plan.placement import Collective, Placement, placement_from_dict

PHASES = ("forward", "backward", "apply")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskGraphPlan:
  """One TaskGraph: its placement and the ops it owns (by phase, names of the user's graph)."""
  index: int
  name: str
  placement: Placement
  location: str                         # where the user opened the scope
  ops: Mapping[str, Tuple[str, ...]]    # phase -> op names

  def op_count(self, phase):
    return len(self.ops.get(phase, ()))

  def __str__(self):
    counts = ", ".join("%s %d" % (p, self.op_count(p)) for p in PHASES)
    return "TaskGraph %d %r: %s [%s]" % (self.index, self.name, self.placement, counts)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Copy:
  """One model copy: shard ``shard`` of replica ``replica``, driven by worker ``client``.

  ``devices[t]`` lists the devices that copy's TaskGraph ``t`` runs on (one for a replicated
  TaskGraph).
  """
  replica: int
  shard: int
  client: int
  devices: Tuple[Tuple[str, ...], ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gradient:
  """A gradient the user's step computes for a variable (tensor names of the user's graph).

  ``tensors`` is ``(dense,)`` or ``(values, indices, dense_shape)`` for IndexedSlices;
  ``applied`` the same for the gradient handed to ``apply_gradients`` (empty when unknown).
  """
  variable: str
  tensors: Tuple[str, ...]
  applied: Tuple[str, ...] = ()

  @property
  def sparse(self):
    """IndexedSlices (an embedding's, from tf.gather): the gradient handed to
    apply_gradients, or the raw one when that is unknown."""
    return len(self.applied or self.tensors) > 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Crossing:
  """A tensor of the user's graph that flows between a replicated and a split TaskGraph, or
  between replicated TaskGraphs with different device counts (``gather``: into the one on
  fewer devices).

  ``gather``: into the split TaskGraph (each replica's split part reads all its copies'
  values: their rows concatenated when ``batch_major``, else copy 0's value -- or, for a
  gradient, the sum); otherwise out of it (copy j reads its own rows when ``batch_major``,
  else the whole value). ``backward``: a gradient on its way back (epl.passes.bridge scales
  it so that the copies' mean gradient stays the local model's).
  """
  tensor: str
  consumer: str
  source: int
  destination: int
  gather: bool
  batch_major: bool
  backward: bool
  axis: int = 0             # the batch axis of a batch-major value (1 for MoE expert slices)
  collective: Collective = Collective.SEND_RECV   # what carries it (placement.TRANSITIONS)

  def __post_init__(self):
    object.__setattr__(self, "collective", Collective(self.collective))   # read from JSON

  def __str__(self):
    return "%s %s -> %s (%s%s%s)" % (
        self.collective, self.tensor, self.consumer,
        ("rows" if not self.axis else "batch axis %d" % self.axis) if self.batch_major else
        "whole", ", gradient" if self.backward else "", "" if self.gather else ", out")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Communication:
  """How gradients and merged fetches travel (``communication.*`` keys)."""
  reduce_method: str = "mean"
  max_splits: int = 5
  sparse_as_dense: bool = False
  clip_after_allreduce: bool = True
  timeout: int = 300            # seconds a step with collectives may run
  num_communicators: int = 2    # channels the gradient buckets are spread over
  fp16: bool = False            # float32 buckets cross workers as float16 ...
  fp16_scale: int = 128         # ... multiplied by this first


class ZeroLevel(enum.StrEnum):
  """``zero.level`` as a typed value; the passes ask what it partitions, never its name.

  Each level keeps what the one before it partitions: v0 the optimizer slots (each copy
  updates its share of the variables, the others take the updated values), v1 also the
  gradient sums (each summed only where its owner is), v2 also the weights themselves."""
  OFF = ""
  V0 = "v0"
  V1 = "v1"
  V2 = "v2"

  def __bool__(self):
    return self is not ZeroLevel.OFF

  @property
  def partitions_slots(self):
    """Variables have owners; a copy keeps and updates only its share's optimizer slots."""
    return bool(self)

  @property
  def partitions_gradients(self):
    """A gradient is summed only at its owner (inside a worker: on its device)."""
    return self is ZeroLevel.V1

  @property
  def partitions_weights(self):
    """The trained variables exist once, on their owner's device."""
    return self is ZeroLevel.V2


@dataclasses.dataclass(frozen=True, kw_only=True)
class Memory:
  """Where weights live and how the update runs (``offload.*``, ``optimizer.*`` keys)."""
  offload: str = ""             # "v0": weights, slots and their update on the host
  num_apply_group: int = 1      # the update in this many sequential groups
  gradient_checkpoint: str = ""             # "", "collection", "auto"
  checkpoint_end_taskgraph: int = -1        # last TaskGraph GC applies to (-1: all)
  checkpoints: Tuple[str, ...] = ()         # the "checkpoints" collection, by tensor name
  check_gradients: bool = False             # verify the recomputed tensors once
  zero: ZeroLevel = ZeroLevel.OFF           # optimizer state partitioned over replicas

  def __post_init__(self):
    object.__setattr__(self, "zero", ZeroLevel(self.zero))     # a plan read back from JSON


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelPlan:
  """The whole job's plan (see the module docstring).

  ``copies`` lists every model copy of the job in global order (replica-major, then shard);
  ``hosts[w]`` is worker w's host device; ``schedule[s]`` the actions (``"F0"``, ``"B0"``...)
  of stage s in one step.
  """
  taskgraphs: Tuple[TaskGraphPlan, ...]
  copies: Tuple[Copy, ...]
  shards: int
  num_micro_batch: int
  pipeline_strategy: str
  schedule: Tuple[Tuple[str, ...], ...]
  hosts: Tuple[str, ...]
  gradients: Tuple[Gradient, ...] = ()
  shared_variables: Tuple[str, ...] = ()      # run once per step (global_step)
  communication: Communication = Communication()
  has_gpu: bool = False
  parts: Mapping[str, int] = dataclasses.field(default_factory=dict)  # split op -> its part
  crossings: Tuple[Crossing, ...] = ()
  # split TaskGraph -> (forward, backward) sums of the parts' partial results per micro-batch
  # (tensor-parallel all-reduces: row-parallel matmuls and embedding lookups forward, the
  # inputs of column-parallel ones backward)
  reductions: Mapping[int, Tuple[int, int]] = dataclasses.field(default_factory=dict)
  # ops of split TaskGraphs that read a split value whole (no rule covers them): the gather
  # fallback (split.gather_fallback)
  gathers: Tuple[Gather, ...] = ()
  # the split values' whole concatenations (op names): they run only if something reads them
  # (a crossing, a fetch), so stage functions leave an unread one out of the step
  wholes: Tuple[str, ...] = ()
  memory: Memory = Memory()
  # gradient accumulation as session runs (graph.micro_batches): each user step is this many
  # runs of the graph's one copy per device, the update in the last; num_micro_batch is then 1
  accumulate_runs: int = 1
  # graph.micro_batches "functions": each stage's forward and backward one graph function
  # called once per micro-batch ("auto": where the rewrite finds nothing they cannot hold,
  # else clones; "required": that is an error); "" -- clones
  stage_functions: str = ""
  # testing.race_delay_ms: every read of a variable the step writes starts this late (the
  # race amplifier of the tests, passes/race_delay.py; 0: off)
  race_delay_ms: int = 0

  @property
  def micro_batches(self):
    """Micro-batches per step as the user set them (in the graph, or as runs)."""
    return self.num_micro_batch * self.accumulate_runs

  # ---- the job -------------------------------------------------------------------------
  @property
  def is_local(self):
    """True when there is nothing to rewrite (no annotation)."""
    return not self.taskgraphs

  @property
  def worker_num(self):
    return max(1, len(self.hosts))

  @property
  def total_copies(self):
    return len(self.copies) or 1

  @property
  def clients(self):
    """Workers that drive at least one copy, in order."""
    return tuple(sorted({c.client for c in self.copies}))

  def is_split(self, taskgraph):
    return self.taskgraphs[taskgraph].placement.kind == "split"

  def part_of(self, op_name):
    """The part (device index in its TaskGraph) of an op of a split TaskGraph."""
    return self.parts.get(op_name, 0)

  def stride(self, taskgraph):
    """How many of a model replica's copies share one run of ``taskgraph``: 1 for a
    TaskGraph replicated on all ``shards``, ``shards`` for a split one (it runs once per
    replica), ``shards // device_count`` for a replicated TaskGraph with fewer devices than
    the widest (each of its runs takes that many copies' rows)."""
    placement = self.taskgraphs[taskgraph].placement
    return self.shards if placement.kind == "split" else self.shards // placement.devices

  def runs_in(self, copy, taskgraph):
    """True if the job's copy ``copy`` (a ``Copy``) runs ``taskgraph``."""
    return copy.shard % self.stride(taskgraph) == 0

  def group_of(self, taskgraph, part=0):
    """The devices that hold ``taskgraph`` (its ``part``, when split) in every copy of the job
    that runs it -- every copy for a replicated TaskGraph, each replica's first copy for a
    split one (collective groups)."""
    return tuple(c.devices[taskgraph][part] for c in self.copies
                 if self.runs_in(c, taskgraph))

  def clients_of(self, taskgraph, part=0):
    """The worker driving each member of ``group_of(taskgraph, part)``."""
    return tuple(c.client for c in self.copies if self.runs_in(c, taskgraph))

  @functools.cached_property
  def op_index(self) -> Dict[str, Tuple[int, str]]:
    """{op name: (TaskGraph index, phase)} (computed once per plan)."""
    return {name: (t.index, phase) for t in self.taskgraphs
            for phase, names in t.ops.items() for name in names}

  @functools.cached_property
  def whole_set(self) -> FrozenSet[str]:
    """``wholes`` as a set (looked up per op by the stage-functions cut)."""
    return frozenset(self.wholes)

  def for_worker(self, index):
    """This worker's part of the plan."""
    return WorkerView(self, index)

  # ---- serialisation -------------------------------------------------------------------
  def to_json(self):
    return json.dumps(_plain(self), sort_keys=True)

  @classmethod
  def from_json(cls, text):
    raw = json.loads(text)
    raw["taskgraphs"] = tuple(TaskGraphPlan(
        index=t["index"], name=t["name"], placement=placement_from_dict(t["placement"]),
        location=t["location"], ops={p: tuple(n) for p, n in sorted(t["ops"].items())})
        for t in raw["taskgraphs"])
    raw["copies"] = tuple(Copy(replica=c["replica"], shard=c["shard"], client=c["client"],
                               devices=tuple(tuple(d) for d in c["devices"]))
                          for c in raw["copies"])
    raw["schedule"] = tuple(tuple(s) for s in raw["schedule"])
    raw["hosts"] = tuple(raw["hosts"])
    raw["gradients"] = tuple(Gradient(variable=g["variable"], tensors=tuple(g["tensors"]),
                                      applied=tuple(g["applied"])) for g in raw["gradients"])
    raw["shared_variables"] = tuple(raw["shared_variables"])
    raw["communication"] = Communication(**raw["communication"])
    raw["crossings"] = tuple(Crossing(**c) for c in raw["crossings"])
    raw["reductions"] = {int(t): tuple(n) for t, n in raw.get("reductions", {}).items()}
    raw["gathers"] = tuple(Gather(**g) for g in raw.get("gathers", ()))
    raw["wholes"] = tuple(raw.get("wholes", ()))
    memory = dict(raw.get("memory", {}))
    memory["checkpoints"] = tuple(memory.get("checkpoints", ()))
    raw["memory"] = Memory(**memory)
    return cls(**raw)

  def __str__(self):
    if self.is_local:
      return "ParallelPlan(local: no annotation, one replica as in the local script)"
    replicas = len({c.replica for c in self.copies})
    lines = ["ParallelPlan: %d worker(s), %d model replica(s) x %d shard(s), %d micro-batch(es)"
             "%s, gradients %s" % (
                 self.worker_num, replicas, self.shards, self.micro_batches,
                 " (%s)" % self.pipeline_strategy if self.num_micro_batch > 1 else
                 " (as session runs)" if self.accumulate_runs > 1 else "",
                 self.communication.reduce_method)]
    for t in self.taskgraphs:
      lines.append("  " + str(t))
      for i, c in enumerate(self.copies):
        if self.runs_in(c, t.index):
          lines.append("    copy %d (replica %d, shard %d, worker %d): %s%s" % (
              i, c.replica, c.shard, c.client, ", ".join(c.devices[t.index]),
              "" if self.stride(t.index) == 1 or t.placement.kind == "split" else
              " (the rows of copies %d-%d)" % (i, i + self.stride(t.index) - 1)))
    return "\n".join(lines)


def _plain(value):
  """A JSON-able view of plan values (placements carry their kind)."""
  if dataclasses.is_dataclass(value):
    out = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Placement):
      out["kind"] = value.kind
    return out
  if isinstance(value, Mapping):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, (tuple, list)):
    return [_plain(v) for v in value]
  return value


@dataclasses.dataclass(frozen=True)
class WorkerView:
  """One worker's view of a ``ParallelPlan``: the copies it drives (local copy c is
  ``copies[c]``) and its host."""
  plan: ParallelPlan
  index: int

  @property
  def copies(self):
    return tuple(c for c in self.plan.copies if c.client == self.index)

  @property
  def num_copies(self):
    return len(self.copies)

  @property
  def num_replicas(self):
    return len({c.replica for c in self.copies})

  @property
  def host(self):
    return self.plan.hosts[self.index] if self.plan.hosts else "/device:CPU:0"

  @property
  def serve_only(self):
    """True on a worker that holds no model replica's first stage: it only serves."""
    return not self.plan.is_local and self.num_copies == 0

  def device_of(self, copy, taskgraph, part=0):
    """The device of ``taskgraph`` (its ``part``, when split) in local copy ``copy``."""
    return self.copies[copy].devices[taskgraph][part]

  def runs(self, copy, taskgraph):
    """True if local copy ``copy`` runs ``taskgraph`` (a split TaskGraph runs once per
    replica, in the replica's first copy)."""
    return self.plan.runs_in(self.copies[copy], taskgraph)

  def first_global_copy(self):
    return next(i for i, c in enumerate(self.plan.copies) if c.client == self.index)

  def client_group(self, taskgraph):
    """Copy 0 of ``taskgraph`` on every client worker (broadcast group), and my position."""
    firsts = [next(c for c in self.plan.copies if c.client == w) for w in self.plan.clients]
    group = tuple(c.devices[taskgraph][0] for c in firsts)
    return group, list(self.plan.clients).index(self.index)

  def remote_tasks(self):
    """Tasks (other than this one) whose devices this worker's copies use."""
    tasks = {worker_of(d) for c in self.copies for devs in c.devices for d in devs
             if "/task:" in d}
    if self.plan.memory.zero and self.plan.worker_num > 1:
      tasks |= set(self.plan.clients)      # ZeRO: optimizer slots live on their owner's task
    return sorted(tasks - {self.index})
