"""A worker started by epl-launch stops when the launcher is gone (killed with -9, say).

The kernel's parent-death signal only reaches the launcher's direct child (``bash run.sh``),
not the Python process the script starts, so epl watches the launcher itself: one daemon
thread checks every second that the launcher's pid still names the same process (its start
time in /proc, so a reused pid does not fool it), and ends the worker when it does not.
"""
import contextlib
import logging
import os
import threading
import time

log = logging.getLogger("epl")


def _start_time(pid):
  """The process's start time (clock ticks since boot), or None when it is gone."""
  try:
    with open("/proc/%d/stat" % pid) as f:
      return f.read().rsplit(")", 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def watch_launcher(pid, interval=1.0, exit_code=1):
  """Starts the watch thread (no-op where /proc is missing). Returns the thread or None."""
  started = _start_time(pid)
  if started is None:
    return None

  def watch():
    while True:
      time.sleep(interval)
      if _start_time(pid) != started:
        log.error("epl-launch (pid %d) is gone: this worker stops", pid)
        for handler in log.handlers:
          handler.flush()
        os._exit(exit_code)          # the main thread may be inside a TF call: no unwinding
  thread = threading.Thread(target=watch, name="epl-launcher-watch", daemon=True)
  thread.start()
  return thread


@contextlib.contextmanager
def deadline(seconds, message):
  """Ends the process with ``message`` if the block takes longer than ``seconds``.

  The backstop for start-up paths that can block inside TF without a timeout of their own
  (the clean errors come first: the start-up barrier has its own deadline).
  """
  def expire():
    log.error("%s", message)
    for handler in log.handlers:
      handler.flush()
    os._exit(1)
  timer = threading.Timer(seconds, expire)
  timer.daemon = True
  timer.start()
  try:
    yield
  finally:
    timer.cancel()
