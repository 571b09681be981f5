"""The planner: stage partition x per-stage replication x placement, scored by a cost model.

How ``plan_pipeline`` searches:

1. Pure data parallelism is always a candidate (with gradient accumulation if that is what
   fits memory), so no plan is returned that the cost model predicts slower.
2. For every layout (device order: pack / wrapped / scatter / ..., see ``layouts``), replica
   unit ``rp`` and bottleneck weighting k the cost model asks for, ``dp.solve`` lays stages
   along the order and minimises the *bottleneck* -- the slowest stage (compute / summed
   speed) or cut transfer -- the quantity DAPPLE's DP minimises, with append (contiguous) and
   fresh (skip to the next server) placements, skipping stages over the memory limit. Per
   unit, ``placements.solve`` runs DAPPLE's own placement DP too: fresh, append or scatter
   chosen per stage as the pipeline grows.
3. The bottleneck is not the whole iteration: a stage's gradient all-reduce adds to it. So
   the DP also takes a cap ``alpha`` on any stage's all-reduce, and the search walks the
   Pareto front of (bottleneck, largest all-reduce): after each solution it lowers ``alpha``
   below that solution's largest all-reduce and solves again, until no plan is left or the
   cost model's lower bound for the next bottleneck cannot beat the best plan so far.
4. Every plan found is scored by the cost model, which also picks the micro-batch count where
   it is free to; ``refine.polish`` then descends from the best few of each DP kind with the
   exact model (boundary shifts, device moves, swaps, merges), and the finalists are
   re-scored exactly.
   The fastest plan that fits memory wins; ties go to fewer stages, then to the first found.
   Everything is deterministic.

Cost: one layout DP is ``sum_j |preds(j)| x P`` array cells, P ~ U^2 valid (start, end) unit
pairs; a placements DP ``sum_j |preds(j)| x`` (occupancy, stage) options, capped by
``placements.MAX_CELLS``. Cuts are first reduced to one per cost signature
(``states.representative_states``: GNMT-16 1,495 -> 69). DAPPLE's own search is the
placements DP with the bottleneck only (no all-reduce cap), one per unit count.
"""
import dataclasses
import functools
import math
from typing import Callable, Tuple

from epl.plan.auto import dp, placements, refine
from epl.plan.auto.cost import Estimate
from epl.plan.auto.devices import DeviceSpec
from epl.plan.auto.errors import PlannerError
from epl.plan.auto.layouts import Tables, layouts
from epl.plan.auto.models import get_model
from epl.plan.auto.pipeline import PipelinePlan, Stage
from epl.plan.auto.workload import Workload

MAX_PROBES = 24        # Pareto points per (layout, unit, micro-batch count); rarely reached
FINALISTS = 5          # best plans the cost model re-scores exactly before choosing
PLACEMENT_STARTS = 2   # best plans of the placements DP the local search also starts from
PHASES = ("states", "search", "local search", "re-scoring", "done")


@dataclasses.dataclass(frozen=True)
class _Candidate:
  placed: Tuple
  estimate: Estimate
  order: int             # when it was found: the last tie-break
  placements: bool = False   # found by the per-stage placements DP

  def key(self):
    # 12 significant digits (a relative 1e-12): the same plan found twice must tie, whatever
    # the float path.
    return (float("%.12g" % self.estimate.iteration_s), len(self.placed), self.order)

  def __str__(self):
    return "%s: %s" % (":".join(str(len(d)) for _, _, d in self.placed), self.estimate)


