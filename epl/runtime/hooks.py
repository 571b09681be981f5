"""The hook dispatcher: receives the events of epl._tf_compat's hooks for one managed graph.

``epl.init`` makes one ``Dispatcher`` for the ``GraphState`` it creates and installs it; the
dispatcher reads only that state (no global lookups).
"""
import bisect
import functools
import logging
import weakref

import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl import annotate
from epl.errors import RuntimeStateError
from epl.sharding.sharded import SplitScope
from epl.io_slicing import assign_files
from epl.launch import status as launch_status
from epl.op_tables import VARIABLE_OPS
from epl.runtime import auto_tp, checkpoints, driver, elastic, serve
from epl.runtime.session_config import session_config
from epl.runtime.step import StepCall, StepChain

log = logging.getLogger("epl")


class Dispatcher:
  """Serves the compat hooks (see epl._tf_compat) for ``state.graph``."""

  def __init__(self, state):
    self.state = state
    self._chain = None            # epl.runtime.step.StepChain once the graph is rewritten
    self._split_scopes = {}       # split TaskGraph index -> its SplitScope
    self._told = weakref.WeakSet()     # unmanaged graphs already checked

  def manages(self, graph):
    return graph is self.state.graph

  def is_chief(self, graph):
    """Worker 0 writes checkpoints and summaries; ``graph`` None: any graph."""
    if graph is not None and not self.manages(graph):
      return True
    return self.state.cluster.worker_index == 0

  def checkpoint_to_restore(self, directory):
    return checkpoints.to_restore(directory, self.is_chief(None))

  def restore_failed(self, directory, path, error):
    return checkpoints.after_failed_restore(directory, path, error, self.is_chief(None))

  def save_failed(self, path, error):
    return checkpoints.after_failed_save(path, error)

  def saved(self, path):
    if self._chain is not None and elastic.resize_asked(self.state.config, self.is_chief(None)):
      self._chain.stop_before_next_step(
          "saved %s; stopping before the next step for the elastic job to grow back "
          "(epl-launch starts every host again from this checkpoint)" % path)

  def restored_without(self, names, path):
    log.info("the checkpoint %s has no %s (written without the feature that keeps it): "
             "starting from its initial value", path, ", ".join(names))

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
    if self.state.parallel is not None:
      _built_after_rewrite(phase)
    self.state.recorder.add_phase(first, last, phase)

  def on_apply(self, graph, grads_and_vars):
    self.state.recorder.grads_and_vars.extend(grads_and_vars)

  def split_shards(self, graph):
    """{op name: shard} of the split variables' parts (and their slots) of ``graph``."""
    return self.state.recorder.shard_ops

  def split_scope(self, graph, inputs=()):
    """The rules context (epl.sharding.rules.SplitScope) of the split TaskGraph that an op
    created now joins -- inside ``with epl.split(...)`` or after it, outside any scope, or
    anywhere when it reads one of ``inputs`` that a split TaskGraph sharded -- or None."""
    if self.state.passes_running:        # the passes' ops read parts and wholes as they are
      return None
    recorder = self.state.recorder
    index = recorder.taskgraph_of(graph.version + 1)
    if index is None:
      return None
    if recorder.specs[index].kind != annotate.SPLIT:
      owners = [recorder.sharded[t].taskgraph for t in inputs
                if isinstance(t, tf.Tensor) and t in recorder.sharded]
      if not owners:
        return None
      index = owners[0]
    scope = self._split_scopes.get(index)
    if scope is None:
      count = recorder.specs[index].device_count or self.state.cluster.total_gpu_num
      scope = self._split_scopes[index] = SplitScope(count, recorder, index,
                                                     functools.partial(_rank_of, graph))
    return scope

  def before_gradients(self, graph):
    """The model is built: auto.layout's split scope ends here (epl.runtime.auto_tp)."""
    auto_tp.close_scope(self.state)

  def on_gradients(self, graph, xs, grads):
    """Records (raw gradient, variable op) for every variable among ``xs``."""
    xs = list(xs) if isinstance(xs, (list, tuple)) else [xs]
    for x, g in zip(xs, grads):
      var_op = variable_op_of(x)
      if g is not None and var_op is not None:
        self.state.recorder.gradients.append((g, var_op))

  def unmanaged_run(self, graph):
    """A session runs a graph epl does not manage: refuse it when the epl annotations went
    to an empty graph (the model would silently train as the local script)."""
    if graph in self._told:
      return
    self._told.add(graph)
    state = self.state
    if state.recorder.specs and state.untouched:
      raise RuntimeStateError(
          "this session runs a graph epl does not manage, while the epl annotations (%s) were "
          "made for another graph that has no model: the model would train as the plain local "
          "script. Build the model in the graph epl.init() was called for, or call epl.init() "
          "and the annotations inside `with graph.as_default():` of this graph" % ", ".join(
              "%r at %s" % (s.name, s.location) for s in state.recorder.specs))
    log.debug("this session runs a graph epl.init() was not called for: it runs as the plain "
             "script")

  def before_session(self, graph):
    self._rewrite()

  def _rewrite(self):
    state = self.state
    pg = driver.rewrite(state)
    if self._chain is None:
      if pg.worker.serve_only:
        launch_status.report(state.config.launch.status_file, launch_status.RUNNING,
                             worker=state.cluster.worker_index)
        serve.serve(state)
      self._chain = StepChain(state, pg)
    return pg

  def session_args(self, graph, target, config):
    """The target and ConfigProto of a session on the managed graph. A session opened before
    the model is built (``with tf.Session() as sess:`` first, as GPT-2 and DCGAN scripts do)
    gets the settings the Config alone decides; the plan waits for the first run."""
    state = self.state
    remote = ()
    plan = driver.session_plan(state)
    if state.server is not None:
      if not target:
        target = state.server.target        # the user's tf.Session() runs on this worker
      index = state.cluster.worker_index
      remote = plan.for_worker(index).remote_tasks() if plan is not None else \
          [t for t in range(state.cluster.worker_num) if t != index]   # any may be used
    return target, session_config(state.cluster, plan, state.config, config, remote)

  def run(self, session, original, fetches, feed_dict, options, run_metadata):
    """A Session.run on the managed graph: the rewrite first, then the step chain."""
    if self._chain is None:
      self._rewrite()
    return self._chain.run(StepCall(session, original, fetches, feed_dict, options,
                                    run_metadata))


