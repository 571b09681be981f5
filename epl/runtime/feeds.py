"""How one ``session.run`` is spread over the model copies: the run's mode and its feeds.

Two modes (decided per run from its fetches and feeds):

* ``ALL``: every copy and micro-batch runs -- a training run (its fetches reach an update of
  the model), or a run that feeds a fixed-size batch placeholder more rows than one copy
  takes. A batch fed to a placeholder (rank >= 1, or no shape) is this worker's whole step: it
  is cut into copies x micro-batches pieces in order. A placeholder with a fixed first dimension B takes
  exactly B rows per piece; with an unknown one the rows may split unevenly (each piece's
  gradient is then weighted by its rows, so the update equals the local run's).
  What is not a batch goes whole to every copy and micro-batch, as the local run sees it:
  a scalar -- fed to a placeholder of shape [] or to one without a shape
  (``tf.placeholder(tf.bool)`` for ``is_training``, a learning rate, ``keep_prob``) -- and a
  value that cannot be batch-major (``BatchRule``): fed to a fixed first dimension B with
  exactly B rows (per-class weights ``[C]``, a table: a batch there has pieces x B rows), or
  fed to ``[None, ...]`` / no shape with rows that are neither a multiple nor a divisor of
  the run's batch rows.
* ``COPY0``: only the user's own ops (model copy 0) run, on everything fed -- evaluation and
  prediction take any batch size, including one row, exactly as the local script. A split
  TaskGraph reads the rows of every copy of its replica: the replica's other copies are fed
  no rows, so it sees exactly the fed batch.
"""
import logging

import numpy as np
import tensorflow.compat.v1 as tf

from epl.errors import PlanError
from epl.op_tables import mutates

ALL, COPY0 = "all", "copy0"
log = logging.getLogger("epl")


