"""Drives the rewrite: build the plan, run ``epl.passes.PASSES``, keep the result.

The rewrite happens once, just before the graph is first used: at ``MonitoredTrainingSession``
creation (Scaffold.finalize), at ``graph.finalize()``, or at the first ``Session.run`` on the
graph -- whichever comes first. Ops created after it are not part of the parallel step (init,
saver and summary ops may be).
"""
import contextlib
import gc
import logging
import time

import epl.passes
from epl import _tf_compat as compat
from epl.amp import apply_amp
from epl.op_tables import VARIABLE_OPS, variable_dtype, variable_shape
from epl.passes.context import RewriteContext
from epl.plan.build import build_plan
from epl.runtime import auto_tp, serve
from epl.runtime.auto_stages import annotate_stages
from epl.runtime.feeds import FeedSplitter
from epl.runtime.fetch import FetchMapper
from epl.runtime.parallel_graph import ParallelGraph

log = logging.getLogger("epl")


def parallel_graph(state):
  """The ParallelGraph of ``state``: the rewritten one, or a plan-only preview."""
  if state.parallel is not None:
    return state.parallel
  transform(state)
  plan = build_plan(state.graph, state.recorder, state.config, state.cluster)
  return ParallelGraph(plan, state.graph, plan.for_worker(state.cluster.worker_index))


def session_plan(state):
  """The plan a session's ConfigProto is made for: the rewritten graph's, a preview of the
  model built so far, or None while the graph holds no variable yet (a session opened before
  the model: the plan waits for the first run, when the model is complete)."""
  if state.parallel is not None:
    return state.parallel.plan
  if not any(op.type in VARIABLE_OPS for op in state.graph.get_operations()):
    return None
  return parallel_graph(state).plan


def transform(state):
  """The model transformations that run before planning, once: AMP, then the automatic
  stage cut (auto.auto_parallel)."""
  if state.amp is None and state.config.amp.level:
    state.amp = apply_amp(state.graph, state.recorder, state.config)
  auto_tp.close_scope(state)
  annotate_stages(state)


def rewrite(state):
  """Plans and rewrites ``state.graph`` once; returns the ParallelGraph."""
  if state.parallel is not None:
    return state.parallel
  start = time.time()
  with _no_cycle_collection():
    transform(state)
    plan = build_plan(state.graph, state.recorder, state.config, state.cluster)
    state.passes_running = True
    try:
      state.parallel = run_passes(state.graph, plan, state.cluster.worker_index)
    finally:
      state.passes_running = False
  pg = state.parallel
  if state.server is not None:
    serve.arrange_exit(state, plan)
  merges = pg.results and (plan.total_copies > 1 or plan.micro_batches > 1)
  state.fetch_mapper = FetchMapper(state.graph, pg, state.collections) if merges else None
  state.feeds = FeedSplitter(pg) if merges else None
  log.debug("rewrite done in %.2f s:\n%s", time.time() - start, pg.format())
  if state.cluster.worker_index == 0:
    log.info("%s", pg.summary())
    if plan.worker_num > 1:
      note, rate = deadline_note(state.graph, plan)
      # worth a line when a link that still works (1 Mbit/s or faster) would reach it
      (log.info if rate >= NOTE_RATE else log.debug)("%s", note)
  return pg


@contextlib.contextmanager
def _no_cycle_collection():
  """Python's cycle collector paused while the rewrite creates its objects (restored after,
  also on an error).

  The rewrite allocates a few Python objects per op it creates (TF's Operation and Tensor
  wrappers), hundreds of thousands on a large model, and every allocation threshold crossed
  starts a collection that scans the whole heap, the user's graph included: measured on
  clone imports, a quarter to a half of their time. Nothing the rewrite makes is garbage
  before it ends; what is collects at the next collection."""
  enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if enabled:
      gc.enable()


def deadline_note(graph, plan):
  """(text, bits/s): what ``communication.collective_timeout`` means for this model's gradients: a ring
  all-reduce of S bytes among n workers moves 2 (n - 1) / n x S bytes over each worker's
  link, so a step whose sync alone outlasts the deadline needs a link slower than that over
  the deadline."""
  total = 0
  for g in plan.gradients:
    try:
      var = graph.get_operation_by_name(g.variable)
    except KeyError:
      continue
    shape = variable_shape(var)
    if shape.is_fully_defined():
      total += shape.num_elements() * variable_dtype(var).size
  n, seconds = plan.worker_num, plan.communication.timeout
  wire = 2.0 * (n - 1) / n * total
  rate = wire * 8 / seconds
  return ("communication.collective_timeout=%d s: this model's %.1f MB of gradients move "
          "%.1f MB over each worker's link per step, so only a link slower than %.2f Mbit/s "
          "(plus the step's compute) would reach the deadline; raise it for slower links" % (
              seconds, total / 1e6, wire / 1e6, rate / 1e6)), rate


NOTE_RATE = 1e6


def run_passes(graph, plan, worker_index):
  """Runs every pass of ``epl.passes.PASSES`` (in that order) on ``graph`` for ``plan``.

  The plan is the whole input: the same graph and ``ParallelPlan.from_json(plan.to_json())``
  give the same rewritten graph.
  """
  worker = plan.for_worker(worker_index)
  if plan.is_local or worker.serve_only:
    return ParallelGraph(plan, graph, worker, rewritten=True)
  with compat.unfinalized(graph):
    ctx = RewriteContext.create(graph, plan, worker_index)
    for run in epl.passes.PASSES:                 # read at call time: the list is the order
      began = time.time()
      ctx = ctx.with_result(run.__name__, run(ctx))
      log.debug("pass %s: %.3f s, %s", run.__name__, time.time() - began,
                ctx.results[run.__name__])
  return ParallelGraph(plan, graph, ctx.worker, ctx.results, rewritten=True,
                       collectives=ctx.collectives)
