"""A training step of gradient accumulation as session runs (``graph.micro_batches``).

With ``plan.accumulate_runs`` R > 1 the graph holds one model copy per device and each copy's
gradient sums over the step (``passes.run_sums``). One user ``session.run`` that spreads over
every copy becomes R runs, run m on each copy's m-th micro-batch of the fed batch
(``FeedSplitter.split_runs``: copy c's rows are the c-th block, as with clones; an iterator is
read once per copy and run, as each micro-batch clone reads it). A step that trains fetches
the same in every run -- the user's fetches and the sums' adds and resets of the train ops
fetched -- and feeds ``last``: False in runs 0..R-2, where the update is dead (the forward and
backward run in full, batch-norm statistics included), True in the last, where the update
reads the sums and zeroes them. So TF compiles one signature of one copy per device,
whatever R. What reads the summed gradients as a tensor (a clipping norm) is fetched by the
last run only (a second signature).

Fetched values are combined over the runs as they are over copies (docs/user_guide.md, "What
a fetch returns"): a mean is the mean of the runs' (row-weighted) means, a sum their sum, a
batch-major value their rows in batch order (a ``GLOBAL_CONCAT`` value across workers: run
by run); anything else, and what reaches the update, is the last run's. The sums are zeroed
once per session before its first step, and again after a step that failed between its runs.
"""
import weakref

import numpy as np
import tensorflow.compat.v1 as tf

from epl.passes.slots import ancestors


class AccumulationRuns:
  """Runs steps of ``pg`` (a ParallelGraph with ``plan.accumulate_runs`` > 1)."""

  def __init__(self, pg, mapper, feeds):
    self.runs = pg.plan.accumulate_runs
    self._pg, self._mapper, self._feeds = pg, mapper, feeds
    sums = pg.sync_report.sums if pg.sync_report is not None else None
    self._accumulators = list(sums.accumulators) if sums is not None else []
    self._last = sums.last if sums is not None else None
    self._inits = [op for a in self._accumulators for op in a.inits]
    self._zeroed = weakref.WeakSet()       # sessions whose sums are zero between steps
    self._targets = {}                     # leaf elements -> the sums' adds and resets

  def step(self, session, original, fetches, feed_dict, options, run_metadata, sums=()):
    """One user step over R runs; returns what ``original`` would for ``fetches``.
    ``sums``: fetched elements (epl's own) whose values add up over the runs."""
    leaves = []
    self._mapper.walk(fetches, lambda f: leaves.append(f) or f)
    mapped, writes = self._mapper.map(leaves)
    elements = [self._mapper.element_of(f) for f in leaves]
    late = [self._late(e) for e in elements]
    kinds = [None if late[i] else "sum" if any(e is s for s in sums) else
             self._mapper.kind(e) for i, e in enumerate(elements)]
    targets = self._targets_of(elements)
    # with sums to add, every run fetches the same (the update is dead before the last run):
    # one signature; what reaches the update only as a tensor is fetched by the last run
    every = [i for i in range(len(leaves)) if not late[i] or (
        targets and isinstance(elements[i], tf.Operation))]
    feeds = self._feeds.split_runs(feed_dict)
    values = [[] for _ in leaves]
    try:
      if session not in self._zeroed and self._inits:
        original(session, self._inits, None, options, None)
      self._zeroed.discard(session)
      for m in range(self.runs - 1 if targets or every else 0):   # (an init op: one run)
        got = original(session, ([mapped[i] for i in every], targets), self._fed(feeds[m], False),
                       options, run_metadata)[0]
        for i, value in zip(every, got):
          if not late[i]:
            values[i].append(value)
      last = original(session, (mapped, targets), self._fed(feeds[-1], True), options,
                      run_metadata)[0]
      self._zeroed.add(session)
    except Exception:                    # the sums hold part of a step: zeroed before the next
      self._zeroed.discard(session)
      raise
    for i, value in enumerate(last):
      values[i].append(value)
    combined = iter([_combine(k, v) for k, v in zip(kinds, values)])
    return self._mapper.walk(fetches, lambda f: next(combined)), writes

  def _late(self, element):
    """True for what only the last run may run: what reaches the update or reads the summed
    gradients (the apply phase: a clipping norm, an all-reduced gradient)."""
    if element is None:
      return False
    op = element if isinstance(element, tf.Operation) else getattr(element, "op", None)
    if op is None:
      return False
    return self._pg.plan.op_index.get(op.name, (None, None))[1] == "apply" or \
        self._feeds.trains(element)

  def _fed(self, feed, last):
    feed = dict(feed) if feed else {}
    if self._last is not None:
      feed[self._last] = last
    return feed

  def _targets_of(self, elements):
    """The adds and resets of the sums of the gradients the fetched train ops read (not
    another train op's: a GAN's generator step computes no discriminator gradient)."""
    key = tuple(elements)
    try:
      hit = self._targets.get(key)
    except TypeError:
      hit, key = None, None
    if hit is not None:
      return hit
    names = {op.name for op in ancestors(_ops_of(elements))}
    hit = [op for a in self._accumulators if names.intersection(a.readers)
           for op in a.adds + a.resets]
    if key is not None:
      self._targets[key] = hit
    return hit


def _ops_of(elements):
  ops = (getattr(e, "op", e) for e in elements)
  return [op for op in ops if isinstance(op, tf.Operation)]


def _combine(kind, values):
  """One fetched value from its value in each run (``kind``: how copies merge it)."""
  last = values[-1]
  if kind is None or len(values) == 1 or last is None:
    return last
  if kind == "concat" and isinstance(last, tuple):     # each copy's rows, copy-major
    return np.concatenate([v[c] for c in range(len(last)) for v in values], axis=0)
  if kind == "concat":
    return np.concatenate(values, axis=0)
  dtype = np.asarray(last).dtype
  total = np.sum(np.stack([np.asarray(v) for v in values]), axis=0)
  if kind == "mean":
    total = total / len(values)
  total = np.asarray(total, dtype)
  return total[()] if total.ndim == 0 else total
