"""A training step of gradient accumulation as session runs (``graph.micro_batches``).

With ``plan.accumulate_runs`` R > 1 the graph holds one model copy per device and each copy's
gradient sum over the step (``passes.accumulate.Accumulator``). One user ``session.run`` that
spreads over every copy becomes R runs, run m on each copy's m-th micro-batch of the fed
batch (``FeedSplitter.split_runs``: copy c's rows are the c-th block, as with clones; an
iterator is read once per copy and run, as each micro-batch clone reads it):

* runs 0..R-2 fetch the user's fetches that neither reach the update nor read the summed
  gradients (a loss, predictions; not a clipping norm) and
  the sums' ``adds`` of the train ops fetched, with what those train ops wait for before the
  update by a control edge (batch-norm statistics: every micro-batch updates them, per copy);
* run R-1 fetches everything the user asked for: its update reads sum + its own gradient, and
  the sums are zeroed after that read (``resets``).

Fetched values are combined over the runs as they are over copies (docs/user_guide.md, "What
a fetch returns"): a mean is the mean of the runs' (row-weighted) means, a sum their sum, a
batch-major value their rows in batch order; anything else, and what reaches the update, is
the last run's. So a step is two fetch signatures for TF to compile, each a graph of one copy
per device, whatever R. The sums are zeroed once per session before its first step, and again
after a step that failed between its runs.
"""
import weakref

import numpy as np
import tensorflow.compat.v1 as tf



class AccumulationRuns:
  """Runs steps of ``pg`` (a ParallelGraph with ``plan.accumulate_runs`` > 1)."""

  def __init__(self, pg, mapper, feeds):
    self.runs = pg.plan.accumulate_runs
    self._pg, self._mapper, self._feeds = pg, mapper, feeds
    report = pg.sync_report
    self._accumulators = list(report.accumulators) if report is not None else []
    self._inits = [op for a in self._accumulators for op in a.inits]
    self._zeroed = weakref.WeakSet()       # sessions whose sums are zero between steps
    self._targets = {}                     # leaf elements -> (adds + early writes, resets)
    self._clones = pg.clones()

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
    early = [i for i in range(len(leaves)) if not late[i]]
    adds, resets = self._targets_of(elements)
    feeds = self._feeds.split_runs(feed_dict)
    values = [[] for _ in leaves]
    try:
      if session not in self._zeroed and self._inits:
        original(session, self._inits, None, options, None)
      self._zeroed.discard(session)
      for m in range(self.runs - 1 if early or adds else 0):   # (an init op: one run)
        got = original(session, ([mapped[i] for i in early], adds), feeds[m], options,
                       run_metadata)[0]
        for i, value in zip(early, got):
          values[i].append(value)
      last = original(session, (mapped, resets), feeds[-1], options, run_metadata)[0]
      self._zeroed.add(session)
    except Exception:                    # the sums hold part of a step: zeroed before the next
      self._zeroed.discard(session)
      raise
    for i, value in enumerate(last):
      values[i].append(value)
    combined = iter([_combine(k, v) for k, v in zip(kinds, values)])
    return self._mapper.walk(fetches, lambda f: next(combined)), writes

  def _waited_for(self, reached):
    """The forward / backward ops that the update (or a train op's group) waits for by a
    control edge: ``tf.control_dependencies(UPDATE_OPS)`` -- batch-norm statistics, which
    every micro-batch updates -- sorted by name."""
    index, graph = self._pg.plan.op_index, self._pg.graph
    step = ("forward", "backward")
    found = {ci for op in reached if index.get(op.name, (None, None))[1] not in step
             for ci in op.control_inputs
             if index.get(ci.name, (None, None))[1] in step and graph.is_fetchable(ci)}
    return sorted(found, key=lambda o: o.name)

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

  def _targets_of(self, elements):
    """(what runs 0..R-2 run besides the fetches, the resets of the last run) for a step
    fetching ``elements``: the sums of the gradients the fetched train ops read, and the
    writes those train ops wait for before the update (in every copy)."""
    key = tuple(elements)
    try:
      hit = self._targets.get(key)
    except TypeError:
      hit, key = None, None
    if hit is not None:
      return hit
    reached, work = set(), [getattr(e, "op", e) for e in elements if e is not None]
    while work:
      op = work.pop()
      if isinstance(op, tf.Operation) and op not in reached:
        reached.add(op)
        work.extend(t.op for t in op.inputs)
        work.extend(op.control_inputs)
    names = {op.name for op in reached}
    used = [a for a in self._accumulators if names.intersection(a.readers)]
    adds = [op for a in used for op in a.adds]
    resets = [op for a in used for op in a.resets]
    for op in self._waited_for(reached):
      adds.extend(o for o in (self._clones.op(c, op) for c in range(self._pg.num_copies))
                  if o is not None)
    hit = (adds, resets)
    if key is not None:
      self._targets[key] = hit
    return hit


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
