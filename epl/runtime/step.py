"""One managed ``Session.run``: a chain of small layers, composed once when the graph is
rewritten (``StepChain``).

Each layer is ``layer(call, proceed) -> result``: it reads the ``StepCall`` (the run's
arguments), may pass on a changed one, and calls ``proceed`` for the rest of the chain. In
order:

  resize          an elastic job's chief after the checkpoint its launcher waited for: the
                  next training run ends the worker instead (stop_before_next_step)
  launch status   the first training step reports RUNNING to epl-launch (launch.status_file)
  gradient check  the first training step also fetches the recomputation check
                  (gradient_checkpoint.check_gradients)
  progress        worker 0's throughput report: rows from the feeds, or from a scalar fetched
                  in every training step (fetched only when reporting, it would make TF
                  compile the graph again)
  plain           one copy on one worker and nothing to map: TF's own run from then on
  deadline        a job with collectives: every run gets the step deadline
  faults          a multi-worker job: the peer watch, a run TF rejects as a duplicate request
                  runs again, a lost peer becomes one error naming it
  dispatch        fetch mapping and feed splitting over the copies, micro-batches as session
                  runs, the replica sync after a run that wrote variables

Only the layers the plan and Config need are in the chain, and a first-step layer leaves it
once it has fired (the chain is composed again): a steady step pays for what it uses.
"""
import dataclasses
import functools
import logging
from typing import Any, Callable, Tuple

import tensorflow.compat.v1 as tf

from epl.launch import status as launch_status
from epl.runtime import elastic, faults, serve
from epl.runtime.accumulation import AccumulationRuns
from epl.runtime.board import Board
from epl.runtime.feeds import ALL
from epl.runtime.progress import Progress

log = logging.getLogger("epl")

# a run TF rejects as a duplicate request runs again at most this many times (each rejection
# is a fresh draw: three in a row do not happen by chance)
RERUNS = 3


@dataclasses.dataclass(frozen=True)
class StepCall:
  """The arguments of one ``Session.run`` on the managed graph; ``original`` is TF's run
  (or, inside the faults layer, TF's run with reruns); ``sums``: extra fetches whose values
  are summed over micro-batch runs (the progress report's rows)."""
  session: Any
  original: Callable
  fetches: Any
  feed_dict: Any = None
  options: Any = None
  run_metadata: Any = None
  sums: Tuple = ()

  def run(self, fetches=None, options=None):
    """TF's run of ``fetches`` (default: this call's) with this call's feeds."""
    return self.original(self.session, self.fetches if fetches is None else fetches,
                         self.feed_dict, self.options if options is None else options,
                         self.run_metadata)


