"""The public API that needs epl's state: ``epl.init``, the strategy scopes, merged-output
collections and ``epl.Graph.get()``.

This module (with the hook dispatcher it installs) is the only place that looks epl's state
up through ``epl.Env``; it hands the recorder and the graph state to everything below.
"""
import atexit
import logging
import os
import sys
import time

import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl import annotate
from epl.cluster import Cluster, default_job_id
from epl.collections_api import check_key
from epl.config import Config
from epl.env import Env
from epl.errors import RuntimeStateError
from epl.runtime import auto_tp, driver, elastic, heartbeat, watchdog
from epl.runtime.hooks import Dispatcher
from epl.runtime.state import GraphState

log = logging.getLogger("epl")


def _visible_gpus():
  return len(tf.config.list_physical_devices("GPU"))


def _start_job(state, placement):
  """A multi-worker job: TF's hooks, this worker's server, every peer met at the barrier."""
  from epl.runtime import server
  config, cluster = state.config, state.cluster
  # TF's hooks go in before the first cross-worker step (the startup below runs steps)
  for on, install, without in _NATIVE_HOOKS:
    why = install(config.communication.native_hooks_untested_tf) if on(config) else None
    if why:
      log.warning(without, why)
  limit = config.cluster.startup_timeout
  with watchdog.deadline(limit + 15, "worker %d: the job did not start within "
                         "cluster.startup_timeout=%d s (+15 s); stopping" % (
                             cluster.worker_index, limit)):
    started = time.time()
    job_id = config.launch.job_id or getattr(placement, "job_id", "") or default_job_id(
        cluster.worker_hosts)
    state.server = server.start_server(cluster)
    server.meet_peers(state.server, cluster, job_id, limit)
    state.start_round = server.next_barrier()
    server.barrier(state.server, cluster, max(1.0, limit - (time.time() - started)),
                   instance=state.start_round)
    server.publish(state.server, cluster, job_id, server.RUNNING)


def init(config=None):
  """Starts epl for the current default graph (graph mode only).

  Calling it again for another graph resets epl's state for that graph. Calling it again for a
  graph that already has epl annotations is refused (they would be dropped silently).

  Args:
    config: an ``epl.Config`` (default: ``epl.Config()``, i.e. defaults + EPL_* environment).
  Returns:
    the ``epl.Env``.
  Raises:
    RuntimeStateError: TensorFlow runs eagerly (call
      ``tf.compat.v1.disable_v2_behavior()`` first), or epl.init() was already called for
      this graph and annotations were made since.
  """
  if tf.executing_eagerly():
    raise RuntimeStateError(
        "epl.init() needs TensorFlow graph mode, but eager execution is on: call "
        "tf.compat.v1.disable_v2_behavior() (or disable_eager_execution()) before epl.init()")
  config = Config() if config is None else config
  if not isinstance(config, Config):
    raise RuntimeStateError("epl.init(config): expected an epl.Config, got %r" % (config,))
  graph = tf.get_default_graph()
  previous = Env._current._state if Env._current is not None else None  # pylint: disable=protected-access
  if previous is not None:
    auto_tp.close_scope(previous)
  if previous is not None and previous.graph is graph and any(
      s.name != auto_tp.SCOPE_NAME for s in previous.recorder.specs):
    raise RuntimeStateError(
        "epl.init() was already called for this graph, and the TaskGraph(s) annotated since "
        "(%s) would be dropped; call epl.init() once, before building the model (or build the "
        "model in a new tf.Graph())" % ", ".join(
            "%r at %s" % (s.name, s.location) for s in previous.recorder.specs))
  cluster, placement = Cluster.from_process(config.cluster.devices_per_worker, os.environ,
                                            _visible_gpus())
  _configure_logging(config, cluster, placement)
  layout = auto_tp.layout_of(config)          # a bad one fails before the job starts
  config = elastic.keep_global_batch(config, cluster.worker_num)
  state = GraphState(graph, config, cluster)
  if cluster.distributed:
    _start_job(state, placement)
  activate(state)
  if layout is not None:
    auto_tp.open_scope(state, layout, _recorder)
  if config.launch.parent_pid:
    watchdog.watch_launcher(config.launch.parent_pid)
  if cluster.distributed:
    _watch_exit(state)
  log.debug("epl.init: %s, %r", cluster, config)
  return Env.get()


def _watch_exit(state):
  """A multi-worker worker's steps and its end, as its launcher and peers see them
  (epl.runtime.heartbeat): the step counter the step runs drive, the exit code Python knows
  (a failed worker skips the farewell that waits for its peers), an ``ended`` event."""
  path = state.config.launch.status_file
  state.exits = heartbeat.ExitCode().install()
  state.heartbeat = heartbeat.Heartbeat(path, floor=state.config.log.stall_secs)
  beat, exits = state.heartbeat, state.exits
  atexit.register(lambda: beat.ended(exits.code or 0))


