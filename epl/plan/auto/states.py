"""Partition units ("states") of a profile graph: PipeDream's antichain construction.

A pipeline cut through a layer graph that is not a chain must leave every edge pointing
forward, so each stage boundary is a *downset* D: a set of layers closed under predecessors
(everything before the cut). PipeDream walks these from the first source: from D it moves to
``D + ancestors(y)`` for every layer y outside D with a parent inside. Every downset found is a
state; a stage is ``D_j - D_k`` for two states with ``D_k`` strictly inside ``D_j`` -- for a
chain, state i is "layers 0..i" and a stage is a contiguous range of layers.

What a cut sends forward is the output of the cut's *augmented antichain*: its maximal layers
plus every earlier layer whose output still crosses the cut. For BERT/XLNet the attention mask
feeds every layer, so each cut carries a layer's activation plus the mask.

As in PipeDream (and DAPPLE, which embeds its code), ``Input*`` sources are dropped first (the
input always lives on stage 0) and ``__getitem__`` sinks are dropped (they feed nothing).

Example:
  >>> states = build_states(Profile.load("vgg-19-pbs-32.txt"))
  >>> len(states), round(states[-1].compute_ms, 2)   # one state per layer; Input dropped
  (25, 144.21)
"""
import dataclasses
from typing import Tuple

from epl.plan.auto.errors import PlannerError
from epl.plan.auto.profile import topological_order

# Beyond this many cuts the O(S^2) stage tables stop being cheap. GNMT-16 has 1,495; GNMT-32's
# full graph has 376,887 and is planned over the cuts of one topological order instead.
MAX_STATES = 4000


@dataclasses.dataclass(frozen=True)
class State:
  """One cut: the layers before it (``members``, a bitmask over ``States.layer_ids``) with
  cumulative costs, and the bytes that cross it per profiled batch."""
  index: int
  members: int
  size: int                  # number of layers before the cut
  forward_ms: float          # forward of every layer before the cut
  compute_ms: float          # forward + backward of every layer before the cut
  parameter_bytes: float
  activation_bytes: float    # outputs of every layer before the cut (kept for backward)
  output_bytes: float        # what crosses the cut: the augmented antichain's outputs
  frontier: Tuple[str, ...]  # the augmented antichain, layer ids

  def __str__(self):
    return "state %d: %d layers, %.3g ms, sends %.3g MB across %s" % (
        self.index, self.size, self.compute_ms, self.output_bytes / 1e6, ",".join(self.frontier))


@dataclasses.dataclass(frozen=True)
class States:
  """All states of a profile in a topological order (by size), and the layers they cover.

  ``states[-1]`` covers the whole model. ``predecessors[j]`` are the indices k < j whose
  layers lie strictly inside state j's: the stages that may end at j start after one of them.
  """
  layer_ids: Tuple[str, ...]       # kept layers, topological order
  layer_names: Tuple[str, ...]
  states: Tuple[State, ...]
  predecessors: Tuple[Tuple[int, ...], ...]
  dropped: Tuple[str, ...]         # Input* sources and __getitem__ sinks
  linear: bool = False             # True: too many cuts, only those along one topological order

  def __len__(self):
    return len(self.states)

  def __getitem__(self, i):
    return self.states[i]

  @property
  def is_chain(self):
    return all(p == tuple(range(j)) for j, p in enumerate(self.predecessors)) and \
        len(self.states) == len(self.layer_ids)

  def stage_layers(self, start, end):
    """Layer ids of the stage after state ``start`` up to state ``end`` (topological order);
    ``start = -1`` means from the beginning of the model."""
    below = self.states[start].members if start >= 0 else 0
    mask = self.states[end].members & ~below
    return tuple(lid for i, lid in enumerate(self.layer_ids) if mask >> i & 1)

  def __str__(self):
    kind = "chain" if self.is_chain else "graph"
    if self.linear:
      kind = "graph with too many cuts: cut along one topological order"
    return "%d states over %d layers (%s, dropped %s)" % (
        len(self.states), len(self.layer_ids), kind, ", ".join(self.dropped) or "nothing")


