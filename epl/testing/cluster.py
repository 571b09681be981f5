"""Test-only: several "hosts" on one Linux machine, as network namespaces joined by a bridge.

Each host is a network namespace with its own address (10.<net>.0.<i+1>/24) and its link to
a bridge in the root namespace: a veth pair whose root end can be capped (``tc ... tbf``: both
directions), taken down, or counted (``/sys/class/net/<link>/statistics``). Processes started
on a host (``Testbed.start``) run inside its namespace, in their own process group.
``close()`` -- also run at exit and from a ``with`` block that fails -- kills every process
of every host and deletes the namespaces, the veths and the bridge. Needs root (CAP_NET_ADMIN);
``available()`` says why not when it cannot.

Example:
  >>> with Testbed(2, rate="1gbit") as bed:
  ...   p = bed.start(0, ["epl-launch", "--machine_list", bed.machine_list(), ...])
"""
import atexit
import os
import shutil
import signal
import socket
import subprocess
import time
import weakref

_LIVE = weakref.WeakSet()
_ETC = "/etc/netns"


def _ip(*args, check=True):
  return subprocess.run(["ip"] + list(args), capture_output=True, text=True, check=check)


def available():
  """None when a testbed can be made here, else the reason (for a skip message)."""
  if os.geteuid() != 0:
    return "network namespaces need root"
  name = "eplprobe%d" % os.getpid()
  try:
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
      return "ip netns add failed: %s" % made.stderr.strip()
    return None
  except FileNotFoundError:
    return "the ip command (iproute2) is not installed"
  finally:
    _ip("netns", "del", name, check=False)


class Testbed:
  """``hosts`` network namespaces on a bridge; ``rate``: a cap for every host's link;
  ``hostnames``: a name per host that every host resolves to its address (as a cluster's
  DNS would: Slurm's node names)."""

  def __init__(self, hosts, rate=None, net=None, hostnames=()):
    self.hostnames = tuple(hostnames)
    tag = "%d%d" % (os.getpid() % 10000, int(time.time() * 1000) % 1000)
    self.net = net if net is not None else 100 + os.getpid() % 100
    self.bridge = "eplb%s" % tag
    self.names = ["eplh%s_%d" % (tag, i) for i in range(hosts)]
    self.links = ["eplv%s_%d" % (tag, i) for i in range(hosts)]      # root ends
    self.addresses = ["10.%d.0.%d" % (self.net, i + 1) for i in range(hosts)]
    self.procs = []
    self._closed = False
    _LIVE.add(self)
    try:
      self._build(rate)
    except BaseException:
      self.close()
      raise

  def _build(self, rate):
    _ip("link", "add", self.bridge, "type", "bridge")
    _ip("link", "set", self.bridge, "up")
    for name, link, address in zip(self.names, self.links, self.addresses):
      _ip("netns", "add", name)
      _ip("link", "add", link, "type", "veth", "peer", "name", link + "p")
      _ip("link", "set", link + "p", "netns", name)
      _ip("link", "set", link, "master", self.bridge)
      _ip("link", "set", link, "up")
      self.exec_ip(name, "link", "set", "lo", "up")
      self.exec_ip(name, "link", "set", link + "p", "name", "eth0")
      self.exec_ip(name, "addr", "add", address + "/24", "dev", "eth0")
      self.exec_ip(name, "link", "set", "eth0", "up")
      # inside the host, this machine's name is the host's address (``ip netns exec`` mounts
      # /etc/netns/<name>/hosts over /etc/hosts), as on a real host: software that finds its
      # own address by its host name (Gloo) must not get the loopback one
      os.makedirs(os.path.join(_ETC, name), exist_ok=True)
      with open(os.path.join(_ETC, name, "hosts"), "w") as f:
        f.write("127.0.0.1 localhost\n%s %s\n" % (address, socket.gethostname()))
        f.writelines("%s %s\n" % pair for pair in zip(self.addresses, self.hostnames))
    if rate:
      for i in range(len(self.names)):
        self.set_rate(i, rate)

  @staticmethod
  def exec_ip(name, *args):
    subprocess.run(["ip", "netns", "exec", name, "ip"] + list(args), capture_output=True,
                   text=True, check=True)

  # ---- what tests use ------------------------------------------------------------------
  def machine_list(self, port=23456):
    return ",".join("%s:%d" % (a, port) for a in self.addresses)

  def start(self, host, argv, env=None, **popen):
    """Starts ``argv`` inside host ``host`` (its own process group); returns the Popen."""
    proc = subprocess.Popen(["ip", "netns", "exec", self.names[host]] + list(argv),
                            env=env, start_new_session=True, **popen)
    self.procs.append(proc)
    return proc

  def set_rate(self, host, rate):
    """Caps host ``host``'s link at ``rate`` (tc syntax: "1gbit", "50mbit") both ways."""
    burst = "%dk" % max(32, _bits(rate) // 8 // 1000 // 50)     # 20 ms worth, >= 32 KiB
    for where in ([], ["ip", "netns", "exec", self.names[host]]):
      dev = self.links[host] if not where else "eth0"
      subprocess.run(where + ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                              rate, "burst", burst, "latency", "50ms"],
                     capture_output=True, text=True, check=True)

  def link_down(self, host):
    _ip("link", "set", self.links[host], "down")

  def link_up(self, host):
    _ip("link", "set", self.links[host], "up")

  def link_bytes(self, host):
    """(bytes the host received, bytes it sent) on its link so far."""
    base = "/sys/class/net/%s/statistics/" % self.links[host]
    with open(base + "tx_bytes") as tx, open(base + "rx_bytes") as rx:
      return int(tx.read()), int(rx.read())      # the root end sends what the host receives

  def pids(self, host):
    out = _ip("netns", "pids", self.names[host], check=False).stdout
    return [int(p) for p in out.split()]

  def kill_host(self, host):
    """Every process of the host dies (SIGKILL) and its namespace goes: a machine lost."""
    for pid in self.pids(host):
      _kill(pid)
    _ip("netns", "del", self.names[host], check=False)

  def close(self):
    if self._closed:
      return
    self._closed = True
    for proc in self.procs:
      if proc.poll() is None:
        try:
          os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
          pass
    for name in self.names:
      for pid in self.pids_of(name):
        _kill(pid)
    for proc in self.procs:
      try:
        proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        pass
    for name in self.names:
      _ip("netns", "del", name, check=False)
      shutil.rmtree(os.path.join(_ETC, name), ignore_errors=True)
    for link in self.links:
      _ip("link", "del", link, check=False)
    _ip("link", "del", self.bridge, check=False)

  @staticmethod
  def pids_of(name):
    out = _ip("netns", "pids", name, check=False).stdout
    return [int(p) for p in out.split()]

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
    return False


def _kill(pid):
  try:
    os.kill(pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _bits(rate):
  units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1}
  for unit, scale in units.items():
    if rate.endswith(unit):
      return int(float(rate[:-len(unit)]) * scale)
  return int(rate)


def leftovers():
  """Namespaces and links a testbed left behind (empty after every close)."""
  names = _ip("netns", "list", check=False).stdout.split()
  links = _ip("-o", "link", "show", check=False).stdout
  etc = os.listdir(_ETC) if os.path.isdir(_ETC) else []
  return [n for n in names if n.startswith("eplh")] + [
      "/etc/netns/" + n for n in etc if n.startswith("eplh")] + [
      w.split("@")[0] for w in links.split() if w.startswith(("eplb", "eplv"))]


@atexit.register
def _close_all():
  for bed in list(_LIVE):
    bed.close()
