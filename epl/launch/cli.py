"""``epl-launch``: start the workers, show their output, stop them all on any failure.

Every worker runs in its own process group; the launcher returns only once every process of
every group is gone. If the launcher itself is killed, at any moment, its guard process
(epl/launch/guard.py) ends every group; besides, the direct child gets SIGKILL from the
kernel, and epl in each worker (``EPL_LAUNCH_PARENT_PID``) watches the launcher once
``epl.init`` ran (epl.runtime.watchdog).

With ``--max_restarts N`` a failed job is started again (every worker, fresh ports on
localhost) and resumes from its last checkpoint, unless the failure would only repeat: a
Config / plan / annotation error, or any error before the job ran its first step
(``restart_refused``). After N restarts within ``--restart_window`` it gives up.

Free ports can be told, not reserved: another process may bind a port epl-launch picked
before the worker's server does. A start that fails so (``port_raced``) is repeated on fresh
ports, with or without --max_restarts, and costs no restart.
"""
import collections
import dataclasses
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

from epl.launch import elastic, status, steps
from epl.launch.guard import Guard
from epl.launch.guard import alive as _group_alive
from epl.launch.console import NoiseFilter, describe_exit, last_traceback, prefixed
from epl.launch.restarts import PORT_RACES, Restarts, failed_with, port_raced, restart_refused
from epl.launch.spec import free_ports, parser, settings_from_args, status_path, worker_specs

GRACE_SECONDS = 5
_PR_SET_PDEATHSIG = 1


def _gpus_on_host():
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    return len([g for g in visible.split(",") if g.strip() not in ("", "-1")])
  try:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    return len([line for line in out.stdout.splitlines() if line.startswith("GPU ")])
  except (OSError, subprocess.SubprocessError):
    return 0


def _die_with_parent():
  """In the child before exec: the kernel sends SIGKILL when the launcher dies (Linux)."""
  try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  except OSError:
    pass


