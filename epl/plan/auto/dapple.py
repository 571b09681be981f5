"""DAPPLE's analytical cost model, as the published planner (HPGO) computes it.

All times in seconds for one global batch, sizes in bytes, ``f = gbs / pbs``:

* ``T1 = f x sum(forward + backward ms) / 1000``: the whole global batch on one device.
* Stage s: ``C_s = f x`` its compute, ``P_s`` its parameters (not scaled), devices ``g_s``.
  Cut c (between stage c and c+1) sends ``A_c = f x`` its output activations.
* A plan has a replica unit ``rp`` (every stage's device count is a multiple of it) and
  ``M = gbs // rp`` micro-batches.
* ``PT = max(max_s C_s / |g_s|, max_c X(k A_c, g_c, g_c+1))``, ``block = PT / M``, with
  ``k = 2`` copies of the activations (forward, and their gradients back): ``comm_copies``.
* ``L = block (M - 1) + T1 / (rp M) + sum_c X(A_c / (rp M), g_c, g_c+1)``.
* ``delta = max(0, max_s AR(g_s, P_s) - s x block)``: the all-reduce of stage s overlaps
  the ``s`` blocks the stages before it still run.
* ``iteration = L + delta``, ``speedup = T1 / iteration``.
* Pure data parallelism: ``T1 / N + AR(all N devices, all parameters)``.

``AR`` and ``X`` are ``DeviceSpec.allreduce_s`` and ``DeviceSpec.transfer_s``. With relative
device speeds (Whale-style heterogeneous devices, each replica gets a share of the batch
proportional to its speed) ``|g_s|`` becomes the stage's summed speed and ``T1 / (rp M)`` the
sum of ``C_s / (rp M x mean speed of g_s)``; with all speeds 1 both are DAPPLE's terms.

``published=True`` also reproduces two quirks of the published planner, to match its numbers:
the all-reduce of a stage that is not the last counts the parameters of the next stage's first
state too, and two-stage plans are also scored as its bipartition search does (``rp = 1`` and
one copy of the activations in ``PT``), keeping the better score.

Memory (not part of DAPPLE's model): 1F1B keeps ``min(S - s, M)`` micro-batches in flight on
stage s (GPipe: all ``M``), each of ``gbs / M`` samples shared among its devices by speed.

Example (two stages of a 2-cut workload ``w`` on devices 0 and 1; tests/test_planner.py works
one such case by hand):
  >>> DappleModel().evaluate(w, ((0, 1, (0,)), (1, 2, (1,)))).iteration_s
"""
import math

from epl.plan.auto.cost import Estimate, best_of, divisors, fewest_fitting, fits, peaks_by_device


