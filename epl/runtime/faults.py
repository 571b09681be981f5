"""Turn a failed multi-worker step into one clear error naming the lost peer.

A step with collectives fails with UnavailableError / AbortedError when a peer died (its
connection was reset) and with DeadlineExceededError when a peer stalled past
``communication.collective_timeout``. TF's ``MonitoredTrainingSession`` treats the first two as
recoverable and recreates the session -- but a worker that re-initialises alone can never meet
its peers' collectives again: it spins, or waits in the start-up broadcast while they wait in
the step. So epl raises ``PeerError`` (not recoverable) instead, after checking which peers
still accept connections.
"""
import logging
import os
import re
import socket
import threading
import time

import tensorflow.compat.v1 as tf

from epl.errors import EplError
from epl.launch import status

log = logging.getLogger("epl")

LOST = (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.DeadlineExceededError,
        tf.errors.CancelledError)


class PeerError(EplError, RuntimeError):
  """A peer worker died or stalled: the job cannot continue."""


class StepRejectedError(EplError, RuntimeError):
  """TensorFlow rejected the same step as a duplicate request more often than epl reruns it."""


def is_duplicate_request(error):
  """TF rejected a step because its RunGraph request id repeats one of the last 100,000 a
  worker received ("The same RunGraph (Worker) request was received twice"; request_id.cc,
  recent_request_ids.cc). The ids are drawn from a thread-local mt19937_64 seeded with 32
  random bits on the new thread the master starts for every step, so they repeat by the
  birthday bound -- unless epl made them unique (``communication.unique_request_ids``,
  epl._tf_compat). Nothing of the rejected step ran on any worker (its input was not read, no
  variable changed) and TF does not retire its collective step id, so running the same step
  again meets the peers' collectives of that step.
  """
  return isinstance(error, tf.errors.AbortedError) and "request was received twice" in str(error)


def collectives_aborted(error):
  """A collective of this worker failed while a peer's part of the step ended under it: TF
  deleted the step's collective state on the peer (its cleanup of a failed or rejected step,
  "Delete called on non-empty BufRendezvous") while this worker's request waited there. TF then
  aborts every collective of this process for good (base_collective_executor.cc:
  "Collective ops is aborted by ... Restart your program to reset"), so the step cannot run
  again here: the worker must stop (and the job restart from its last checkpoint)."""
  return isinstance(error, tf.errors.OpError) and \
      "Delete called on non-empty BufRendezvous" in str(error)


def cleared_from_outside(error):
  """A step of a job that already trained failed because the worker's state is gone: its
  variables uninitialised, its resource containers or sessions missing. Nothing in the job
  does that; another TensorFlow client that reached the worker's port does (``tf.Session.reset``
  on a master whose cluster names this worker, a master naming itself one of the job's
  tasks): TF's servers accept any client."""
  text = str(error)
  if isinstance(error, tf.errors.InvalidArgumentError):
    # a variable cleared under a running update reads back as an empty one (shape []) that
    # its update cannot apply to: "var and delta do not have the same shape[] [4]"
    return bool(_CLEARED_VARIABLE.search(text))
  return isinstance(error, (tf.errors.FailedPreconditionError, tf.errors.NotFoundError,
                            tf.errors.AbortedError)) and any(word in text for word in (
                                "uninitialized value", "Container", "Session handle",
                                "session is closed", "not found in session"))


_CLEARED_VARIABLE = re.compile(r"do not have the same shape\[\] \[")


OUTSIDE = ("TensorFlow's servers accept any client: another TensorFlow program that reached "
           "this worker's port cleared it (tf.Session.reset, or a master that names itself one "
           "of the job's tasks). Let only the job's hosts reach its ports (a firewall, a "
           "network policy, --port_range); restart the job from its last checkpoint")


def with_reruns(run, reruns, on_rerun):
  """``run()``, run again (at most ``reruns`` more times, calling ``on_rerun(error, count)``
  before each) while TF rejects it as a duplicate request (``is_duplicate_request``).

  Raises:
    StepRejectedError: it was rejected ``reruns + 1`` times in a row.
  """
  for attempt in range(reruns + 1):
    try:
      return run()
    except tf.errors.AbortedError as e:
      if not is_duplicate_request(e):
        raise
      if attempt == reruns:
        raise StepRejectedError(
            "TensorFlow rejected the same step as a duplicate request %d times in a row (%s); "
            "epl runs a rejected step again at most %d times. This should not happen with "
            "communication.unique_request_ids (the default): check the warning epl.init logged"
            % (reruns + 1, essence(e), reruns)) from e
      on_rerun(e, attempt + 1)