class _TooManyCuts(Exception):
  pass


class _Graph:
  """The profile's layers as bit positions, with ancestor masks."""

  def __init__(self, profile):
    nodes = {n.id: n for n in profile.nodes}
    parents = {n.id: set() for n in profile.nodes}
    children = {n.id: set() for n in profile.nodes}
    for a, b in profile.edges:
      parents[b].add(a)
      children[a].add(b)
    # Same drops as PipeDream's optimizer: the input is never a partition choice, and
    # __getitem__ sinks are dead ends of multi-output layers.
    dropped = [i for i in nodes if not parents[i] and nodes[i].name.startswith("Input")]
    for i in dropped:
      _remove(i, parents, children)
    sinks = [i for i in nodes if i not in dropped and not children[i] and
             nodes[i].name.startswith("__getitem__")]
    for i in sinks:
      _remove(i, parents, children)
    gone = set(dropped) | set(sinks)
    self.dropped = tuple(dropped + sinks)
    self.ids = tuple(i for i in topological_order(profile) if i not in gone)
    if not self.ids:
      raise PlannerError("%s has no layer besides its Input nodes" % profile.source)
    bit = {lid: k for k, lid in enumerate(self.ids)}
    self.nodes = [nodes[i] for i in self.ids]
    self.parents = [sum(1 << bit[p] for p in parents[i]) for i in self.ids]
    self.children = [sum(1 << bit[c] for c in children[i]) for i in self.ids]
    self.ancestors = []                  # inclusive
    for k in range(len(self.ids)):       # topological: parents are done first
      mask = 1 << k
      for p in _bits(self.parents[k]):
        mask |= self.ancestors[p]
      self.ancestors.append(mask)
    # The first remaining source in file order starts the walk, as in PipeDream.
    order = {n.id: i for i, n in enumerate(profile.nodes)}
    sources = [k for k in range(len(self.ids)) if not self.parents[k]]
    self.first = min(sources, key=lambda k: order[self.ids[k]])


def _remove(node_id, parents, children):
  for p in parents.pop(node_id):
    children[p].discard(node_id)
  for c in children.pop(node_id):
    parents[c].discard(node_id)


def _bits(mask):
  while mask:
    low = mask & -mask
    yield low.bit_length() - 1
    mask ^= low


def _walk(graph, limit):
  """All downsets reachable from the first source, by PipeDream's one-layer-at-a-time rule."""
  start = graph.ancestors[graph.first]
  seen = {start}
  queue = [start]
  while queue:
    members = queue.pop()
    reach = 0
    for k in _bits(members):
      reach |= graph.children[k]
    for y in _bits(reach & ~members):
      bigger = members | graph.ancestors[y]
      if bigger not in seen:
        seen.add(bigger)
        queue.append(bigger)
        if len(seen) > limit:
          raise _TooManyCuts()
  full = (1 << len(graph.ids)) - 1
  if full not in seen:
    raise PlannerError(
        "the profile graph is not connected: layers %s cannot be reached from %s" % (
            ", ".join(graph.ids[k] for k in _bits(full & ~max(seen, key=_popcount))[:5]),
            graph.ids[graph.first]))
  return sorted(seen, key=lambda m: (_popcount(m), _members_key(m)))


def _popcount(mask):
  return bin(mask).count("1")


def _members_key(mask):
  # Deterministic order among cuts of equal size: by their layers.
  return tuple(k for k in _bits(mask))


def _frontier(graph, members):
  """The augmented antichain: maximal layers, plus earlier layers that feed a layer outside
  the ancestors of the maximal layer they precede (PipeDream's rule, byte for byte)."""
  maximal = [k for k in _bits(members) if not graph.children[k] & members]
  extra = 0
  for a in maximal:
    strict = graph.ancestors[a] & ~(1 << a)
    for p in _bits(strict):
      if graph.children[p] & ~graph.ancestors[a]:
        extra |= 1 << p
  return sorted(set(_bits(extra)) | set(maximal))


