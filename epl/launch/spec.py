"""The pure middle of ``epl-launch``: settings and the (argv, env) of every worker.

Nothing here starts a process, so it is unit-tested directly (as Horovod tests its runner).
"""
import argparse
import dataclasses
import json
import os
import shlex
import socket
import sys
from typing import Dict, Optional, Tuple

from epl.cluster import default_job_id


@dataclasses.dataclass(frozen=True)
class Settings:
  num_workers: int
  gpu_per_worker: int
  hosts: Tuple[str, ...]            # host:port of every worker
  machine_rank: Optional[int]       # start only this worker (one host of a multi-host job)
  log_dir: str
  debug: bool
  script: str
  script_args: Tuple[str, ...]
  job_id: str = "job"
  port_range: Optional[Tuple[int, int]] = None
  max_restarts: int = 0
  restart_window: int = 0          # seconds; 0: restarts count over the whole run
  python: Tuple[str, ...] = ()      # runs a .py script (launch.python); (): the launcher's own
  picked_ports: bool = False         # epl-launch picked the ports (no --machine_list)
  local_slot: int = 0                # with machine_rank: its index among this host's tasks
  scheduler: str = ""                # what a scheduler said (Slurm, MPI), printed at start
  min_workers: int = 0               # elastic (--min_workers): the fewest hosts it trains on
  host_timeout: int = 60             # elastic: seconds a silent host has before it is dropped
  elastic_workers: int = 0           # elastic: the workers the job started with
  resize_file: str = ""              # elastic: the chief stops after a checkpoint when it exists

  @property
  def local_hosts(self):
    """True when epl-launch picked the addresses (localhost, free ports)."""
    return all(h.startswith("localhost:") for h in self.hosts) and self.machine_rank is None

  @property
  def local_ranks(self):
    return [self.machine_rank] if self.machine_rank is not None else list(
        range(self.num_workers))


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
  index: int
  argv: Tuple[str, ...]
  env: Dict[str, str]
  log_path: str


def parser():
  p = argparse.ArgumentParser(
      prog="epl-launch", description="Start an epl training script on every worker.")
  p.add_argument("--num_workers", type=int, default=None,
                 help="number of workers (default 1; under srun / mpirun: the tasks started)")
  p.add_argument("--gpu_per_worker", type=int, default=1,
                 help="accelerators per worker (virtual CPU devices where there is no GPU)")
  p.add_argument("--machine_list", default="",
                 help="comma-separated host[:port] of every worker (default: localhost with "
                      "free ports)")
  p.add_argument("--machine_rank", type=int, default=None,
                 help="start only this worker (one host of a multi-host job)")
  p.add_argument("--log_dir", default="epl_logs", help="where every worker's log goes")
  p.add_argument("--debug", action="store_true",
                 help="epl's DEBUG logs (plan, passes, collectives, barrier) and TF's own logs")
  p.add_argument("--job_id", default=None,
                 help="the job's name (default: derived from --machine_list, or random on "
                      "localhost); a worker given another job's address fails at start-up")
  p.add_argument("--port_range", default=None, metavar="LOW-HIGH",
                 help="ports the workers' servers may use (free ones are picked on localhost; "
                      "--machine_list hosts without a port get LOW + their position)")
  p.add_argument("--max_restarts", type=int, default=None,
                 help="after a worker fails, stop every worker and start the job again (it "
                      "resumes from the last checkpoint), at most this often (default 0)")
  p.add_argument("--restart_window", type=int, default=None, metavar="SECONDS",
                 help="count --max_restarts over the last SECONDS only (default 0: the whole "
                      "run)")
  p.add_argument("--min_workers", type=int, default=None,
                 help="elastic job: when hosts are lost for good, go on with the hosts left "
                      "if at least this many (the last checkpoint restored, the global batch "
                      "kept), and grow back when they return; one epl-launch per host "
                      "(--machine_rank or a scheduler)")
  p.add_argument("--host_timeout", type=int, default=60, metavar="SECONDS",
                 help="elastic job: a host silent this long is dropped (default 60)")
  p.add_argument("script", help="a .py runs under python, anything else under bash")
  p.add_argument("script_args", nargs=argparse.REMAINDER)
  return p


