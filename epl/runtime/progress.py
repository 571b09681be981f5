"""Training progress on worker 0: steps/s and samples/s every ``log.progress_secs`` seconds.

A step is a ``session.run`` that trains (its fetches reach an update of the model). Its
samples follow the batch semantics: the rows fed to batch placeholders, or, with an iterator
or in-graph inputs, copies x micro-batches x the batch each one reads (measured in every
step: one scalar fetched with each training step, so that a report never changes the step's
fetches and TF never compiles the graph again for it). In a multi-worker job the job's rate
is the worker's times the number of workers that drive copies.

  [epl] step 1200: 9.8 steps/s, 627 samples/s (job: 1254 samples/s)
"""
import logging
import time

import numpy as np
import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl.op_tables import DATA_SOURCE_OPS, RANDOM_OPS, VARIABLE_OPS, mutates
from epl.passes.slots import ancestors
from epl.runtime import feeds

log = logging.getLogger("epl")


def flatten(graph, fetches):
  """The graph elements (ops and tensors) of a fetch structure (names resolved)."""
  if isinstance(fetches, (list, tuple)):
    return [e for f in fetches for e in flatten(graph, f)]
  if isinstance(fetches, dict):
    return [e for f in fetches.values() for e in flatten(graph, f)]
  if isinstance(fetches, str):
    try:
      return [graph.as_graph_element(fetches)]
    except (KeyError, ValueError, TypeError):
      return []
  return [fetches]


_ELEMENTS = (tf.Tensor, tf.Operation, str, tf.Variable, tf.compat.v2.Variable)


def _fetch_key(fetches, element_types):
  """A hashable key for a fetch structure (lists, tuples and dicts -- MonitoredSession hands
  its hooks' fetches in a dict -- of graph elements and names), else None.
  ``element_types``: the types already seen to be graph elements (isinstance checks against
  TF's abstract classes cost microseconds; this runs on every ``session.run``)."""
  kind = type(fetches)
  if kind is list or kind is tuple:
    keys = tuple(_fetch_key(f, element_types) for f in fetches)
    return None if None in keys else (kind,) + keys
  if kind is dict:
    keys = tuple((k, _fetch_key(v, element_types)) for k, v in sorted(
        fetches.items(), key=lambda item: repr(item[0])))
    return None if any(v is None for _, v in keys) else (kind,) + keys
  if kind is str or fetches is None or kind in element_types or _learn(fetches, element_types):
    return (kind, fetches)
  return None


def _learn(element, element_types):
  if isinstance(element, _ELEMENTS):
    element_types.add(type(element))
    return True
  return False


