"""Ports for tests that write TF_CONFIG / --machine_list themselves.

Free ports can be told, not reserved. epl-launch picks its ports from the kernel's ephemeral
range (and starts again on fresh ones when another process took one first); a test that
names its workers' addresses has no such retry, and a killed peer is named by probing its
port. So these come from this xdist worker's own thousand below the ephemeral range: no
launcher, no outgoing connection and no other test process takes them.
"""
import os
import random

from epl.launch.spec import free_ports


def private_ports(count):
  """``count`` free ports from this xdist worker's own thousand below the ephemeral range."""
  with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
    ephemeral = int(f.read().split()[0])
  worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
  low = ephemeral - 1000 * (worker + 2)
  assert low > 1024, "no room below the ephemeral range %d for xdist worker %d" % (
      ephemeral, worker)
  start = random.randrange(low, low + 900)     # not the same ports test after test
  return free_ports(count, (start, low + 999))
