"""What a fetch returns when every copy runs (docs/user_guide.md, "What a fetch returns").

| fetched tensor of a model copy                       | returns                                    |
|------------------------------------------------------|--------------------------------------------|
| in ``epl.add_to_collection(t, GraphKeys.X)``         | merged as X says (``GLOBAL_*``: job-wide)  |
| floating-point scalar (loss, metric)                 | mean over copies and micro-batches,        |
|                                                      | weighted by their fed rows                 |
| batch-major (first dimension = the copy's batch)     | every copy's and micro-batch's rows,       |
|                                                      | concatenated in batch order                |
| anything else (global_step, a weight, a histogram)   | copy 0's value (the user's own op)         |

In a run where only copy 0 runs (evaluation, prediction, a stop vote; see epl.runtime.feeds)
every fetch is the user's own tensor, except a ``GLOBAL_*`` one with several clients: merged over
every client's copy 0. The mapper also tells the runtime when a fetch writes a mirrored variable
outside the step (initializer, ``Saver.restore``, a user assign), so that copy 0's new values
are copied to the other copies right after.
"""
import collections
import contextlib

import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl.collections_api import MERGE_KINDS
from epl.errors import PlanError
from epl.op_tables import ASSIGN_OPS, RANDOM_OPS, is_stage_call
from epl.passes.accumulate import group_weights


