"""Bridge pass: connect each model replica's split TaskGraphs, and its stages replicated on
fewer devices than the widest, to its copies of the widest replicated ones.

A replicated stage on d of a replica's k = ``plan.shards`` copies' devices runs in every
(k / d)-th copy on the rows of that many copies: the same gather / scatter as a split part
(which runs once, on all k copies' rows), over its group of copies, per micro-batch.

Expects: the ``replicate`` clones and the plan's crossings (``epl.plan.split``). A split
TaskGraph runs once per model replica (in the replica's first copy) on the whole replica's
batch, while a replicated TaskGraph runs in each of the replica's k copies on 1/k of it.
For every crossing and local replica:

* into the split TaskGraph (``gather``): a batch-major value is the concatenation of the k
  copies' rows, built on each consuming device (an all-gather over TF's send/recv), or for
  an iterator's output the replica's batch before ``replicate`` split it; any other
  value is copy 0's (the copies hold equal weights), or for a gradient the sum of the copies';
* out of it (``scatter``): copy j reads its own rows of a batch-major value, sliced on the
  producing device (only those rows travel), or the whole value otherwise.

The rows are along the crossing's batch axis: 0 for activations (all-gather in, split batch
out), the tokens' axis of MoE expert slices (each copy cut its dispatched tokens per part,
each part gathers its slices; each copy reads its tokens of every part's output: the
all-to-all of epl.sharding.experts). Each crossing carries the collective
epl.plan.placement.TRANSITIONS names for it, and ``BUILDERS`` maps that name to its builder.

Gradients crossing back are scaled so that the job trains the local model: with
``gradients_reduce_method: mean`` the copies' gradients are averaged, so a copy's share of a
batch-major gradient is multiplied by k and a gradient gathered from the copies is divided by
k; with ``sum`` the whole-value gradient each copy reads is divided by k. With one copy per
replica nothing is inserted (TF's send/recv moves the tensors). The gathers, sums and row
cuts come from ``epl.collectives`` (``gather_rows``, ``reduce_to``, ``rows_of``).

Rows split unevenly (a fed batch whose rows are not a multiple of the pieces): accumulate
weights a TaskGraph's gradient in a run by that run's rows -- w_c (``row_weights``) in
copy c, w_G (the mean of its copies' w_c) in a narrower TaskGraph that reads the rows of a
group G of copies -- which is right where the run's backward pass starts at its own loss (a
mean over its rows). Every backward value is kept in those units, so the update is the
local one wherever the loss lives: a gradient gathered from copy c into G is multiplied by
w_c / w_G, a batch-major one scattered from G into copy c divided by it (a value read whole
keeps its factor: the copies' mean is the same, and a copy with no rows keeps its share).
With even rows every ratio is 1 and nothing is inserted. Returns ``Bridges``.
"""
import dataclasses
from typing import List, Tuple

import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl.passes.accumulate import Weights
from epl.plan.placement import Collective


@dataclasses.dataclass(frozen=True)
class Bridges:
  built: List[Tuple[str, str, tf.Tensor]]   # (crossing kind, user's tensor name, new tensor)

  def count(self, kind):
    return sum(1 for k, _, _ in self.built if k == kind)


def _scale(plan, crossing, k):
  if not crossing.backward:
    return 1.0
  mean = plan.communication.reduce_method == "mean"
  if crossing.gather:
    return 1.0 / k if mean else 1.0
  if crossing.batch_major:
    return float(k) if mean else 1.0
  return 1.0 if mean else 1.0 / k


def _scaled(t, factor):
  return t if factor == 1.0 else t * tf.cast(factor, t.dtype)


def _retarget(consumer, old, new):
  """Makes ``consumer`` read ``new`` wherever it reads one of the tensors ``old``."""
  for i, inp in enumerate(consumer.inputs):
    if inp in old:
      compat.update_input(consumer, i, new)


def bridge(ctx):
  """Runs the pass; see the module docstring."""
  plan, worker, graph, coll = ctx.plan, ctx.worker, ctx.graph, ctx.collectives
  if not plan.crossings or plan.shards == 1:
    return Bridges([])
  analysis, clones = ctx.result("analyze"), ctx.clones()
  cloned, sources = analysis.cloned_set, frozenset(analysis.sources)
  replication = ctx.result("replicate")
  splits = replication.source_splits
  weights = Weights(replication.row_weights, plan.num_micro_batch) \
      if replication.row_weights is not None else None
  crossings = [x for x in plan.crossings
               if graph.get_tensor_by_name(x.tensor).op in cloned and
               graph.get_operation_by_name(x.consumer) in cloned]
  built, cache, counts = [], {}, {}
  with graph.as_default(), tf.name_scope(None), tf.control_dependencies(None), \
      tf.name_scope("epl_bridge"):
    for m in range(plan.num_micro_batch):
      for x in crossings:
        build = BUILDERS[(x.collective, x.gather)]
        narrow, wide = (x.destination, x.source) if x.gather else (x.source, x.destination)
        every, step = plan.stride(narrow), plan.stride(wide)
        for lead in range(worker.num_copies):
          if worker.copies[lead].shard % every == 0:
            members = tuple(range(lead, lead + every, step))
            if (narrow, wide, members, m) not in counts:
              counts[(narrow, wide, members, m)] = _rows(
                  plan, clones, graph, crossings, sources, (narrow, wide), members, m)
            rows = counts[(narrow, wide, members, m)]
            build(_Site(plan, coll, clones, graph, sources, splits, x,
                        worker.copies[lead].shard, members, m, rows, weights), built, cache)
  return Bridges(built)


