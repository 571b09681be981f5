"""Cost models behind one interface, chosen by name, and the helpers they share.

A cost model scores a *placed plan*: a tuple of stages ``(k, j, devices)`` (cuts of a
``Workload`` and global device ids), and says how the search may vary the micro-batch count.

=============  ===========================================================================
``dapple``     DAPPLE's analytical formula (``dapple.py``), so plans compare with the
               published planner on its own ruler.
``dapple-published``  the same formula with the published planner's quirks reproduced
               (its all-reduce counts the next stage's first layer; two-stage splits are
               also scored with one copy of the activations and one micro-batch per sample).
``simulate``   an event-level replay of the 1F1B or GPipe schedule with per-stage times,
               point-to-point links and all-reduce, integer micro-batch splits and per-device
               memory (``simulate.py``).
=============  ===========================================================================

``comm_copies`` (DAPPLE's k) is the number of copies of a cut's activations the pipeline
bottleneck counts: DAPPLE counts 2 (activations forward, gradients back over one link).

Every model implements:

* ``evaluate(w, placed, micro_batches=None) -> Estimate or None`` -- iteration seconds, the
  micro-batch count used and each device's peak memory. ``micro_batches=None``: the model
  picks the fastest count that fits memory; an int: exactly that count (``None`` when the
  model cannot run the plan with it).
* ``data_parallel(w) -> (placed, Estimate)`` -- pure data parallelism over every device, with
  the fewest micro-batches (gradient accumulation steps) that fit memory.
* ``unit_sizes(w)`` -- replica-unit sizes the search runs one DP per (stage device counts are
  multiples of the unit); ``dp_micro_batches(w, unit)`` -- the micro-batch counts the DP's
  memory check assumes, one DP each (``None``: no check in the DP, only in ``evaluate``).
* ``comm_copies`` -- the values of k the search runs one DP family per.
* ``lower_bound(w, bottleneck, comm_copies)`` -- no plan whose DP bottleneck (counting
  ``comm_copies`` copies of each cut) is ``bottleneck`` seconds per global batch can finish an
  iteration faster than this; ``quick_bound(w, placed)`` -- the same for a placed plan, cheap.
* ``evaluate_near(w, placed, estimate)`` -- ``evaluate`` restricted to micro-batch counts
  near ``estimate``'s (the local search's neighbours); ``polish_budget`` -- its evaluations;
  ``finalize(w, placed, estimate, fixed=False)`` -- the exact score of a finalist (with
  ``fixed``: at ``estimate``'s micro-batch count only) (``simulate`` replays in
  full what it extrapolated while searching).
"""
import dataclasses
import math
from typing import Optional, Tuple


@dataclasses.dataclass(frozen=True)
class Estimate:
  """What a cost model predicts for one placed plan."""
  iteration_s: float
  micro_batches: int
  peak_memory: Tuple[float, ...]      # bytes, per global device id (0: idle)
  fits: bool = True                   # every device within the memory limit

  def __str__(self):
    return "%.4g s/iteration with %d micro-batches, peak %.3g GiB%s" % (
        self.iteration_s, self.micro_batches, max(self.peak_memory) / 2.0 ** 30,
        "" if self.fits else " (over the memory limit)")


def divisors(n):
  """The divisors of ``n`` in increasing order: ``divisors(12) == [1, 2, 3, 4, 6, 12]``."""
  small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
  return sorted(set(small + [n // d for d in small]))


def fits(w, peak_memory):
  return w.memory is None or max(peak_memory) <= w.memory * (1 + 1e-12)


def peaks_by_device(w, per_stage):
  """Scatters ``[(devices, per-device bytes), ...]`` into a tuple indexed by device id."""
  peaks = [0.0] * w.spec.num_devices
  for devices, values in per_stage:
    for d, v in zip(devices, values):
      peaks[d] = max(peaks[d], v)
  return tuple(peaks)


def best_of(estimates) -> Optional[Estimate]:
  """The fastest estimate that fits memory; else the one with the smallest peak."""
  estimates = [e for e in estimates if e is not None]
  if not estimates:
    return None
  fitting = [e for e in estimates if e.fits]
  if fitting:
    return min(fitting, key=lambda e: (e.iteration_s, e.micro_batches))
  return leanest(estimates)


def leanest(estimates):
  """The estimate with the smallest peak on any device (ties: the faster)."""
  return min(estimates, key=lambda e: (max(e.peak_memory), e.iteration_s))


def fewest_fitting(estimates):
  """The first estimate that fits memory, from estimates in increasing micro-batch order
  (evaluated lazily: stops at the first fit); else the leanest of them."""
  seen = []
  for est in estimates:
    if est.fits:
      return est
    seen.append(est)
  return leanest(seen)
