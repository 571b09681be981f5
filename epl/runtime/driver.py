"""Drives the rewrite and serves the compat hooks for the graph epl manages.

The rewrite happens once, just before the graph is first used: at
``MonitoredTrainingSession`` creation (Scaffold.finalize), at ``graph.finalize()``, or at the
first ``Session.run`` on the graph — whichever comes first. Ops created after it are not
part of the parallel step (init, saver and summary ops may be).
"""
import logging
import socket
import time

import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl.collectives import Collectives
from epl.env import Env
from epl.errors import PlanError
from epl.passes.analyze import analyze
from epl.passes.clone import NodeDefCache
from epl.passes.grad_sync import gradient_sync
from epl.io_slicing import assign_files
from epl.passes.op_tables import READ_OPS
from epl.passes.micro_batch import micro_batches
from epl.passes.replicate import replicate
from epl.passes.schedule import apply_schedule
from epl.plan.build import build_plan
from epl.runtime.fetch import FetchMapper
from epl.runtime.parallel_graph import ParallelGraph
from epl.runtime.session_config import session_config

log = logging.getLogger("epl")


def parallel_graph(state):
  """The ParallelGraph of ``state``: the rewritten one, or a plan-only preview."""
  if state.parallel is not None:
    return state.parallel
  plan, owner, phase = build_plan(state.graph, state.recorder, state.config, state.cluster,
                                  state.graph.version)
  return ParallelGraph(plan, state.graph, owner, phase)


def rewrite(state):
  """Runs the pass pipeline once on ``state.graph``; returns the ParallelGraph."""
  if state.parallel is not None:
    return state.parallel
  graph = state.graph
  with compat.unfinalized(graph):
    plan, owner, phase = build_plan(graph, state.recorder, state.config, state.cluster,
                                    graph.version)
    if plan.is_local or plan.serve_only:
      state.parallel = ParallelGraph(plan, graph, owner, phase, rewritten=True)
      state.fetch_mapper = None
      return state.parallel
    global_steps = [v.op for v in graph.get_collection(tf.GraphKeys.GLOBAL_STEP)]
    analysis = analyze(graph, owner, global_steps)
    _check_gradients(graph, analysis, state.recorder)
    collectives = Collectives(on_gpu=state.cluster.has_gpu)
    cache = NodeDefCache(graph)
    replication = replicate(graph, plan, analysis, owner, cache, collectives)
    micro_batches(graph, plan, analysis, owner, phase, replication, cache)
    schedule = apply_schedule(graph, plan, analysis, owner, phase, replication)
    report = gradient_sync(graph, plan, replication, state.recorder.grads_and_vars, owner,
                           phase, collectives)
  state.parallel = ParallelGraph(plan, graph, owner, phase, analysis, replication, report,
                                 rewritten=True, collectives=collectives, schedule=schedule)
  state.fetch_mapper = FetchMapper(graph, state.parallel, state.collections, collectives) \
      if plan.total_copies > 1 or plan.num_micro_batch > 1 else None
  log.info("epl rewrite done:\n%s", state.parallel.format())
  return state.parallel


def _check_gradients(graph, analysis, recorder):
  """A trainable variable the step writes without a recorded gradient would diverge."""
  with_grad = {v.op for g, v in recorder.grads_and_vars if g is not None}
  trainable = {v.op: v for v in graph.get_collection(tf.GraphKeys.TRAINABLE_VARIABLES)}
  for var_op in analysis.mirrored:
    if var_op in with_grad or var_op not in trainable:
      continue
    writers = [c for t in var_op.outputs for c in t.consumers()
               if c in analysis.cloned_set and c.type not in READ_OPS]
    if writers:
      raise PlanError(
          "epl found no gradient for trainable variable %r, which op %r updates in the "
          "training step: epl synchronises gradients given to an optimizer's minimize() or "
          "apply_gradients(); use one of those for this variable" % (
              trainable[var_op].name, writers[0].name))


def serve(state, poll_seconds=1.0):
  """A worker with no model replica's first stage only serves its devices to the clients.

  Its script stops here: this blocks while the job's clients are alive (their servers accept
  connections), then ends the process with exit code 0. (A client that fails makes
  epl-launch stop every worker.)
  """
  cluster = state.cluster
  log.warning("epl: worker %d holds no first stage of a model replica: it serves its devices "
              "to the clients until the job ends", cluster.worker_index)
  clients = [cluster.worker_hosts[w] for w, _ in state.parallel.plan.clients] or \
      [cluster.worker_hosts[0]]
  while any(_accepts(address) for address in clients):
    time.sleep(poll_seconds)
  log.warning("epl: worker %d: the clients are gone; the job has ended", cluster.worker_index)
  raise SystemExit(0)


def _accepts(address):
  host, port = address.rsplit(":", 1)
  try:
    with socket.create_connection((host, int(port)), timeout=2):
      return True
  except OSError:
    return False


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


class Listener:
  """Receives the compat hooks' events (see epl._tf_compat)."""

  def manages(self, graph):
    return Env.state_for(graph) is not None

  def is_chief(self, graph):
    """Worker 0 writes checkpoints and summaries; ``graph`` None: the current epl graph."""
    env = Env._current  # pylint: disable=protected-access
    if env is None or (graph is not None and Env.state_for(graph) is None):
      return True
    return env.cluster.worker_index == 0

  def slice_files(self, graph, files, is_files):
    """This worker's share of a file list (io.slicing), or None to leave it alone."""
    state = Env.state_for(graph)
    if not state.config.io.slicing or state.cluster.worker_num == 1:
      return None
    mine = assign_files(files, state.cluster.worker_num, state.cluster.worker_index,
                        state.config.io.unbalanced_io_slicing, state.config.io.drop_last_files)
    log.info("epl io.slicing: worker %d reads %d of %d file(s)", state.cluster.worker_index,
             len(mine), len(files))
    return mine

  def on_phase(self, graph, first, last, phase):
    Env.state_for(graph).recorder.add_phase(first, last, phase)

  def on_apply(self, graph, grads_and_vars):
    Env.state_for(graph).recorder.grads_and_vars.extend(grads_and_vars)

  def before_session(self, graph):
    state = Env.state_for(graph)
    rewrite(state)
    if state.parallel.plan.serve_only:
      serve(state)

  def session_args(self, graph, target, config):
    state = Env.state_for(graph)
    remote = ()
    if state.server is not None:
      if not target:
        target = state.server.target        # the user's tf.Session() runs on this worker
      remote = parallel_graph(state).plan.remote_tasks()
    return target, session_config(state.cluster, state.config, config, remote)

  def run(self, session, original, fetches, feed_dict, options, run_metadata):
    state = Env.state_for(session.graph)
    if state.parallel is None:
      rewrite(state)
      if state.parallel.plan.serve_only:
        serve(state)
    plan = state.parallel.plan
    if plan.total_copies > 1 or plan.worker_num > 1:
      options = step_deadline(options, plan.collective_timeout)
    mapper = state.fetch_mapper
    if mapper is None:
      return original(session, fetches, feed_dict, options, run_metadata)
    if feed_dict:
      _check_fed_batches(state.parallel, feed_dict)
    mapped, writes = mapper.map(fetches)
    result = original(session, mapped, feed_dict, options, run_metadata)
    sync = state.parallel.replication.sync_op
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
