"""The ``simulate`` cost model: replay the pipeline schedule event by event.

The schedule is epl's own (``epl.plan.schedule``: ``prefer_backward`` = DAPPLE's 1F1B,
``prefer_forward`` = GPipe): per stage, the ordered forward/backward actions of every
micro-batch. ``replay`` runs them with

* per-stage forward and backward times of one micro-batch: the micro-batch's samples are
  split among the stage's replicas in proportion to their speed, in whole samples, and the
  slowest replica sets the time;
* one link per cut and direction: activations go forward over ``transfer_s`` (DAPPLE's rule),
  gradients come back the same way, each link carries one transfer at a time;
* after its last backward, a stage all-reduces its gradients (``allreduce_s``), overlapping
  whatever the other stages still run.

The iteration ends when the last stage's all-reduce does. Memory per device: parameters x
``parameter_factor`` plus the activations of the micro-batches in flight (the replay counts
them) for the samples that device holds.

The micro-batch count is searched: every divisor M of the global batch that gives each replica
of the widest stage at least one sample, from the number of stages up. While searching, beyond
``EXACT_MICRO_BATCHES`` the replay runs three shorter schedules and extends each stage's finish
time linearly -- 1F1B and GPipe settle into a period once filled -- and replays in full when
the three points are not on a line. Where links and stages take turns as the bottleneck the
settling is slow and the extension can be off (up to 1% on random stage and link times); so
``finalize`` replays the best plans in full, and the numbers a plan reports are exact.
"""
import dataclasses
import functools
from typing import Tuple

from epl.plan.auto.cost import (Estimate, best_of, divisors, fewest_fitting, fits,
                                peaks_by_device)
from epl.plan.auto.errors import PlannerError
from epl.plan.schedule import prefer_backward, prefer_forward

EXACT_MICRO_BATCHES = 32


@dataclasses.dataclass(frozen=True)
class Replay:
  """Outcome of one replay: when each stage finished its last backward, and how many
  micro-batches each held at most."""
  stage_end: Tuple[float, ...]
  peak_in_flight: Tuple[int, ...]


def replay(num_micro_batches, forward, backward, send, send_back, schedule="1f1b"):
  """Replays the schedule with per-stage times (seconds per micro-batch).

  Args:
    num_micro_batches: M.
    forward, backward: per stage.
    send, send_back: per cut c (stage c -> c + 1): activation and gradient transfer times.
    schedule: "1f1b" or "gpipe".
  Returns:
    ``Replay``.
  Raises:
    PlannerError: the schedule deadlocks (a bug in the schedule, not in the input).
  """
  run = _Run(num_micro_batches, forward, backward, send, send_back,
             _actions(len(forward), num_micro_batches, schedule))
  remaining = sum(len(a) for a in run.actions)
  stages = range(len(forward))
  while remaining:
    # Round-robin over stages: each runs its actions until one waits on another stage.
    moved = 0
    for s in stages:
      moved += run.advance(s)
    if not moved:
      raise PlannerError("the %s schedule deadlocks with %d stages and %d micro-batches" % (
          schedule, len(forward), num_micro_batches))
    remaining -= moved
  return Replay(tuple(run.free), tuple(run.peak))