def free_ports(count, port_range=None):
  """Ports the OS reports free now on every interface, as TensorFlow's server binds them
  (bound, read, released); from ``port_range`` (low, high) when given.

  Raises:
    SystemExit: the range has fewer than ``count`` free ports.
  """
  socks, ports = [], []
  candidates = range(port_range[0], port_range[1] + 1) if port_range else [0] * count
  try:
    for port in candidates:
      if len(ports) == count:
        break
      s = socket.socket()
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      try:
        s.bind(("", port))
      except OSError:
        s.close()
        continue
      socks.append(s)
      ports.append(s.getsockname()[1])
  finally:
    for s in socks:
      s.close()
  if len(ports) < count:
    raise SystemExit("epl-launch: error: --port_range %d-%d has %d free port(s) for %d "
                     "worker(s); widen it" % (port_range[0], port_range[1], len(ports), count))
  return ports


def _port_range(text, fail):
  if not text:
    return None
  try:
    low, high = (int(x) for x in text.split("-"))
  except ValueError:
    fail("--port_range %r: expected LOW-HIGH, e.g. 30000-30100" % text)
  if not 1 <= low <= high <= 65535:
    fail("--port_range %r: expected 1 <= LOW <= HIGH <= 65535" % text)
  return low, high


def _port_of(host, fail):
  """The port of ``host`` ("name:port"), 1..65535, or ``fail``s naming it."""
  text = host.rsplit(":", 1)[1]
  if not text.isdigit() or not 1 <= int(text) <= 65535:
    fail("--machine_list: %r has port %r; a port is a number from 1 to 65535" % (host, text))
  return int(text)


# what one local worker costs the launcher and the host, at least: file descriptors (its
# output pipe, its log, a port probe) and memory (a process that imports TensorFlow)
FDS_PER_WORKER = 4
BYTES_PER_WORKER = 350 << 20


def _fits_this_host(workers, fail, limits=None):
  """Refuses a worker count this host cannot start: more open files than the launcher may
  hold (``ulimit -n``), or more TensorFlow processes than its memory holds."""
  if limits is None:
    import resource
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
      memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
      memory = None
  else:
    files, memory = limits
  if files != -1 and workers * FDS_PER_WORKER + 32 > files:
    fail("--num_workers %d: the launcher would hold %d open files for them, over this "
         "process's limit of %d (ulimit -n); start fewer workers per host, or raise the "
         "limit" % (workers, workers * FDS_PER_WORKER + 32, files))
  if memory and workers * BYTES_PER_WORKER > memory:
    fail("--num_workers %d on this host: each worker imports TensorFlow (%d MiB or more), "
         "%d GiB in all, over this host's %.1f GiB; start fewer workers per host "
         "(--machine_list over several hosts)" % (
             workers, BYTES_PER_WORKER >> 20, workers * BYTES_PER_WORKER >> 30,
             memory / float(1 << 30)))


def _launch_defaults(environ):
  """The launch.* Config keys (EPL_LAUNCH_* in the environment): defaults of the flags, for
  schedulers that start epl-launch themselves."""
  from epl.config import Config            # pure: no TensorFlow
  from epl.errors import EplError
  try:
    return Config(environ=environ).launch
  except EplError as e:
    raise SystemExit("epl-launch: error: %s" % e) from None


DEFAULT_PORT = 22220