class FeedSplitter:
  """Decides run modes and maps feed_dicts onto the copies' placeholders."""

  def __init__(self, parallel):
    self.parallel = parallel
    self.graph = parallel.graph
    self.clones = parallel.clones()
    self.pieces = parallel.num_copies * parallel.plan.micro_batches   # per step
    analysis = parallel.analysis
    self._batch = {op.outputs[0] for op in analysis.batch_placeholders}
    self._cloned = analysis.cloned_set
    self._weights = parallel.replication.row_weights
    update = {op for op, phase in _phases(parallel).items() if phase == "apply"}
    self._trains_at = set(analysis.singletons) | {op for op in update if mutates(op)}
    self._trains = {}
    self._warned = set()          # fixed placeholders warned about (fed B rows: not split)
    self.loose_split = []         # (name, rows, piece rows) of loose values the last run split
    worker = parallel.worker
    # copies that run with copy 0 in an evaluation run: its replica's others, when a split
    # TaskGraph gathers their rows
    self._partners = [c for c in range(1, worker.num_copies)
                      if worker.copies[c].replica == worker.copies[0].replica] \
        if analysis.split_ops else []

  # ---- the mode ----------------------------------------------------------------------
  def mode(self, elements, feed_dict):
    """ALL when the run trains (or a fixed-size placeholder needs every copy), else COPY0."""
    if any(self.trains(e) for e in elements):
      return ALL
    for tensor, value in self._fed(feed_dict):
      rows = _rows(value)
      fixed = tensor.shape.rank and tensor.shape.dims[0].value
      if tensor in self._batch and fixed and rows is not None and rows > fixed:
        return ALL
    return COPY0

  def trains(self, element):
    """True when running ``element`` (an op or tensor) reaches an update of the model."""
    op = element if isinstance(element, tf.Operation) else getattr(element, "op", None)
    if op is None:
      return False
    if op not in self._trains:
      found, seen, work = False, set(), [op]
      while work and not found:
        x = work.pop()
        if x in seen:
          continue
        seen.add(x)
        found = x in self._trains_at
        work.extend(t.op for t in x.inputs)
        work.extend(x.control_inputs)
      self._trains[op] = found
    return self._trains[op]

  def explain(self, error):
    """``error`` (a TF error of a run this splitter split) with a note naming the loose values
    (``[None]`` / no shape) it cut like the batch: a short vector of settings whose length
    divides the batch's rows is one -- the error TF raises then points inside epl's copies."""
    if not self.loose_split:
      return error
    what = "; ".join("%r (%d rows -> %s)" % (name, rows, "/".join(map(str, sizes)))
                     for name, rows, sizes in self.loose_split)
    note = ("\n[epl] this run split these values, fed to [None]-shaped (or shapeless) "
            "placeholders with fewer rows than the batch, over the model copies and "
            "micro-batches as batches: %s. If one is "
            "not a batch (a vector of settings, class weights), declare its size, e.g. "
            "tf.placeholder(tf.float32, [%d]): a value fed to a fixed size that it fills goes "
            "whole to every copy" % (what, self.loose_split[0][1]))
    return type(error)(error.node_def, error.op, error.message + note)

  # ---- the feeds ---------------------------------------------------------------------
  def _fed(self, feed_dict):
    return fed_tensors(self.graph, feed_dict)

  def split(self, feed_dict, mode):
    """The feed_dict for ``mode``: pieces of fed batches for every copy's placeholders."""
    if not feed_dict or (mode == COPY0 and not self._partners):
      return feed_dict
    if mode == COPY0:
      return self._with_partners(feed_dict)
    return self._split(feed_dict, 1)[0]

  def split_runs(self, feed_dict):
    """The feed_dict of each run of a step of accumulation runs (epl.runtime.accumulation):
    a batch is cut as with micro-batch clones (copy c takes the c-th block of rows, cut into
    its micro-batches), and run m feeds each copy its m-th micro-batch."""
    runs = self.parallel.plan.accumulate_runs
    if not feed_dict:
      return [feed_dict] * runs
    return self._split(feed_dict, runs)

  def _split(self, feed_dict, runs):
    """One feed_dict per run: piece i of a batch (``pieces`` of them in order) goes to
    target i // runs (a copy, or a copy's micro-batch clone) in run i % runs."""
    outs = [dict(feed_dict) for _ in range(runs)]
    weights = None
    self.loose_split = []
    fed = [(t, v) for t, v in self._fed(feed_dict) if t.op in self._cloned]
    rule = BatchRule(self._batch, self.pieces, fed, self._warned)
    for tensor, value in fed:
      targets = self.clones.every(tensor)
      if rule.is_batch(tensor, value):
        pieces, sizes = self._pieces(tensor, value)
        if _fixed(tensor) is None and rule.rows and _rows(value) < rule.rows:
          self.loose_split.append((tensor.op.name, _rows(value), sizes))
        for i, piece in enumerate(pieces):
          target = targets[i // runs]
          if target is not None:
            outs[i % runs][target] = piece
        if weights is None and len(set(sizes)) > 1:
          # (float64: each use casts to its tensor's dtype -- a float64 model's gradients and
          # fetched means keep their precision)
          weights = np.asarray(sizes, np.float64) * (self.pieces / float(sum(sizes)))
      else:
        for out in outs:
          for target in targets:
            if target is not None:
              out[target] = value
    if weights is not None and self._weights is not None:
      for m, out in enumerate(outs):
        out[self._weights] = weights[m::runs]
    return outs

  def _with_partners(self, feed_dict):
    out = dict(feed_dict)
    fed = [(t, v) for t, v in self._fed(feed_dict) if t.op in self._cloned]
    rule = BatchRule(self._batch, 1, fed, self._warned)
    for tensor, value in fed:
      for c in self._partners:
        target = self.clones.tensor(c, tensor)
        if target is None:
          continue
        if rule.is_batch(tensor, value):
          if tensor.shape.rank and tensor.shape.dims[0].value is not None:
            raise PlanError(
                "an evaluation run of a split model feeds %r, whose first dimension is fixed: "
                "epl cannot give the replica's other copies an empty batch; declare it "
                "[None, ...], or evaluate with a training-sized batch" % tensor.op.name)
          out[target] = np.asarray(value)[:0]
        else:
          out[target] = value
    return out

  def _pieces(self, tensor, value):
    value = np.asarray(value) if not hasattr(value, "shape") else value
    rows = value.shape[0]
    fixed = tensor.shape.dims[0].value if tensor.shape.rank else None
    name = tensor.op.name
    where = "this worker's %d model copies x %d micro-batch(es)" % (
        self.parallel.num_copies, self.parallel.plan.micro_batches)
    if fixed is not None:
      if rows != fixed * self.pieces:
        raise PlanError(
            "the batch fed to %r has %d rows; %r takes %d rows per model copy, and a training "
            "run feeds %s: feed %d rows (or %d for a run that updates nothing)" % (
                name, rows, name, fixed, where, fixed * self.pieces, fixed))
      return np.split(value, self.pieces), [fixed] * self.pieces
    if rows < self.pieces:
      raise PlanError(
          "the batch fed to %r has %d rows, fewer than %s (%d): a training run needs at least "
          "one row per copy and micro-batch; feed at least %d rows" % (
              name, rows, where, self.pieces, self.pieces))
    pieces = np.array_split(value, self.pieces)
    return pieces, [len(p) for p in pieces]


class BatchRule:
  """Which values fed to one run are batches (split into the pieces) and which go whole.

  Every value a batch-major script feeds (images, labels, token ids, per-token targets,
  multi-crop images beside their labels) is split, as before this rule; what goes whole is
  what cannot be a batch. Terms: p = pieces (copies x micro-batches), a *fixed* placeholder
  has a fixed first dimension B, a *loose* one ``[None, ...]`` or no shape; R, the run's batch
  rows: of the fixed placeholders fed p x B rows, else of the loose ones, else (p = 1) of all:
  the rows of the highest-rank value (the data), ties to the count most values share, then
  the smaller. When the highest-rank value fed is a fixed placeholder fed its B rows (a
  fixed-size batch fed one copy's rows), nothing is split.

  * fixed, p > 1: p x B rows is a batch. Exactly B rows fit the placeholder as it is, so the
    value goes whole -- per-class weights ``[C]``, a table -- unless a loose batch has B rows
    too (then it is that batch's copy-sized part: ``_pieces`` names the rows to feed). With
    nothing split at all (a fixed-size batch fed one copy's rows) every copy trains on the
    same rows -- the local model -- and epl warns once. Other counts: ``_pieces``' error.
  * fixed, p = 1 (the other copies of a split model's evaluation run): a batch when fed R rows.
  * loose: a batch when its rows are a multiple or a divisor of R (equal rows, per-token
    targets of R sequences, the labels of multi-crop images); else whole, warned once -- a
    class-weight vector is such a value only when its length does not divide, nor is
    divided by, the batch's rows: declare it ``[C]``.
  """

  def __init__(self, batch_placeholders, pieces, fed, warned):
    self.batch, self.pieces, self.warned = batch_placeholders, pieces, warned
    candidates = [(t, r, np.ndim(v)) for t, r, v in ((t, _rows(v), v) for t, v in fed
                                                     if t in batch_placeholders)
                  if r is not None]
    split_fixed = [c for c in candidates
                   if _fixed(c[0]) is not None and pieces > 1 and c[1] == _fixed(c[0]) * pieces]
    loose = [c for c in candidates if _fixed(c[0]) is None]
    if pieces > 1 and not split_fixed and loose and \
        max(c[2] for c in loose) < max(c[2] for c in candidates):
      loose = []          # the data is a fixed placeholder fed its B rows: nothing is split
    source = split_fixed or loose or (candidates if pieces == 1 else [])
    self.rows, self.from_loose = _data(source), not split_fixed and bool(loose)
    self.whole = bool(candidates) and not source

  def is_batch(self, tensor, value):
    rows = _rows(value)
    if tensor not in self.batch or not np.ndim(value) or rows is None:
      return False
    fixed = _fixed(tensor)
    if fixed is not None:
      if self.pieces == 1:
        return rows == self.rows
      if rows == fixed and not (self.from_loose and rows == self.rows):
        if self.whole:
          self._warn(tensor, "%r is fed %d rows, its declared first dimension: every model copy "
                     "and micro-batch gets them whole and trains on the same rows (the local "
                     "model, without the speed-up). Feed %d rows so that each gets its own %d",
                     tensor.op.name, rows, rows * self.pieces, rows)
        return False
      return True
    if self.whole:
      return False
    if not self.rows or not rows or rows % self.rows == 0 or self.rows % rows == 0:
      return True
    self._warn(tensor, "%r is fed %d rows, neither a multiple nor a divisor of this run's batch "
               "rows (%d): it is not a batch, and every model copy and micro-batch gets it "
               "whole. Declare its size (e.g. tf.placeholder(..., [%d])) to say so",
               tensor.op.name, rows, self.rows, rows)
    return False

  def _warn(self, tensor, message, *args):
    if self.warned is not None and tensor.op.name not in self.warned:
      self.warned.add(tensor.op.name)
      log.warning(message, *args)


def fed_tensors(graph, feed_dict):
  """(tensor, value) of a feed_dict, its keys given as tensors or as tensor names."""
  for key, value in (feed_dict or {}).items():
    tensor = key
    if isinstance(key, str):
      try:
        tensor = graph.as_graph_element(key)
      except (KeyError, ValueError):
        continue
    if isinstance(tensor, tf.Tensor):
      yield tensor, value


def _fixed(tensor):
  return tensor.shape.dims[0].value if tensor.shape.rank else None


def _data(candidates):
  """The rows of the highest-rank value among ``candidates`` ((placeholder, rows, rank)):
  ties go to the rows most of them share, then to the smaller count; None if none."""
  if not candidates:
    return None
  top = max(rank for _, _, rank in candidates)
  counts = [r for _, r, rank in candidates if rank == top]
  return max(set(counts), key=lambda r: (counts.count(r), -r))


def _rows(value):
  shape = getattr(value, "shape", None)
  if shape is not None:
    return shape[0] if len(shape) else None
  return len(value) if isinstance(value, (list, tuple)) else None


def _phases(parallel):
  get = parallel.graph.get_operation_by_name
  return {get(name): phase for name, (_, phase) in parallel.plan.op_index.items()}
