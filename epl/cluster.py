"""The device mesh of a job: workers x accelerators, read once at ``epl.init``.

A worker's accelerators are its GPUs, or, on a machine without GPUs, ``devices_per_worker``
virtual CPU devices ``CPU:1..N`` (``CPU:0`` stays the host, as on a GPU box) -- except a lone
one, which is ``CPU:0`` itself: a second CPU device would only add a host <-> device copy of
every batch (bench/overhead.py measures it). ``TF_CONFIG``
is parsed the way EPL did: ``chief`` hosts first (chief = worker 0), then ``worker`` hosts,
then ``ps`` hosts as extra workers; everything runs as job ``worker``.

Example:
  >>> c = Cluster.local(devices_per_worker=2, has_gpu=False)
  >>> c.devices_of(0)
  ('/device:CPU:1', '/device:CPU:2')
"""
import dataclasses
import hashlib
import ipaddress
import json
import re
import socket
from typing import Tuple

from epl.errors import PlanError

JOB = "worker"
_TASK = re.compile(r"/task:(\d+)")


def worker_of(device):
  """The task index in a device name (0 for a local name without a job)."""
  found = _TASK.search(device)
  return int(found.group(1)) if found else 0


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Immutable view of the job's workers and their accelerators."""
  worker_hosts: Tuple[str, ...]     # empty: a single local worker without a server
  worker_index: int
  gpu_num_per_worker: int
  has_gpu: bool

  @classmethod
  def local(cls, devices_per_worker=1, has_gpu=False):
    return cls((), 0, max(1, devices_per_worker), has_gpu)

  @classmethod
  def from_environment(cls, devices_per_worker, tf_config_json, visible_gpus):
    """Builds the cluster from the config value, ``TF_CONFIG`` and the visible GPU count.

    Args:
      devices_per_worker: ``cluster.devices_per_worker`` (0 = all GPUs, or 1 virtual device).
      tf_config_json: the ``TF_CONFIG`` string or "".
      visible_gpus: number of GPUs this process sees.
    Raises:
      PlanError: TF_CONFIG is malformed, or asks for more GPUs than are visible.
    """
    hosts, index = parse_tf_config(tf_config_json)
    has_gpu = visible_gpus > 0
    if devices_per_worker == 0:
      count = visible_gpus if has_gpu else 1
    elif has_gpu and devices_per_worker > visible_gpus:
      raise PlanError(
          "cluster.devices_per_worker=%d but this worker sees only %d GPU(s); lower it or "
          "launch with --gpu_per_worker %d" % (devices_per_worker, visible_gpus, visible_gpus))
    else:
      count = devices_per_worker
    return cls(hosts, index, count, has_gpu)

  @classmethod
  def from_process(cls, devices_per_worker, environ, visible_gpus):
    """(cluster, ``scheduler.Placement`` or None): from ``TF_CONFIG`` when set (checked
    against a scheduler that started a different number of tasks), else from a scheduler's
    variables (Slurm, MPI: epl.scheduler), else a local job.

    Raises:
      PlanError: TF_CONFIG is malformed; scheduler variables are, or contradict it.
    """
    from epl import scheduler
    text = environ.get("TF_CONFIG", "")
    placement = None
    if text:
      scheduler.check_tf_config(environ, max(1, len(parse_tf_config(text)[0])))
    else:
      placement = scheduler.detect(environ, scheduler.base_port(environ))
      text = placement.tf_config() if placement is not None else ""
    return cls.from_environment(devices_per_worker, text, visible_gpus), placement

  # --- the public view (epl.Env.get().cluster) -------------------------------------------
  @property
  def worker_num(self):
    return max(1, len(self.worker_hosts))

  @property
  def total_gpu_num(self):
    return self.worker_num * self.gpu_num_per_worker

  @property
  def virtual_devices(self):
    """True when the accelerators are virtual CPU devices (no GPU on this machine)."""
    return not self.has_gpu

  @property
  def distributed(self):
    return bool(self.worker_hosts)

  # --- device names ----------------------------------------------------------------------
  def _prefix(self, worker):
    return "/job:%s/replica:0/task:%d" % (JOB, worker) if self.distributed else ""

  def device(self, worker, index):
    """The name of accelerator ``index`` of ``worker``."""
    assert 0 <= index < self.gpu_num_per_worker, index
    if self.has_gpu:
      return "%s/device:GPU:%d" % (self._prefix(worker), index)
    if self.gpu_num_per_worker == 1:
      return self.host(worker)
    return "%s/device:CPU:%d" % (self._prefix(worker), index + 1)

  def devices_of(self, worker):
    return tuple(self.device(worker, i) for i in range(self.gpu_num_per_worker))

  def host(self, worker):
    return "%s/device:CPU:0" % self._prefix(worker)

  def all_devices(self):
    """Every accelerator of the job, worker-major."""
    return tuple(d for w in range(self.worker_num) for d in self.devices_of(w))

  def session_device_count(self):
    """``ConfigProto.device_count`` this worker needs (virtual CPU devices + host)."""
    if self.has_gpu:
      return {}
    return {"CPU": 1 if self.gpu_num_per_worker == 1 else self.gpu_num_per_worker + 1}

  def __str__(self):
    kind = "GPU" if self.has_gpu else "virtual CPU"
    return "Cluster(%d worker(s) x %d %s device(s), this is worker %d)" % (
        self.worker_num, self.gpu_num_per_worker, kind, self.worker_index)