def _built_after_rewrite(phase):
  """A gradient or an optimizer built after the graph's first run (when epl rewrote it)."""
  if phase == "apply":
    raise RuntimeStateError(
        "an optimizer's apply_gradients / minimize was called after the graph's first "
        "Session.run, when epl already rewrote the graph for the model built until then: the "
        "new train op would update the variables of model copy 0 only. Build every train op "
        "before the first session.run (a session may be opened before the model; the rewrite "
        "waits for the first run)")
  log.warning("tf.gradients was called after the graph's first Session.run (when epl rewrote "
              "it): the new gradients are computed on model copy 0 and its first "
              "micro-batch only (as an evaluation op); build training ops before the first run")


def _rank_of(graph, op):
  """The creation rank of ``op`` (1 for the first op): the positions the Recorder uses."""
  ids = sorted(compat.op_id(o) for o in graph.get_operations())
  return bisect.bisect_left(ids, compat.op_id(op)) + 1


def variable_op_of(x):
  """The variable op behind ``x`` (a Variable, its ref / handle, or a read of it), or None."""
  op = getattr(x, "op", None)
  for _ in range(3):               # kernel/read (Identity) or ReadVariableOp -> the variable
    if op is None or op.type in VARIABLE_OPS:
      return op
    if op.type not in ("Identity", "ReadVariableOp") or not op.inputs:
      return None
    op = op.inputs[0].op
  return None
