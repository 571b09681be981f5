"""``epl-launch``: start the workers, show their output, stop them all on any failure.

Every worker runs in its own process group; the launcher returns only once every process of
every group is gone. Workers get ``EPL_LAUNCH_PARENT_PID``: if the launcher itself is killed,
epl stops them (epl.runtime.watchdog), and the direct child also gets SIGKILL from the kernel.
"""
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

from epl.launch.console import NoiseFilter, describe_exit, last_traceback, prefixed
from epl.launch.spec import parser, settings_from_args, worker_specs

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


def _group_alive(pgid):
  try:
    os.killpg(pgid, 0)
    return True
  except ProcessLookupError:
    return False
  except PermissionError:
    return True


class Job:
  """The running workers of this launcher."""

  def __init__(self, specs, debug=False, out=None):
    self.specs = {s.index: s for s in specs}
    self.debug = debug
    self.out = out or sys.stdout
    self.procs = {}
    self.exits = []                      # (time, index, code) in the order workers ended
    self._threads = []
    self._print_lock = threading.Lock()

  def start(self):
    for spec in self.specs.values():
      os.makedirs(os.path.dirname(spec.log_path) or ".", exist_ok=True)
      proc = subprocess.Popen(spec.argv, env=spec.env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, start_new_session=True,
                              preexec_fn=_die_with_parent)
      self.procs[spec.index] = proc
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

  def watch(self, poll=0.2):
    """Returns 0 when every worker succeeded; on the first failure stops the rest."""
    while True:
      for index, proc in sorted(self.procs.items()):
        code = proc.poll()
        if code is not None and index not in [i for _, i, _ in self.exits]:
          self.exits.append((time.time(), index, code))
      failed = [(i, c) for _, i, c in self.exits if c != 0]
      if failed:
        self.stop()
        self._summary(*failed[0])
        return 1
      if len(self.exits) == len(self.procs):
        self.reap()
        return 0
      time.sleep(poll)

  def _summary(self, index, code):
    spec = self.specs[index]
    try:
      with open(spec.log_path, errors="replace") as f:
        text = f.read()
    except OSError:
      text = "(no log)"
    others = [i for _, i, c in self.exits if i != index and c != 0]
    sys.stderr.write(
        "epl-launch: worker %d failed (%s); stopped the other workers%s.\n"
        "--- worker %d (%s) ---\n%s\n" % (
            index, describe_exit(code),
            " (%s then failed too)" % ", ".join("worker %d" % i for i in others) if others
            else "", index, spec.log_path, last_traceback(text)))
    sys.stderr.flush()


def main(argv=None):
  args = parser().parse_args(argv)
  settings = settings_from_args(args)
  specs = worker_specs(settings, os.environ, gpus_on_host=_gpus_on_host(),
                       launcher_pid=os.getpid())
  job = Job(specs, debug=settings.debug)
  print("epl-launch: %d worker(s) x %d device(s); logs in %s" % (
      settings.num_workers, settings.gpu_per_worker, os.path.abspath(settings.log_dir)),
      flush=True)

  def on_signal(signum, _frame):
    job.stop()
    print("epl-launch: interrupted (%s); all workers stopped" % signal.Signals(signum).name,
          file=sys.stderr)
    sys.exit(128 + signum)

  signal.signal(signal.SIGINT, on_signal)
  signal.signal(signal.SIGTERM, on_signal)
  job.start()
  code = job.watch()
  print("epl-launch: %s; logs in %s" % ("all workers finished" if code == 0 else "failed",
                                        os.path.abspath(settings.log_dir)), flush=True)
  return code


if __name__ == "__main__":
  sys.exit(main())
