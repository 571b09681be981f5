"""The compat module's hook below Python: TensorFlow's RPC request ids (see epl._tf_compat).

TF draws every RPC request id (request_id.cc: ``GetUniqueRequestId``) from
``tsl::random::ThreadLocalNew64``, a thread-local mt19937_64 seeded with 32 random bits, and the
master runs each step on a new thread (master.cc, ``SchedClosure``): a step's RunGraph id is
the first output of a fresh 32-bit seed, and a worker rejects a step whose id repeats one of
its last 100,000 ("The same RunGraph (Worker) request was received twice"), about 2.3 times per
100,000 steps per worker once that window is full (docs/architecture.md has the measurements).
``unique_request_ids()`` points libtensorflow_cc's import of ``ThreadLocalNew64`` at
``tsl::random::New64`` -- one process-wide mt19937_64 stream whose 64-bit outputs do not repeat
within a window -- so no step is rejected. The same function type and generator family; only
libtensorflow_cc's calls (request ids, a few XLA names) change; ``restore()`` undoes it.
"""
import functools
import os

_request_ids = None      # epl._elf.ImportSlots while libtensorflow_cc's ids come from New64
_TF_CC = "libtensorflow_cc.so.2"
_TF_FRAMEWORK = "libtensorflow_framework.so.2"
_THREAD_LOCAL_NEW64 = "_ZN3tsl6random16ThreadLocalNew64Ev"
_NEW64 = "_ZN3tsl6random5New64Ev"


def unique_request_ids():
  """Makes TF's RPC request ids one process-wide stream (once per process); returns None, or
  the reason it could not (the job then relies on rerunning a rejected step)."""
  global _request_ids
  if _request_ids is None:
    import tensorflow as _tf
    from epl import _elf
    lib = functools.partial(os.path.join, os.path.dirname(_tf.__file__))
    try:
      _request_ids = _elf.redirect_import(lib(_TF_CC), _THREAD_LOCAL_NEW64, lib(_TF_FRAMEWORK),
                                          _NEW64)
    except (_elf.ElfError, OSError) as e:
      return str(e)
  return None


def request_ids_unique():
  """True while TF's request ids come from the process-wide stream."""
  return _request_ids is not None


def restore():
  """Gives libtensorflow_cc its own ThreadLocalNew64 back."""
  global _request_ids
  if _request_ids is not None:
    _request_ids.restore()
    _request_ids = None