def settings_from_args(args, pick_ports=free_ports, environ=None):
  """Validates the parsed flags; returns Settings. Raises SystemExit(2) with a message."""
  def fail(message):
    raise SystemExit("epl-launch: error: " + message)
  env = _launch_defaults(os.environ if environ is None else environ)
  port_range = _port_range(args.port_range if args.port_range is not None else env.port_range,
                           fail)
  max_restarts = args.max_restarts if args.max_restarts is not None else env.max_restarts
  window = args.restart_window if args.restart_window is not None else env.restart_window
  if max_restarts < 0:
    fail("--max_restarts must be >= 0")
  if window < 0:
    fail("--restart_window must be >= 0 (0: the whole run)")
  args = _from_scheduler(args, os.environ if environ is None else environ, port_range, fail)
  if args.num_workers is None:
    args.num_workers = 1
  if args.num_workers < 1:
    fail("--num_workers must be >= 1")
  if args.gpu_per_worker < 1:
    fail("--gpu_per_worker must be >= 1")
  if args.machine_list:
    hosts = []
    first = port_range[0] if port_range else DEFAULT_PORT
    for i, item in enumerate(h.strip() for h in args.machine_list.split(",") if h.strip()):
      hosts.append(item if ":" in item else "%s:%d" % (item, first + i))
      port = _port_of(hosts[-1], fail)
      if port_range and not port_range[0] <= port <= port_range[1]:
        fail("--machine_list: port %d of %s is outside --port_range %d-%d" % (
            port, hosts[-1], *port_range))
    if len(hosts) != args.num_workers:
      fail("--machine_list names %d host(s) but --num_workers is %d" % (len(hosts),
                                                                         args.num_workers))
    if len(set(hosts)) != len(hosts):
      fail("--machine_list repeats a host:port: %s" % ",".join(hosts))
    _fits_this_host(1 if args.machine_rank is not None else args.num_workers, fail)
  else:
    if args.machine_rank is not None:
      fail("--machine_rank needs --machine_list (every worker must know every address)")
    _fits_this_host(args.num_workers, fail)
    hosts = ["localhost:%d" % p for p in pick_ports(args.num_workers, port_range)]
  if args.machine_rank is not None and not 0 <= args.machine_rank < args.num_workers:
    fail("--machine_rank %d is out of range for %d worker(s)" % (args.machine_rank,
                                                                  args.num_workers))
  if not os.path.exists(args.script):
    fail("script %r not found" % args.script)
  job_id = args.job_id or env.job_id or (
      default_job_id(hosts) if args.machine_list else "job-" + os.urandom(5).hex())
  if not all(c.isalnum() or c in "-_." for c in job_id):
    fail("--job_id %r: use letters, digits, '-', '_' and '.'" % job_id)
  elastic = _elastic(args, fail)
  return Settings(args.num_workers, args.gpu_per_worker, tuple(hosts), args.machine_rank,
                  args.log_dir, args.debug, args.script, tuple(args.script_args), job_id,
                  port_range, max_restarts, window, python_command(env.python, fail),
                  picked_ports=not args.machine_list,
                  local_slot=getattr(args, "local_slot", 0),
                  scheduler=getattr(args, "scheduler", ""), **elastic)


