"""The search's dynamic program: one layout, one replica unit, one all-reduce cap.

Stages are laid along the layout's device order from the last stage back to the first. The
state is ``(cut j, unit a, loc)``: the stages after cut j are placed, the earliest of them
starts at unit ``a`` and stays on one server (``loc=1``) or not. A step prepends a stage
``k -> j`` (k a predecessor cut of j) on units ``[a', b)`` -- a *pair* of the layout's tables,
``b = a`` or ``b`` the server boundary before ``a`` -- and costs::

  max(value(j, a, loc), compute(k, j) / speed[a', b), c x bytes(j) x xfer[a', b, a, loc])

with ``c = comm_copies`` (DAPPLE's k, see ``cost``). The value of a plan is its bottleneck;
stages whose all-reduce exceeds ``alpha`` or whose devices would exceed the memory limit are
not allowed. Units after the last stage may stay idle. Per cut, all predecessors and pairs
are one (K, P) array; ``minimum.reduceat`` folds pairs into states. The argmins are not kept:
reconstruction recomputes the one (k, j) it follows, with the same function.
"""
import math

import numpy as np


class _Costs:
  """What a step costs, computed the same way for the DP and for the reconstruction."""

  def __init__(self, w, tables, comm_copies, alpha, micro_batches):
    self.w, self.t = w, tables
    self.comm_copies, self.alpha = comm_copies, alpha
    self.samples = None
    if w.memory is not None and micro_batches is not None:
      in_flight = (np.full(tables.pair_units_after.shape, micro_batches)
                   if w.schedule == "gpipe"
                   else np.minimum(micro_batches, tables.pair_units_after + 1))
      # Samples the busiest device holds: micro-batch x its share x micro-batches in flight.
      self.samples = w.gbs / micro_batches * tables.pair_share * in_flight
    # A stage k -> j may run on a pair while its parameters stay below alpha / (s per byte).
    with np.errstate(divide="ignore"):
      self.max_params = np.where(tables.pair_allreduce > 0, alpha / tables.pair_allreduce,
                                 np.inf)

  def base(self, value_j, j):
    """Per pair: the best of the rest of the plan with the transfer into it; and that value
    per locality of the next stage (P, 2), for the reconstruction."""
    t = self.t
    comm = self.comm_copies * self.w.cut_bytes(j) * t.pair_xfer            # (P, 2)
    both = np.maximum(value_j[t.pair_next], comm)
    return both.min(axis=1), both

  def stage(self, base, j, ks, pairs=slice(None)):
    """(K, P) values of prepending stage k -> j on each pair."""
    w, t = self.w, self.t
    compute = w.f * (w.cmp_ms[j] - w.cmp_ms[ks]) / 1000.0
    cand = np.multiply.outer(compute, t.pair_inverse_speed[pairs])
    np.maximum(cand, base[pairs][None], out=cand)
    params = w.params[j] - w.params[ks]
    if math.isfinite(self.alpha):
      cand[params[:, None] > self.max_params[pairs][None]] = np.inf
    if self.samples is not None:
      acts = (w.acts[j] - w.acts[ks]) / w.pbs
      need = params[:, None] * w.parameter_factor + acts[:, None] * self.samples[pairs][None]
      cand[need > w.memory] = np.inf
    return cand


def solve(w, tables, comm_copies, alpha=math.inf, micro_batches=None):
  """Minimises the bottleneck (see the module docstring).

  Args:
    w: ``Workload``; tables: ``layouts.Tables``; comm_copies: the cost model's copies of a
    cut's bytes; alpha: cap on any stage's all-reduce seconds; micro_batches: check memory as
    for this many micro-batches (``None``: do not check).
  Returns:
    ``(bottleneck, ((k, j, devices), ...))`` in pipeline order, or ``None``.
  """
  t, final = tables, w.final
  costs = _Costs(w, tables, comm_copies, alpha, micro_batches)
  value = np.full((final + 1, t.units + 1, 2), np.inf)
  pick_j = np.full(value.shape, -1, dtype=int)
  value[final] = 0.0          # nothing after the last stage; devices after it stay idle
  segments = (t.seg_start[None, :], t.seg_loc[None, :])
  for j in range(final, 0, -1):
    ks = w.preds[j]
    if not len(ks) or not np.isfinite(value[j]).any():
      continue
    base, _ = costs.base(value[j], j)
    best = np.minimum.reduceat(costs.stage(base, j, ks), t.seg_first, axis=1)   # (K, S)
    rows = ks[:, None]
    current = value[rows, segments[0], segments[1]]
    better = best < current
    if better.any():
      value[rows, segments[0], segments[1]] = np.where(better, best, current)
      pick_j[rows, segments[0], segments[1]] = np.where(better, j,
                                                        pick_j[rows, segments[0], segments[1]])
  if not np.isfinite(value[0]).any():
    return None
  a, loc = np.unravel_index(int(np.argmin(value[0])), value[0].shape)
  return float(value[0][a, loc]), _follow(w, costs, value, pick_j, int(a), int(loc))


def _follow(w, costs, value, pick_j, a, loc):
  """Walks the picks from the model's start, recomputing each step's best pair."""
  t, stages, k = costs.t, [], 0
  while k != w.final:
    j = int(pick_j[k, a, loc])
    base, both = costs.base(value[j], j)
    next_loc = both.argmin(axis=1)
    pairs = np.flatnonzero((t.pair_start == a) & (t.pair_loc == loc))
    cand = costs.stage(base, j, np.array([k]), pairs)[0]
    p = int(pairs[int(np.argmin(cand))])
    assert abs(cand.min() - value[k, a, loc]) <= 1e-12 * max(1.0, value[k, a, loc]), \
        "reconstruction diverged from the DP"
    stages.append((k, j, t.stage_devices(a, int(t.pair_end[p]))))
    k, a, loc = j, int(t.pair_next[p]), int(next_loc[p])
  return tuple(stages)