class Job:
  """The running workers of this launcher."""

  def __init__(self, specs, debug=False, out=None, status_files=None, guard=None):
    self.specs = {s.index: s for s in specs}
    self.guard = guard                   # a Guard told of every worker's process group
    self.debug = debug
    self.out = out or sys.stdout
    self.status_files = status_files or {}   # index -> its launch.status_file
    self.procs = {}
    self.exits = []                      # (time, index, code) in the order workers ended
    self.failure = None                  # (index, code) of the first worker that failed
    self.reason = ""                     # why the job was stopped, when no worker failed
    self.stopping = False
    self._stalls = set()                 # (worker, step) stalls already reported
    self._checked = 0.0
    self._threads = []
    self._print_lock = threading.Lock()

  def start(self):
    for path in self.status_files.values():
      status.clear(path)
      status.clear(status.beat_path(path))     # a beat of the start before is not this one's
    for spec in self.specs.values():
      os.makedirs(os.path.dirname(spec.log_path) or ".", exist_ok=True)
      proc = subprocess.Popen(spec.argv, env=spec.env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, start_new_session=True,
                              preexec_fn=_die_with_parent)
      self.procs[spec.index] = proc
      if self.guard is not None:
        self.guard.add(proc.pid)           # its process group (start_new_session)
      t = threading.Thread(target=self._pump, args=(spec, proc), daemon=True)
      t.start()
      self._threads.append(t)
      self._say("epl-launch: worker %d started (pid %d), log %s" % (spec.index, proc.pid,
                                                                   spec.log_path))

  def _say(self, text):
    with self._print_lock:
      self.out.write(text + "\n")
      self.out.flush()

  def _pump(self, spec, proc):
    """Copies a worker's output to its log, and the interesting lines to the console."""
    noise = NoiseFilter(self.debug)
    with open(spec.log_path, "wb") as log:
      for raw in iter(proc.stdout.readline, b""):
        log.write(raw)
        log.flush()
        line = raw.decode("utf-8", "replace")
        if noise.keep(line):
          with self._print_lock:
            self.out.write(prefixed(spec.index, line))
            self.out.flush()

  def stop(self, sig=signal.SIGTERM):
    """Stops every worker's process group; returns once no process of any group is left."""
    for proc in self.procs.values():
      if _group_alive(proc.pid):
        try:
          os.killpg(proc.pid, sig)
        except ProcessLookupError:
          pass
    self.reap()

  def reap(self):
    """Waits for every process of every worker's group, SIGKILLing what outlives the grace."""
    deadline = time.time() + GRACE_SECONDS
    for proc in self.procs.values():
      while _group_alive(proc.pid) or proc.poll() is None:
        if time.time() > deadline:
          try:
            os.killpg(proc.pid, signal.SIGKILL)
          except ProcessLookupError:
            pass
        time.sleep(0.05)
        proc.poll()
    for t in self._threads:
      t.join(timeout=2)

  def watch(self, poll=0.2, on_status=None, stop_when=None):
    """Returns 0 when every worker succeeded; on the first failure stops the rest (and
    ``failure`` says which). ``on_status(index, event)``: each status event of a worker;
    ``stop_when()``: a reason to stop every worker (an elastic job ended elsewhere), or None."""
    seen = collections.Counter()
    while True:
      reason = stop_when() if stop_when is not None else None
      if reason:
        self.reason, self.failure = "the job ended on another host (%s)" % reason, (
            min(self.procs), 0)
        self.stop()
        return 1
      known = {i for _, i, _ in self.exits}
      codes = {i: p.poll() for i, p in self.procs.items() if i not in known}
      for index in sorted((i for i, c in codes.items() if c is not None),
                          key=lambda i: (self._ended_at(i), i)):
        self.exits.append((time.time(), index, codes[index]))
      if on_status is not None:
        for index, path in self.status_files.items():
          events = status.read(path)
          for event in events[seen[index]:]:
            on_status(index, event)
          seen[index] = len(events)
      failed = [(i, c) for _, i, c in self.exits if c != 0]
      if failed:
        failed = self._left_first() or failed
      elif time.time() - self._checked >= 1.0:
        self._checked = time.time()
        failed = self._check_steps()
      if failed:
        self.failure = failed[0]
        self.stop()
        return 1
      if len(self.exits) == len(self.procs):
        self.reap()
        return 0
      time.sleep(poll)

  # ---- what the workers' steps say (epl.runtime.heartbeat; epl/launch/steps.py) --------
  def _check_steps(self, now=None):
    """About once a second: reports a stalled step (once per worker and step), and ends a job
    whose worker left its script (exit code 0) while another waits in a step for it.
    Returns [(index, code)] of a worker to blame, or []."""
    found = steps.check(self.status_files, {i: p.pid for i, p in self.procs.items()},
                        self._stalls, time.time() if now is None else now)
    for report in found.reports:
      self._say(report)
    return self._blame(found)

  def _blame(self, found):
    """[(index, 0)] of the worker ``found`` says left its script (its reason kept), or []."""
    if found.left is None:
      return []
    self.reason = found.reason
    return [(found.left, 0)]

  def _ended_at(self, index):
    """When worker ``index`` said it ended (its ``ended`` event), to order the workers seen
    gone in one poll: one that ended without a word (killed, crashed) came first, its peers'
    errors follow from it."""
    event = status.last(self.status_files.get(index, ""), status.ENDED)
    return (event or {}).get("at", float("-inf"))

  def _left_first(self):
    """[(index, 0)] of a worker that had left its script while the failed one waited in a
    step for it (the waiting worker may notice first: its peer's ended flag), or []."""
    return self._blame(steps.check(self.status_files, {i: p.pid for i, p in self.procs.items()},
                                   set(), time.time(), left_wait=0.0))

  def step_of(self, index):
    """" at step N" (the steps worker ``index`` ran, as it last told), or ""."""
    return steps.step_of(self.status_files.get(index))

  def ran(self):
    """True when a worker of this run started training (its first step ran)."""
    return any(e.get("event") == status.RUNNING for path in self.status_files.values()
               for e in status.read(path))

  def log_text(self, index):
    try:
      with open(self.specs[index].log_path, errors="replace") as f:
        return f.read()
    except OSError:
      return "(no log)"

  def summary(self):
    """What the console shows of the failure: the first failed worker's traceback."""
    index, code = self.failure
    others = [i for _, i, c in self.exits if i != index and c != 0]
    what = self.reason or "worker %d failed (%s)%s, the first worker to end" % (
        index, describe_exit(code), self.step_of(index))
    return ("epl-launch: %s; stopped the other workers%s.\n"
            "--- worker %d (%s) ---\n%s\n" % (
                what, " (%s then failed too)" % ", ".join("worker %d" % i for i in others)
                if others else "", index, self.specs[index].log_path,
                last_traceback(self.log_text(index))))


def _listening(settings):
  ports = ", ".join("worker %d on %s" % (i, settings.hosts[i]) for i in settings.local_ranks)
  return ("epl-launch: job %s: %s. TensorFlow's servers listen on every interface without "
          "authentication: run on a trusted network, or let only the job's hosts reach these "
          "ports (--port_range)" % (settings.job_id, ports))


class Interrupted(BaseException):
  """SIGINT / SIGTERM, raised in the launcher's main thread wherever it was (a
  BaseException, as KeyboardInterrupt: no ``except Exception`` on the way swallows it).

  The handler does nothing else: stopping the workers runs after the exception has unwound
  what the signal interrupted. A handler that stopped them itself could land inside
  ``Popen.poll`` (between its non-blocking acquire of the process's wait lock and the
  release); every ``poll`` in the handler then found the lock taken and answered "still
  running", so the launcher waited for a worker that had long exited and never ended (a
  Ctrl-C in tests/test_cluster.py hung so in one CI run; tests/test_launch.py has the
  interrupt land there on purpose)."""

  def __init__(self, signum):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


def _raise_interrupted(signum, _frame):
  raise Interrupted(signum)


