"""Local search on finished plans, scored by the exact cost model.

The DP optimises the bottleneck and the largest all-reduce; the cost models also reward what
it cannot see -- an all-reduce hidden behind the blocks of the stages before it, transfers per
micro-batch, integer micro-batch splits, device orders outside the searched layouts. This pass
closes that gap greedily: from a plan it tries, in a fixed order,

1. moving a stage boundary to another cut between its neighbours (nearest first);
2. moving one device from a stage to the next or the previous one;
3. giving an idle device to a stage, or leaving one of a stage's devices idle;
4. swapping one device between two adjacent stages (changes which servers they span);
5. merging two adjacent stages;

takes the first move that makes the iteration strictly faster and still fits memory, and
starts over, until no move helps or ``budget`` evaluations are spent. Deterministic.
"""
import itertools

SAME = 1e-12       # relative gain below this is noise, not an improvement


def _boundary_moves(w, preds, placed):
  for s in range(len(placed) - 1):
    k, j, devs = placed[s]
    _, j2, devs2 = placed[s + 1]
    between = [c for c in range(1, w.final) if c != j and k in preds[c] and c in preds[j2]]
    # Nearest cuts first: small shifts are the likely gains, and the first gain is taken.
    for c in sorted(between, key=lambda c: (abs(c - j), c)):
      yield placed[:s] + ((k, c, devs), (c, j2, devs2)) + placed[s + 2:]


def _device_moves(placed):
  for s in range(len(placed)):
    k, j, devs = placed[s]
    if len(devs) < 2:
      continue
    for t in (s - 1, s + 1):
      if not 0 <= t < len(placed):
        continue
      kt, jt, devt = placed[t]
      for d in devs:
        moved = list(placed)
        moved[s] = (k, j, tuple(x for x in devs if x != d))
        moved[t] = (kt, jt, tuple(sorted(devt + (d,))))
        yield tuple(moved)


def _idle_moves(w, placed):
  used = {d for _, _, devs in placed for d in devs}
  idle = [d for d in range(w.spec.num_devices) if d not in used]
  for s, (k, j, devs) in enumerate(placed):
    for d in idle:
      yield placed[:s] + ((k, j, tuple(sorted(devs + (d,)))),) + placed[s + 1:]


def _drops(placed):
  for s, (k, j, devs) in enumerate(placed):
    if len(devs) > 1:
      for d in devs:
        yield placed[:s] + ((k, j, tuple(x for x in devs if x != d)),) + placed[s + 1:]


def _swaps(w, placed):
  server = w.spec.server_of
  for s in range(len(placed) - 1):
    k, j, devs = placed[s]
    k2, j2, devs2 = placed[s + 1]
    for d in devs:
      for e in devs2:
        if server(d) == server(e):
          continue                  # same server: an identical plan
        moved = list(placed)
        moved[s] = (k, j, tuple(sorted(x if x != d else e for x in devs)))
        moved[s + 1] = (k2, j2, tuple(sorted(x if x != e else d for x in devs2)))
        yield tuple(moved)


def _merges(placed):
  for s in range(len(placed) - 1):
    k, _, devs = placed[s]
    _, j2, devs2 = placed[s + 1]
    yield placed[:s] + ((k, j2, tuple(sorted(devs + devs2))),) + placed[s + 2:]


def polish(w, model, placed, estimate, budget):
  """Greedy descent from ``placed`` (see the module docstring).

  Returns:
    ``(placed, estimate, evaluations)`` of the best plan reached.
  """
  preds = [set(int(k) for k in p) for p in w.preds]
  spent = 0
  improved = True
  while improved and spent < budget:
    improved = False
    moves = itertools.chain(_boundary_moves(w, preds, placed), _device_moves(placed),
                            _idle_moves(w, placed), _drops(placed), _swaps(w, placed),
                            _merges(placed))
    for candidate in moves:
      if spent >= budget:
        break
      if model.quick_bound(w, candidate) >= estimate.iteration_s:
        continue
      spent += 1
      est = model.evaluate_near(w, candidate, estimate)
      if est is None or not est.fits:
        continue
      if est.iteration_s < estimate.iteration_s * (1 - SAME):
        placed, estimate, improved = candidate, est, True
        break
  return placed, estimate, spent