class FetchMapper:
  """Maps user fetches to merged tensors; caches per fetched element."""

  def __init__(self, graph, parallel, collections):
    self.graph = graph
    self.parallel = parallel
    self._collectives = parallel.collectives
    self._clones = parallel.clones()
    self._cache = {}
    self._writes = {}
    self._kind_of = {}
    for key, tensors in collections.items():
      for t in tensors:
        self._kind_of[t] = MERGE_KINDS[key]
    self._mirrored = {ops[0] for ops in parallel.replication.mirrored.values()}
    analysis = parallel.analysis
    self._cloned = analysis.cloned_set
    inputs = analysis.sources + analysis.batch_placeholders + tuple(
        op for op in analysis.cloned if op.type in RANDOM_OPS)      # synthetic batches
    self._batch_inputs = [t for op in inputs for t in op.outputs if t.shape.rank]
    self._weights = parallel.replication.row_weights
    self._runs = parallel.plan.accumulate_runs > 1

  def elements(self, fetches):
    """The graph elements (ops and tensors) of a fetch structure."""
    out = []
    self._walk(fetches, lambda e: out.append(self._graph_element(e)) or e)
    return out

  def map(self, fetches, all_copies=True):
    """Returns (fetches with the same structure, merged when ``all_copies``, and whether the
    run writes mirrored variables)."""
    writes = [False]

    def element(fetch):
      key = (fetch, all_copies)
      try:
        hit = self._cache.get(key)
      except TypeError:
        return fetch
      if hit is None:
        hit = self._element(fetch, all_copies)
        self._cache[key] = hit
      if hit[1]:
        writes[0] = True
      return hit[0]
    return self._walk(fetches, element), writes[0]

  def walk(self, fetches, fn):
    """``fetches`` with every leaf (a graph element or its name) replaced by ``fn(leaf)``, in
    the order ``elements`` lists them."""
    return self._walk(fetches, fn)

  def element_of(self, fetch):
    """The graph element a fetch leaf names (None for what is not one)."""
    return self._graph_element(fetch)

  def kind(self, element):
    """How a fetched tensor merges over copies and runs: "mean", "sum", "concat" or None
    (one value: copy 0's, the last run's)."""
    if not isinstance(element, tf.Tensor):
      return None
    kind = self._kind_of.get(element, (None, False))[0]
    if kind is None and element.op in self._cloned:
      if element.shape.rank == 0 and element.dtype.is_floating:
        kind = "mean"
      elif self._batch_major(element):
        kind = "concat"
    return kind

  def _walk(self, fetches, fn):
    if isinstance(fetches, (list, tuple)):
      mapped = [self._walk(f, fn) for f in fetches]
      if isinstance(fetches, tuple) and hasattr(fetches, "_fields"):
        return type(fetches)(*mapped)
      return type(fetches)(mapped)
    if isinstance(fetches, collections.abc.Mapping):
      return type(fetches)((k, self._walk(v, fn)) for k, v in fetches.items()) \
          if not isinstance(fetches, collections.defaultdict) else \
          {k: self._walk(v, fn) for k, v in fetches.items()}
    return fn(fetches)

  def _element(self, fetch, all_copies):
    element = fetch
    if isinstance(fetch, str):
      try:
        element = self.graph.as_graph_element(fetch)
      except (KeyError, ValueError, TypeError):
        return fetch, False
    if isinstance(element, tf.Operation):
      return fetch, self._writes_mirrored(element)
    if isinstance(element, tf.Tensor) and all_copies:
      return self._merged(element, fetch), False
    if isinstance(element, tf.Tensor):
      return self._job_wide_copy0(element, fetch), False
    return fetch, False

  def _graph_element(self, fetch):
    if isinstance(fetch, str):
      try:
        return self.graph.as_graph_element(fetch)
      except (KeyError, ValueError, TypeError):
        return None
    return fetch

  # ---- merging -----------------------------------------------------------------------
  def _merged(self, t, fetch):
    kind, job_wide = self.kind(t), self._kind_of.get(t, (None, False))[1]
    if kind is None:
      return fetch
    pieces = self._clones.every(t)
    if self._clones.in_body(t.op) and any(p is None for p in pieces):
      raise PlanError(
          "a training run fetches %r, which epl computes inside stage %d's %s function "
          "(graph.micro_batches: functions) and does not hand out of it: add it to a "
          "collection before epl rewrites the graph (epl.add_to_collection(tensor, "
          "epl.GraphKeys.GLOBAL_MEAN_OBJECTS), or any tf.add_to_collection), fetch it in a "
          "run without the train op (evaluation runs the model's own ops), or set "
          "graph.micro_batches 'clones'" % (t.name, self.parallel.plan.op_index[t.op.name][0],
                                            "forward" if self.parallel.plan.op_index[
                                                t.op.name][1] == "forward" else "backward"))
    weights = self._weights
    split_tg = self._split_taskgraph(t)
    if split_tg is not None:          # runs once per replica, in the replica's first copy
      pieces, weights = self._per_replica(split_tg, t)
    if all(p is None for p in pieces[1:]) and not (
        self._runs and kind == "mean" and weights is not None):   # one piece on this worker
      # (a run of accumulation runs weights it by its rows, as a micro-batch clone is)
      if not (job_wide and self.parallel.plan.worker_num > 1):
        return fetch
      pieces, weights = pieces[:1], None             # GLOBAL_*: still merged job-wide
    if any(p is None for p in pieces):               # run once per step (not per micro-batch)
      m = self._clones.num_micro_batch
      pieces, weights = pieces[::m], None
      if any(p is None for p in pieces):
        return fetch
    with self._merging_scope():
      return self._merge(kind, job_wide, pieces, weights)

  def _merge(self, kind, job_wide, pieces, weights):
    plan, host = self.parallel.plan, self.parallel.worker.host
    if kind == "concat" and self._runs and not (job_wide and plan.worker_num > 1):
      return tuple(pieces)        # each copy's rows: put in order over the runs (accumulation)
    if kind == "concat":
      merged = tf.concat(pieces, axis=0)
      if job_wide and plan.worker_num > 1:
        merged = self._collectives.all_gather([merged], [host], group=self._client_hosts())[0]
      return merged
    if kind == "mean" and weights is not None and len(pieces) == weights.shape[0]:
      pieces = [p * tf.cast(weights[i], p.dtype) for i, p in enumerate(pieces)]
    merged = tf.add_n(pieces)
    count = len(pieces)
    if job_wide and plan.worker_num > 1:
      merged = self._collectives.all_reduce([merged], [host], "sum",
                                            group=self._client_hosts())[0]
      count = count * plan.total_copies // max(1, self.parallel.num_copies)
    return merged / tf.cast(count, merged.dtype) if kind == "mean" else merged

  def _job_wide_copy0(self, t, fetch):
    """A ``GLOBAL_*`` tensor in a run of copy 0 only (no train op: evaluation, a stop vote):
    merged over every client's copy 0 -- job-wide still means job-wide (every client must
    fetch it in the same runs, as in training)."""
    kind, job_wide = self._kind_of.get(t, (None, False))
    if not job_wide or len(self.parallel.plan.clients) < 2:
      return fetch
    with self._merging_scope():
      return self._merge(kind, True, [t], None)

  @contextlib.contextmanager
  def _merging_scope(self):
    """Where merged tensors are built: outside any control context, on this worker's host."""
    with compat.unfinalized(self.graph), self.graph.as_default(), tf.name_scope(None), \
        tf.control_dependencies(None), tf.device(self.parallel.worker.host), \
        tf.name_scope("epl_merged"):
      yield

  def _split_taskgraph(self, t):
    plan = self.parallel.plan
    tg = plan.op_index.get(t.op.name, (None, None))[0]
    return tg if tg is not None and plan.stride(tg) > 1 else None

  def _per_replica(self, tg, t):
    """The tensor of a TaskGraph that runs in only some copies (split: once per replica; a
    stage on fewer devices: every ``stride``-th copy) in each of its runs and micro-batches,
    and their row weights."""
    worker, plan = self.parallel.worker, self.parallel.plan
    micro = self._clones.num_micro_batch
    leads = [c for c in range(worker.num_copies) if worker.runs(c, tg)]
    pieces = [self._clones.tensor(c, t, m) for c in leads for m in range(micro)]
    weights = None
    if self._weights is not None:
      with compat.unfinalized(self.graph), self.graph.as_default(), tf.name_scope(None), \
          tf.device(self.parallel.worker.host):
        weights = group_weights(self._weights, plan.stride(tg), micro)
    return pieces, weights

  def _batch_major(self, t):
    """True when ``t``'s first dimension is the batch dimension of an input it comes from."""
    if not t.shape.rank:
      return False
    dim = t.shape.dims[0].value
    upstream, seen, work = set(), set(), [t.op]
    while work:     # through the copy's ops, epl's bridges into split parts, stage calls
      op = work.pop()
      if op in seen or (op not in self._cloned and not op.name.startswith("epl_bridge/") and
                        not is_stage_call(op)):
        continue
      seen.add(op)
      upstream.update(op.outputs)
      work.extend(i.op for i in op.inputs)
    return any(b in upstream and b.shape.dims[0].value == dim for b in self._batch_inputs)

  def _client_hosts(self):
    plan = self.parallel.plan
    return tuple(plan.hosts[w] for w in plan.clients)

  def _writes_mirrored(self, op):
    """True if running ``op`` assigns a mirrored variable outside the step."""
    if op in self._writes:
      return self._writes[op]
    found, seen, work = False, set(), [op]
    while work and not found:
      x = work.pop()
      if x in seen:
        continue
      seen.add(x)
      if x.type in ASSIGN_OPS and x not in self._cloned and x.inputs and \
          x.inputs[0].op in self._mirrored:
        found = True
      elif x is op or x.type == "NoOp":
        work.extend(x.control_inputs)
    self._writes[op] = found
    return found
