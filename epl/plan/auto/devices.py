"""The devices a plan may use: servers x devices, the network between them, and its rules.

Device ids are global and server-major: with ``servers=(8, 8)`` devices 0-7 sit on server 0
and 8-15 on server 1. DAPPLE writes the same cluster as cumulative server boundaries,
``seps = 8,16``; ``DeviceSpec.parse`` reads both that form and ``2x8``.

The two network rules are DAPPLE's (its planner's ``all_reduce_time`` and
``split_concat_all2all_time``), written here as two small functions:

* ``allreduce_s(devices, nbytes)``: 0 on one device; ``2W(n-1)/n / 3 GB/s`` when the group
  spans servers; else ``2W(n-1)/n / (25 GB/s x floor(n/2))`` (NVLink rings in parallel).
* ``transfer_s(nbytes, src, dst)``: into a group inside one server, the share of the bytes held
  by source devices on other servers crosses at 1 GB/s point-to-point (all of it at 25 GB/s if
  every source is local); into a group spanning servers, everything moves at 3 GB/s.

Example:
  >>> spec = DeviceSpec.parse("8,16")
  >>> spec.servers, spec.num_devices
  ((8, 8), 16)
  >>> round(spec.allreduce_s(range(16), 3e9), 3)     # spans servers: 2 x 3e9 x 15/16 / 3e9
  1.875
"""
import dataclasses
from typing import Tuple

from epl.plan.auto.errors import PlannerError

