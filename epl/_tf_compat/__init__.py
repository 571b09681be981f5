"""Every touch of TensorFlow internals, in one place.

Two kinds of things live here:
  * accessors for private graph-editing methods (op ids, in-place input/device edits), so a
    TF upgrade that renames them breaks one file;
  * fourteen hooks (the ``_HOOKS`` table), installed by ``epl.init`` with the dispatcher that
    receives their events (epl.runtime.hooks) and removed by ``uninstall()``. Each wraps one TF
    function, forwards to the original, and only acts on the graph epl was initialised for:

    ======================================  ==================================================
    hooked function                          why
    ======================================  ==================================================
    op_def_library._apply_op_helper          epl.split: an op built in a split scope is built
                                             per part by its split rule (epl.sharding.rules),
                                             or on the whole values when none covers it
    gradients_util._GradientsHelper          force ``colocate_gradients_with_ops=True`` so each
                                             gradient op is attributable to its forward op;
                                             record the ids of the backward ops and the raw
                                             gradient of every variable (the sync point)
    training.optimizer.Optimizer             record the (gradient, variable) pairs and the ids
      .apply_gradients                       of the apply ops (gradient sync hooks in here)
    monitored_session.Scaffold.finalize      rewrite the graph before MonitoredTrainingSession
                                             builds init/ready/saver ops from it
    ops.Graph.finalize                       rewrite before a user finalizes the graph
    session.BaseSession.__init__             add epl's devices/threads to the ConfigProto
    session.BaseSession.run                  rewrite before the first step; spread the step
                                             over the copies (feeds, fetches); copy replica 0's
                                             variables to the others after init/restore runs;
                                             refuse a graph annotated elsewhere (never silently
                                             local)
    training.saver.Saver.save                only the chief writes checkpoints, even when every
                                             worker's script passes is_chief=True; a failed
                                             save (a full disk) leaves no partial files and
                                             names the path; an elastic job's chief stops
                                             after a save when the job grows back
    training.saver.Saver.build               a hand-written optimizer's slots of a split
                                             variable's parts are saved as slices of the whole
                                             variable's slot (split_variables
                                             .adopt_part_slots) before the saver reads names
    training.saver.Saver.restore             a checkpoint written without epl's own state
                                             (AMP's loss scale: ``epl_*`` variables) restores,
                                             that state starting afresh (a job resumed with
                                             AMP turned on)
    training.session_manager                MonitoredTrainingSession's restore: a directory
      .SessionManager._restore_checkpoint    without a readable state file resumes from its
                                             newest good checkpoint, a checkpoint that does
                                             not restore gives way to the newest older one
                                             (epl.runtime.checkpoints)
    summary.writer.FileWriter.add_event      only the chief writes summaries (add_summary
      and ._add_event                        and friends go through _add_event)
    from_tensor_slices_op                    io.slicing: a constant list of file names (the
      ._TensorSliceDataset.__init__          list behind TFRecordDataset / TextLineDataset or
                                             given to from_tensor_slices) is cut to this
                                             worker's share as the dataset is built, before a
                                             one-shot iterator captures it in a function
    ======================================  ==================================================

And two hooks below Python (a multi-worker ``epl.init``; removed by ``uninstall()``; epl._elf
rewrites libtensorflow_cc's import slot, see epl._tf_compat.native):
``unique_request_ids()``: its calls of ``tsl::random::ThreadLocalNew64`` -- where TF draws its
RPC request ids -- go to ``tsl::random::New64``, so that no step is rejected as a duplicate
request (docs/architecture.md says why and shows the measurements);
``release_aborted_rendezvous()``: its calls of ``LocalRendezvous::StartAbort`` go to
``LocalRendezvous::DoAbort``, so that TF does not keep every rendezvous a step's cleanup
aborts (a memory leak without bound; docs/benchmarks.md, "Long runs").
"""
import contextlib
import functools
import threading

from tensorflow.python.client import session as _session
from tensorflow.python.data.ops import from_tensor_slices_op as _slices
from tensorflow.python.framework import ops as _ops
from tensorflow.python.framework import op_def_library as _op_def_library
from tensorflow.python.ops import gradients_util as _gradients_util
from tensorflow.python.ops import variable_scope as _variable_scope
from tensorflow.python.ops import variables as _variables
from tensorflow.python.training import monitored_session as _monitored_session
from tensorflow.python.summary.writer import writer as _writer
from tensorflow.python.training import optimizer as _optimizer
from tensorflow.python.training import saver as _saver
from tensorflow.python.training import session_manager as _session_manager