def default_job_id(hosts):
  """A job's id when nobody named it: derived from its workers' addresses, so every worker of
  a job (each started apart, by a scheduler or a per-host epl-launch) agrees on it, and two
  jobs that run at the same time (their ports differ) never share it."""
  return "job-" + hashlib.sha1(",".join(hosts).encode()).hexdigest()[:10]


def parse_tf_config(text):
  """Returns (worker hosts, this worker's index) from a TF_CONFIG string ("" = local)."""
  if not text:
    return (), 0
  try:
    conf = json.loads(text)
    spec = conf.get("cluster", {})
    task = conf.get("task", {})
  except (ValueError, AttributeError) as e:
    raise PlanError("TF_CONFIG is not valid JSON with 'cluster' and 'task': %s" % e) from None
  chief, workers, ps = (list(spec.get(k, [])) for k in ("chief", "worker", "ps"))
  hosts = chief + workers + ps
  if not hosts:
    raise PlanError("TF_CONFIG has no 'chief', 'worker' or 'ps' hosts: %s" % text)
  _refuse_duplicates(hosts, resolve=_addresses)
  kind, index = task.get("type", "worker"), task.get("index", 0)
  offsets = {"chief": 0, "worker": len(chief), "ps": len(chief) + len(workers)}
  sizes = {"chief": len(chief), "worker": len(workers), "ps": len(ps)}
  if kind not in offsets:
    raise PlanError("TF_CONFIG task type %r is not one of chief, worker, ps" % kind)
  if not isinstance(index, int) or not 0 <= index < sizes[kind]:
    raise PlanError("TF_CONFIG task index %r is out of range: the cluster has %d %r task(s)"
                    % (index, sizes[kind], kind))
  return tuple(hosts), offsets[kind] + index


def _addresses(host):
  """The IP addresses ``host`` names; every loopback address counts as one ("loopback")."""
  try:
    infos = socket.getaddrinfo(host, None)
  except OSError:
    return {host.lower()}
  found = set()
  for info in infos:
    ip = ipaddress.ip_address(info[4][0].split("%")[0])
    found.add("loopback" if ip.is_loopback else str(ip))
  return found or {host.lower()}


def _refuse_duplicates(hosts, resolve):
  """Two tasks naming one server (``localhost:2222`` and ``127.0.0.1:2222``) would make the
  collective group leader talk to itself: refuse that before any server starts."""
  seen = []
  for index, entry in enumerate(hosts):
    host, _, port = entry.rpartition(":")
    addresses = resolve(host.strip("[]") or "localhost")
    for other, (other_port, other_addresses) in enumerate(seen):
      if port == other_port and addresses & other_addresses:
        raise PlanError(
            "TF_CONFIG names one server twice: task %d %r and task %d %r are the same address "
            "(%s); every task needs its own host:port" % (
                other, hosts[other], index, entry, sorted(addresses & other_addresses)[0]))
    seen.append((port, addresses))

