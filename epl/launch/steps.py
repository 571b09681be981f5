"""What epl-launch reads of its workers' steps (their heartbeat: epl.runtime.heartbeat, and
their status files): a stalled step, and a worker that left its script while another waits in
a step for it. Pure (no TensorFlow)."""
import collections

from epl.launch import status

LEFT_WAIT = 5.0     # seconds a worker may wait in a step for a peer that left its script

Found = collections.namedtuple("Found", "reports left reason")


def process_state(pid):
  """What a process is doing, from /proc: running, sleeping, stopped (SIGSTOP), gone..."""
  try:
    with open("/proc/%d/stat" % pid) as f:
      code = f.read().rsplit(")", 1)[1].split()[0]
  except (OSError, IndexError):
    return "gone"
  return {"R": "running", "S": "running (waiting)", "D": "in uninterruptible I/O",
          "T": "stopped (SIGSTOP)", "t": "stopped by a debugger", "Z": "gone (exited)",
          "X": "gone"}.get(code, "state %s" % code)


def check(status_files, pids, told, now, left_wait=LEFT_WAIT):
  """One look at the workers (``status_files``: index -> path; ``pids``: index -> the pid the
  launcher started). Returns Found(reports: stall reports not in ``told`` -- (worker, step)
  pairs, updated --, left: the worker that left its script while another has waited
  ``left_wait`` seconds in a step for it, or None, and why)."""
  beats = {i: status.read_beat(path) for i, path in status_files.items()}
  reports = []
  for i, beat in sorted(beats.items()):
    if not beat or beat.get("since") is None:
      continue
    waited = now - beat["since"]
    for j, path in sorted(status_files.items()):
      left = status.last(path, status.ENDED)
      if j != i and left is not None and not left.get("code") and beat["training"] and \
          beat["steps"] >= left.get("steps", 0) and waited > left_wait:
        return Found(reports, j, "worker %d ended its script (exit code 0) at step %s while "
                     "worker %d waits in step %d for it" % (j, left.get("steps"), i,
                                                            beat["steps"] + 1))
    # (the first step compiles the graph: it may take minutes, and proves nothing)
    if beat["steps"] and waited > beat.get("limit", 60.0) and (i, beat["steps"]) not in told:
      told.add((i, beat["steps"]))
      reports.append(_stall_report(i, beat, waited, beats, pids, now))
  return Found(reports, None, "")


def _stall_report(index, beat, waited, beats, pids, now):
  others = []
  for j in sorted(beats):
    if j == index:
      continue
    other = beats[j] or {}
    pid = other.get("pid") or pids[j]
    step = other.get("steps")
    where = ("in step %d for %.0f s" % (step + 1, now - other["since"])
             if other.get("since") is not None else
             "after step %s" % step if step is not None else "before its first step")
    others.append("worker %d (pid %d): %s, %s" % (j, pid, process_state(pid), where))
  return ("epl-launch: no step finished for %.0f s (the stall limit is %.0f s): worker %d "
          "waits in step %d%s. communication.collective_timeout ends the job if it does not "
          "move" % (waited, beat.get("limit", 60.0), index, beat["steps"] + 1,
                    "; " + "; ".join(others) if others else
                    "; its peers run under other launchers (see their consoles)"))


def step_of(path):
  """" at step N" (the training steps the worker of status file ``path`` ran, as it last
  told), or ""."""
  left = status.last(path, status.ENDED) if path else None
  beat = status.read_beat(path) if path else None
  steps = left.get("steps") if left else beat.get("steps") if beat else None
  return " at step %d" % steps if steps is not None else ""
