"""When epl-launch starts a failed job again: the restart policy (``restart_refused``, the
budget ``Restarts``) and a start lost to a port race (``port_raced``)."""
import re
import time

from epl.launch.console import describe_exit, last_traceback


# errors that a restart would only repeat: the script, its Config or its annotations are wrong
REPEATING = ("ConfigError", "NotImplementedYetError", "AnnotationError", "PlanError",
             "RuntimeStateError")
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Za-z_]\w*(?:Error|Exception))\b")


def failed_with(log_text):
  """The class name of the exception a worker's log ends with ("" when none)."""
  for line in reversed(last_traceback(log_text).splitlines()):
    found = _EXCEPTION_LINE.match(line)
    if found:
      return found.group(1)
  return ""


def restart_refused(code, error, ran):
  """Why a restart would only repeat a failure ("" when it may help).

  Args:
    code: the failed worker's exit code (negative: killed by that signal).
    error: the class name of the exception its log ends with ("" when none).
    ran: whether the job ran its first step in this run.
  """
  if error in REPEATING:
    return "a %s repeats on every start" % error
  if code is not None and code < 0:
    return ""                                  # killed (OOM, preempted, kill -9): restart
  if not ran:
    return ("it failed before the job's first step (%s), which a restart would repeat" %
            (error or describe_exit(code)))
  return ""


class Restarts:
  """The restart budget: ``limit`` restarts within ``window`` seconds (0: the whole run)."""

  def __init__(self, limit, window, clock=time.time):
    self.limit, self.window, self._clock = limit, window, clock
    self.times = []

  def recent(self):
    now = self._clock()
    return [t for t in self.times if not self.window or now - t <= self.window]

  def allow(self):
    """Takes one restart from the budget; False when it is spent."""
    if len(self.recent()) >= self.limit:
      return False
    self.times.append(self._clock())
    return True


PORT_RACES = 3                # fresh-port starts after a picked port was taken, per job


def port_raced(settings, error, ran):
  """True when a start failed only because another process took a port epl-launch picked
  (between its pick and the worker's bind: free ports can be told, not reserved): the
  worker's ``error`` is AddressTakenError, before the job's first step, on picked ports.
  Such a start is repeated on fresh ports whether or not --max_restarts allows restarts."""
  return settings.picked_ports and not ran and error == "AddressTakenError"