GB = 1e9


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """Servers and bandwidths (bytes/s). Defaults are DAPPLE's V100 cluster figures."""
  servers: Tuple[int, ...]
  intra_bandwidth: float = 25 * GB       # NVLink, inside a server
  inter_bandwidth: float = 1 * GB        # point-to-point across servers
  allreduce_bandwidth: float = 3 * GB    # NCCL all-reduce (and scatter) across servers

  def __post_init__(self):
    if not self.servers or any(int(n) != n or n < 1 for n in self.servers):
      raise PlannerError("servers=%r: every server needs a whole number >= 1 of devices" %
                         (self.servers,))
    for name in ("intra_bandwidth", "inter_bandwidth", "allreduce_bandwidth"):
      if not getattr(self, name) > 0:
        raise PlannerError("%s=%r must be > 0 bytes/s" % (name, getattr(self, name)))
    object.__setattr__(self, "servers", tuple(int(n) for n in self.servers))
    owner = []
    for s, n in enumerate(self.servers):
      owner += [s] * n
    object.__setattr__(self, "_owner", tuple(owner))

  @classmethod
  def grid(cls, num_servers, per_server, **bandwidths):
    return cls((per_server,) * num_servers, **bandwidths)

  @classmethod
  def from_seps(cls, seps, **bandwidths):
    """DAPPLE's cumulative boundaries: ``[8, 16]`` = two servers of 8."""
    seps = [int(s) for s in seps]
    if not seps or seps[0] < 1 or any(b <= a for a, b in zip(seps, seps[1:])):
      raise PlannerError("seps=%r must increase strictly from >= 1, e.g. 8,16 for 2 servers "
                         "of 8 devices" % (seps,))
    return cls(tuple(b - a for a, b in zip([0] + seps, seps)), **bandwidths)

  @classmethod
  def parse(cls, text, **bandwidths):
    """Reads ``"8,16"`` (cumulative seps), ``"2x8"`` (servers x devices) or ``"8"``."""
    text = str(text).strip().lower().replace(" ", "")
    try:
      if "x" in text:
        servers, per = (int(v) for v in text.split("x"))
        grid = True
      else:
        seps = [int(v) for v in text.split(",") if v]
        grid = False
    except ValueError:
      raise PlannerError("devices=%r: write cumulative server boundaries like 8,16 or "
                         "servers x devices like 2x8" % text) from None
    if grid:
      return cls.grid(servers, per, **bandwidths)
    return cls.from_seps(seps, **bandwidths)

  @property
  def num_devices(self):
    return len(self._owner)

  @property
  def seps(self):
    out, total = [], 0
    for n in self.servers:
      total += n
      out.append(total)
    return tuple(out)

  def server_of(self, device):
    return self._owner[device]

  def spans(self, devices):
    """Whether ``devices`` sit on more than one server."""
    return len({self._owner[d] for d in devices}) > 1

  def allreduce_s(self, devices, nbytes):
    devices = tuple(devices)
    n = len(devices)
    if n <= 1 or nbytes <= 0:
      return 0.0
    volume = 2.0 * nbytes * (n - 1) / n
    if self.spans(devices):
      return volume / self.allreduce_bandwidth
    return volume / (self.intra_bandwidth * (n // 2))

  def transfer_s(self, nbytes, src, dst):
    """Time to move ``nbytes`` from the group ``src`` to the group ``dst``."""
    src, dst = tuple(src), tuple(dst)
    if nbytes <= 0:
      return 0.0
    if self.spans(dst):
      return nbytes / self.allreduce_bandwidth
    home = self._owner[dst[0]]
    remote = sum(1 for d in src if self._owner[d] != home)
    if remote:
      return nbytes * remote / len(src) / self.inter_bandwidth
    return nbytes / self.intra_bandwidth

  def __str__(self):
    if len(set(self.servers)) == 1:
      shape = "%dx%d" % (len(self.servers), self.servers[0])
    else:
      shape = "servers of %s" % ",".join(map(str, self.servers))
    return "%d devices (%s), %.3g/%.3g/%.3g GB/s intra/p2p/all-reduce" % (
        self.num_devices, shape, self.intra_bandwidth / GB, self.inter_bandwidth / GB,
        self.allreduce_bandwidth / GB)


def parse_bytes(text):
  """``"16GiB"``, ``"32GB"``, ``"1.5e10"`` or ``"16"`` (a bare number below 4096 is GiB).

  Raises:
    PlannerError: not a size.
  """
  raw = str(text).strip()
  units = (("tib", 2 ** 40), ("tb", 1e12), ("gib", 2 ** 30), ("gb", 1e9), ("mib", 2 ** 20),
           ("mb", 1e6), ("kib", 2 ** 10), ("kb", 1e3), ("g", 2 ** 30),
           ("b", 1))
  low = raw.lower()
  for suffix, scale in units:
    if low.endswith(suffix):
      number = low[:-len(suffix)]
      break
  else:
    number, scale = low, None
  try:
    value = float(number)
  except ValueError:
    raise PlannerError("memory=%r is not a size; write e.g. 16GiB, 32GB or 17179869184" %
                       raw) from None
  if scale is None:
    scale = 2 ** 30 if value < 4096 else 1
  if value <= 0:
    raise PlannerError("memory=%r must be > 0" % raw)
  return value * scale


def parse_speeds(text, spec):
  """Relative device speeds: one per device, one per server, or ``server:speed`` pairs.

  Example: ``"1,1,1,1,2,2,2,2"``, ``"1,2"`` (server 0 at 1x, server 1 at 2x) or ``"1:2"``.
  Raises:
    PlannerError: the count matches neither devices nor servers, or a speed is not > 0.
  """
  parts = [p for p in str(text).replace(" ", "").split(",") if p]
  try:
    if parts and all(":" in p for p in parts):
      per_server = [1.0] * len(spec.servers)
      for p in parts:
        server, speed = p.split(":")
        per_server[int(server)] = float(speed)
      values = per_server
    else:
      values = [float(p) for p in parts]
  except (ValueError, IndexError):
    raise PlannerError("speeds=%r: write one relative speed per device or per server, e.g. "
                       "1,2 or 1:2" % text) from None
  if len(values) == len(spec.servers) and len(values) != spec.num_devices:
    values = [values[spec.server_of(d)] for d in range(spec.num_devices)]
  return check_speeds(values, spec)


def check_speeds(speeds, spec):
  if speeds is None:
    return (1.0,) * spec.num_devices
  speeds = tuple(float(s) for s in speeds)
  if len(speeds) != spec.num_devices:
    raise PlannerError("speeds has %d entries but there are %d devices (%d servers); give one "
                       "per device or one per server" % (len(speeds), spec.num_devices,
                                                         len(spec.servers)))
  if any(not s > 0 for s in speeds):
    raise PlannerError("speeds=%r: every relative speed must be > 0" % (speeds,))
  return speeds
