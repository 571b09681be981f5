"""What a worker's steps look like from outside: its step count, a step that stalls, how it ended.

A multi-worker job's peers and its launcher cannot see inside a worker whose main thread is
inside TensorFlow. ``Heartbeat`` keeps, beside ``launch.status_file``, one small record it
rewrites in place at every run through a memory map (``<status_file>.beat``, format
``epl.launch.status.BEAT``: the worker's pid, training steps done, when the running run
started, the median step time) that epl-launch reads to say at which step a worker ended
and what a stalled job waits for; and it logs a step that has run for
max(``STALL_FLOOR``, ``STALL_FACTOR`` x the median step) -- long before
``communication.collective_timeout`` ends it -- once per step, with the peers that still
accept connections. At process exit it appends an ``ended`` event (exit code as far as Python
knows it, steps done) to the status file; a peer on the same host names it in its error.
"""
import builtins
import collections
import logging
import math
import mmap
import os
import sys
import time

from epl.launch import status

log = logging.getLogger("epl")

STALL_FLOOR = 60.0           # seconds: a step is stalled after max(this, factor x median)
STALL_FACTOR = 10.0


class Heartbeat:
  """Counts the runs of a worker's steps and tells of stalls; see the module docstring."""

  def __init__(self, status_file, clock=time.time, floor=STALL_FLOOR, factor=STALL_FACTOR):
    self._path = status_file
    self._clock = clock
    self._floor, self._factor = floor, factor
    self.steps = 0
    self._since = None
    self._training = 0
    self._times = collections.deque(maxlen=101)
    self._median = None
    self._pid = os.getpid()
    self._told = None                          # the step whose stall was reported
    self._ended = False
    self._map = self._open(status.beat_path(status_file))

  @staticmethod
  def _open(path):
    """The beat's record, mapped (writing it is a memory write), or None."""
    if not path:
      return None
    try:
      with open(path, "wb") as f:
        f.write(b"\0" * status.BEAT.size)
      with open(path, "r+b") as f:
        return mmap.mmap(f.fileno(), status.BEAT.size)
    except (OSError, ValueError):
      return None

  def _write(self):
    if self._map is not None:
      status.BEAT.pack_into(self._map, 0, self._pid, self.steps, self._training,
                            math.nan if self._since is None else self._since,
                            math.nan if self._median is None else self._median, self.limit())

  # ---- the main thread ----------------------------------------------------------------------
  def begin(self, training=True):
    """A run starts; ``training``: it is a training step."""
    self._since, self._training = self._clock(), int(training)
    self._write()

  def end(self, training=True):
    """A run ended; ``training``: it was a training step (counted, and timed)."""
    if self._since is not None and training:
      self._times.append(self._clock() - self._since)
      times = sorted(self._times)
      self._median = times[len(times) // 2]
    self._since, self._training = None, 0
    self.steps += bool(training)
    self._write()

  def ended(self, code):
    """Appends the ``ended`` event (``code``: the exit code as Python knows it) once."""
    if not self._ended:
      self._ended = True
      status.report(self._path, status.ENDED, code=code, steps=self.steps, at=time.time())

  # ---- the watch thread (epl.runtime.faults.PeerWatch), about once a second ----------------
  def median(self):
    return self._median

  def limit(self):
    median = self._median
    return max(self._floor, self._factor * median) if median is not None else self._floor

  def tick(self, describe_peers=None):
    """``describe_peers()``: what the stall report says of the peers."""
    now, since = self._clock(), self._since
    # (the first step compiles the graph: it may take minutes, and proves nothing)
    if since is not None and self.steps and now - since > self.limit() and \
        self._told != self.steps:
      self._told = self.steps
      peers = describe_peers() if describe_peers else ""
      log.warning("step %d has run for %.0f s (the median step takes %s): it waits on another "
                  "worker%s; communication.collective_timeout ends it if it does not finish",
                  self.steps + 1, now - since, "%.3g s" % self.median() if self.median()
                  is not None else "unknown", "; " + peers if peers else "")
      status.report(self._path, status.STALLED, step=self.steps + 1,
                    seconds=round(now - since, 1))


class ExitCode:
  """The exit code a worker's Python ends with, as far as Python can tell: ``sys.exit(n)`` /
  ``exit(n)`` (wrapped), an uncaught exception (1). ``raise SystemExit(n)`` written out is not
  seen (0); ``os._exit`` and signals end the process before any of this runs (epl-launch sees
  those codes itself). Installed once per process; ``uninstall`` puts the originals back."""

  def __init__(self):
    self.code = None
    self._originals = None

  def install(self):
    if self._originals is not None:
      return self
    hook, exit_fn = sys.excepthook, sys.exit
    self._originals = (hook, exit_fn, getattr(builtins, "exit", None),
                       getattr(builtins, "quit", None))

    def excepthook(kind, value, tb):
      if self.code is None and not issubclass(kind, SystemExit):
        self.code = 1
      hook(kind, value, tb)

    def exiting(code=None):
      self.record(code)
      exit_fn(code)
    sys.excepthook, sys.exit = excepthook, exiting
    builtins.exit = builtins.quit = exiting
    return self

  def uninstall(self):
    if self._originals is None:
      return
    sys.excepthook, sys.exit, quitter_exit, quitter_quit = self._originals
    if quitter_exit is not None:
      builtins.exit = quitter_exit
    if quitter_quit is not None:
      builtins.quit = quitter_quit
    self._originals = None

  def record(self, code):
    if code is None:
      self.code = 0
    elif isinstance(code, int):
      self.code = code
    else:
      self.code = 1                 # sys.exit("message") prints it and exits 1

  @property
  def failed(self):
    return bool(self.code)
