"""DAPPLE's per-stage device assignment: fresh, append or scatter, chosen stage by stage.

The layout DP (``dp``) lays every stage along one device order. DAPPLE's planner instead
decides, each time it extends the pipeline by a stage, where that stage's devices come from
(HPGO's ``next_cards``, the same three policies):

=========  =================================================================================
fresh      from servers none of whose devices is used yet, in server order, filling each
append     from servers already in use, in server order, filling each
scatter    one device per server that has a free one, round-robin in server order
=========  =================================================================================

A server's devices are taken fastest first (by id among equal speeds), so what a plan has used
is a count per server, the *occupancy*. The DP is HPGO's: forward over cuts, one state per
``(cut, occupancy)`` holding the best bottleneck so far and, for the transfer into the next
stage, the per-server counts of that solution's last stage. A stage ``k -> j`` of ``g``
devices (a multiple of the unit) costs, as in ``dp``::

  max(value(k, occ), compute(k, j) / speed(g), c x bytes(k) x X(last stage -> new stage))

Like HPGO's it is not exact -- of two prefixes reaching the same state the slower one is
dropped even if its last stage would send more cheaply -- and like every plan of the search its
plans are re-scored by the cost model. ``Placements.build`` returns ``None`` where the state
space exceeds ``MAX_CELLS`` array cells per DP (4x8 with one- and two-device units): those
clusters rely on the layouts and the local search there.
"""
import collections
import dataclasses
import math
from typing import Tuple

import numpy as np

from epl.plan.auto.layouts import server_devices

POLICIES = ("fresh", "append", "scatter")
MAX_CELLS = 4e6        # (stages k -> j) x options: the largest DP, about 0.1 s


def _sequence(policy, used, sizes):
  """The servers ``policy`` takes devices from, one entry per device, in taking order: a
  stage of g devices takes the first g (HPGO's ``next_cards_with_strategy``)."""
  free = [n - u for n, u in zip(sizes, used)]
  if policy == "scatter":
    return [s for r in range(max(free, default=0)) for s in range(len(sizes)) if free[s] > r]
  fresh = policy == "fresh"
  return [s for s in range(len(sizes)) if (used[s] == 0) == fresh for _ in range(free[s])]


def _takes(used, sizes, unit):
  """The distinct per-server takes of every policy and stage size (a multiple of ``unit``)."""
  found = set()
  for policy in POLICIES:
    take = [0] * len(sizes)
    for g, server in enumerate(_sequence(policy, used, sizes), 1):
      take[server] += 1
      if g % unit == 0:
        found.add(tuple(take))
  return sorted(found)


@dataclasses.dataclass(frozen=True, eq=False)
class Placements:
  """Every reachable occupancy and, flattened, every (occupancy, stage) option from it:
  ``opt_*`` arrays of length O, ordered by the occupancy they lead to. Read-only."""
  unit: int
  occupancies: Tuple[Tuple[int, ...], ...]
  devices: Tuple[Tuple[int, ...], ...]       # per option: the stage's device ids
  opt_from: np.ndarray
  opt_to: np.ndarray
  opt_take: np.ndarray                       # (O, servers): devices taken per server
  opt_home: np.ndarray                       # the stage's server; -1: it spans servers
  opt_inverse_speed: np.ndarray
  opt_share: np.ndarray                      # largest speed / summed speed
  opt_allreduce: np.ndarray                  # seconds per parameter byte
  opt_free_after: np.ndarray                 # devices left for the later stages
  successors: Tuple[np.ndarray, ...]         # per cut k: the cuts j with k in w.preds[j]

  @classmethod
  def build(cls, w, unit):
    """The options of ``w.spec`` at replica unit ``unit``; ``None`` over ``MAX_CELLS``."""
    successors = _successors(w)
    limit = MAX_CELLS / max(1, sum(len(s) for s in successors))
    fast = server_devices(w.spec, w.speeds)
    start = (0,) * len(fast)
    index, queue, rows = {start: 0}, collections.deque([start]), []
    while queue:                               # breadth first from no device used
      used = queue.popleft()
      for take in _takes(used, w.spec.servers, unit):
        after = tuple(u + t for u, t in zip(used, take))
        if after not in index:
          index[after] = len(index)
          queue.append(after)
        devs = tuple(sorted(d for s, t in enumerate(take) for d in fast[s][used[s]:used[s] + t]))
        rows.append((index[used], index[after], take, devs))
        if len(rows) > limit:
          return None
    rows.sort(key=lambda r: (r[1], r[0]))
    return cls._from_rows(w, unit, tuple(index), rows, successors)

  @classmethod
  def _from_rows(cls, w, unit, occupancies, rows, successors):
    spec = w.spec
    speed = np.array([w.speed_of(r[3]) for r in rows])
    arrays = dict(
        opt_from=np.array([r[0] for r in rows], dtype=int),
        opt_to=np.array([r[1] for r in rows], dtype=int),
        opt_take=np.array([r[2] for r in rows], dtype=int).reshape(len(rows), -1),
        opt_home=np.array([-1 if spec.spans(r[3]) else spec.server_of(r[3][0]) for r in rows],
                          dtype=int),
        opt_inverse_speed=1.0 / speed,
        opt_share=np.array([max(w.speeds[d] for d in r[3]) for r in rows]) / speed,
        opt_allreduce=np.array([spec.allreduce_s(r[3], 1.0) for r in rows]),
        opt_free_after=np.array([spec.num_devices - sum(occupancies[r[1]]) for r in rows]))
    for value in arrays.values():
      value.flags.writeable = False
    return cls(unit=unit, occupancies=occupancies, devices=tuple(r[3] for r in rows),
               successors=successors, **arrays)

  def __str__(self):
    return "per-stage placements"