def build_states(profile, limit=MAX_STATES):
  """Builds the states of ``profile`` (see the module docstring).

  Args:
    profile: a ``Profile``.
    limit: above this many cuts, use only the prefixes of one topological order.
  Returns:
    ``States``, smallest cut first; the last state holds every layer.
  Raises:
    PlannerError: the graph is not connected.
  """
  graph = _Graph(profile)
  linear = False
  try:
    masks = _walk(graph, limit)
  except _TooManyCuts:
    # Every prefix of a topological order is a downset: a subset of the cuts, always valid.
    linear = True
    masks = [(1 << (k + 1)) - 1 for k in range(len(graph.ids))]
  fwd = [n.forward_ms for n in graph.nodes]
  compute = [n.compute_ms for n in graph.nodes]
  params = [n.parameter_bytes for n in graph.nodes]
  acts = [n.activation_bytes for n in graph.nodes]
  states = []
  for index, members in enumerate(masks):
    layers = list(_bits(members))
    frontier = _frontier(graph, members)
    states.append(State(
        index, members, len(layers), sum(fwd[k] for k in layers),
        sum(compute[k] for k in layers),
        sum(params[k] for k in layers), sum(acts[k] for k in layers),
        sum(acts[k] for k in frontier), tuple(graph.ids[k] for k in frontier)))
  return States(tuple(graph.ids), tuple(n.name for n in graph.nodes), tuple(states),
                _predecessors(masks), graph.dropped, linear)


def _predecessors(masks):
  """For each state, the earlier states strictly inside it (subset test on bitmasks)."""
  result = []
  for j, mj in enumerate(masks):
    result.append(tuple(k for k in range(j) if masks[k] & mj == masks[k] and masks[k] != mj))
  return tuple(result)


def _signature(state):
  # Rounded so that the same layers summed in another order compare equal.
  return tuple(float("%.9g" % v) for v in (state.forward_ms, state.compute_ms,
                                            state.parameter_bytes, state.activation_bytes))


def representative_states(states, signature=_signature):
  """The states a search needs: one per cost signature, when that loses nothing.

  Cuts that differ only by zero-cost layers (``__getitem__``, ``Add``, a ``hidden`` source)
  have the same compute, parameters and activations before them; only the bytes they send
  differ. Keeping, per signature, the cut that sends the least is exact as long as every
  stage ``k -> j`` of the full set maps to a stage ``rep(k) -> rep(j)``; signatures where that
  fails keep all their cuts. GNMT-16 drops from 1,495 states to about 70 this way.

  Args:
    states: ``States``.
    signature: state -> hashable; states with equal signatures cost the same as stage ends.
  Returns:
    Sorted indices of the kept states (always including the last, whole-model state).
  """
  n = len(states)
  group = [signature(s) for s in states.states]
  members = {}
  for i, g in enumerate(group):
    members.setdefault(g, []).append(i)
  best = {g: min(idx, key=lambda i: (states[i].output_bytes, i)) for g, idx in members.items()}
  best[group[n - 1]] = n - 1                      # the last cut must hold every layer
  masks = [s.members for s in states.states]
  keep_all = set()
  while True:
    rep = [i if group[i] in keep_all else best[group[i]] for i in range(n)]
    bad = set()
    for j in range(n):
      rj = masks[rep[j]]
      for k in states.predecessors[j]:
        if group[k] == group[j]:
          continue                                # a stage of zero-cost layers: never useful
        rk = masks[rep[k]]
        if rk & rj != rk or rk == rj:
          bad.update((group[k], group[j]))
    if not bad - keep_all:
      break
    keep_all |= bad
  return tuple(sorted(set(rep)))
