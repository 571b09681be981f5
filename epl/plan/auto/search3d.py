"""The 3D planner: the fastest layout of a transformer on a cluster that fits its memory (#51).

``plan_3d(model, cluster, batch)`` tries every tensor-parallel degree (powers of two that
divide the heads, up to two nodes: inside a node is where TP is cheap, and the cost model
prices the slower link beyond), every pipeline depth that divides what TP leaves, the data
parallelism that fills the cluster, micro-batches of 1-8 sequences that divide the batch,
the ZeRO levels, offload and the two schedules; per layout it recomputes activations only
on the stages that do not fit without (the first stages hold the most micro-batches in
flight under 1F1B). Each candidate is priced by ``cost3d.price``; the fastest that fits
wins, ties going to the plainer layout (no ZeRO, no offload, fewer recomputing stages).

Megatron-LM's rule of thumb (TP within a node, then PP across nodes, DP for the rest) is
one point of this space, not a constraint: ``megatron_table`` prices Megatron's own
configuration of each row of its scaling table beside the plan chosen here.

Example:
  >>> from epl.plan.auto.transformer import SHAPES, selene
  >>> plan = plan_3d(SHAPES["gpt3-175b"], selene(1024), batch=1536)
  >>> plan.best.layout.tp, plan.best.fits
  (8, True)
"""
import dataclasses
import time
from typing import Optional, Tuple

from epl.plan.auto.cost3d import ZERO_LEVELS, Layout, Priced, try_price
from epl.plan.auto.errors import PlannerError
from epl.plan.auto.transformer import megatron_rows, selene

ROWS = (1, 2, 4, 8)


@dataclasses.dataclass(frozen=True)
class Plan3D:
  best: Priced
  considered: int                 # layouts priced
  seconds: float                  # planning time
  runners_up: Tuple[Priced, ...]  # the next fastest that fit, one per (tp, pp)

  def describe(self):
    return "\n".join(["best: " + self.best.describe()] +
                     ["  or: " + p.describe() for p in self.runners_up] +
                     ["(%d layouts priced in %.2f s)" % (self.considered, self.seconds)])


def _divisors(n):
  return [k for k in range(1, n + 1) if n % k == 0]


def _plainness(priced):
  layout = priced.layout
  return (ZERO_LEVELS.index(layout.zero), layout.offload, sum(layout.recompute),
          layout.schedule != "1f1b")


def fit_recompute(model, cluster, layout, batch) -> Optional[Priced]:
  """``layout`` priced with recomputation on the fewest leading stages that make it fit
  (None: it cannot run, or does not fit even so). Leading: 1F1B's first stages hold the
  most micro-batches, and epl's ``gradient_checkpoint.end_taskgraph`` names the last
  TaskGraph that recomputes -- a prefix of the stages."""
  plain = try_price(model, cluster, dataclasses.replace(layout, recompute=()), batch)
  if plain is None or plain.fits:
    return plain
  limit = cluster.memory * cluster.usable_memory
  last = max(s for s, x in enumerate(plain.memory) if x > limit)
  again = tuple(s <= last for s in range(layout.pp))
  priced = try_price(model, cluster, dataclasses.replace(layout, recompute=again), batch)
  return priced if priced is not None and priced.fits else None


def candidates(model, cluster, batch, max_tp=None, rows=ROWS, zero=ZERO_LEVELS,
               offload=(False, True), schedules=("1f1b", "gpipe")):
  """Every ``Layout`` of the search space (recompute left to ``fit_recompute``)."""
  gpus = cluster.gpus
  max_tp = max_tp or 2 * cluster.gpus_per_node
  for tp in (k for k in _divisors(gpus) if k <= max_tp and k & (k - 1) == 0):
    if model.heads % tp or model.hidden % tp:
      continue
    for pp in _divisors(gpus // tp):
      if pp > model.layers:
        break
      dp = gpus // (tp * pp)
      for b in rows:
        if batch % (dp * b):
          continue
        for level in zero:
          if level and dp == 1:
            continue
          for off in offload:
            for schedule in schedules:
              yield Layout(tp, pp, dp, b, level, off, (), schedule)


def plan_3d(model, cluster, batch, memory=None, **space) -> Plan3D:
  """The fastest layout that fits (see the module docstring). ``memory``: bytes per GPU
  instead of the cluster's; ``space``: ``candidates``' keywords to narrow the search."""
  if memory is not None:
    cluster = dataclasses.replace(cluster, memory=float(memory))
  start = time.perf_counter()
  best, considered, per_shape = None, 0, {}
  for layout in candidates(model, cluster, batch, **space):
    considered += 1
    priced = fit_recompute(model, cluster, layout, batch)
    if priced is None:
      continue
    key = (priced.step_s, _plainness(priced))
    shape = (layout.tp, layout.pp)
    if shape not in per_shape or key < (per_shape[shape].step_s, _plainness(per_shape[shape])):
      per_shape[shape] = priced
    if best is None or key < (best.step_s, _plainness(best)):
      best = priced
  if best is None:
    raise PlannerError(
        "no layout of %s (%.3gB parameters) fits %s GPUs of %.0f GB at batch %d: more GPUs, "
        "a smaller batch or more memory per GPU" % (
            model.name, model.parameters / 1e9, cluster.gpus, cluster.memory / 1e9, batch))
  others = sorted((p for s, p in per_shape.items() if p is not best), key=lambda p: p.step_s)
  return Plan3D(best, considered, time.perf_counter() - start, tuple(others[:3]))


def plan_config(priced):
  """The epl Config keys that run ``priced``'s layout (with ``pipeline.num_stages`` and
  ``split.device_count`` for ``auto.auto_parallel``; by hand: one ``epl.replicate`` scope
  per stage, each an ``epl.split(device_count=tp)`` when tp > 1)."""
  layout = priced.layout
  config = {"pipeline.num_micro_batch": priced.micro_batches,
            "pipeline.strategy": "PreferBackward" if layout.schedule == "1f1b"
                                 else "PreferForward",
            "amp.level": "O1", "communication.fp16": True}
  if layout.zero:
    config["zero.level"] = layout.zero
  if layout.offload:
    config["offload.level"] = "v0"
  if any(layout.recompute):
    config["gradient_checkpoint.type"] = "auto"
    last = max(s for s, r in enumerate(layout.recompute) if r)
    if last < layout.pp - 1:
      config["gradient_checkpoint.end_taskgraph"] = last
  return config


def megatron_layout(row, recompute=True):
  """Megatron's configuration of a scaling-table row as a ``Layout`` (micro-batches of one
  sequence, full recomputation, 1F1B: epl's schedule; Megatron ran its interleaved one)."""
  dp = row["gpus"] // (row["tp"] * row["pp"])
  return Layout(row["tp"], row["pp"], dp, 1, recompute=(recompute,) * row["pp"])


def megatron_table(cluster_of=selene, **space):
  """Per row of Megatron's scaling table: its configuration priced, the published TFLOP/s,
  and the plan chosen here (dicts; ``docs/planner.md``'s table, bench/planner3d.py)."""
  out = []
  for row in megatron_rows():
    model, cluster = row["model"], cluster_of(row["gpus"])
    theirs = try_price(model, cluster, megatron_layout(row), row["batch"])
    ours = plan_3d(model, cluster, row["batch"], **space)
    out.append(dict(model=model.name, gpus=row["gpus"], batch=row["batch"],
                    published=row["tflops"], megatron=theirs, plan=ours,
                    error=theirs.tflops_per_gpu / row["tflops"] - 1,
                    speedup=theirs.step_s / ours.best.step_s))
  return out