def plan_pipeline(profile, pbs, gbs, devices, cost_model="dapple", memory=None, speeds=None,
                  parameter_factor=4.0, schedule="1f1b", progress=None, accept=None,
                  micro_batches=None, accept_stages=None):
  """Plans a pipeline for ``profile`` trained at global batch ``gbs`` on ``devices``.

  Args:
    profile: ``Profile``, a path to a profile file, or ``States``.
    pbs: batch size the profile was taken at.
    gbs: global batch size.
    devices: ``DeviceSpec`` (or a string ``DeviceSpec.parse`` reads, e.g. "8,16").
    cost_model: "dapple", "dapple-published" or "simulate" (or a cost model object).
    memory: bytes per device, or ``None`` for no limit.
    speeds: relative speed per device (``None``: identical devices).
    parameter_factor: bytes of memory per parameter byte (4: weights, gradients, Adam).
    schedule: "1f1b" or "gpipe" (the ``simulate`` model replays it; memory uses it).
    progress: optional ``callable(phase, done, total, detail)``, called as each step of
      ``PHASES`` starts ("states", "search", "local search", "re-scoring") and once with
      "done" when the plan is ready.
    accept: optional ``callable(device_counts) -> bool`` over a plan's per-stage device
      counts: only plans it accepts (and pure data parallelism) are returned -- what a runtime
      can execute, e.g. epl's equal device count per stage.
    accept_stages: optional ``callable(((layer ids, device count), ...)) -> bool`` over a
      plan's stages, for what depends on the cut too (a variable read in two layers needs
      their stages on as many devices in epl).
    micro_batches: optional ``callable(device_counts) -> M`` (or ``None``: cannot run): the
      micro-batch count a runtime would use for a plan with those per-stage device counts
      (epl keeps the global batch and trades model replicas for micro-batches); every plan
      is then scored, and returned, at that count.
  Returns:
    ``PipelinePlan`` -- never predicted slower than pure data parallelism on the same model.
  Raises:
    PlannerError: bad input, or nothing fits in ``memory``.

  Example:
    >>> plan = plan_pipeline("vgg-19-pbs-32.txt", 32, 2048, "8,16")
    >>> plan.replicas
    (15, 1)
  """
  report = progress or (lambda phase, done, total, detail: None)
  spec = devices if isinstance(devices, DeviceSpec) else DeviceSpec.parse(devices)
  model = get_model(cost_model)
  report("states", 0, 1, "cutting the profile")
  w = Workload(profile, pbs, gbs, spec, speeds, memory, parameter_factor, schedule)
  dp_placed, dp_estimate = model.data_parallel(w)
  pure = _Candidate(dp_placed, model.finalize(w, dp_placed, dp_estimate), 0)
  found = [pure]
  _search(w, model, found, report)
  _polish(w, model, found, report)
  if accept is not None:
    found[:] = [c for c in found
                if c is pure or accept(tuple(len(devices) for _, _, devices in c.placed))]
  if accept_stages is not None:
    found[:] = [c for c in found if c is pure or accept_stages(tuple(
        (frozenset(w.layers(k, j)), len(devices)) for k, j, devices in c.placed))]
  if micro_batches is not None:
    found[:], pure = _at_micro_batches(w, model, found, pure, micro_batches)
  best = _final(w, model, found, pure, report, fixed=micro_batches is not None)
  plan = _to_plan(w, model, best, pure.estimate)
  report("done", 1, 1, str(best))
  return plan


@dataclasses.dataclass(frozen=True)
class _Family:
  """One DP family: a device arrangement (a layout, or DAPPLE's per-stage placements) at one
  replica unit; ``tables()`` builds what its ``solve`` reads (``None``: too large, skipped)."""
  name: str
  unit: int
  tables: Callable
  solve: Callable

  def __str__(self):
    return "%s, %d-device units" % (self.name, self.unit)


def _families(w, model):
  """Every layout at every unit, then the per-stage placements at every unit."""
  found = []
  for layout in layouts(w.spec, w.speeds):
    for unit in model.unit_sizes(w):
      build = functools.partial(Tables.build, w.spec, w.speeds, layout, unit)
      found.append(_Family(str(layout), unit, build, dp.solve))
  for unit in model.unit_sizes(w):
    build = functools.partial(placements.Placements.build, w, unit)
    found.append(_Family("per-stage placements", unit, build, placements.solve))
  return found


def _search(w, model, found, report):
  """Runs every family's DP for each k in ``model.comm_copies``, walking the Pareto front of
  (bottleneck, largest all-reduce) per family; appends what it finds to ``found``."""
  families = _families(w, model)
  steps = [(f, copies) for copies in model.comm_copies for f in families]
  best = min((c.estimate.iteration_s for c in found if c.estimate.fits), default=math.inf)
  seen = {c.placed for c in found}
  tables = {}
  for done, (family, copies) in enumerate(steps):
    report("search", done, len(steps), "%s, k=%g" % (family, copies))
    if family not in tables:
      tables[family] = family.tables()
    if tables[family] is None:
      continue
    for micro_batches in model.dp_micro_batches(w, family.unit):
      best = _probe(w, model, found, seen, best, family,
                    (tables[family], copies, micro_batches))


def _probe(w, model, found, seen, best, family, args):
  """Solves with a falling cap on the all-reduce until the cost model's lower bound for the
  next bottleneck cannot beat ``best``; returns the new best."""
  tables, copies, micro_batches = args
  alpha = math.inf
  for _ in range(MAX_PROBES):
    solved = family.solve(w, tables, copies, alpha, micro_batches)
    if solved is None:
      break
    bottleneck, placed = solved
    if model.lower_bound(w, bottleneck, copies) >= best:
      break
    if placed not in seen:
      seen.add(placed)
      est = model.evaluate(w, placed)
      if est is not None:
        found.append(_Candidate(placed, est, len(found), family.solve is placements.solve))
        if est.fits:
          best = min(best, est.iteration_s)
    largest = max(w.spec.allreduce_s(d, w.parameters(k, j)) for k, j, d in placed)
    if largest <= 0:
      break
    alpha = largest * (1 - 1e-9)
  return best


