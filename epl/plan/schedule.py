"""Pipeline schedules as data, and a simulator that checks them without TensorFlow.

A schedule is, per stage, the ordered list of actions that stage runs in one step:
``F3`` = forward of micro-batch 3, ``B3`` = its backward. ``simulate`` replays the lists with
the pipeline's data dependencies (F(s, m) after F(s-1, m); B(s, m) after B(s+1, m) and
F(s, m)), reports deadlocks, the bubble fraction and the peak number of micro-batches each
stage holds activations for (forward done, backward not yet).

Example:
  >>> [str(a) for a in prefer_backward(4, 6)[0]]
  ['F0', 'F1', 'F2', 'F3', 'B0', 'F4', 'B1', 'F5', 'B2', 'B3', 'B4', 'B5']
"""
import dataclasses
from typing import List, Sequence, Tuple

from epl.errors import PlanError


@dataclasses.dataclass(frozen=True)
class Action:
  kind: str          # "F" or "B"
  micro_batch: int

  def __str__(self):
    return "%s%d" % (self.kind, self.micro_batch)


def prefer_backward(num_stages, num_micro_batch):
  """DAPPLE's early backward (1F1B): stage s runs min(S - s, M) warm-up forwards, then
  alternates one backward and one forward, then drains the remaining backwards."""
  schedule = []
  for s in range(num_stages):
    warmup = min(num_stages - s, num_micro_batch)
    actions = [Action("F", m) for m in range(warmup)]
    f, b = warmup, 0
    while b < num_micro_batch:
      actions.append(Action("B", b))
      b += 1
      if f < num_micro_batch:
        actions.append(Action("F", f))
        f += 1
    schedule.append(tuple(actions))
  return tuple(schedule)


def prefer_forward(num_stages, num_micro_batch):
  """GPipe: every forward, then every backward."""
  one = tuple([Action("F", m) for m in range(num_micro_batch)] +
              [Action("B", m) for m in range(num_micro_batch)])
  return tuple(one for _ in range(num_stages))


SCHEDULES = {"PreferBackward": prefer_backward, "PreferForward": prefer_forward}


def make_schedule(strategy, num_stages, num_micro_batch):
  return SCHEDULES[strategy](num_stages, num_micro_batch)


@dataclasses.dataclass(frozen=True)
class SimulationReport:
  makespan: float
  bubble_fraction: float
  peak_in_flight: Tuple[int, ...]          # per stage
  timeline: Tuple[Tuple[int, str, float, float], ...]   # (stage, action, start, end)


class ScheduleDeadlock(PlanError):
  """No stage can run its next action."""


def simulate(schedule: Sequence[Sequence[Action]], forward_time=1.0, backward_time=2.0):
  """Replays ``schedule`` with pipeline dependencies; raises ScheduleDeadlock if stuck."""
  stages = len(schedule)
  done = {}                                   # (kind, stage, m) -> end time
  position = [0] * stages
  free_at = [0.0] * stages
  in_flight, peak = [0] * stages, [0] * stages
  timeline = []
  remaining = sum(len(a) for a in schedule)
  while remaining:
    progressed = False
    for s in range(stages):
      if position[s] == len(schedule[s]):
        continue
      action = schedule[s][position[s]]
      m = action.micro_batch
      if action.kind == "F":
        deps = [("F", s - 1, m)] if s > 0 else []
      else:
        deps = [("F", s, m)] + ([("B", s + 1, m)] if s + 1 < stages else [])
      if not all(d in done for d in deps):
        continue
      start = max([free_at[s]] + [done[d] for d in deps])
      end = start + (forward_time if action.kind == "F" else backward_time)
      done[(action.kind, s, m)] = end
      free_at[s] = end
      timeline.append((s, str(action), start, end))
      in_flight[s] += 1 if action.kind == "F" else -1
      peak[s] = max(peak[s], in_flight[s])
      position[s] += 1
      remaining -= 1
      progressed = True
    if not progressed:
      stuck = ", ".join("stage %d at %s" % (s, schedule[s][position[s]])
                        for s in range(stages) if position[s] < len(schedule[s]))
      raise ScheduleDeadlock("the schedule deadlocks: %s wait for each other" % stuck)
  makespan = max(free_at)
  busy = sum(e - b for _, _, b, e in timeline)
  return SimulationReport(makespan, 1.0 - busy / (stages * makespan), tuple(peak),
                          tuple(sorted(timeline, key=lambda r: (r[2], r[0]))))