def _successors(w):
  found = [[] for _ in range(w.final + 1)]
  for j in range(1, w.final + 1):
    for k in w.preds[j]:
      found[int(k)].append(j)
  arrays = tuple(np.array(s, dtype=int) for s in found)
  for a in arrays:
    a.flags.writeable = False
  return arrays


def transfer_per_byte(spec, last, home):
  """Seconds per byte from stages with per-server device counts ``last`` (rows) into stages
  on server ``home`` (-1: spanning) -- ``DeviceSpec.transfer_s`` on counts, vectorised."""
  total = last.sum(axis=1)
  on_home = np.take_along_axis(last, np.maximum(home, 0)[:, None], axis=1)[:, 0]
  remote = total - on_home
  local = np.where(remote > 0, remote / np.maximum(total, 1) / spec.inter_bandwidth,
                   1.0 / spec.intra_bandwidth)
  return np.where(home < 0, 1.0 / spec.allreduce_bandwidth, np.where(total > 0, local, 0.0))


def solve(w, table, comm_copies, alpha=math.inf, micro_batches=None):
  """Minimises the bottleneck over per-stage placements (see the module docstring).

  Args: as ``dp.solve``, with ``table`` a ``Placements``.
  Returns:
    ``(bottleneck, ((k, j, devices), ...))`` in pipeline order, or ``None``.
  """
  t = table
  n = len(t.occupancies)
  value = np.full((w.final + 1, n), np.inf)
  last = np.zeros((w.final + 1, n, t.opt_take.shape[1]), dtype=int)
  back = np.full((w.final + 1, n, 2), -1, dtype=int)        # (previous cut, option)
  value[0, 0] = 0.0
  need = _memory_need(w, t, micro_batches)
  for k in range(w.final):
    opts = np.flatnonzero(np.isfinite(value[k][t.opt_from]))
    js = t.successors[k]
    if not len(opts) or not len(js):
      continue
    src = t.opt_from[opts]
    xfer = transfer_per_byte(w.spec, last[k, src], t.opt_home[opts])
    base = np.maximum(value[k, src], comm_copies * w.cut_bytes(k) * xfer)
    compute = w.f * (w.cmp_ms[js] - w.cmp_ms[k]) / 1000.0
    cand = np.maximum(base[None], compute[:, None] * t.opt_inverse_speed[opts][None])
    params = w.params[js] - w.params[k]
    if math.isfinite(alpha):
      cand[params[:, None] * t.opt_allreduce[opts][None] > alpha] = np.inf
    if need is not None:
      acts = (w.acts[js] - w.acts[k]) / w.pbs
      cand[params[:, None] * w.parameter_factor + acts[:, None] * need[opts][None] >
           w.memory] = np.inf
    _relax(t, value, last, back, k, js, opts, cand)
  if not np.isfinite(value[w.final]).any():
    return None
  occ = int(np.argmin(value[w.final]))
  return float(value[w.final, occ]), _follow(t, back, w.final, occ)


def _memory_need(w, t, micro_batches):
  """Per option: samples its busiest device holds; later stages number at most the free
  units left, so 1F1B's in-flight bound ``min(M, S - s)`` is checked safely."""
  if w.memory is None or micro_batches is None:
    return None
  later = t.opt_free_after // t.unit
  in_flight = (np.full(later.shape, micro_batches) if w.schedule == "gpipe"
               else np.minimum(micro_batches, later + 1))
  return w.gbs / micro_batches * t.opt_share * in_flight


def _relax(t, value, last, back, k, js, opts, cand):
  """Folds ``cand`` (successors x options) into the states each option leads to."""
  to = t.opt_to[opts]                          # sorted: options are ordered by target
  first = np.flatnonzero(np.diff(to, prepend=-1))
  best = np.minimum.reduceat(cand, first, axis=1)                      # (J, targets)
  counts = np.diff(first, append=len(to))
  hit = cand == np.repeat(best, counts, axis=1)
  pick = np.minimum.reduceat(np.where(hit, np.arange(len(to))[None], len(to)), first, axis=1)
  targets = to[first]
  rows, cols = np.nonzero(best < value[js[:, None], targets[None, :]])
  if len(rows):
    jj, tt, chosen = js[rows], targets[cols], opts[pick[rows, cols]]
    value[jj, tt] = best[rows, cols]
    last[jj, tt] = t.opt_take[chosen]
    back[jj, tt, 0], back[jj, tt, 1] = k, chosen


def _follow(t, back, j, occ):
  stages = []
  while j > 0:
    k, option = (int(x) for x in back[j, occ])
    stages.append((k, j, t.devices[option]))
    j, occ = k, int(t.opt_from[option])
  return tuple(reversed(stages))
