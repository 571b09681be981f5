"""The hooks on TF's checkpointing (listed in epl._tf_compat's table): only the chief writes,
a failed save names its path, a checkpoint without epl's own state restores, and
MonitoredTrainingSession resumes from the newest good checkpoint."""
# pylint: disable=protected-access
from tensorflow.python.client import session as _session
from tensorflow.python.framework import errors as _errors
from tensorflow.python.framework import ops as _ops
from tensorflow.python.ops import variables as _variables
from tensorflow.python.training import checkpoint_utils as _checkpoint_utils
from tensorflow.python.training import saver as _saver

import epl._tf_compat._state as _state


def saver_save_hook(original):
  bind = _state.binder(original)

  def save(*args, **kwargs):
    arguments = bind(*args, **kwargs).arguments
    sess, save_path = arguments["sess"], arguments["save_path"]
    if not _state.manages(sess.graph):
      return original(*args, **kwargs)
    if not _state.listener.is_chief(sess.graph):
      return save_path                     # the chief writes the shared checkpoint
    try:
      saved = original(*args, **kwargs)
    except _errors.OpError as e:           # a full disk: no half-written checkpoint stays
      raise _state.listener.save_failed(save_path, e) from e
    _state.listener.saved(saved)           # an elastic job may stop here to grow back
    return saved
  return save


def restore_checkpoint_hook(original):
  """SessionManager._restore_checkpoint (MonitoredTrainingSession's restore from its
  checkpoint_dir): a directory without a readable state file, or whose checkpoint does not
  restore, resumes from the newest good one (epl.runtime.checkpoints picks it; the restore
  then names it explicitly, so workers restoring at once never read a state file another one
  rewrites)."""
  bind = _state.binder(original)

  def restore_checkpoint(*args, **kwargs):
    bound = bind(*args, **kwargs)
    directory = bound.arguments.get("checkpoint_dir")
    if not directory or not _state.manages(bound.arguments["self"]._graph):
      return original(*args, **kwargs)
    path, explicit = _state.listener.checkpoint_to_restore(directory)
    while True:
      if explicit:
        bound.arguments["checkpoint_dir"] = None
        bound.arguments["checkpoint_filename_with_path"] = path
      try:
        return original(*bound.args, **bound.kwargs)
      except _RESTORE_FAILURES as e:
        path, explicit = _state.listener.restore_failed(directory, path, e), True   # or raises
  return restore_checkpoint


# what a checkpoint that does not read back raises when restored
_RESTORE_FAILURES = (_errors.DataLossError, _errors.OutOfRangeError, _errors.NotFoundError)

OWN_STATE = "epl_"        # name prefix of the variables epl itself adds (AMP's loss scale)


def saver_restore_hook(original):
  bind = _state.binder(original)

  def restore(*args, **kwargs):
    arguments = bind(*args, **kwargs).arguments
    self, sess, save_path = arguments["self"], arguments["sess"], arguments["save_path"]
    if not save_path or not _state.manages(sess.graph):
      return original(*args, **kwargs)
    try:
      return _restore(original, self, sess, save_path)
    except _RESTORE_FAILURES as e:               # TF's message names no file
      raise type(e)(e.node_def, e.op, "restoring checkpoint %s failed: %s" % (
          save_path, e.message)) from e
  return restore


def _restore(original, self, sess, save_path):
  """Saver.restore on the managed graph (see saver_restore_hook)."""
  if self._var_list is None:  # pylint: disable=protected-access
    return original(self, sess, save_path)
  graph = sess.graph
  saved = {name for name, _ in _checkpoint_utils.list_variables(save_path)}
  missing = [v for v in graph.get_collection(_ops.GraphKeys.GLOBAL_VARIABLES)
             if v.op.name.startswith(OWN_STATE) and v.op.name not in saved]
  if not missing:
    return original(self, sess, save_path)
  names = {v.op.name for v in missing}
  listed = self._var_list  # pylint: disable=protected-access
  keep = {k: v for k, v in listed.items() if k not in names} if isinstance(listed, dict) \
      else [v for v in listed if getattr(getattr(v, "op", None), "name", None) not in names]
  with _state.unfinalized(graph), graph.as_default():
    partial = _saver.Saver(var_list=keep, sharded=self._sharded)  # pylint: disable=protected-access
    fresh = _variables.variables_initializer(missing)
  # unhooked and first: the restore's replica sync (after it) reads every variable
  _state.ORIGINALS[(_session.BaseSession, "run")](sess, fresh)
  result = original(partial, sess, save_path)
  _state.listener.restored_without(sorted(names), save_path)
  return result