class Progress:
  """Counts training steps and logs their rate; ``every`` 0 turns it off."""

  def __init__(self, parallel, every, clients=1, clock=time.time):
    self.every = every
    self.clients = clients
    self._clock = clock
    self._parallel = parallel
    self._started = clock()
    self._steps = self._window_steps = 0
    self._trains = {}
    self._by_fetches = {}
    self._element_types = set()
    self._rows_by_fetches = {}
    analysis = parallel.analysis
    self._batch = {op.outputs[0] for op in analysis.batch_placeholders} if analysis else set()
    phases = parallel.plan.op_index
    get = parallel.graph.get_operation_by_name
    self._update = {get(n) for n, (_, p) in phases.items() if p == "apply"}
    initialisers = {v.initializer for key in (tf.GraphKeys.GLOBAL_VARIABLES,
                                              tf.GraphKeys.LOCAL_VARIABLES)
                    for v in parallel.graph.get_collection(key)}  # slots' (built in apply)
    # the model is updated by ops that write a variable (not by initialisers, nor by other
    # stateful ops such as an initialiser's random numbers)
    self._update = {op for op in self._update if mutates(op) and op not in initialisers and
                    op.type not in VARIABLE_OPS and
                    any(t.op.type in VARIABLE_OPS for t in op.inputs)}
    if analysis is not None:
      self._update |= set(analysis.singletons)

  @property
  def on(self):
    return self.every > 0

  def due(self):
    """True when the next training step should report (and measure its batch)."""
    return self.on and self._clock() - self._started >= self.every

  def trains(self, elements):
    return any(self._reaches_update(e) for e in elements)

  def trains_fetches(self, graph, fetches):
    """``trains`` of a fetch structure; remembered for the shapes a training loop repeats
    (one graph element, or a list / tuple of them), so a step costs one dict lookup."""
    key = _fetch_key(fetches, self._element_types)
    found = self._by_fetches.get(key) if key is not None else None
    if found is None:
      found = self.trains(flatten(graph, fetches))
      if key is not None and len(self._by_fetches) < 4096:
        self._by_fetches[key] = found
    return found

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
        found = x in self._update
        work.extend(t.op for t in x.inputs)
        work.extend(x.control_inputs)
      self._trains[op] = found
    return self._trains[op]

  def fed_rows(self, feed_dict):
    """Rows fed to batch placeholders in this run (None when none are fed)."""
    fed = list(feeds.fed_tensors(self._parallel.graph, feed_dict))
    pieces = self._parallel.num_copies * self._parallel.plan.micro_batches
    rule = feeds.BatchRule(self._batch, pieces, fed, warned=None)
    rows = [np.shape(v)[0] for k, v in fed if rule.is_batch(k, v)]
    return max(rows) if rows else None

  def rows_tensor(self, graph, fetches):
    """A scalar tensor: the rows every copy and micro-batch of a step of ``fetches`` read, from
    the first input (data source or random op) that step reads anyway -- fetching one it does
    not read would pull a batch the local step never pulls (a GAN's generator step) -- or
    None. Cached per fetch structure, like ``trains_fetches``."""
    key = _fetch_key(fetches, self._element_types)
    elements = None
    if key is None:        # by what it fetches: a new op on every run would extend the
      elements = flatten(graph, fetches)      # session's graph, and TF recompiles it
      key = ("elements",) + tuple(sorted(getattr(e, "name", repr(e)) for e in elements))
    if key in self._rows_by_fetches:
      return self._rows_by_fetches[key]
    found = self._rows_of(flatten(graph, fetches) if elements is None else elements)
    if len(self._rows_by_fetches) < 4096:
      self._rows_by_fetches[key] = found
    return found

  def _rows_of(self, elements):
    pg = self._parallel
    inputs = [op for op in pg.analysis.cloned
              if op.type in DATA_SOURCE_OPS or op.type in RANDOM_OPS] if pg.analysis else []
    if not inputs:
      return None
    upstream = ancestors([op for op in (getattr(e, "op", e) for e in elements)
                          if isinstance(op, tf.Operation)])
    clones = pg.clones() if pg.replication is not None else None
    for op in inputs:
      first = op.outputs[0]
      pieces = [t for t in (clones.every(first) if clones else [first])
                if t is not None and t.op in upstream]
      if pieces:
        with compat.unfinalized(pg.graph), pg.graph.as_default(), tf.name_scope(None), \
            tf.control_dependencies(None), tf.device(pg.worker.host):
          return tf.add_n([tf.shape(t)[0] for t in pieces], name="epl_step_rows")
    return None

  @property
  def steps(self):
    return self._steps

  def step(self, rows, report):
    """Counts one training step of ``rows`` samples (None: unknown); logs when ``report``
    (``due()`` asked before the step ran, so that it could measure its batch) and returns
    the figures logged ({"steps_per_sec": ..., "samples_per_sec": ..., ...}), else None."""
    self._steps += 1
    self._window_steps += 1
    if not report:
      return None
    now = self._clock()
    seconds = now - self._started
    rate = self._window_steps / max(seconds, 1e-9)
    text = "step %d: %.1f steps/s" % (self._steps, rate)
    rates = {"steps_per_sec": rate}
    if rows:
      text += ", %.0f samples/s" % (rate * rows)
      rates["samples_per_sec"] = rate * rows
      if self.clients > 1:
        text += " (job: %.0f samples/s)" % (rate * rows * self.clients)
        rates["job_samples_per_sec"] = rate * rows * self.clients
    log.info("%s", text)
    self._started, self._window_steps = now, 0
    return rates
