"""Typed placements of a TaskGraph, and the collective that bridges two of them.

A TaskGraph is ``Replicate(devices=k)`` (each model replica runs it on k devices, splitting its
batch k ways) or ``Split(devices=k)`` (its weights are sharded over k devices). When a tensor
flows from a TaskGraph with one placement into a TaskGraph with another, the rewrite inserts
the collective this table names (forward direction; its gradient flows back through the
collective's adjoint). Split and MoE fill the Split rows; adding a transition is one row here
and one pass rule.

Example:
  >>> b = bridge(Replicate(1), Split(4))
  >>> str(b.forward), str(b.backward)
  ('all_gather', 'reduce_scatter')
"""
import dataclasses
import enum
from typing import ClassVar


@dataclasses.dataclass(frozen=True)
class Placement:
  devices: int = 1
  kind: ClassVar[str] = ""

  def __str__(self):
    return "%s(device_count=%d)" % (self.kind, self.devices)


@dataclasses.dataclass(frozen=True)
class Replicate(Placement):
  """Data parallel: every model replica holds the whole TaskGraph."""
  kind: ClassVar[str] = "replicate"


@dataclasses.dataclass(frozen=True)
class Split(Placement):
  """Tensor / expert parallel: the TaskGraph's weights are sharded over ``devices``."""
  kind: ClassVar[str] = "split"


KINDS = {cls.kind: cls for cls in (Replicate, Split)}


def placement_from_dict(raw):
  return KINDS[raw["kind"]](devices=raw["devices"])


class Collective(enum.StrEnum):
  """What carries a tensor between two placements (epl.passes.bridge builds each)."""
  SEND_RECV = "send_recv"            # TF's own send/recv: pipeline stages, nothing inserted
  ALL_GATHER = "all_gather"          # the copies' rows concatenated (into a split part)
  REDUCE_SCATTER = "reduce_scatter"  # the parts' gradients summed, each copy its rows
  SPLIT_BATCH = "split_batch"        # each copy takes its rows of a whole value
  ALL_TO_ALL = "all_to_all"          # rows <-> experts (MoE dispatch / combine)


@dataclasses.dataclass(frozen=True)
class Bridge:
  forward: Collective   # applied to activations entering the destination
  backward: Collective  # what their gradients go through on the way back


# (source kind, destination kind, layout) -> Bridge; layout "rows": a value whose batch is
# its rows, "experts": a value cut along the experts in the copies and along the batch in the
# split parts (MoE dispatch / combine, epl.sharding.experts). Same-kind replicated TaskGraphs
# exchange activations by TF's own send/recv (pipeline stages); nothing is inserted. Between
# replicated TaskGraphs with different device counts (a pipeline with per-stage replication,
# e.g. 2:1) a copy of the narrower one takes the rows of several copies of the wider one.
# epl.plan.split.crossings labels every crossing from this table; epl.passes.bridge builds
# each label with its collective.
_C = Collective
TRANSITIONS = {
    ("replicate", "replicate", "rows"): Bridge(_C.SEND_RECV, _C.SEND_RECV),
    ("replicate", "replicate", "rows into fewer copies"): Bridge(_C.ALL_GATHER, _C.REDUCE_SCATTER),
    ("replicate", "replicate", "rows into more copies"): Bridge(_C.SPLIT_BATCH, _C.ALL_GATHER),
    ("replicate", "split", "rows"): Bridge(_C.ALL_GATHER, _C.REDUCE_SCATTER),
    ("split", "replicate", "rows"): Bridge(_C.SPLIT_BATCH, _C.ALL_GATHER),
    ("replicate", "split", "experts"): Bridge(_C.ALL_TO_ALL, _C.ALL_TO_ALL),
    ("split", "replicate", "experts"): Bridge(_C.ALL_TO_ALL, _C.ALL_TO_ALL),
    ("split", "split", "rows"): Bridge(_C.ALL_TO_ALL, _C.ALL_TO_ALL),
}


def bridge(source, destination, layout="rows"):
  """The Bridge between two placements (KeyError names the unsupported pair)."""
  if source.kind == destination.kind == "replicate" and source.devices != destination.devices:
    layout += " into %s copies" % ("fewer" if destination.devices < source.devices else "more")
  return TRANSITIONS[(source.kind, destination.kind, layout)]
