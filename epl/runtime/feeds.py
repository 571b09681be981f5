"""How one ``session.run`` is spread over the model copies: the run's mode and its feeds.

Two modes (decided per run from its fetches and feeds):

* ``ALL``: every copy and micro-batch runs -- a training run (its fetches reach an update of
  the model), or a run that feeds a fixed-size batch placeholder more rows than one copy
  takes. A batch fed to a placeholder (rank >= 1, or no shape) is this worker's whole step: it
  is cut into copies x micro-batches pieces in order. A placeholder with a fixed first dimension B takes
  exactly B rows per piece; with an unknown one the rows may split unevenly (each piece's
  gradient is then weighted by its rows, so the update equals the local run's). A scalar --
  fed to a placeholder of shape [] or to one without a shape (``tf.placeholder(tf.bool)`` for
  ``is_training``, a learning rate, ``keep_prob``) -- is not a batch: every copy and
  micro-batch gets it whole.
* ``COPY0``: only the user's own ops (model copy 0) run, on everything fed -- evaluation and
  prediction take any batch size, including one row, exactly as the local script. A split
  TaskGraph reads the rows of every copy of its replica: the replica's other copies are fed
  no rows, so it sees exactly the fed batch.
"""
import numpy as np
import tensorflow.compat.v1 as tf

from epl.errors import PlanError
from epl.op_tables import mutates

ALL, COPY0 = "all", "copy0"


class FeedSplitter:
  """Decides run modes and maps feed_dicts onto the copies' placeholders."""

  def __init__(self, parallel):
    self.parallel = parallel
    self.graph = parallel.graph
    self.clones = parallel.clones()
    self.pieces = parallel.num_copies * parallel.plan.num_micro_batch
    analysis = parallel.analysis
    self._batch = {op.outputs[0] for op in analysis.batch_placeholders}
    self._cloned = analysis.cloned_set
    self._weights = parallel.replication.row_weights
    update = {op for op, phase in _phases(parallel).items() if phase == "apply"}
    self._trains_at = set(analysis.singletons) | {op for op in update if mutates(op)}
    self._trains = {}
    worker = parallel.worker
    # copies that run with copy 0 in an evaluation run: its replica's others, when a split
    # TaskGraph gathers their rows
    self._partners = [c for c in range(1, worker.num_copies)
                      if worker.copies[c].replica == worker.copies[0].replica] \
        if analysis.split_ops else []

  # ---- the mode ----------------------------------------------------------------------
  def mode(self, elements, feed_dict):
    """ALL when the run trains (or a fixed-size placeholder needs every copy), else COPY0."""
    if any(self._reaches_update(e) for e in elements):
      return ALL
    for tensor, value in self._fed(feed_dict):
      rows = _rows(value)
      fixed = tensor.shape.rank and tensor.shape.dims[0].value
      if tensor in self._batch and fixed and rows is not None and rows > fixed:
        return ALL
    return COPY0

  def _reaches_update(self, element):
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

  # ---- the feeds ---------------------------------------------------------------------
  def _fed(self, feed_dict):
    for key, value in (feed_dict or {}).items():
      tensor = key
      if isinstance(key, str):
        try:
          tensor = self.graph.as_graph_element(key)
        except (KeyError, ValueError):
          continue
      if isinstance(tensor, tf.Tensor):
        yield tensor, value

  def split(self, feed_dict, mode):
    """The feed_dict for ``mode``: pieces of fed batches for every copy's placeholders."""
    if not feed_dict or (mode == COPY0 and not self._partners):
      return feed_dict
    if mode == COPY0:
      return self._with_partners(feed_dict)
    out = dict(feed_dict)
    weights = None
    for tensor, value in list(self._fed(feed_dict)):
      if tensor.op not in self._cloned:
        continue
      targets = self.clones.every(tensor)
      if tensor in self._batch and np.ndim(value):
        pieces, sizes = self._pieces(tensor, value)
        for target, piece in zip(targets, pieces):
          if target is not None:
            out[target] = piece
        if weights is None and len(set(sizes)) > 1:
          weights = np.asarray(sizes, np.float32) * (self.pieces / float(sum(sizes)))
      else:
        for target in targets:
          if target is not None:
            out[target] = value
    if weights is not None and self._weights is not None:
      out[self._weights] = weights
    return out

  def _with_partners(self, feed_dict):
    out = dict(feed_dict)
    for tensor, value in list(self._fed(feed_dict)):
      if tensor.op not in self._cloned:
        continue
      for c in self._partners:
        target = self.clones.tensor(c, tensor)
        if target is None:
          continue
        if tensor in self._batch and np.ndim(value):
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
        self.parallel.num_copies, self.parallel.plan.num_micro_batch)
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


def _rows(value):
  shape = getattr(value, "shape", None)
  if shape is not None:
    return shape[0] if len(shape) else None
  return len(value) if isinstance(value, (list, tuple)) else None


def _phases(parallel):
  get = parallel.graph.get_operation_by_name
  return {get(name): phase for name, (_, phase) in parallel.plan.op_index.items()}