class _Run:
  """The mutable state of one replay (private to ``replay``): per stage and micro-batch when
  its activation / gradient arrived, when each stage and link is next free, and how many
  micro-batches each stage holds."""

  def __init__(self, m, forward, backward, send, send_back, actions):
    stages = len(forward)
    self.forward, self.backward, self.send, self.send_back = forward, backward, send, send_back
    self.actions = actions
    self.arrived = [[0.0 if s == 0 else -1.0] * m for s in range(stages)]
    self.grad = [[0.0 if s == stages - 1 else -1.0] * m for s in range(stages)]
    self.fdone = [[False] * m for _ in range(stages)]
    self.free = [0.0] * stages
    self.link = [0.0] * stages              # link s carries stage s -> s + 1
    self.link_back = [0.0] * stages         # link_back s carries stage s + 1 -> s
    self.position = [0] * stages
    self.in_flight, self.peak = [0] * stages, [0] * stages
    self.last = stages - 1

  def advance(self, s):
    """Runs stage ``s`` until its next action waits; returns the number of actions run.
    (The hot loop of ``simulate``: plain locals and conditionals, no calls.)"""
    todo, start, t = self.actions[s], self.position[s], self.free[s]
    arrived, grad, done = self.arrived[s], self.grad[s], self.fdone[s]
    link, back, in_flight, peak = self.link, self.link_back, self.in_flight, self.peak
    pos = start
    while pos < len(todo):
      is_forward, m = todo[pos]
      if is_forward:
        if arrived[m] < 0:
          break
        t = (t if t > arrived[m] else arrived[m]) + self.forward[s]
        done[m] = True
        if s < self.last:
          link[s] = (t if t > link[s] else link[s]) + self.send[s]
          self.arrived[s + 1][m] = link[s]
        in_flight[s] += 1
        if in_flight[s] > peak[s]:
          peak[s] = in_flight[s]
      else:
        if grad[m] < 0 or not done[m]:
          break
        t = (t if t > grad[m] else grad[m]) + self.backward[s]
        if s > 0:
          back[s - 1] = (t if t > back[s - 1] else back[s - 1]) + self.send_back[s - 1]
          self.grad[s - 1][m] = back[s - 1]
        in_flight[s] -= 1
      pos += 1
    self.position[s], self.free[s] = pos, t
    return pos - start


@functools.lru_cache(maxsize=256)
def _actions(stages, num_micro_batches, schedule):
  make = prefer_backward if schedule == "1f1b" else prefer_forward
  return tuple(tuple((a.kind == "F", a.micro_batch) for a in stage)
               for stage in make(stages, num_micro_batches))


def replay_long(num_micro_batches, forward, backward, send, send_back, schedule="1f1b",
                exact=False):
  """``replay``, or past ``EXACT_MICRO_BATCHES`` (unless ``exact``) three shorter replays
  extended linearly (see the module docstring)."""
  stages = len(forward)
  if exact or num_micro_batches <= EXACT_MICRO_BATCHES:
    return replay(num_micro_batches, forward, backward, send, send_back, schedule)
  step = stages + 1
  base = max(2 * stages + 2, EXACT_MICRO_BATCHES - 2 * step)
  runs = [replay(base + i * step, forward, backward, send, send_back, schedule)
          for i in range(3)]
  ends = []
  for s in range(stages):
    e0, e1, e2 = (r.stage_end[s] for r in runs)
    if abs((e2 - e1) - (e1 - e0)) > 1e-9 * max(1.0, abs(e2)):
      return replay(num_micro_batches, forward, backward, send, send_back, schedule)
    ends.append(e0 + (e1 - e0) * (num_micro_batches - base) / step)
  peak = runs[0].peak_in_flight
  if schedule == "gpipe":
    peak = (num_micro_batches,) * stages
  return Replay(tuple(ends), peak)


def split_samples(batch, speeds):
  """Splits ``batch`` whole samples in proportion to ``speeds`` (largest remainder)."""
  total = sum(speeds)
  exact = [batch * v / total for v in speeds]
  counts = [int(x) for x in exact]
  order = sorted(range(len(speeds)), key=lambda i: (-(exact[i] - counts[i]), i))
  for i in order[:batch - sum(counts)]:
    counts[i] += 1
  return counts


