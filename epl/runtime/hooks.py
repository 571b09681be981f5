"""The hook dispatcher: receives the events of epl._tf_compat's hooks for one managed graph.

``epl.init`` makes one ``Dispatcher`` for the ``GraphState`` it creates and installs it; the
dispatcher reads only that state (no global lookups).
"""
import logging

import tensorflow.compat.v1 as tf

from epl.errors import PlanError
from epl.io_slicing import assign_files
from epl.runtime import driver, faults
from epl.runtime.session_config import session_config

log = logging.getLogger("epl")


class Dispatcher:
  """Serves the compat hooks (see epl._tf_compat) for ``state.graph``."""

  def __init__(self, state):
    self.state = state
    self.retried_steps = 0

  def manages(self, graph):
    return graph is self.state.graph

  def is_chief(self, graph):
    """Worker 0 writes checkpoints and summaries; ``graph`` None: any graph."""
    if graph is not None and not self.manages(graph):
      return True
    return self.state.cluster.worker_index == 0

  def slice_files(self, graph, files, is_files):
    """This worker's share of a file list (io.slicing), or None to leave it alone."""
    state = self.state
    if not state.config.io.slicing or state.cluster.worker_num == 1:
      return None
    mine = assign_files(files, state.cluster.worker_num, state.cluster.worker_index,
                        state.config.io.unbalanced_io_slicing, state.config.io.drop_last_files)
    log.info("io.slicing: worker %d reads %d of %d file(s)", state.cluster.worker_index,
             len(mine), len(files))
    return mine

  def on_phase(self, graph, first, last, phase):
    self.state.recorder.add_phase(first, last, phase)

  def on_apply(self, graph, grads_and_vars):
    self.state.recorder.grads_and_vars.extend(grads_and_vars)

  def before_session(self, graph):
    self._rewrite()

  def _rewrite(self):
    pg = driver.rewrite(self.state)
    if pg.worker.serve_only:
      driver.serve(self.state)
    return pg

  def session_args(self, graph, target, config):
    state = self.state
    remote = ()
    plan = driver.parallel_graph(state).plan
    if state.server is not None:
      if not target:
        target = state.server.target        # the user's tf.Session() runs on this worker
      remote = plan.for_worker(state.cluster.worker_index).remote_tasks()
    return target, session_config(state.cluster, plan, state.config, config, remote)

  def run(self, session, original, fetches, feed_dict, options, run_metadata):
    state = self.state
    pg = state.parallel if state.parallel is not None else self._rewrite()
    plan = pg.plan
    if plan.total_copies > 1 or plan.worker_num > 1:
      options = step_deadline(options, plan.communication.timeout)
    if plan.worker_num == 1:
      return self._run(pg, session, original, fetches, feed_dict, options, run_metadata)
    try:
      try:
        return self._run(pg, session, original, fetches, feed_dict, options, run_metadata)
      except tf.errors.AbortedError as e:
        if not faults.is_duplicate_request(e):
          raise
        self.retried_steps += 1
        log.warning("TensorFlow rejected a step as a duplicate request (a TF request-id "
                    "collision, about once per 100k steps); running the same step again "
                    "(%d so far)", self.retried_steps)
        return self._run(pg, session, original, fetches, feed_dict, options, run_metadata)
    except faults.LOST as e:
      error = faults.peer_error(e, state.cluster, plan.communication.timeout)
      log.error("%s", error)
      raise error from e

  def _run(self, pg, session, original, fetches, feed_dict, options, run_metadata):
    mapper = self.state.fetch_mapper
    if mapper is None:
      return original(session, fetches, feed_dict, options, run_metadata)
    if feed_dict:
      _check_fed_batches(pg, feed_dict)
    mapped, writes = mapper.map(fetches)
    result = original(session, mapped, feed_dict, options, run_metadata)
    sync = pg.replication.sync_op
    if writes and sync is not None:
      original(session, sync, options=options)
    return result


def step_deadline(options, seconds):
  """``options`` (a RunOptions or None) with ``timeout_in_ms`` at most ``seconds``.

  The deadline is what turns a dead or stalled peer into an error: the collectives carry no
  per-op timeout (TF would spend a thread per launch on it, see epl.collectives). A smaller
  timeout the user asked for is kept.
  """
  limit = int(seconds * 1000)
  if options is not None and 0 < options.timeout_in_ms <= limit:
    return options
  merged = tf.RunOptions()
  if options is not None:
    merged.CopyFrom(options)
  merged.timeout_in_ms = limit
  return merged


def _check_fed_batches(parallel, feed_dict):
  """A fed batch is split over copies and micro-batches: refuse one that does not divide."""
  pieces = parallel.num_copies * parallel.plan.num_micro_batch
  if pieces == 1:
    return
  split = {ph.outputs[0] for ph in parallel.analysis.split_placeholders}
  for key, value in feed_dict.items():
    tensor = key if isinstance(key, tf.Tensor) else None
    if tensor is None and isinstance(key, str):
      try:
        tensor = parallel.graph.as_graph_element(key)
      except (KeyError, ValueError):
        continue
    if tensor in split and hasattr(value, "__len__") and len(value) % pieces:
      raise PlanError(
          "the batch fed to %r has %d rows, which epl cannot split evenly over this worker's "
          "%d model copies x %d micro-batch(es); feed a multiple of %d rows" % (
              tensor.op.name, len(value), parallel.num_copies,
              parallel.plan.num_micro_batch, pieces))
