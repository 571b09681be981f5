"""The planner's answer: ``PipelinePlan``, a frozen, printable value with a fixed JSON form.

``to_json_dict()`` is exactly::

  {"stages": [{"layers": ["node4", "node17"], "devices": [0, 1, 2]}, ...],
   "micro_batches": 64, "predicted_iteration_s": 0.123, "speedup": 11.2}

``layers`` names the first and last layer of the stage (inclusive, profile node ids, in
topological order); device ids are global and server-major (see ``devices``).
"""
import dataclasses
import json
from typing import Tuple


@dataclasses.dataclass(frozen=True)
class Stage:
  """One pipeline stage: the layers of state ``last_state`` minus those of state
  ``first_state - 1`` (none when ``first_state == 0``), run data-parallel on ``devices``.

  For a chain, state i is layer i, so the stage is layers ``first_state..last_state``.
  ``compute_ms`` (forward + backward, profiled batch) and ``parameter_bytes`` are the stage's
  totals, for display.
  """
  first_state: int
  last_state: int
  layers: Tuple[str, ...]
  devices: Tuple[int, ...]
  compute_ms: float = 0.0
  parameter_bytes: float = 0.0

  @property
  def first_layer(self):
    return self.layers[0]

  @property
  def last_layer(self):
    return self.layers[-1]

  def __str__(self):
    return "%s..%s (%d layers) on %s" % (self.first_layer, self.last_layer, len(self.layers),
                                        ranges(self.devices))


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
  """Stages with their devices, the micro-batch count and what the cost model predicts.

  ``peak_memory_per_device[d]`` is device d's predicted peak in bytes (0 for an idle device);
  ``data_parallel_speedup`` is pure data parallelism on the same cost model, for comparison.
  """
  stages: Tuple[Stage, ...]
  micro_batches: int
  predicted_iteration_s: float
  speedup: float
  peak_memory_per_device: Tuple[float, ...]
  cost_model: str
  data_parallel_speedup: float
  schedule: str = "1f1b"

  @property
  def is_data_parallel(self):
    return len(self.stages) == 1

  @property
  def replicas(self):
    """Devices per stage, e.g. ``(15, 1)``."""
    return tuple(len(s.devices) for s in self.stages)

  def to_json_dict(self):
    return {
        "stages": [{"layers": [s.first_layer, s.last_layer], "devices": list(s.devices)}
                   for s in self.stages],
        "micro_batches": self.micro_batches,
        "predicted_iteration_s": self.predicted_iteration_s,
        "speedup": self.speedup,
    }

  def to_json(self, indent=None):
    return json.dumps(self.to_json_dict(), indent=indent)

  def __str__(self):
    head = ("%d stage(s) %s, %d micro-batches, %.4g s/iteration, speedup %.2f "
            "(pure DP %.2f) [%s]") % (
        len(self.stages), ":".join(map(str, self.replicas)), self.micro_batches,
        self.predicted_iteration_s, self.speedup, self.data_parallel_speedup, self.cost_model)
    return "\n".join([head] + ["  stage %d: %s" % (i, s) for i, s in enumerate(self.stages)])


def ranges(ids):
  """Compact ids for display: ``ranges((0, 1, 2, 5)) == "0-2,5"``."""
  ids = sorted(ids)
  parts, start = [], None
  for i, d in enumerate(ids):
    if start is None:
      start = d
    if i + 1 == len(ids) or ids[i + 1] != d + 1:
      parts.append(str(start) if start == d else "%d-%d" % (start, d))
      start = None
  return ",".join(parts)
