"""This worker's ``tf.train.Server`` and the start-up barrier of a multi-worker job.

Every worker of a job starts one server (job ``worker``, its index from TF_CONFIG) whose
default session config carries the collective group leader (task 0) — without it
cross-process collectives hang silently — and the virtual CPU devices. Before the user's
graph runs, all workers meet in a barrier (a one-element all-reduce with a deadline), so a
worker that never starts becomes an error on the others instead of an endless wait.

Before the barrier, every worker checks that each address it was given is a worker of its own
job (``meet_peers``): it publishes its job id (``launch.job_id``) in a variable on its own task
and reads every peer's. A worker handed another job's address fails at once with both jobs
named, before any collective could join that job's. The reads must not disturb a job they
reach by mistake: a TF worker drops every session of a master task when a master of the same
task name but another incarnation creates a session on it (SessionMgr: "found old
WorkerSessions created by the same master task with a different incarnation"), so a plain
session of worker 0 of one job would end the running sessions of worker 0 of another on that
worker. The reads therefore run in sessions whose master has a name of its own (a
``ClusterDef`` with a one-task ``epl_probe_<random>`` job at this server's address) and share
the peer's state (``share_session_state_in_clusterspec_propagation``).
"""
import logging
import os
import socket
import time

import tensorflow.compat.v1 as tf
from tensorflow.python.ops import collective_ops

from epl.cluster import JOB
from epl.errors import EplError
from epl.runtime import faults

log = logging.getLogger("epl")
_SERVERS = {}           # (hosts, index) -> server: a process can start a server only once
LEADER = "/job:%s/replica:0/task:0" % JOB
BARRIER_GROUP_KEY = 2 ** 30
FAREWELL_GROUP_KEY = 2 ** 30 + 1


class StartupError(EplError, RuntimeError):
  """The job could not start: a port is taken, or a worker did not join in time."""


class AddressTakenError(StartupError):
  """A worker's address is held by another process: its own server could not bind it, or a
  peer's address answers as another job's server. When epl-launch picked the ports, another
  process took one between the pick and the bind, and the launcher starts again on fresh
  ones (epl.launch.cli)."""


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
    raise AddressTakenError(
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


JOB_ID_VARIABLE = "epl.job_id"      # shared name of the string each worker publishes
_PEER_READ_MS = 2000
_UNKNOWN_DEVICE = "unknown device"


def _job_id_variable(worker):
  with tf.device("/job:%s/replica:0/task:%d/device:CPU:0" % (JOB, worker)):
    return tf.raw_ops.VariableV2(shape=[], dtype=tf.string, shared_name=JOB_ID_VARIABLE,
                                 name="job_id_%d" % worker)


def _task_filter(*workers):
  return tf.ConfigProto(device_filters=["/job:%s/task:%d" % (JOB, w) for w in workers])


def _probe_config(server, cluster, worker):
  """A session config whose master is ``/job:epl_probe_<random>/task:0`` (this server) and
  whose only other task is ``worker`` (see the module docstring)."""
  config = tf.ConfigProto()
  probe = config.cluster_def.job.add()
  probe.name = "epl_probe_" + os.urandom(5).hex()
  probe.tasks[0] = server.target[len("grpc://"):] if server.target.startswith("grpc://") \
      else server.target
  peers = config.cluster_def.job.add()
  peers.name = JOB
  peers.tasks[worker] = cluster.worker_hosts[worker]
  config.experimental.share_session_state_in_clusterspec_propagation = True
  return config


STARTING, RUNNING = "starting", "running"


def publish(server, cluster, job_id, phase):
  """Sets this worker's ``job id|index|phase`` (``STARTING`` until every worker met in the
  barrier, then ``RUNNING``)."""
  me = cluster.worker_index
  graph = tf.Graph()
  with graph.as_default():
    assign = tf.assign(_job_id_variable(me), "%s|%d|%s" % (job_id, me, phase),
                       validate_shape=False)
  with tf.Session(server.target, graph=graph, config=_task_filter(me)) as sess:
    sess.run(assign)


def meet_peers(server, cluster, job_id, timeout, clock=time.time, pause=0.5):
  """Publishes ``job_id`` on this worker's task and waits until every peer published the same.

  A peer that is past the barrier belongs to the job's previous start (a restart met a
  process that has not yet noticed it): it is waited for, as one that has not started.

  Raises:
    StartupError: a peer's address is a worker of another job, or a TensorFlow server that is
      not this job's worker there (both named), or a peer did not publish within ``timeout``.
  """
  me = cluster.worker_index
  publish(server, cluster, job_id, STARTING)
  reads = {}                                   # peer -> (its graph, the read of its id)
  for w in range(cluster.worker_num):
    if w != me:
      graph = tf.Graph()
      with graph.as_default():
        reads[w] = (graph, tf.identity(_job_id_variable(w)))
  deadline = clock() + timeout
  waiting = {w: "not started" for w in reads}   # peer -> why it is not confirmed yet
  while waiting:
    for w in sorted(waiting):
      why = _peer_state(server, cluster, job_id, w, reads[w])
      if why is None:
        del waiting[w]
      else:
        waiting[w] = why
    if waiting and clock() > deadline:
      raise StartupError(
          "worker %d: not every one of the %d workers joined within %.0f s (%s). Check that "
          "every worker was started, with the same TF_CONFIG / --machine_list, or raise "
          "cluster.startup_timeout" % (me, cluster.worker_num, timeout, "; ".join(
              "worker %d at %s %s" % (w, cluster.worker_hosts[w], why)
              for w, why in sorted(waiting.items()))))
    if waiting:
      time.sleep(pause)
  log.debug("every peer is a worker of job %s", job_id)


def _peer_state(server, cluster, job_id, w, read):
  """None when worker ``w`` published ``job_id`` and has not passed the barrier, else why it
  is not confirmed yet; raises StartupError when its address is another job's."""
  me, address = cluster.worker_index, cluster.worker_hosts[w]
  if not faults.reachable(address, timeout=1.0):     # TF's session creation would wait
    return "does not answer"
  try:
    peer_graph, tensor = read
    with tf.Session(server.target, graph=peer_graph,
                    config=_probe_config(server, cluster, w)) as sess:
      value = sess.run(tensor, options=tf.RunOptions(timeout_in_ms=_PEER_READ_MS))
  except tf.errors.InvalidArgumentError as e:
    if _UNKNOWN_DEVICE not in str(e):
      raise
    raise AddressTakenError(
        "worker %d of job %s: %s, given for worker %d, is a TensorFlow server of another "
        "job (it is not task %d of %d workers). Check TF_CONFIG / --machine_list: every "
        "worker of a job must get the same list" % (me, job_id, address, w, w,
                                                    cluster.worker_num)) from None
  except tf.errors.FailedPreconditionError:
    return "started its server, not yet epl"
  except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
          tf.errors.AbortedError, tf.errors.CancelledError, tf.errors.InternalError):
    return "does not answer"
  their_job, their_index, phase = (value.decode("utf-8", "replace").rsplit("|", 2) +
                                   ["", ""])[:3]
  if their_job == job_id and their_index == str(w) and phase == RUNNING:
    # past the barrier while this worker has not met it: a run of the job's previous
    # start, which ends as soon as it notices the restart (its peers are gone)
    return "still runs the job's previous start"
  if their_job != job_id or their_index != str(w):
    raise AddressTakenError(
        "worker %d of job %s: %s, given for worker %d, is worker %s of job %s. Two jobs "
        "were given each other's addresses: check TF_CONFIG / --machine_list (or set the "
        "same launch.job_id / --job_id on every worker of one job)" % (
            me, job_id, address, w, their_index, their_job))
  return None


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
    silent = ["worker %d at %s does not answer" % (w, h)
              for w, h in enumerate(cluster.worker_hosts[:size])
              if w != cluster.worker_index and not faults.reachable(h)]
    raise StartupError(
        "worker %d: not every one of the %d workers joined within %.0f s (%s%s: %s). Check "
        "that every worker was started, with the same TF_CONFIG / --machine_list, or raise "
        "cluster.startup_timeout" % (
            cluster.worker_index, size, timeout, "; ".join(silent) + "; " if silent else "",
            type(e).__name__, str(e).splitlines()[0])) from None
  assert int(joined) == size
  log.debug("barrier: all %d workers joined in %.1f s", size, time.time() - start)


