"""``balance_stages``: split a list of per-layer costs into k contiguous stages, minimising the
most expensive stage -- the split for ``auto.auto_parallel`` with ``pipeline.num_stages``
(``epl/runtime/auto_stages.py``), given each layer's profiled cost.

Exact dynamic program over prefix sums, vectorised per stage count: ``O(k n^2)`` array cells,
milliseconds for a few thousand layers. Among optimal splits it returns the one whose stages
end as late as possible from the back, i.e. the earlier stages take the spare layers; the
choice is deterministic.

Example:
  >>> balance_stages([4, 1, 1, 1, 1, 4], 3)
  ((0, 0), (1, 4), (5, 5))
"""
import numpy as np

from epl.plan.auto.errors import PlannerError


def balance_stages(layer_costs, num_stages):
  """Contiguous partition of ``layer_costs`` into ``num_stages`` stages with the smallest
  maximum stage cost.

  Args:
    layer_costs: per-layer costs (seconds, FLOPs...), each >= 0, in pipeline order.
    num_stages: k >= 1, at most the number of layers (every stage gets a layer).
  Returns:
    A tuple of ``(first, last)`` layer indices per stage, inclusive.
  Raises:
    PlannerError: no layers, a negative or non-finite cost, or k out of range.
  """
  costs = np.asarray(list(layer_costs), dtype=float)
  n = len(costs)
  if n == 0:
    raise PlannerError("balance_stages got no layer costs")
  if not np.all(np.isfinite(costs)) or np.any(costs < 0):
    bad = int(np.argmax(~np.isfinite(costs) | (costs < 0)))
    raise PlannerError("layer_costs[%d]=%r: every cost must be a finite number >= 0" % (
        bad, float(costs[bad])))
  if int(num_stages) != num_stages or not 1 <= num_stages <= n:
    raise PlannerError("num_stages=%r must be a whole number in 1..%d (one layer per stage "
                       "at least)" % (num_stages, n))
  k = int(num_stages)
  prefix = np.concatenate([[0.0], np.cumsum(costs)])
  # best[s][i]: smallest max cost of splitting layers [0, i) into s stages.
  best = np.full((k + 1, n + 1), np.inf)
  cut = np.zeros((k + 1, n + 1), dtype=int)
  best[0][0] = 0.0
  for s in range(1, k + 1):
    for i in range(s, n - (k - s) + 1):
      starts = np.arange(s - 1, i)                  # the last stage is [start, i)
      values = np.maximum(best[s - 1][starts], prefix[i] - prefix[starts])
      # Latest start among the optimal ones: later stages stay short, earlier ones absorb.
      pick = len(values) - 1 - int(np.argmin(values[::-1]))
      best[s][i], cut[s][i] = values[pick], starts[pick]
  stages, end = [], n
  for s in range(k, 0, -1):
    start = int(cut[s][end])
    stages.append((start, end - 1))
    end = start
  return tuple(reversed(stages))
