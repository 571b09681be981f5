"""The launcher's guard: ends every worker of the job when epl-launch is gone, however it ended.

``epl-launch`` starts this file (by path, under the same interpreter: it imports nothing of
epl, so no TensorFlow) in a session of its own, with a pipe as its standard input, before any
worker. For each worker it starts, the launcher writes ``group <pgid>``: every worker runs in
its own process group (its shell, the python the shell starts, whatever that starts). When
the launcher ends its job itself it writes ``done`` and the guard exits. When the pipe closes
without ``done`` -- the launcher was killed (``kill -9``, OOM), at any moment, the first
second included -- the guard sends SIGTERM to every group, SIGKILL after ``GRACE`` seconds to
what is left, and exits once the groups are gone.

Why a process: the kernel's parent-death signal reaches only the launcher's direct child (a
shell entry's ``bash``, not the python it starts), and epl's own watch of the launcher runs
only once a worker's python imported epl. A guard in its own session survives a kill of the
launcher's process group and a Ctrl-C in its terminal.
"""
import os
import signal
import subprocess
import sys
import time

GRACE = 1.0


def alive(pgid):
  """True while process group ``pgid`` has a process."""
  try:
    os.killpg(pgid, 0)
    return True
  except ProcessLookupError:
    return False
  except PermissionError:
    return True


def _signal(groups, sig):
  for pgid in groups:
    try:
      os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
      pass


def stop(groups, grace=GRACE):
  """SIGTERM to every group, then SIGKILL to what outlives ``grace``; returns once gone."""
  _signal(groups, signal.SIGTERM)
  deadline = time.time() + grace
  while any(alive(g) for g in groups):
    if time.time() > deadline:
      _signal([g for g in groups if alive(g)], signal.SIGKILL)
    time.sleep(0.05)


def main(stream=None):
  for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
    signal.signal(sig, signal.SIG_IGN)
  stream = stream or sys.stdin.buffer
  groups = []
  for raw in iter(stream.readline, b""):
    word, _, arg = raw.decode("ascii", "replace").strip().partition(" ")
    if word == "group":
      groups.append(int(arg))
    elif word == "done":
      return 0
  stop(groups)               # the launcher is gone
  return 0


class Guard:
  """The launcher's side: starts the guard process and tells it of every worker's group."""

  def __init__(self):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "guard.py")
    self._proc = subprocess.Popen([sys.executable, path], stdin=subprocess.PIPE,
                                  stdout=subprocess.DEVNULL, start_new_session=True)

  def add(self, pgid):
    self._send("group %d" % pgid)

  def done(self):
    """This launcher ends its job itself: the guard exits without touching anything."""
    self._send("done")
    try:
      self._proc.stdin.close()
      self._proc.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
      pass

  def _send(self, line):
    try:
      self._proc.stdin.write((line + "\n").encode())
      self._proc.stdin.flush()
    except OSError:
      pass


if __name__ == "__main__":
  sys.exit(main())