DECISION_VARIABLE = "epl.decision"     # shared name of the string worker 0 publishes


def _decision_variable():
  with tf.device("/job:%s/replica:0/task:0/device:CPU:0" % JOB):
    return tf.raw_ops.VariableV2(shape=[], dtype=tf.string, shared_name=DECISION_VARIABLE,
                                 name="decision")


def agreed(server, cluster, decide, round_key, timeout, pause=0.2, clock=time.time):
  """The JSON-able dict ``decide()`` returns on worker 0, on every worker: a decision each
  worker could make differently (a plan from measured times) is worker 0's. Worker 0
  publishes it (an exception of ``decide`` as {"error": its message}, then re-raised) in a
  variable on its task; the others read it there (``round_key``: this start's, so a value of
  an earlier epl.init is not taken) and never call ``decide``."""
  import json
  if cluster.worker_index == 0:
    try:
      decision = dict(decide())
      text = json.dumps(dict(decision, round=round_key))
    except Exception as e:              # every error: the others must not wait for a plan
      message = str(e) if isinstance(e, EplError) else "%s: %s" % (type(e).__name__, e)
      _publish_decision(server, cluster, json.dumps({"error": message, "round": round_key}))
      raise
    _publish_decision(server, cluster, text)
    return decision
  graph = tf.Graph()
  with graph.as_default():
    read = tf.identity(_decision_variable())
  deadline = clock() + timeout
  while True:
    try:
      with tf.Session(server.target, graph=graph,
                      config=_probe_config(server, cluster, 0)) as sess:
        value = json.loads(sess.run(read, options=tf.RunOptions(
            timeout_in_ms=_PEER_READ_MS)).decode("utf-8"))
      if value.pop("round", None) == round_key:
        return value
    except (tf.errors.FailedPreconditionError, tf.errors.UnavailableError,
            tf.errors.DeadlineExceededError, tf.errors.AbortedError):
      pass                                   # not published yet
    if clock() > deadline:
      raise StartupError(
          "worker %d: worker 0 (%s) did not publish its decision within %.0f s (it makes the "
          "choices every worker must share, e.g. auto.auto_parallel's plan); check worker "
          "0's log, or raise cluster.startup_timeout" % (
              cluster.worker_index, cluster.worker_hosts[0], timeout))
    time.sleep(pause)


def _publish_decision(server, cluster, text):
  graph = tf.Graph()
  with graph.as_default():
    assign = tf.assign(_decision_variable(), text, validate_shape=False)
  with tf.Session(server.target, graph=graph, config=_task_filter(0)) as sess:
    sess.run(assign)