def _elastic(args, fail):
  """The Settings fields of --min_workers / --host_timeout ({} without --min_workers)."""
  if args.min_workers is None:
    return {}
  if args.machine_rank is None:
    fail("--min_workers needs one epl-launch per host (--machine_list with --machine_rank, "
         "or srun / mpirun): the launchers of the hosts left agree on the next layout")
  if not 1 <= args.min_workers <= args.num_workers:
    fail("--min_workers %d: expected 1 to %d (--num_workers)" % (args.min_workers,
                                                                 args.num_workers))
  if args.host_timeout < 1:
    fail("--host_timeout must be >= 1 second")
  if 2 * args.min_workers <= args.num_workers:
    print("epl-launch: warning: --min_workers %d of %d hosts: both sides of a split network "
          "may train on (each from the last checkpoint, into the same directory); more than "
          "half the hosts (%d) prevents it" % (args.min_workers, args.num_workers,
                                               args.num_workers // 2 + 1), file=sys.stderr)
  rank = args.machine_rank
  return {"min_workers": args.min_workers, "host_timeout": args.host_timeout,
          "elastic_workers": args.num_workers,
          "resize_file": os.path.abspath(os.path.join(args.log_dir, "resize.%d" % rank))}


def _from_scheduler(args, environ, port_range, fail):
  """The flags a scheduler's variables fill in (epl.scheduler): under srun / mpirun each task
  runs one epl-launch that starts its own worker of the job -- ``--machine_rank`` its rank,
  ``--machine_list`` every task's host and port, ``--num_workers`` the tasks. Flags given
  must agree with the scheduler."""
  from epl import scheduler                  # pure: no TensorFlow
  try:
    placement = scheduler.detect(environ, port_range[0] if port_range else
                                 scheduler.DEFAULT_PORT, args.machine_list or None)
  except scheduler.SchedulerError as e:
    fail(str(e))
  if placement is None:
    return args
  if args.num_workers is not None and args.num_workers != placement.size:
    fail("--num_workers %d but %s started %d task(s) (each runs one worker): drop "
         "--num_workers or start %d task(s)" % (args.num_workers, placement.source,
                                                placement.size, args.num_workers))
  if args.machine_rank is not None and args.machine_rank != placement.rank:
    fail("--machine_rank %d but %s says this is task %d" % (args.machine_rank,
                                                             placement.source, placement.rank))
  args = argparse.Namespace(**vars(args))
  args.num_workers, args.machine_rank = placement.size, placement.rank
  args.machine_list = ",".join(placement.hosts)
  args.local_slot, args.scheduler = placement.local_rank, placement.describe()
  if not args.job_id and placement.job_id:
    args.job_id = placement.job_id
  return args


def python_command(text, fail):
  """launch.python (EPL_LAUNCH_PYTHON) split as a shell would; () for the default (the
  launcher's own interpreter). ``fail(message)`` reports text a shell could not split."""
  try:
    return tuple(shlex.split(text))
  except ValueError as e:
    fail("EPL_LAUNCH_PYTHON %r: %s" % (text, e))


def log_path(settings, index, attempt=0):
  """worker_<i>.log; a restarted job's workers write worker_<i>.restart<k>.log."""
  name = "worker_%d.log" % index if not attempt else "worker_%d.restart%d.log" % (index, attempt)
  return os.path.join(settings.log_dir, name)


def status_path(settings, index):
  return os.path.join(settings.log_dir, "worker_%d.status" % index)


def worker_specs(settings, base_env, python=sys.executable, gpus_on_host=0, launcher_pid=None,
                 attempt=0):
  """The argv and environment of each worker this launcher starts (pure).

  Args:
    settings: the launch Settings.
    base_env: the environment to extend (os.environ).
    gpus_on_host: GPUs visible on this host; workers sharing a host get disjoint slices.
    launcher_pid: this launcher's pid (workers stop when it is gone).
    attempt: how many times the job was restarted before (0: the first start).
  """
  specs = []
  interpreter = (list(settings.python or [python]) if settings.script.endswith(".py")
                 else ["bash"])
  for index in settings.local_ranks:
    env = dict(base_env)
    # a shell script's `python` is the launcher's interpreter (its virtualenv)
    env["PATH"] = os.pathsep.join([os.path.dirname(python)] + (
        [base_env["PATH"]] if base_env.get("PATH") else []))
    env["TF_CONFIG"] = json.dumps({"cluster": {"worker": list(settings.hosts)},
                                   "task": {"type": "worker", "index": index}})
    env["EPL_CLUSTER_DEVICES_PER_WORKER"] = str(settings.gpu_per_worker)
    env["EPL_LAUNCH_WORKER_INDEX"] = str(index)
    env["EPL_LAUNCH_JOB_ID"] = settings.job_id
    env["EPL_LAUNCH_ATTEMPT"] = str(attempt)
    env["EPL_LAUNCH_STATUS_FILE"] = os.path.abspath(status_path(settings, index))
    if settings.elastic_workers:
      env["EPL_LAUNCH_ELASTIC_WORKERS"] = str(settings.elastic_workers)
      env["EPL_LAUNCH_RESIZE_FILE"] = settings.resize_file
    if launcher_pid is not None:
      env["EPL_LAUNCH_PARENT_PID"] = str(launcher_pid)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "0" if settings.debug else "2")
    if settings.debug:
      env["EPL_LOG_LEVEL"] = "debug"         # epl's own DEBUG logs (plan, passes, collectives)
    if gpus_on_host:
      same_host = [i for i in settings.local_ranks]
      slot = settings.local_slot if settings.machine_rank is not None else same_host.index(index)
      first = slot * settings.gpu_per_worker
      env["CUDA_VISIBLE_DEVICES"] = ",".join(
          str(g) for g in range(first, first + settings.gpu_per_worker))
    argv = tuple(interpreter + [settings.script] + list(settings.script_args))
    specs.append(WorkerSpec(index, argv, env, log_path(settings, index, attempt)))
  return specs
