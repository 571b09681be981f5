"""What a fetch returns under replication (reference page, "What a fetch returns").

* a floating-point scalar computed by the model copies (the loss, a metric): the mean over
  this worker's copies — the number the single-device run prints;
* a tensor in ``epl.add_to_collection(t, GraphKeys.X)``: merged as X says (``GLOBAL_*``
  across every worker too: every client must fetch it in the same steps);
* anything else: copy 0's value (the user's own op).

The mapper also tells the runtime when a fetch writes a mirrored variable outside the
training step (initializer, ``Saver.restore``, a user assign), so that copy 0's new values can
be copied to the other copies right after.
"""
import collections

import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl.collections_api import MERGE_KINDS
from epl.passes.op_tables import ASSIGN_OPS


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
    self._cloned = parallel.analysis.cloned_set

  def map(self, fetches):
    """Returns (mapped fetches with the same structure, whether the run writes variables)."""
    writes = [False]
    return self._map(fetches, writes), writes[0]

  def _map(self, fetches, writes):
    if isinstance(fetches, (list, tuple)):
      mapped = [self._map(f, writes) for f in fetches]
      if isinstance(fetches, tuple) and hasattr(fetches, "_fields"):
        return type(fetches)(*mapped)
      return type(fetches)(mapped)
    if isinstance(fetches, collections.abc.Mapping):
      return type(fetches)((k, self._map(v, writes)) for k, v in fetches.items()) \
          if not isinstance(fetches, collections.defaultdict) else \
          {k: self._map(v, writes) for k, v in fetches.items()}
    try:
      hit = self._cache.get(fetches)
    except TypeError:
      return fetches
    if hit is None:
      hit = self._element(fetches)
      self._cache[fetches] = hit
    if hit[1]:
      writes[0] = True
    return hit[0]

  def _element(self, fetch):
    element = fetch
    if isinstance(fetch, str):
      try:
        element = self.graph.as_graph_element(fetch)
      except (KeyError, ValueError, TypeError):
        return fetch, False
    if isinstance(element, tf.Operation):
      return fetch, self._writes_mirrored(element)
    if isinstance(element, tf.Tensor):
      return self._merged(element, fetch), False
    return fetch, False

  def _merged(self, t, fetch):
    kind, job_wide = self._kind_of.get(t, (None, False))
    if kind is None:
      if (t.op not in self._cloned or t.shape.rank != 0 or not t.dtype.is_floating or
          self.parallel.num_copies * self._clones.num_micro_batch == 1):
        return fetch
      kind = "mean"
    rep = self._clones
    copies = [rep.tensor(c, t) for c in range(self.parallel.num_copies)]
    if any(c is None for c in copies):
      return fetch
    micro = [rep.tensor(c, t, m) for c in range(self.parallel.num_copies)
             for m in range(1, rep.num_micro_batch)]
    if micro and all(x is not None for x in micro):
      copies += micro                          # the loss is averaged over micro-batches too
    with compat.unfinalized(self.graph), self.graph.as_default(), tf.name_scope(None), \
        tf.control_dependencies(None), tf.device(self.parallel.worker.host), \
        tf.name_scope("epl_merged"):
      plan, host = self.parallel.plan, self.parallel.worker.host
      if kind == "concat":
        merged = tf.concat(copies, axis=0)
        if job_wide and plan.worker_num > 1:
          merged = self._collectives.all_gather([merged], [host],
                                                group=self._client_hosts())[0]
        return merged
      merged = tf.add_n(copies)
      if job_wide and plan.worker_num > 1:
        merged = self._collectives.all_reduce([merged], [host], "sum",
                                              group=self._client_hosts())[0]
        count = plan.total_copies * (len(copies) // max(1, self.parallel.num_copies))
      else:
        count = len(copies)
      return merged / tf.cast(count, merged.dtype) if kind == "mean" else merged

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
