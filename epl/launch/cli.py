"""``epl-launch`` entry point: start the workers, watch them, stop them all on any failure."""
import os
import signal
import subprocess
import sys
import threading
import time

from epl.launch.spec import parser, settings_from_args, worker_specs

GRACE_SECONDS = 5


def _gpus_on_host():
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    return len([g for g in visible.split(",") if g.strip() not in ("", "-1")])
  try:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    return len([line for line in out.stdout.splitlines() if line.startswith("GPU ")])
  except (OSError, subprocess.SubprocessError):
    return 0


def _tail(path, lines=20):
  try:
    with open(path, errors="replace") as f:
      return "".join(f.readlines()[-lines:])
  except OSError:
    return "(no log)"


class Job:
  """The running workers of this launcher."""

  def __init__(self, specs, tee_index):
    self.specs = specs
    self.tee_index = tee_index
    self.procs = {}
    self._threads = []

  def start(self):
    for spec in self.specs:
      os.makedirs(os.path.dirname(spec.log_path) or ".", exist_ok=True)
      log = open(spec.log_path, "wb")
      tee = spec.index == self.tee_index
      proc = subprocess.Popen(spec.argv, env=spec.env, stdout=subprocess.PIPE if tee else log,
                              stderr=subprocess.STDOUT, start_new_session=True)
      self.procs[spec.index] = proc
      if tee:
        t = threading.Thread(target=self._tee, args=(proc, log), daemon=True)
        t.start()
        self._threads.append(t)
      print("epl-launch: worker %d started (pid %d), log %s" % (spec.index, proc.pid,
                                                               spec.log_path), flush=True)

  @staticmethod
  def _tee(proc, log):
    for line in iter(proc.stdout.readline, b""):
      log.write(line)
      log.flush()
      sys.stdout.buffer.write(line)
      sys.stdout.flush()
    log.close()

  def stop(self, sig=signal.SIGTERM):
    """Stops every worker still running (its whole process group), then waits."""
    for proc in self.procs.values():
      if proc.poll() is None:
        try:
          os.killpg(proc.pid, sig)
        except ProcessLookupError:
          pass
    deadline = time.time() + GRACE_SECONDS
    for proc in self.procs.values():
      try:
        proc.wait(timeout=max(0.1, deadline - time.time()))
      except subprocess.TimeoutExpired:
        try:
          os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
        proc.wait()
    for t in self._threads:
      t.join(timeout=2)

  def watch(self, poll=0.2):
    """Returns 0 when every worker succeeded; on the first failure stops the rest."""
    while True:
      running = 0
      for index, proc in sorted(self.procs.items()):
        code = proc.poll()
        if code is None:
          running += 1
        elif code != 0:
          self.stop()
          spec = next(s for s in self.specs if s.index == index)
          print("epl-launch: worker %d failed with exit code %d; stopped the other workers. "
                "Last lines of %s:\n%s" % (index, code, spec.log_path, _tail(spec.log_path)),
                file=sys.stderr, flush=True)
          return 1
      if not running:
        for t in self._threads:
          t.join(timeout=2)
        return 0
      time.sleep(poll)


def main(argv=None):
  args = parser().parse_args(argv)
  settings = settings_from_args(args)
  specs = worker_specs(settings, os.environ, gpus_on_host=_gpus_on_host())
  job = Job(specs, tee_index=min(s.index for s in specs))
  print("epl-launch: %d worker(s) x %d device(s); logs in %s" % (
      settings.num_workers, settings.gpu_per_worker, os.path.abspath(settings.log_dir)),
      flush=True)

  def on_signal(signum, _frame):
    job.stop()
    print("epl-launch: interrupted (signal %d); all workers stopped" % signum, file=sys.stderr)
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