# (is it on, put it in -> None or why not, the warning when it could not) per hook below Python
_NATIVE_HOOKS = (
    (lambda c: c.communication.unique_request_ids, compat.unique_request_ids,
     "could not make TensorFlow's request ids unique (%s): a step TF rejects as a duplicate "
     "request (about once per 43,000 steps per worker) is run again"),
    (lambda c: c.communication.release_aborted_rendezvous, compat.release_aborted_rendezvous,
     "could not stop TensorFlow keeping every rendezvous a step's cleanup aborts (%s): the "
     "workers' memory grows by ~1 KB in a few percent of steps"),
)


def activate(state):
  """Makes ``state`` the managed graph: the public view and the hook dispatcher."""
  Env._reset_to(state)  # pylint: disable=protected-access
  compat.install(Dispatcher(state))


def _configure_logging(config, cluster, placement=None):
  """epl's own messages go to stderr at ``log.level``, prefixed with the worker in a job;
  what a scheduler said about the job (``placement``) is said at start."""
  handler = next((h for h in log.handlers if getattr(h, "_epl", False)), None)
  if handler is None:
    handler = logging.StreamHandler(sys.stderr)
    handler._epl = True  # pylint: disable=protected-access
    log.addHandler(handler)
    log.propagate = False
  prefix = "[epl w%d] " % cluster.worker_index if cluster.distributed else "[epl] "
  handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
  log.setLevel(config.log.level.upper())
  if placement is not None:
    log.warning("epl.init: the job as %s", placement.describe())


def _state():
  """epl's state for the graph being built (the default graph).

  ``epl.init()`` at the top of a notebook and the model inside ``with tf.Graph().as_default():``
  is fine: an annotation made in another graph while epl's graph is still untouched moves epl
  to that graph.
  """
  state = Env.get()._state  # pylint: disable=protected-access
  graph = tf.get_default_graph()
  if graph is not state.graph:
    if state.untouched and not state.recorder.specs and not state.collections:
      log.debug("epl moves to the graph the model is built in (epl.init's graph is empty)")
      state.bind(graph)
      return state
    raise RuntimeStateError(
        "epl.init() was called for another graph, which already has %s; call epl.init() "
        "inside `with graph.as_default():` of the graph you build" % (
            "epl annotations" if state.recorder.specs else "ops"))
  return state


def _recorder():
  return _state().recorder


# ---- strategy scopes ---------------------------------------------------------------------
def replicate(device_count=None, name=None):
  """Ops created inside form one TaskGraph trained data-parallel.

  Args:
    device_count: devices one model replica of this TaskGraph uses (default 1); with k > 1
      each replica's batch is split over its k devices.
    name: a name for the TaskGraph (shown by ``epl.Graph.get().format()``).
  Returns:
    A context manager (also accepted by ``set_default_strategy``).

  Example:
    >>> with epl.replicate(device_count=1, name="stage_0"):
    ...   hidden = tf.layers.dense(x, 16)
  """
  return annotate.Strategy(annotate.REPLICATE, device_count, name, _recorder)


def split(device_count=None, name=None):
  """Ops created inside form one TaskGraph split over ``device_count`` devices.

  Variables created inside are sharded over the devices (docs/user_guide.md, "Split"); the
  ops that read them run sharded by the rules of ``epl.sharding.rules``.

  Example:
    >>> with epl.split(device_count=4, name="classifier"):
    ...   logits = tf.layers.dense(features, 100000)
    ...   loss = tf.losses.sparse_softmax_cross_entropy(labels, logits)
  """
  return annotate.Strategy(annotate.SPLIT, device_count, name, _recorder,
                           context=compat.split_variables)


def set_default_strategy(strategy):
  """Ops created outside any scope from now on form a new TaskGraph with ``strategy``.

  Raises:
    AnnotationError: ``strategy`` is not an epl strategy, or a scope is open.
  """
  annotate.set_default(strategy, _recorder)


# ---- merged outputs ----------------------------------------------------------------------
def add_to_collection(tensor, key):
  """Marks ``tensor`` so that fetching it returns its merge over the model copies.

  Args:
    tensor: a tensor of the model (the loss, a metric, predictions).
    key: one of ``epl.GraphKeys``.
  Raises:
    ConfigError: ``key`` is not one of ``epl.GraphKeys``.
  """
  check_key(key)
  _state().collections.setdefault(key, []).append(tensor)


def get_collection(key):
  """The tensors added under ``key`` (a list, empty if none)."""
  return list(_state().collections.get(key, []))


class Graph:
  """``epl.Graph.get()``: introspection of the parallel graph."""

  @staticmethod
  def get():
    """The ParallelGraph of the graph ``epl.init`` was called for.

    Before the first step it shows the plan the annotations ask for; after it (or after
    ``MonitoredTrainingSession`` creation) it also shows the replicas epl built.
    """
    return driver.parallel_graph(_state())