def reachable(address, timeout=2.0):
  """True when something listens on ``address`` (host:port). A connection to a local port
  nobody listens on can connect to itself (TCP's simultaneous open, when the kernel picks
  that very port as the source: epl-launch's ports on localhost are in the ephemeral range);
  such a connection is not a listener."""
  host, port = address.rsplit(":", 1)
  try:
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
      return s.getsockname() != s.getpeername()
  except OSError:
    return False


_TELLING = ("non-empty bufrendezvous", "aborted by", "timed out", "reset", "closed",
            "unavailable", "failed to connect", "deadline", "received twice")


def essence(error):
  """The line of a TF error message that says what happened (not "Graph execution error:")."""
  lines = [l.strip() for l in str(getattr(error, "message", error)).splitlines() if l.strip()]
  lines = [l for l in lines if not l.startswith(("Graph execution error", "Detected at node",
                                                 "File ", "Node:", "[[", "From /job"))]
  for line in lines:
    if any(word in line.lower() for word in _TELLING):
      return line[:300]
  return lines[0][:300] if lines else type(error).__name__


def _ended(status_file, worker):
  """"worker 1 ended (exit code 3) at step 50" when that worker's ``ended`` event lies beside
  this worker's status file (the same epl-launch started both), else ""."""
  event = status.last(status.sibling(status_file, worker), status.ENDED) \
      if status_file else None
  if event is None:
    return ""
  return ended_text(worker, event.get("steps"), event.get("code"))


def ended_text(worker, steps, code):
  return "worker %d ended (exit code %s) at step %s" % (worker, code, steps)


_CONNECTION_LOST = ("connection reset", "socket closed", "connection closed", "broken pipe")


def _gone(peers, patient, again=(0.25, 0.5, 1.0)):
  """The peers that no longer accept connections; ``patient``: asks a peer that still accepts
  again for up to ~2 s (a killed process's sockets close one by one as it exits: this
  worker's connection to it can reset before its listening port closes)."""
  gone = [(w, h) for w, h in peers if not reachable(h)]
  for pause in again if patient else ():
    if gone:
      break
    time.sleep(pause)
    gone = [(w, h) for w, h in peers if not reachable(h)]
  return gone


def peer_error(error, cluster, timeout, status_file="", ended_peers=None):
  """The PeerError that explains ``error`` (a TF error of a step with collectives).
  ``ended_peers``: serve.EndedPeers of this worker (what peers on other hosts left as they
  ended), or None."""
  me = cluster.worker_index
  peers = [(w, h) for w, h in enumerate(cluster.worker_hosts) if w != me]
  first = essence(error)
  ended = [text for text in (_ended(status_file, w) for w, _ in peers) if text]
  if not ended and ended_peers is not None:
    ended = [ended_text(w, steps, code) for w, (steps, code) in ended_peers().items()]
  outside, aborted = cleared_from_outside(error), collectives_aborted(error)
  # only a lost connection with nothing else to tell waits for a peer's port to close: a
  # rejected step, aborted collectives and a stalled peer are told at once
  patient = not ended and not outside and not aborted and \
      any(word in str(getattr(error, "message", error)).lower() for word in _CONNECTION_LOST)
  gone = _gone(peers, patient)
  if outside and not isinstance(error, tf.errors.AbortedError):
    what = "its state was cleared from outside the job (%s). %s" % (first, OUTSIDE)
  elif ended:
    what = "; ".join(ended)
  elif gone:
    what = "lost worker %s: %s no longer accept%s connections" % (
        ", ".join(str(w) for w, _ in gone), ", ".join(h for _, h in gone),
        "s" if len(gone) == 1 else "")
  elif aborted:
    what = ("TensorFlow aborted this worker's collectives (%s): a peer's part of the step "
            "ended while this worker's collective waited on it -- its sessions closed from "
            "outside the job (another TensorFlow client that reached its port), or a step TF "
            "rejected there -- and TF cannot run collectives in this process again" % first)
  elif outside:
    what = "its sessions were closed from outside the job (%s). %s" % (first, OUTSIDE)
  elif isinstance(error, tf.errors.DeadlineExceededError):
    what = ("a step did not finish within communication.collective_timeout=%d s: a peer is "
            "stalled (every worker still accepts connections: %s)" % (
                timeout, ", ".join("worker %d %s" % p for p in peers)))
  else:
    what = "a collective with the other workers failed (%s: %s)" % (type(error).__name__, first)
  return PeerError(
      "epl worker %d stops: %s. The job cannot continue without every worker; restart it "
      "(from the last checkpoint)." % (me, what))