def _polish(w, model, found, report):
  """Local search (``refine.polish``) from the ``FINALISTS`` best distinct plans of the
  layout DPs (and pure DP), and the ``PLACEMENT_STARTS`` best of the placements DP: the two
  find different kinds of plans, and greedy descents from either may end best."""
  starts = []
  for placed_by, limit in ((False, FINALISTS), (True, PLACEMENT_STARTS)):
    ranked = sorted((c for c in found if c.estimate.fits and c.placements == placed_by),
                    key=_Candidate.key)
    for cand in [c for c in ranked if c.placed not in {s.placed for s in starts}][:limit]:
      starts.append(cand)
  for done, cand in enumerate(starts):
    report("local search", done, len(starts), str(cand))
    placed, est, _ = refine.polish(w, model, cand.placed, cand.estimate,
                                   budget=model.polish_budget)
    if placed != cand.placed:
      found.append(_Candidate(placed, est, len(found)))


def _at_micro_batches(w, model, found, pure, micro_batches):
  """The candidates re-scored at the micro-batch count the runtime gives their device counts
  (those it cannot run dropped), and pure data parallelism among them."""
  kept, new_pure = [], None
  for c in found:
    m = micro_batches(tuple(len(devices) for _, _, devices in c.placed))
    est = model.evaluate(w, c.placed, m) if m else None
    if est is None:
      continue
    kept.append(_Candidate(c.placed, est, c.order, c.placements))
    if c is pure:
      new_pure = kept[-1]
  if new_pure is None:
    raise PlannerError("pure data parallelism cannot run at the runtime's micro-batch count "
                       "%s for the global batch %d" % (
                           micro_batches(tuple(len(d) for _, _, d in pure.placed)), w.gbs))
  return kept, new_pure


def _final(w, model, found, pure, report, fixed=False):
  """Re-scores the best plans exactly (``model.finalize``) and returns the fastest."""
  fitting = sorted((c for c in found if c.estimate.fits), key=_Candidate.key)
  if not fitting:
    raise _nothing_fits(w, found)
  # Pure data parallelism stays among the finalists, already exact.
  final = [pure] if pure.estimate.fits else []
  finalists = [c for c in fitting[:FINALISTS] if c is not pure]
  for done, cand in enumerate(finalists):
    report("re-scoring", done, len(finalists), str(cand))
    est = model.finalize(w, cand.placed, cand.estimate, **({"fixed": True} if fixed else {}))
    if est is not None and est.fits:
      final.append(_Candidate(cand.placed, est, cand.order))
  return min(final or fitting[:1], key=_Candidate.key)


def _nothing_fits(w, found):
  """The error for a memory limit no plan meets: what the leanest plan holds, and the fix."""
  gib = 2.0 ** 30
  lean = min(found, key=lambda c: (max(c.estimate.peak_memory), c.estimate.iteration_s))
  est = lean.estimate
  device = max(range(len(est.peak_memory)), key=lambda d: (est.peak_memory[d], -d))
  k, j, devices = next(p for p in lean.placed if device in p[2])
  weights = w.parameters(k, j) * w.parameter_factor
  activations = est.peak_memory[device] - weights
  per_sample = w.activation_per_sample(k, j)
  held = activations / per_sample if per_sample > 0 else 0.0
  lines = ["nothing fits in %.3g GiB per device. The leanest plan found (%d stage(s) %s, %d "
           "micro-batches of %.3g sample(s)) peaks at %.3g GiB on device %d: %.3g GiB of "
           "weights, gradients and optimizer state (%g x its stage's %.3g GiB of parameters) "
           "+ %.3g GiB of activations (%.3g samples held for backward)" % (
               w.memory / gib, len(lean.placed), ":".join(str(len(p[2])) for p in lean.placed),
               est.micro_batches, w.gbs / est.micro_batches, est.peak_memory[device] / gib,
               device, weights / gib, w.parameter_factor, w.parameters(k, j) / gib,
               activations / gib, held)]
  spread = w.total_parameters * w.parameter_factor / w.spec.num_devices
  if spread > w.memory:
    lines.append("; even spread over all %d devices the weights, gradients and optimizer "
                 "state alone need %.3g GiB per device" % (w.spec.num_devices, spread / gib))
  lines.append(". Add devices, lower the global batch (gbs=%d) so fewer samples are held per "
               "micro-batch, lower parameter_factor (%g), or allow at least %.3g GiB per "
               "device" % (w.gbs, w.parameter_factor, est.peak_memory[device] / gib))
  return PlannerError("".join(lines))


def _to_plan(w, model, best, dp_estimate):
  stages = []
  for k, j, devices in best.placed:
    stages.append(Stage(w.cut_state[k] + 1, w.cut_state[j], w.layers(k, j),
                        tuple(sorted(devices)), float(w.cmp_ms[j] - w.cmp_ms[k]),
                        w.parameters(k, j)))
  est = best.estimate
  return PipelinePlan(
      stages=tuple(stages), micro_batches=est.micro_batches,
      predicted_iteration_s=est.iteration_s, speedup=w.t1 / est.iteration_s,
      peak_memory_per_device=est.peak_memory, cost_model=model.name,
      data_parallel_speedup=w.t1 / dp_estimate.iteration_s, schedule=w.schedule)