def main(argv=None):
  args = parser().parse_args(argv)
  settings = settings_from_args(args)
  gpus = _gpus_on_host()
  if settings.scheduler:
    print("epl-launch: %s" % settings.scheduler, flush=True)
  print("epl-launch: %d worker(s) x %d device(s); logs in %s%s" % (
      settings.num_workers, settings.gpu_per_worker, os.path.abspath(settings.log_dir),
      "; restarts: at most %d%s" % (settings.max_restarts, " within %d s" %
                                    settings.restart_window if settings.restart_window else "")
      if settings.max_restarts else ""), flush=True)
  running = []
  signal.signal(signal.SIGINT, _raise_interrupted)
  signal.signal(signal.SIGTERM, _raise_interrupted)
  guard = Guard()                # before any worker: a kill -9 of this launcher ends them too
  try:
    return _run(settings, gpus, running, guard)
  except Interrupted as interrupt:
    for sig in (signal.SIGINT, signal.SIGTERM):    # a second Ctrl-C: the stop goes on
      signal.signal(sig, signal.SIG_IGN)
    for job in running:
      job.stop()
    print("epl-launch: interrupted (%s); all workers stopped" % interrupt, file=sys.stderr)
    return 128 + interrupt.signum
  finally:
    for job in running:          # an exception of the launcher's own: no worker outlives it
      job.stop()
    guard.done()


def _run(settings, gpus, running, guard=None):
  """Starts the job (again after a failure, within the restart budget) until it ends;
  ``running`` holds the current run's Job for ``main`` to stop on an interrupt."""
  budget = Restarts(settings.max_restarts, settings.restart_window)
  attempt = restarts = races = 0            # starts so far, restarts, port races retried
  resizer = elastic.Resizer(settings, lambda line: print(line, flush=True)) \
      if settings.min_workers else None
  while True:
    if resizer is not None:
      settings = resizer.settings()
    if attempt and settings.local_hosts:                 # fresh ports for the new start
      settings = dataclasses.replace(settings, hosts=tuple(
          "localhost:%d" % p for p in free_ports(settings.num_workers, settings.port_range)))
    job, code = _start(settings, gpus, attempt, restarts, running, guard,
                       resizer.told if resizer is not None else None)
    if code == 0:
      if resizer is not None:
        resizer.finish(elastic.DONE)
      print("epl-launch: all workers finished%s; logs in %s" % (
          " (after %d restart(s))" % restarts if restarts else "",
          os.path.abspath(settings.log_dir)), flush=True)
      return 0
    index, exit_code = job.failure
    resize = resizer is not None and exit_code == elastic.RESIZE_EXIT
    if not resize:
      sys.stderr.write(job.summary())
    error = failed_with(job.log_text(index))
    attempt += 1
    if resizer is not None:
      # only an error that repeats on every start ends an elastic job: a run that failed
      # before its first step may have met a host that was going
      code = resizer.after_run(resize, "" if resize else restart_refused(
          exit_code, error, True), budget)
      if code is not None:
        return code
      restarts += not resize
      time.sleep(RESTART_PAUSE)
      continue
    if port_raced(settings, error, job.ran()) and races < PORT_RACES:
      races += 1
      print("epl-launch: worker %d found a port epl-launch picked taken by another process "
            "(%s); starting every worker again on fresh ports (%d of at most %d)" % (
                index, error, races, PORT_RACES), flush=True)
      continue
    refused = _refused(settings, budget, exit_code, error, job.ran())
    if refused:
      print("epl-launch: failed%s; logs in %s" % (
          "" if not settings.max_restarts else " (not restarted: %s)" % refused,
          os.path.abspath(settings.log_dir)), flush=True)
      return 1
    restarts += 1
    print("epl-launch: restart %d of at most %d: worker %d failed (%s); starting every worker "
          "again, to resume from the last checkpoint" % (
              restarts, settings.max_restarts, index, describe_exit(exit_code)), flush=True)
    time.sleep(RESTART_PAUSE)


def _start(settings, gpus, attempt, restarts, running, guard, stop_when=None):
  """Starts one run of the job and watches it to its end: (its Job, 0 or 1)."""
  print(_listening(settings), flush=True)
  specs = worker_specs(settings, os.environ, gpus_on_host=gpus, launcher_pid=os.getpid(),
                       attempt=attempt)
  job = Job(specs, debug=settings.debug, status_files={
      i: status_path(settings, i) for i in settings.local_ranks}, guard=guard)
  running[:] = [job]
  job.start()

  def on_status(index, event):
    if restarts and event.get("event") == status.RUNNING and event.get("global_step") \
        is not None and index == min(job.specs):
      job._say("epl-launch: restart %d resumed at global_step %s" % (
          restarts, event["global_step"]))
  return job, job.watch(on_status=on_status, stop_when=stop_when)


def _refused(settings, budget, exit_code, error, ran):
  """Why the failed job is not started again ("": it is, and takes one restart)."""
  refused = restart_refused(exit_code, error, ran) \
      if settings.max_restarts else "no --max_restarts"
  if not refused and not budget.allow():
    refused = "--max_restarts %d reached%s" % (
        settings.max_restarts, " within %d s" % settings.restart_window
        if settings.restart_window else "")
  return refused


RESTART_PAUSE = 1.0           # seconds between a failed run and the restart


if __name__ == "__main__":
  sys.exit(main())