from epl._tf_compat import _state, native
from epl._tf_compat._state import unfinalized  # noqa: F401
from epl._tf_compat.checkpoint_hooks import (OWN_STATE, restore_checkpoint_hook,  # noqa: F401
                                            saver_restore_hook, saver_save_hook)
from epl._tf_compat import split_variables as _split_vars
from epl._tf_compat.native import (  # noqa: F401
    aborted_rendezvous_released, pinned_rendezvous, release_aborted_rendezvous,
    request_ids_unique, unique_request_ids)
from epl.io_slicing import file_list
from epl.sharding import rules as _split_rules
from epl.sharding import sharded as _sharded


# ---- private accessors (graph_edit.py) and the finalized-graph escape ----------------------
from epl._tf_compat.graph_edit import (  # noqa: E402,F401  pylint: disable=wrong-import-position
    add_control_inputs, control_outputs, drop_colocation, import_nodes, in_control_flow, op_id,
    delay_op, downstream, replace_control_inputs, set_device, update_input)


# ---- hooks -----------------------------------------------------------------------------------
_building = threading.local()      # inside tf.gradients / apply_gradients: split rules rest


@contextlib.contextmanager
def _differentiating():
  depth = getattr(_building, "depth", 0)
  _building.depth = depth + 1
  try:
    yield
  finally:
    _building.depth = depth


def _split_scope(inputs=()):
  """The rules context of the split TaskGraph an op built now joins (an open epl.split
  scope, or the one that sharded one of ``inputs``), or None (none, or inside tf.gradients /
  an optimizer, whose ops follow the forward ops they belong to)."""
  if _state.listener is None or getattr(_building, "depth", 0):
    return None
  graph = _ops.get_default_graph()
  return _state.listener.split_scope(graph, inputs) if _state.manages(graph) else None


def _gradients_hook(original):
  bind = _state.binder(original)

  def helper(*args, **kwargs):
    graph = _ops.get_default_graph()
    if not _state.manages(graph):
      return original(*args, **kwargs)
    bound = bind(*args, **kwargs)
    bound.arguments["colocate_gradients_with_ops"] = True
    _state.listener.before_gradients(graph)
    first = graph.version + 1
    with _differentiating():
      result = original(*bound.args, **bound.kwargs)
    _state.listener.on_phase(graph, first, graph.version, "backward")
    _state.listener.on_gradients(graph, bound.arguments["xs"], result)
    return result
  return helper


def _apply_hook(original):
  bind = _state.binder(original)

  def apply_gradients(*args, **kwargs):
    graph = _ops.get_default_graph()
    if not _state.manages(graph):
      return original(*args, **kwargs)
    bound = bind(*args, **kwargs)
    grads_and_vars = bound.arguments["grads_and_vars"] = tuple(bound.arguments["grads_and_vars"])
    first = graph.version + 1
    with _differentiating():
      result = original(*bound.args, **bound.kwargs)
    _state.listener.on_phase(graph, first, graph.version, "apply")
    _state.listener.on_apply(graph, grads_and_vars)
    return result
  return apply_gradients


def _rewrite_before(original):
  """Scaffold.finalize (MonitoredTrainingSession) builds init/ready/saver ops from the graph."""
  def finalize(*args, **kwargs):
    graph = _ops.get_default_graph()
    if _state.manages(graph) and not graph.finalized:
      _state.listener.before_session(graph)
    return original(*args, **kwargs)
  return finalize


def _graph_finalize_hook(original):
  def finalize(graph, *args, **kwargs):
    if _state.manages(graph) and not graph.finalized:
      _state.listener.before_session(graph)
    return original(graph, *args, **kwargs)
  return finalize


def _session_init_hook(original):
  bind = _state.binder(original)

  def __init__(*args, **kwargs):
    bound = bind(*args, **kwargs)
    arguments = bound.arguments
    graph = arguments["graph"]
    graph = graph if graph is not None else _ops.get_default_graph()
    if not _state.manages(graph):
      return original(*args, **kwargs)
    try:
      arguments["target"], arguments["config"] = _state.listener.session_args(
          graph, arguments["target"], arguments["config"])
    except Exception:
      arguments["self"]._session = None  # a session refused before TF made one deletes quietly
      raise
    return original(*bound.args, **bound.kwargs)
  return __init__


def _session_run_hook(original):
  bind = _state.binder(original)

  def run(*args, **kwargs):
    bound = bind(*args, **kwargs)
    arguments = bound.arguments
    session = arguments["self"]
    if _state.manages(session.graph):
      return _state.listener.run(session, original, arguments["fetches"], arguments["feed_dict"],
                           arguments["options"], arguments["run_metadata"])
    if _state.listener is not None:
      _state.listener.unmanaged_run(session.graph)
    return original(*args, **kwargs)
  return run