class PeerWatch:
  """Ends a worker whose step waits on a peer that is gone.

  Some waits never fail by themselves: in a ring, the worker whose buffer a dead peer was to
  fetch waits until the step deadline (``communication.collective_timeout``). While a step has
  run for ``check_after`` seconds, one daemon thread checks every ``interval`` that every peer
  still accepts connections; a peer missing twice in a row is lost: the worker logs the error
  a failed step would raise and exits with code 1 (the main thread is inside TF; nothing can
  unwind it). Short steps never trigger a check.
  """

  def __init__(self, cluster, timeout, check_after=5.0, interval=1.0, exit_fn=os._exit,
               beat=None, status_file="", ended_peers=None):
    self._cluster = cluster
    self._ended_peers = ended_peers       # serve.EndedPeers: peers that left as they ended
    self._timeout = timeout
    self._beat = beat                     # epl.runtime.heartbeat.Heartbeat, ticked here
    self.training = False                 # the runs to come train (the beat counts them)
    self._status_file = status_file
    self._check_after = check_after
    self._interval = interval
    self._exit = exit_fn
    self._since = None
    self._thread = None

  def __enter__(self):
    self._since = time.time()
    if self._beat is not None:
      self._beat.begin(self.training)
    if self._thread is None:
      self._thread = threading.Thread(target=self._watch, name="epl-peer-watch", daemon=True)
      self._thread.start()
    return self

  def __exit__(self, *exc):
    self._since = None
    if self._beat is not None:
      self._beat.end(self.training)
    return False

  def describe_peers(self):
    """Which peers accept connections now (for a stall report)."""
    me = self._cluster.worker_index
    peers = [(w, h) for w, h in enumerate(self._cluster.worker_hosts) if w != me]
    gone = [w for w, h in peers if not reachable(h)]
    return "peers accepting connections: %s%s" % (
        ", ".join("worker %d" % w for w, _ in peers if w not in gone) or "none",
        "; not: %s" % ", ".join("worker %d" % w for w in gone) if gone else "")

  def _gone(self):
    me = self._cluster.worker_index
    return [w for w, h in enumerate(self._cluster.worker_hosts) if w != me and not reachable(h)]

  def _watch(self):
    missing = set()
    while True:
      time.sleep(self._interval)
      if self._beat is not None:
        self._beat.tick(self.describe_peers)
      since = self._since
      if since is None or time.time() - since < self._check_after:
        missing = set()
        continue
      early = self._left_before_this_step()
      if early:
        self._stop(PeerError(
            "epl worker %d stops: %s while this worker waits in step %d. The job cannot "
            "continue without every worker; restart it (from the last checkpoint)." % (
                self._cluster.worker_index, "; ".join(early), self._beat.steps + 1)))
        return
      gone = set(self._gone())
      if gone & missing:
        self._stop(peer_error(tf.errors.UnavailableError(None, None, "the step waits on it"),
                              self._cluster, self._timeout, self._status_file,
                              self._ended_peers))
        return
      missing = gone

  def _left_before_this_step(self):
    """"worker 1 ended (exit code 0) at step 30" for each peer that ended after fewer
    training steps than this training step needs (its ended flag; another host's launcher
    cannot tell this worker)."""
    if self._ended_peers is None or self._beat is None or not self.training:
      return []
    done = self._beat.steps
    return [ended_text(w, steps, code) for w, (steps, code) in self._ended_peers().items()
            if steps <= done]

  def _stop(self, error):
    log.error("%s", error)
    for handler in log.handlers:
      handler.flush()
    self._exit(1)