class StepChain:
  """The layers of one rewritten graph (see the module docstring); ``chain.run(call)`` runs
  one ``StepCall``."""

  def __init__(self, state, pg):
    self.state, self.pg = state, pg
    plan = pg.plan
    self.retried_steps = 0
    # which runs train: one detector (its walk of the graph and its caches) for every layer
    self._trains = Progress(pg, 0)
    self._status = self._trains if state.config.launch.status_file else None
    every = state.config.log.progress_secs if state.cluster.worker_index == 0 else 0
    self._progress = Progress(pg, every, clients=len(plan.clients)) \
        if every and not plan.is_local else None
    summary_dir = state.config.log.summary_dir
    self.board = Board(summary_dir, pg) \
        if summary_dir and self._progress is not None else None
    recomputed = pg.results.get("recompute")
    self._check = (recomputed.check_op, self._trains) \
        if recomputed is not None and recomputed.check_op is not None else None
    self._plain = plan.total_copies == 1 and plan.worker_num == 1 and state.fetch_mapper is None
    self._peers = self._ended = None
    self._accumulation = None
    self._layers = [layer for layer, wanted in (
        (self._launch_status, self._status is not None),
        (self._gradient_check, self._check is not None),
        (self._report_progress, self._progress is not None),
        (self._deadline, not self._plain and (plan.total_copies > 1 or plan.worker_num > 1)),
        (self._faults, not self._plain and plan.worker_num > 1)) if wanted]
    self.run = None
    self._compose()

  def _compose(self):
    run = self._dispatch if not self._plain else StepCall.run
    for layer in reversed(self._layers):
      run = functools.partial(layer, proceed=run)
    self.run = run

  def stop_before_next_step(self, why):
    """An elastic job grows back: the next training run ends the worker (exit code 75)
    before it runs (epl.runtime.elastic)."""
    def resize(call, proceed):
      if not self._trains.trains_fetches(call.session.graph, call.fetches):
        return proceed(call)
      log.warning("%s", why)
      elastic.stop()
    if not self._layers or self._layers[0].__name__ != "resize":
      self._layers.insert(0, resize)
      self._compose()

  def _leave(self, layer):
    """A first-step layer that has fired leaves the chain."""
    self._layers.remove(layer)
    self._compose()

  # ---- first-step layers ----------------------------------------------------------------
  def _launch_status(self, call, proceed):
    if not self._status.trains_fetches(call.session.graph, call.fetches):
      return proceed(call)
    self._leave(self._launch_status)                    # the first training step only
    resumed = _global_step(call)
    result = proceed(call)
    launch_status.report(self.state.config.launch.status_file, launch_status.RUNNING,
                         worker=self.state.cluster.worker_index, global_step=resumed)
    return result

  def _gradient_check(self, call, proceed):
    if not self._check[1].trains_fetches(call.session.graph, call.fetches):
      return proceed(call)
    check = self._check[0]
    self._leave(self._gradient_check)                   # the first training step only
    log.info("gradient_checkpoint.check_gradients: checking the recomputed tensors in this "
             "step")
    return proceed(dataclasses.replace(call, fetches=(call.fetches, check)))[0]

  def _report_progress(self, call, proceed):
    progress = self._progress
    if not progress.trains_fetches(call.session.graph, call.fetches):
      return proceed(call)
    report = progress.due()
    rows = progress.fed_rows(call.feed_dict) if call.feed_dict else None
    extra = progress.rows_tensor(call.session.graph, call.fetches) if rows is None else None
    traced = None
    if report and self.board is not None and call.options is None and \
        call.run_metadata is None:                    # that one step traced, for the board
      traced = tf.RunMetadata()
      call = dataclasses.replace(call, options=tf.RunOptions(
          trace_level=tf.RunOptions.FULL_TRACE), run_metadata=traced)
    if extra is None:
      result = proceed(call)
    else:
      result, rows = proceed(dataclasses.replace(call, fetches=(call.fetches, extra),
                                                 sums=(extra,)))
    rates = progress.step(rows, report)
    if rates is not None and self.board is not None:
      self.board.report(progress.steps, rates, traced)
    return result

  # ---- every step ------------------------------------------------------------------------
  def _deadline(self, call, proceed):
    return proceed(dataclasses.replace(
        call, options=step_deadline(call.options, self.pg.plan.communication.timeout)))

  def _faults(self, call, proceed):
    state, plan = self.state, self.pg.plan
    if self._peers is None:
      self._ended = serve.EndedPeers(state)
      self._peers = faults.PeerWatch(state.cluster, plan.communication.timeout,
                                     beat=state.heartbeat,
                                     status_file=state.config.launch.status_file,
                                     ended_peers=self._ended)
    self._peers.training = self._trains.trains_fetches(call.session.graph, call.fetches)
    original = call.original

    def one_run(*args, **kwargs):
      """One TF run; a run TF rejects as a duplicate request runs again (nothing of it ran)."""
      with self._peers:
        return faults.with_reruns(lambda: original(*args, **kwargs), RERUNS, self._on_rerun)
    try:
      return proceed(dataclasses.replace(call, original=one_run))
    except (faults.LOST + (tf.errors.InternalError, tf.errors.FailedPreconditionError,
                           tf.errors.NotFoundError, tf.errors.InvalidArgumentError)) as e:
      if isinstance(e, tf.errors.InternalError) and not faults.collectives_aborted(e):
        raise
      if isinstance(e, (tf.errors.FailedPreconditionError, tf.errors.NotFoundError,
                        tf.errors.InvalidArgumentError)) and not (
          state.heartbeat is not None and state.heartbeat.steps and
          faults.cleared_from_outside(e)):
        raise                              # the script's own error (before training, say)
      error = faults.peer_error(e, state.cluster, plan.communication.timeout,
                                state.config.launch.status_file, self._ended)
      log.error("%s", error)
      # the cause keeps TF's message; its frames (TF's run, epl's layers) would only bury it
      raise error from e.with_traceback(None)

  def _on_rerun(self, error, count):
    self.retried_steps += 1
    log.warning("TensorFlow rejected a step as a duplicate request (%s); running the same step "
                "again (%d time(s) for this step, %d in this job)", faults.essence(error), count,
                self.retried_steps)

  def _dispatch(self, call):
    mapper, feeds = self.state.fetch_mapper, self.state.feeds
    if mapper is None:
      return call.run()
    mode = feeds.mode(mapper.elements(call.fetches), call.feed_dict)
    try:
      if mode == ALL and self.pg.plan.accumulate_runs > 1:
        if self._accumulation is None:
          self._accumulation = AccumulationRuns(self.pg, mapper, feeds)
        result, writes = self._accumulation.step(
            call.session, call.original, call.fetches, call.feed_dict, call.options,
            call.run_metadata, call.sums)
      else:
        mapped, writes = mapper.map(call.fetches, all_copies=mode == ALL)
        result = call.original(call.session, mapped, feeds.split(call.feed_dict, mode),
                               call.options, call.run_metadata)
    except (tf.errors.InvalidArgumentError, tf.errors.OutOfRangeError) as e:
      raise feeds.explain(e) from e
    sync = self.pg.replication.sync_op
    if writes and sync is not None:
      call.original(call.session, sync, options=call.options)
    return result


def _global_step(call):
  """The value of the graph's global step (None when it has none or cannot be read)."""
  step = tf.train.get_global_step(call.session.graph)
  if step is None:
    return None
  try:
    return int(call.original(call.session, step, None, None, None))
  except (tf.errors.OpError, TypeError, ValueError):
    return None


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