class SimulateModel:
  """See the module docstring."""
  name = "simulate"
  polish_budget = 150     # evaluations the local search may spend
  # 1F1B keeps only S - s micro-batches in flight on stage s, so a slow link stalls the
  # pipeline more than its occupancy suggests: the DP also runs counting each cut twice.
  comm_copies = (1.0, 2.0)

  def unit_sizes(self, w):
    return (1,)

  def dp_micro_batches(self, w, unit):
    # No check in the DP first (evaluate still checks memory exactly), then DPs that check
    # memory at a few micro-batch counts spread geometrically over the divisors of gbs.
    if w.memory is None:
      return (None,)
    options = [d for d in divisors(w.gbs) if d >= 2] or [1]
    picks = sorted({options[round(i * (len(options) - 1) / 5)] for i in range(6)})
    return (None,) + tuple(picks)

  def lower_bound(self, w, bottleneck, comm_copies):
    # Each link direction carries one copy of a cut's bytes; compute counts once.
    return bottleneck / max(1.0, comm_copies)

  def micro_batch_options(self, w, placed):
    """Divisors M of gbs that give every replica a sample, those >= the stage count if any."""
    valid = [m for m in divisors(w.gbs) if self.can_run(w, placed, m)]
    long_enough = [m for m in valid if m >= len(placed)]
    return tuple(long_enough) if long_enough else tuple(valid[-1:])

  @staticmethod
  def can_run(w, placed, m):
    """Whether ``m`` micro-batches split gbs evenly and give each replica a sample."""
    return m >= 1 and w.gbs % m == 0 and w.gbs // m >= max(len(d) for _, _, d in placed)

  def quick_bound(self, w, placed):
    """A lower bound of the iteration: the slowest stage's compute for the global batch."""
    return max(w.compute_s(k, j) / w.speed_of(d) for k, j, d in placed)

  def evaluate_near(self, w, placed, estimate):
    """``evaluate`` over the micro-batch counts next to ``estimate``'s (local search)."""
    return self._around(w, placed, estimate.micro_batches, exact=False)

  def evaluate(self, w, placed, micro_batches=None):
    """Best replay over the micro-batch counts (or exactly ``micro_batches``); ``None`` when
    the global batch cannot give every replica a sample."""
    options = (micro_batches,) if micro_batches else self.micro_batch_options(w, placed)
    return best_of(self._evaluate(w, placed, m) for m in options if self.can_run(w, placed, m))

  def finalize(self, w, placed, estimate, fixed=False):
    """Full replay at ``estimate``'s micro-batch count and its neighbours (``fixed``: at that
    count only)."""
    if fixed:
      m = estimate.micro_batches
      return self._evaluate(w, placed, m, exact=True) if self.can_run(w, placed, m) else None
    return self._around(w, placed, estimate.micro_batches, exact=True)

  def _around(self, w, placed, m, exact):
    return best_of(self._evaluate(w, placed, x, exact) for x in (m // 2, m, m * 2)
                   if self.can_run(w, placed, x))

  def _evaluate(self, w, placed, m, exact=False):
    batch = w.gbs // m
    spec = w.spec
    forward, backward, shares = [], [], []
    for k, j, devices in placed:
      samples = split_samples(batch, [w.speeds[d] for d in devices])
      slowest = max(n / w.speeds[d] for n, d in zip(samples, devices))
      per_sample_f = w.forward_s(k, j) / w.gbs
      per_sample_b = (w.compute_s(k, j) - w.forward_s(k, j)) / w.gbs
      forward.append(slowest * per_sample_f)
      backward.append(slowest * per_sample_b)
      shares.append(samples)
    send, back = [], []
    for (_, j, src), (_, _, dst) in zip(placed, placed[1:]):
      nbytes = w.cut_bytes(j) / m
      send.append(spec.transfer_s(nbytes, src, dst))
      back.append(spec.transfer_s(nbytes, dst, src))
    run = replay_long(m, forward, backward, send, back, w.schedule, exact)
    finish = max(end + spec.allreduce_s(devices, w.parameters(k, j))
                 for end, (k, j, devices) in zip(run.stage_end, placed))
    per_stage = [(devices, w.stage_memory(k, j, devices, [n * run.peak_in_flight[s]
                                                          for n in shares[s]]))
                 for s, (k, j, devices) in enumerate(placed)]
    peaks = peaks_by_device(w, per_stage)
    return Estimate(finish, m, peaks, fits(w, peaks))

  def data_parallel(self, w):
    """All devices (at most one per sample) on the whole model; accumulates gradients over
    the fewest micro-batches that fit memory.

    Returns:
      ``(placed, Estimate)``.
    """
    devices = tuple(range(min(w.spec.num_devices, w.gbs)))
    placed = ((0, w.final, devices),)
    counts = [m for m in divisors(w.gbs) if self.can_run(w, placed, m)]
    return placed, fewest_fitting(self._evaluate(w, placed, m, exact=True) for m in counts)