@dataclasses.dataclass(frozen=True)
class _Site:
  """One crossing in one run of the narrower TaskGraph (in copy ``members[0]``, on the rows
  of the wider one's copies ``members``), for micro-batch ``m``."""
  plan: object
  coll: object
  clones: object
  graph: tf.Graph
  sources: frozenset            # the input pipeline's ops (``analyze``)
  splits: tuple                 # (Split, source op): how ``replicate`` cut each source
  x: object
  shard: int                    # the first member's shard in its replica
  members: tuple
  m: int
  rows: object
  weights: object               # accumulate.Weights of uneven rows, or None

  @property
  def k(self):
    return len(self.members)

  @property
  def lead(self):
    return self.members[0]

  @property
  def tensor(self):
    return self.graph.get_tensor_by_name(self.x.tensor)

  @property
  def consumer(self):
    return self.graph.get_operation_by_name(self.x.consumer)

  def values(self):
    return [self.clones.tensor(c, self.tensor, self.m) for c in self.members]

  def in_copy_units(self, value, c, into):
    """A backward ``value`` of the narrower TaskGraph converted into copy ``c``'s units
    (``into``), or one of copy c converted into the narrower TaskGraph's: see the module
    docstring (uneven rows)."""
    if self.weights is None or not self.x.backward:
      return value
    narrow, wide = (self.x.destination, self.x.source) if self.x.gather else \
        (self.x.source, self.x.destination)
    dtype = value.dtype.base_dtype
    with tf.device(value.device):
      ratio = tf.math.divide_no_nan(            # 0 where the group has no rows
          self.weights.of(c, self.m, dtype, self.plan.stride(wide)),
          self.weights.of(self.lead, self.m, dtype, self.plan.stride(narrow)))
      return tf.math.divide_no_nan(value, ratio) if into else value * ratio


def _gather(site, built, cache):
  """Into a split part: the copies' rows concatenated along the batch axis (all-gather of
  activations, all-to-all of expert slices), copy 0's value, or the copies' gradient sum."""
  x, coll = site.x, site.coll
  factor = _scale(site.plan, x, site.k)
  user = site.clones.op(site.lead, site.consumer, site.m)
  if site.tensor.op in site.sources:
    # an iterator's batch: the replica's first copy pulls the whole replica batch and
    # splits it k ways (``replicate``); the narrower TaskGraph reads the unsplit batch, or
    # the pieces of the copies it serves
    for split, source in site.splits:
      if source is not site.tensor.op:
        continue
      cut = site.clones.op(site.lead - site.shard, split, site.m)   # this replica's cut
      if cut.inputs[1].value_index != site.tensor.value_index:
        continue
      pieces = cut.outputs[site.shard:site.shard + site.k]
      new = cut.inputs[1] if site.k == site.plan.shards else tf.concat(pieces, axis=0)
      _retarget(user, {pieces[0]}, new)
      built.append(("gather", x.tensor, new))
    return
  values = site.values()
  key = (x.tensor, site.lead, site.m, user.device, factor)
  if key not in cache:
    mine = [site.in_copy_units(v, c, into=False) for v, c in zip(values, site.members)]
    if x.batch_major:
      new = coll.gather_rows(mine, user.device, x.axis)
    else:
      new = coll.reduce_to(mine, user.device) if x.backward else values[0]
    with tf.device(user.device):
      cache[key] = _scaled(new, factor)
    built.append(("gather", x.tensor, cache[key]))
  _retarget(user, {values[0]}, cache[key])


def _scatter(site, built, cache):
  """Out of a split part: copy j reads its own rows (cut on the part's device: only they
  travel), or the whole value."""
  x = site.x
  factor = _scale(site.plan, x, site.k)
  source = site.values()[0]             # the narrower TaskGraph runs in the first member
  for j, c in enumerate(site.members):
    user = site.clones.op(c, site.consumer, site.m)
    key = (x.tensor, c, site.m, factor)
    if key not in cache:
      piece = site.coll.rows_of(source, site.rows, j, site.k, x.axis) if x.batch_major else \
          source
      with tf.device(source.device):
        cache[key] = _scaled(piece, factor)
        if x.batch_major:
          cache[key] = site.in_copy_units(cache[key], c, into=True)
      built.append(("scatter", x.tensor, cache[key]))
    _retarget(user, {site.tensor, source}, cache[key])


# (collective of epl.plan.placement.TRANSITIONS, into the split part?) -> builder
BUILDERS = {(Collective.ALL_GATHER, True): _gather, (Collective.ALL_TO_ALL, True): _gather,
            (Collective.REDUCE_SCATTER, False): _scatter,
            (Collective.SPLIT_BATCH, False): _scatter, (Collective.ALL_TO_ALL, False): _scatter}


def _rows(plan, clones, graph, crossings, sources, pair, members, m):
  """The batch size of each member copy: from the first batch-major tensor gathered into the
  narrower TaskGraph of ``pair`` (narrow, wide) -- from ``wide`` itself, else from a
  TaskGraph running in the same copies (wide, narrow, wide: the second reads the rows of the
  first) -- None: the copies split the rows evenly."""
  narrow, wide = pair
  into = [x for x in crossings if x.gather and x.batch_major and not x.backward and
          x.destination == narrow and plan.stride(x.source) == plan.stride(wide) and
          graph.get_tensor_by_name(x.tensor).op not in sources]
  first = next((x for x in into if x.source == wide), into[0] if into else None)
  if first is None:
    return None
  tensor = graph.get_tensor_by_name(first.tensor)
  counts = []
  for c in members:
    value = clones.tensor(c, tensor, m)
    with tf.device(value.device):
      counts.append(tf.shape(value)[first.axis])
  return counts
