"""This worker's ``tf.train.Server`` and the start-up barrier of a multi-worker job.

Every worker of a job starts one server (job ``worker``, its index from TF_CONFIG) whose
default session config carries the collective group leader (task 0) — without it
cross-process collectives hang silently — and the virtual CPU devices. Before the user's
graph runs, all workers meet in a barrier (a one-element all-reduce with a deadline), so a
worker that never starts becomes an error on the others instead of an endless wait.
"""
import logging
import socket
import time

import tensorflow.compat.v1 as tf
from tensorflow.python.ops import collective_ops

from epl.cluster import JOB
from epl.errors import EplError

log = logging.getLogger("epl")
_SERVERS = {}           # (hosts, index) -> server: a process can start a server only once
LEADER = "/job:%s/replica:0/task:0" % JOB
BARRIER_GROUP_KEY = 2 ** 30
FAREWELL_GROUP_KEY = 2 ** 30 + 1


class StartupError(EplError, RuntimeError):
  """The job could not start: a port is taken, or a worker did not join in time."""


def server_config(cluster):
  config = tf.ConfigProto()
  for kind, count in cluster.session_device_count().items():
    config.device_count[kind] = count
  config.experimental.collective_group_leader = LEADER
  if cluster.virtual_devices and cluster.gpu_num_per_worker > 1:
    # the server's worker runs every session's ops on its own pool (sessions on a server
    # cannot have per-session pools): size it for the virtual devices
    config.inter_op_parallelism_threads = 2 * cluster.gpu_num_per_worker + 2
  return config


def start_server(cluster):
  """Starts (once per process) and returns this worker's server."""
  key = (cluster.worker_hosts, cluster.worker_index)
  if key in _SERVERS:
    return _SERVERS[key]
  spec = tf.train.ClusterSpec({JOB: list(cluster.worker_hosts)})
  address = cluster.worker_hosts[cluster.worker_index]
  foreign = _not_mine(address)
  if foreign:
    raise StartupError(
        "worker %d could not start its server on %s: %s is not an address of this host (%s); "
        "give each worker its own host's address in TF_CONFIG / --machine_list (in the "
        "order of --machine_rank)" % (cluster.worker_index, address, address.rsplit(":", 1)[0],
                                      foreign))
  try:
    server = tf.train.Server(spec, job_name=JOB, task_index=cluster.worker_index,
                             config=server_config(cluster), start=True)
  except (tf.errors.UnknownError, tf.errors.InternalError, ValueError) as e:
    raise StartupError(
        "worker %d could not start its server on %s (%s); is the port in use? Pick a free "
        "port in TF_CONFIG / --machine_list" % (cluster.worker_index, address,
                                                str(e).splitlines()[0])) from None
  _SERVERS[key] = server
  return server


def _not_mine(address):
  """Why ``address``'s host is not one of this machine's addresses, or "" (it is, or it
  cannot be told: a name that does not resolve here is left to TF's own error)."""
  host = address.rsplit(":", 1)[0].strip("[]")
  try:
    infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
  except socket.gaierror:
    return ""
  errors = []
  for family, _, _, _, sockaddr in infos:
    with socket.socket(family, socket.SOCK_STREAM) as probe:
      try:
        probe.bind((sockaddr[0], 0))
        return ""
      except OSError as e:
        errors.append("%s: %s" % (sockaddr[0], e.strerror))
  return "; ".join(errors)


def session_target_config(cluster, user_config):
  """Adds the device filter (this task only) and the collective leader to a ConfigProto."""
  user_config.experimental.collective_group_leader = LEADER
  own = "/job:%s/task:%d" % (JOB, cluster.worker_index)
  if own not in user_config.device_filters:
    user_config.device_filters.append(own)
  return user_config


_barriers = [0]


def next_barrier():
  """Instance key of the next barrier (each epl.init of a process meets the others anew)."""
  _barriers[0] += 1
  return _barriers[0]


def barrier(server, cluster, timeout, instance=1, size=None, group_key=BARRIER_GROUP_KEY):
  """Blocks until every worker (or the ``size`` workers of the group ``group_key``) reached
  it; raises StartupError after ``timeout`` seconds."""
  size = size or cluster.worker_num
  graph = tf.Graph()
  with graph.as_default():
    with tf.device("/job:%s/replica:0/task:%d/device:CPU:0" % (JOB, cluster.worker_index)):
      ping = collective_ops.all_reduce_v2(
          tf.constant(1.0), group_size=size, group_key=group_key,
          instance_key=instance, merge_op="Add", final_op="Id")
  config = session_target_config(cluster, tf.ConfigProto())
  start = time.time()
  try:
    with tf.Session(server.target, graph=graph, config=config) as sess:
      # a run deadline, not the op's own timeout (which costs a thread; see epl.collectives)
      joined = sess.run(ping, options=tf.RunOptions(timeout_in_ms=int(timeout * 1000)))
  except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
          tf.errors.InternalError, tf.errors.CancelledError, tf.errors.AbortedError) as e:
    from epl.runtime.faults import reachable
    silent = ["worker %d at %s does not answer" % (w, h)
              for w, h in enumerate(cluster.worker_hosts[:size])
              if w != cluster.worker_index and not reachable(h)]
    raise StartupError(
        "worker %d: not every one of the %d workers joined within %.0f s (%s%s: %s). Check "
        "that every worker was started, with the same TF_CONFIG / --machine_list, or raise "
        "cluster.startup_timeout" % (
            cluster.worker_index, size, timeout, "; ".join(silent) + "; " if silent else "",
            type(e).__name__, str(e).splitlines()[0])) from None
  assert int(joined) == size
  log.debug("barrier: all %d workers joined in %.1f s", size, time.time() - start)