def _add_event_hook(original):
  def add_event(self, *args, **kwargs):
    if _state.listener is not None and not _state.listener.is_chief(None):
      return None
    return original(self, *args, **kwargs)
  return add_event


def _slices_hook(original):
  bind = _state.binder(original)

  def __init__(*args, **kwargs):
    graph = _ops.get_default_graph()
    if _state.manages(graph):
      bound = bind(*args, **kwargs)
      files = file_list(bound.arguments["element"])
      if files is not None:
        mine = _state.listener.slice_files(graph, files, bound.arguments["is_files"])
        if mine is not None:
          bound.arguments["element"] = mine
          return original(*bound.args, **bound.kwargs)
    return original(*args, **kwargs)
  return __init__


def _apply_op_hook(original):
  """Inside a split scope, an op that reads a sharded value is built by its split rule; an op
  no rule covers is built on the whole values (the gather fallback), its reason recorded."""
  def apply_op(op_type_name, name=None, **keywords):   # TF's own signature: (name, **keywords)
    if not _sharded.in_rule() and keywords:
      keywords = {k: _whole(v) for k, v in keywords.items()}
      inputs = list(_split_rules.tensors(keywords))
      scope = _split_scope(inputs) if inputs else None
      if scope is not None:
        keywords = _split_rules.current(scope, keywords)
        outputs, reason = _split_rules.apply(
            scope, op_type_name, lambda **kw: original(op_type_name, **kw)[3], keywords, name)
        if outputs is not None:
          return None, False, outputs[0].op, outputs
        if reason is not None:
          built = original(op_type_name, name=name, **keywords)
          scope.recorder.fallbacks[built[2].name] = reason
          return built
    return original(op_type_name, name=name, **keywords)
  return apply_op


def _whole(value):
  """A split variable handed to an op as is (tf.einsum does not convert its operands) reads
  as its registered whole value."""
  if isinstance(value, _variables.PartitionedVariable):
    return value.as_tensor()
  if isinstance(value, (list, tuple)) and any(
      isinstance(v, _variables.PartitionedVariable) for v in value):
    return type(value)(_whole(v) for v in value)
  return value


def _saver_build_hook(original):
  def build(*args, **kwargs):
    graph = _ops.get_default_graph()
    if _state.manages(graph):
      adopt_part_slots(graph, _state.listener.split_shards(graph))
    return original(*args, **kwargs)
  return build


def adopt_part_slots(graph, shards):
  """See epl._tf_compat.split_variables.adopt_part_slots."""
  return _split_vars.adopt_part_slots(graph, shards)


def split_variables():
  """The context an ``epl.split`` scope enters: variables created inside are sharded."""
  return _variable_scope.variable_creator_scope(
      functools.partial(_split_vars.create, _split_scope))


# (owner, attribute, wrapper factory): the table the module docstring describes
_HOOKS = (
    (_op_def_library, "_apply_op_helper", _apply_op_hook),
    (_gradients_util, "_GradientsHelper", _gradients_hook),
    (_optimizer.Optimizer, "apply_gradients", _apply_hook),
    (_monitored_session.Scaffold, "finalize", _rewrite_before),
    (_ops.Graph, "finalize", _graph_finalize_hook),
    (_session.BaseSession, "__init__", _session_init_hook),
    (_session.BaseSession, "run", _session_run_hook),
    (_saver.Saver, "build", _saver_build_hook),
    (_saver.Saver, "save", saver_save_hook),
    (_saver.Saver, "restore", saver_restore_hook),
    (_session_manager.SessionManager, "_restore_checkpoint", restore_checkpoint_hook),
    (_writer.FileWriter, "add_event", _add_event_hook),
    (_writer.FileWriter, "_add_event", _add_event_hook),
    (_slices._TensorSliceDataset, "__init__", _slices_hook),  # pylint: disable=protected-access
)


def install(listener):
  """Installs the hooks (once per process); ``listener`` receives the events from now on."""
  _state.listener = listener
  if _state.ORIGINALS:
    return
  for owner, attr, make_wrapper in _HOOKS:
    original = getattr(owner, attr)
    _state.ORIGINALS[(owner, attr)] = original
    wrapper = make_wrapper(original)
    functools.update_wrapper(wrapper, original)
    wrapper.__epl_hook__ = True
    setattr(owner, attr, wrapper)


def uninstall():
  """Removes every hook, restoring TF's own functions."""
  _state.listener = None
  for (owner, attr), original in _state.ORIGINALS.items():
    setattr(owner, attr, original)
  _state.ORIGINALS.clear()
  native.restore()


def installed():
  """True while the hooks are in place."""
  return bool(_state.ORIGINALS)
