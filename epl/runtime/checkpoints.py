"""Which checkpoint a job resumes from: never from scratch over checkpoints it could not see,
never stuck on one bad file, and no half-written checkpoint left behind.

TF's ``MonitoredTrainingSession`` resumes from the checkpoint its state file (``checkpoint``)
names. Without that file (deleted, or unreadable) it silently trains from step 0 and
overwrites ``model.ckpt-0``, ``-100``, ... beside the newer ones; with a newest checkpoint that
does not read back (a truncated ``.data`` file, a checksum mismatch) it fails on every start,
naming no file. epl, which runs the job and sees the directory (the compat hook on
``SessionManager._restore_checkpoint``, and on ``Saver.save`` / ``Saver.restore``):

* no readable state file, but checkpoints on disk: resumes from the newest one that reads back
  (every tensor read, checksums checked), the chief rewriting the state file, with a warning;
  when none reads back, stops with ``CheckpointError`` naming the directory and the fix;
* the newest checkpoint fails to restore: the error is logged naming it, and the job resumes
  from the newest older one that reads back (a warning names both); none: ``CheckpointError``;
* a save that fails (a full disk) removes its ``*_temp`` folder and temporary files, and the
  error names the checkpoint path.
"""
import glob
import logging
import os
import re
import shutil

import tensorflow.compat.v1 as tf
from tensorflow.python.checkpoint import checkpoint_management

from epl.errors import EplError

log = logging.getLogger("epl")

# what a checkpoint that does not read back raises in Saver.restore
UNREADABLE = (tf.errors.DataLossError, tf.errors.OutOfRangeError, tf.errors.NotFoundError,
              tf.errors.InvalidArgumentError)


class CheckpointError(EplError, RuntimeError):
  """The checkpoints of a directory cannot be resumed from, and epl will not train over them."""


_STEP = re.compile(r"-(\d+)$")


def on_disk(directory):
  """The checkpoint prefixes in ``directory`` (an ``.index`` file each), newest first: by the
  step in their name, then by time."""
  prefixes = [p[:-len(".index")] for p in glob.glob(os.path.join(directory, "*.index"))]

  def key(prefix):
    found = _STEP.search(prefix)
    return (int(found.group(1)) if found else -1, os.path.getmtime(prefix + ".index"))
  return sorted(prefixes, key=key, reverse=True)


def unreadable(prefix):
  """Why the checkpoint ``prefix`` does not read back (every tensor read: TF checks their
  checksums), or None when it does."""
  try:
    reader = tf.train.load_checkpoint(prefix)
    for name in reader.get_variable_to_shape_map():
      reader.get_tensor(name)
  except Exception as e:  # pylint: disable=broad-except  (the reader raises IndexError too)
    return _first_line(e)
  return None


def _first_line(error):
  """The line of ``error``'s message that says what went wrong ("Read less bytes than
  requested"), not TF's framing ("Graph execution error:", "Detected at node ...")."""
  lines = [l.strip() for l in str(getattr(error, "message", error)).splitlines() if l.strip()]
  said = [l for l in lines if "Graph execution error" not in l and not l.startswith(
      ("Detected at node", "Node:", "From /job", "[[", "File ", "Original stack trace"))]
  return (said or lines or [type(error).__name__])[0][:300]


def _newest_readable(candidates):
  bad = []
  for prefix in candidates:
    why = unreadable(prefix)
    if why is None:
      return prefix, bad
    bad.append((prefix, why))
  return None, bad


def _point_state_at(directory, prefix):
  """Writes ``directory``'s state file: resume from ``prefix``, with the older ones kept."""
  step = _step(prefix)
  kept = [p for p in reversed(on_disk(directory)) if p != prefix and
          (step is None or _step(p) is None or _step(p) < step)]
  checkpoint_management.update_checkpoint_state_internal(
      directory, prefix, all_model_checkpoint_paths=kept + [prefix], save_relative_paths=True)


def to_restore(directory, chief):
  """Before MonitoredTrainingSession restores from ``directory``: (path, explicit). ``path``:
  the checkpoint the state file names (explicit False: TF restores it as usual), or, when
  there is no readable state file but checkpoints lie there, the newest that reads back
  (explicit True; the ``chief`` rewrites the state file, with a warning); (None, False) for a
  directory without checkpoints. Raises CheckpointError when none reads back."""
  if not directory or not os.path.isdir(directory):
    return None, False
  state = checkpoint_management.get_checkpoint_state(directory)
  if state is not None and state.model_checkpoint_path:
    return state.model_checkpoint_path, False
  found = on_disk(directory)
  if not found:
    return None, False                       # a fresh directory: training starts from scratch
  good, bad = _newest_readable(found)
  if good is None:
    raise CheckpointError(
        "%s holds %d checkpoint(s) (newest %s) but no readable state file ('checkpoint'), and "
        "none of them reads back (%s): epl does not train over them from step 0. Move them "
        "away to start afresh, or restore a checkpoint from a copy" % (
            directory, len(found), os.path.basename(found[0]), bad[0][1]))
  if chief:
    _point_state_at(directory, good)
  log.warning("%s has no readable state file ('checkpoint'), but holds %d checkpoint(s): "
              "resuming from %s, the newest that reads back%s%s", directory, len(found),
              os.path.basename(good), "; newer ones that do not: " + ", ".join(
                  "%s (%s)" % (os.path.basename(p), why) for p, why in bad) if bad else "",
              " (the state file is written again)" if chief else "")
  return good, True


def after_failed_restore(directory, failed, error, chief):
  """The restore of checkpoint ``failed`` from ``directory`` raised ``error``: returns the
  newest older checkpoint that reads back (a warning names both; the ``chief`` points the
  state file at it). Raises ``error`` when ``failed`` itself reads back (not a damaged file:
  another model's checkpoint?), CheckpointError naming it when no older one reads back."""
  if failed is None or unreadable(failed) is None:
    raise error
  older = [p for p in on_disk(directory) if os.path.abspath(p) != os.path.abspath(failed) and
           (_step(p) is None or _step(failed) is None or _step(p) < _step(failed))]
  good, bad = _newest_readable(older)
  log.error("checkpoint %s does not restore: %s", failed, _first_line(error))
  if good is None:
    raise CheckpointError(
        "checkpoint %s in %s does not restore (%s), and no older checkpoint there reads back: "
        "move the directory away to start afresh, or put a good checkpoint back" % (
            os.path.basename(failed), directory, _first_line(error))) from error
  if chief:
    _point_state_at(directory, good)
  log.warning("resuming from %s instead of %s, which does not restore (%s)%s",
              os.path.basename(good), os.path.basename(failed), _first_line(error),
              "; skipped too: " + ", ".join(os.path.basename(p) for p, _ in bad) if bad else "")
  return good


def _step(prefix):
  found = _STEP.search(prefix)
  return int(found.group(1)) if found else None


def after_failed_save(path, error):
  """A save to ``path`` (the prefix given to ``Saver.save``; the step follows it) failed:
  removes what it left (``*_temp`` folders, temporary files); returns the error to raise,
  naming the path."""
  stem = glob.escape(path)
  for leftover in glob.glob(stem + "*_temp*") + glob.glob(stem + "*.tempstate*"):
    if os.path.isdir(leftover):
      shutil.rmtree(leftover, ignore_errors=True)
    else:
      try:
        os.remove(leftover)
      except OSError:
        pass
  if isinstance(error, tf.errors.OpError):
    return type(error)(error.node_def, error.op, "saving a checkpoint to %s failed (its partial "
                       "files are removed): %s" % (path, error.message))
  return error
