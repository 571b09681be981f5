"""The pure middle of ``epl-launch``: settings and the (argv, env) of every worker.

Nothing here starts a process, so it is unit-tested directly (as Horovod tests its runner).
"""
import argparse
import dataclasses
import json
import os
import socket
import sys
from typing import Dict, List, Optional, Tuple


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
  p.add_argument("--num_workers", type=int, default=1, help="number of workers")
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
  p.add_argument("script", help="a .py runs under python, anything else under bash")
  p.add_argument("script_args", nargs=argparse.REMAINDER)
  return p


def free_ports(count):
  """Ports the OS reports free now (bound, read, released)."""
  socks, ports = [], []
  try:
    for _ in range(count):
      s = socket.socket()
      s.bind(("127.0.0.1", 0))
      socks.append(s)
      ports.append(s.getsockname()[1])
  finally:
    for s in socks:
      s.close()
  return ports


DEFAULT_PORT = 22220


def settings_from_args(args, pick_ports=free_ports):
  """Validates the parsed flags; returns Settings. Raises SystemExit(2) with a message."""
  def fail(message):
    raise SystemExit("epl-launch: error: " + message)
  if args.num_workers < 1:
    fail("--num_workers must be >= 1")
  if args.gpu_per_worker < 1:
    fail("--gpu_per_worker must be >= 1")
  if args.machine_list:
    hosts = []
    for i, item in enumerate(h.strip() for h in args.machine_list.split(",") if h.strip()):
      hosts.append(item if ":" in item else "%s:%d" % (item, DEFAULT_PORT + i))
    if len(hosts) != args.num_workers:
      fail("--machine_list names %d host(s) but --num_workers is %d" % (len(hosts),
                                                                         args.num_workers))
    if len(set(hosts)) != len(hosts):
      fail("--machine_list repeats a host:port: %s" % ",".join(hosts))
  else:
    if args.machine_rank is not None:
      fail("--machine_rank needs --machine_list (every worker must know every address)")
    hosts = ["localhost:%d" % p for p in pick_ports(args.num_workers)]
  if args.machine_rank is not None and not 0 <= args.machine_rank < args.num_workers:
    fail("--machine_rank %d is out of range for %d worker(s)" % (args.machine_rank,
                                                                  args.num_workers))
  if not os.path.exists(args.script):
    fail("script %r not found" % args.script)
  return Settings(args.num_workers, args.gpu_per_worker, tuple(hosts), args.machine_rank,
                  args.log_dir, args.debug, args.script, tuple(args.script_args))


def worker_specs(settings, base_env, python=sys.executable, gpus_on_host=0, launcher_pid=None):
  """The argv and environment of each worker this launcher starts (pure).

  Args:
    settings: the launch Settings.
    base_env: the environment to extend (os.environ).
    gpus_on_host: GPUs visible on this host; workers sharing a host get disjoint slices.
    launcher_pid: this launcher's pid (workers stop when it is gone).
  """
  specs = []
  interpreter = [python] if settings.script.endswith(".py") else ["bash"]
  for index in settings.local_ranks:
    env = dict(base_env)
    # a shell script's `python` is the launcher's interpreter (its virtualenv)
    env["PATH"] = os.pathsep.join([os.path.dirname(python)] + (
        [base_env["PATH"]] if base_env.get("PATH") else []))
    env["TF_CONFIG"] = json.dumps({"cluster": {"worker": list(settings.hosts)},
                                   "task": {"type": "worker", "index": index}})
    env["EPL_CLUSTER_DEVICES_PER_WORKER"] = str(settings.gpu_per_worker)
    env["EPL_LAUNCH_WORKER_INDEX"] = str(index)
    if launcher_pid is not None:
      env["EPL_LAUNCH_PARENT_PID"] = str(launcher_pid)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "0" if settings.debug else "2")
    if settings.debug:
      env["EPL_LOG_LEVEL"] = "debug"         # epl's own DEBUG logs (plan, passes, collectives)
    if gpus_on_host:
      same_host = [i for i in settings.local_ranks]
      slot = same_host.index(index)
      first = slot * settings.gpu_per_worker
      env["CUDA_VISIBLE_DEVICES"] = ",".join(
          str(g) for g in range(first, first + settings.gpu_per_worker))
    argv = tuple(interpreter + [settings.script] + list(settings.script_args))
    specs.append(WorkerSpec(index, argv, env,
                            os.path.join(settings.log_dir, "worker_%d.log" % index)))
  return specs
