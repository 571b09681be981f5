"""The compat module's hooks below Python (see epl._tf_compat): TensorFlow's RPC request ids,
and the rendezvous TF keeps after a step's cleanup.

Request ids. TF draws every RPC request id (request_id.cc: ``GetUniqueRequestId``) from
``tsl::random::ThreadLocalNew64``, a thread-local mt19937_64 seeded with 32 random bits, and the
master runs each step on a new thread (master.cc, ``SchedClosure``): a step's RunGraph id is
the first output of a fresh 32-bit seed, and a worker rejects a step whose id repeats one of
its last 100,000 ("The same RunGraph (Worker) request was received twice"), about 2.3 times per
100,000 steps per worker once that window is full (docs/architecture.md has the measurements).
``unique_request_ids()`` points libtensorflow_cc's import of ``ThreadLocalNew64`` at
``tsl::random::New64`` -- one process-wide mt19937_64 stream whose 64-bit outputs do not repeat
within a window -- so no step is rejected. The same function type and generator family; only
libtensorflow_cc's calls (request ids, a few XLA names) change.

Aborted rendezvous. A worker's step owns a rendezvous (``BaseRemoteRendezvous``, found by step
id in a cache of weak pointers). After the step the master sends ``CleanupGraph``, which
removes the step id from the cache and aborts the rendezvous if it is still alive -- and
``LocalRendezvous::StartAbort`` keeps one reference to every rendezvous it aborts in a static
vector, forever (``aborted_rendezs_``, "so that subsequent RendezvousMgr::Find() will return
the aborted rendezvous"; after a cleanup the step id is out of the cache, so none will).
Whether it is still alive is a race: ``GraphMgr::ExecuteAsync`` answers the RunGraph before
it drops its own reference, and the master's thread, woken by that answer, can run the cleanup
first. Measured: ~1-1.5 KB in a few percent of steps (60-150 bytes a run on average), both
workers, without bound (docs/benchmarks.md, "Long runs"). ``release_aborted_rendezvous()``
points libtensorflow_cc's import of ``LocalRendezvous::StartAbort`` (its one caller there:
``BaseRemoteRendezvous::StartAbort``, the distributed runtime's) at ``LocalRendezvous::DoAbort``
-- the same abort without the extra reference -- so an aborted rendezvous lives as long as a
counted reference holds it. That also covers aborts of a failed or cancelled step, whose
rendezvous is still in the cache: a peer's RecvTensor that arrives after the step let go of
it (and before its cleanup) now finds a fresh rendezvous that never answers, where TF would
have answered with the step's error; the peer's step then ends by the master's cancellation
or its deadline (epl sets one), as it would for a request arriving after the cleanup in TF as
is. DirectSession's and eager's rendezvous (libtensorflow_framework's own calls) keep TF's
behaviour. ``pinned_rendezvous()`` counts the references TF keeps.

``restore()`` undoes both hooks.
"""
import ctypes
import os

_hooks = {}          # name -> epl._elf.ImportSlots while that hook is in place
_aborted = None      # the pointer behind TF's aborted_rendezs_ (pinned_rendezvous)
_TF_CC = "libtensorflow_cc.so.2"
_TF_FRAMEWORK = "libtensorflow_framework.so.2"
_THREAD_LOCAL_NEW64 = "_ZN3tsl6random16ThreadLocalNew64Ev"
_NEW64 = "_ZN3tsl6random5New64Ev"
_STATUS = "RKN4absl12lts_202508146StatusE"          # const absl::Status& (TF 2.21's absl)
_START_ABORT = "_ZN10tensorflow15LocalRendezvous10StartAbortE" + _STATUS
_DO_ABORT = "_ZN10tensorflow15LocalRendezvous7DoAbortE" + _STATUS
_ABORTED = "_ZN10tensorflow15LocalRendezvous16aborted_rendezs_E"


def _lib(name):
  import tensorflow as _tf
  return os.path.join(os.path.dirname(_tf.__file__), name)


# TensorFlow versions the hooks were tested on (their symbol names embed absl's inline
# namespace, and their behaviour TF's sources of that version); others: skipped with a
# warning unless communication.native_hooks_untested_tf opts in
TESTED_TF = ("2.21.0",)


def untested_tf():
  """The running TensorFlow's version when the hooks were not tested on it, else None."""
  import tensorflow as _tf
  version = getattr(_tf, "__version__", "unknown")
  return None if version in TESTED_TF else version


def _redirect(name, symbol, replacement, untested_ok=False):
  """libtensorflow_cc's calls of ``symbol`` go to ``replacement`` (libtensorflow_framework's),
  once per process; returns None, or the reason it could not (any failure: the hook is then
  not in place and TF keeps its own behaviour)."""
  if name not in _hooks:
    version = untested_tf()
    if version is not None and not untested_ok:
      return ("TensorFlow %s is not among the versions the hook was tested on (%s); set "
              "communication.native_hooks_untested_tf to try it" % (
                  version, ", ".join(TESTED_TF)))
    from epl import _elf
    try:
      _hooks[name] = _elf.redirect_import(_lib(_TF_CC), symbol, _lib(_TF_FRAMEWORK),
                                          replacement)
    except Exception as e:  # pylint: disable=broad-except  (a hook must never stop epl.init)
      return "%s: %s" % (type(e).__name__, e)
  return None


def unique_request_ids(untested_ok=False):
  """Makes TF's RPC request ids one process-wide stream; returns None, or the reason it could
  not (the job then relies on rerunning a rejected step)."""
  return _redirect("request_ids", _THREAD_LOCAL_NEW64, _NEW64, untested_ok)


def request_ids_unique():
  """True while TF's request ids come from the process-wide stream."""
  return "request_ids" in _hooks


def release_aborted_rendezvous(untested_ok=False):
  """A rendezvous aborted by a step's cleanup is freed when its last holder lets go, instead
  of being kept forever; returns None, or the reason it could not."""
  return _redirect("rendezvous", _START_ABORT, _DO_ABORT, untested_ok)


def aborted_rendezvous_released():
  """True while the hook above is in place."""
  return "rendezvous" in _hooks


def pinned_rendezvous():
  """How many aborted rendezvous TF keeps a reference to (``aborted_rendezs_``'s size, read
  without its lock: a diagnostic), or None where the symbol is not found."""
  global _aborted
  if _aborted is None:
    try:
      lib = ctypes.CDLL(_lib(_TF_FRAMEWORK), mode=getattr(os, "RTLD_NOLOAD", 4))
      _aborted = ctypes.c_void_p.in_dll(lib, _ABORTED)   # a static reference: a pointer
    except (OSError, ValueError):
      return None
  vector = _aborted.value
  if not vector:
    return 0

  def word(i):                    # libstdc++'s std::vector: begin, end, end of storage
    return ctypes.c_void_p.from_address(vector + 8 * i).value or 0
  for _ in range(100):            # a push_back may reallocate while we read: read until stable
    end, begin = word(1), word(0)
    if word(1) == end:
      return max(0, end - begin) // ctypes.sizeof(ctypes.c_void_p)
  return None


def restore():
  """Gives libtensorflow_cc its own functions back."""
  for name in list(_hooks):
    _hooks.pop(name).restore()