class DappleModel:
  """See the module docstring."""
  polish_budget = 3000     # evaluations the local search may spend
  comm_copies = (2.0,)     # DAPPLE's k: activations forward + gradients back

  def __init__(self, published=False):
    self.published = published
    self.name = "dapple-published" if published else "dapple"

  # --- what the search asks ---------------------------------------------------------------
  def unit_sizes(self, w):
    # DAPPLE's units: N // i devices for i = 2..N (fewer units than i are searched too).
    n = w.spec.num_devices
    return tuple(sorted({n // i for i in range(2, n + 1) if w.gbs // (n // i) >= 1}))

  def dp_micro_batches(self, w, unit):
    # With a memory limit, also a DP that leaves memory to ``evaluate`` alone: the DP's check
    # assumes the worst number of micro-batches in flight and can miss plans that fit.
    return (w.gbs // unit,) if w.memory is None else (None, w.gbs // unit)

  def lower_bound(self, w, bottleneck, comm_copies):
    # PT >= the bottleneck rescaled from comm_copies to the fewest copies this model scores
    # with (2; 1 for dapple-published's bipartition), never above it. The plan may be scored
    # with a larger unit than it was found with, so M is at least gbs // N.
    own = 1.0 if self.published else 2.0
    pt = bottleneck * min(1.0, own / comm_copies)
    m = max(1, w.gbs // w.spec.num_devices)
    return pt * (m - 1) / m

  def quick_bound(self, w, placed):
    """A lower bound of the iteration from the slowest stage alone."""
    m = max(1, w.gbs // w.spec.num_devices)
    return max(w.compute_s(k, j) / w.speed_of(d) for k, j, d in placed) * (m - 1) / m

  def evaluate_near(self, w, placed, estimate):
    return self.evaluate(w, placed)

  def finalize(self, w, placed, estimate, fixed=False):
    return estimate                    # the formula is already exact

  # --- scoring ------------------------------------------------------------------------------
  def evaluate(self, w, placed, micro_batches=None):
    """Scores ``placed`` (``((k, j, devices), ...)``) with the best replica unit.

    The units tried are the divisors rp of the stages' common device count (``M = gbs //
    rp``); with ``micro_batches`` only those giving that M. Returns the fastest that fits
    memory (see ``cost.best_of``), or ``None`` when no unit gives ``micro_batches``.
    """
    common = 0
    for _, _, devices in placed:
      common = math.gcd(common, len(devices))
    units = [u for u in divisors(common) if w.gbs // u >= 1 and
             micro_batches in (None, w.gbs // u)]
    scored = [self._estimate(w, placed, self.iteration_s(w, placed, rp), w.gbs // rp)
              for rp in units]
    if self.published and len(placed) == 2 and micro_batches in (None, w.gbs):
      # HPGO's bipartition search: rp = 1 and one copy of the cut's bytes in PT.
      scored.append(self._estimate(w, placed, self.iteration_s(w, placed, 1, comm_copies=1.0),
                                   w.gbs))
    return best_of(scored)

  def iteration_s(self, w, placed, rp, comm_copies=2.0):
    """``L + delta`` of the module docstring for replica unit ``rp``; ``comm_copies`` is k."""
    spec = w.spec
    m = w.gbs // rp
    stage_times, fill = [], 0.0
    for k, j, devices in placed:
      compute = w.compute_s(k, j)
      speed = w.speed_of(devices)
      stage_times.append(compute / speed)
      fill += compute * len(devices) / speed / (rp * m)
    cuts = []
    for (_, j, src), (_, _, dst) in zip(placed, placed[1:]):
      cuts.append((w.cut_bytes(j), src, dst))
    pt = max(stage_times + [spec.transfer_s(comm_copies * a, src, dst) for a, src, dst in cuts])
    block = pt / m
    length = block * (m - 1) + fill
    length += sum(spec.transfer_s(a / (rp * m), src, dst) for a, src, dst in cuts)
    delta = 0.0
    for s, (k, j, devices) in enumerate(placed):
      params = w.parameters(k, j)
      if self.published and s + 1 < len(placed):
        params = self._published_parameters(w, k, j)
      delta = max(delta, spec.allreduce_s(devices, params) - s * block)
    return length + delta

  def _published_parameters(self, w, k, j):
    # HPGO reads parameter_sizes[first][next_first]: through the next stage's first state.
    nxt = w.cut_state[j] + 1
    states = w.states
    if nxt >= len(states):
      return w.parameters(k, j)
    return float(states[nxt].parameter_bytes - w.params[k])

  def _estimate(self, w, placed, time, m):
    mbs = w.gbs / m
    per_stage = []
    num = len(placed)
    for s, (k, j, devices) in enumerate(placed):
      in_flight = m if w.schedule == "gpipe" else min(num - s, m)
      speed = w.speed_of(devices)
      samples = [in_flight * mbs * w.speeds[d] / speed for d in devices]
      per_stage.append((devices, w.stage_memory(k, j, devices, samples)))
    peaks = peaks_by_device(w, per_stage)
    return Estimate(time, m, peaks, fits(w, peaks))

  def data_parallel(self, w):
    """``T1 / N + AR(all devices, all parameters)``; accumulates gradients over the fewest
    micro-batches that fit memory (the time does not change).

    Returns:
      ``(placed, Estimate)``.
    """
    devices = tuple(range(w.spec.num_devices))
    placed = ((0, w.final, devices),)
    time = w.t1 / w.speed_of(devices) + w.spec.allreduce_s(devices, w.total_parameters)
    return placed, fewest_fitting(self._estimate(w, placed, time, m) for m in divisors(w.gbs))
