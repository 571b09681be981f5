"""How the workers of a job end: together, and telling a finished job from a lost peer.

Clients (the workers whose sessions drive the model copies) leave together: when a client's
process ends normally it meets the other clients in a farewell barrier before its server goes
away. Without it the first client to finish its last step could exit while a peer still
pulls that step's last collective chunk from it, and the peer's step would fail with "lost
worker". A worker that completed the barrier knows every client has finished its steps; the
barrier's own last pull may then fail on a peer that exits first, which is harmless and
ignored. A process that ends with an uncaught exception or ``sys.exit(n)``, n != 0, skips it
(its peers are failing too, or must learn at once that it is gone).

A worker that holds no model replica's first stage only serves its devices to the clients:
its script stops in ``serve`` until the clients are gone. A client says goodbye when its
process ends normally: it sets a flag variable that lives on each serve-only worker
(``epl_goodbye/client_<c>``). A serve-only worker whose clients are all gone exits 0 when each
said goodbye, and otherwise stops with an error naming the client it lost.
"""
import atexit
import logging
import threading
import time

import tensorflow.compat.v1 as tf
from tensorflow.python.ops import state_ops

from epl import _tf_compat as compat
from epl.runtime.faults import PeerError, reachable
from epl.errors import EplError
from epl.runtime import server as servers
from epl.runtime.server import session_target_config

log = logging.getLogger("epl")


def _flag(device, client):
  with tf.device(device):
    return state_ops.variable_op_v2([], tf.bool, name="epl_goodbye/client_%d" % client)


def _serving_workers(plan):
  return [w for w in range(plan.worker_num) if w not in plan.clients]


FAREWELL_SECONDS = 60        # a client that never reaches its farewell (it hangs) costs this


def arrange_exit(state, plan):
  """On a client of a multi-worker job: at normal process exit, meet the other clients in a
  farewell barrier, then set the serve-only workers' goodbye flags."""
  me = state.cluster.worker_index
  clients = sorted(plan.clients) if plan.clients else list(range(plan.worker_num))
  if me not in clients:
    return
  instance = servers.next_barrier()               # the same on every worker of the script
  servers_only = _serving_workers(plan)
  goodbye = None
  if servers_only:
    graph = state.graph
    with compat.unfinalized(graph), graph.as_default(), tf.name_scope(None), \
        tf.control_dependencies(None):
      goodbye = tf.group(*[tf.assign(_flag(state.cluster.host(w), me), True,
                                     validate_shape=False) for w in servers_only])
  exits = state.exits              # epl.runtime.heartbeat.ExitCode (epl.init installed it)

  def on_exit():
    if state.heartbeat is not None:          # before the farewell: the launcher reads it
      state.heartbeat.ended(exits.code or 0)
      tell_peers_ended(state, [c for c in clients if c != me], state.heartbeat.steps,
                       exits.code or 0 if exits is not None else 0)
    if exits is not None and exits.failed:   # an exception, sys.exit(n != 0): no farewell
      return
    if len(clients) > 1 and 0 in clients:        # task 0 leads every collective group
      try:
        servers.barrier(state.server, state.cluster, FAREWELL_SECONDS, instance=instance,
                        size=len(clients), group_key=servers.FAREWELL_GROUP_KEY)
      except EplError as e:                      # a peer left first, or never came
        log.debug("farewell barrier: %s", e)
    if goodbye is not None:
      _say_goodbye(state, goodbye, servers_only)
  atexit.register(on_exit)


def _ended_flag(device, worker):
  with tf.device(device):
    return state_ops.variable_op_v2([2], tf.int64, name="epl_ended/worker_%d" % worker)


def tell_peers_ended(state, peers, steps, code, seconds=3.0):
  """Leaves ``[steps, code]`` in a flag on each peer's server that accepts connections
  (``epl_ended/worker_<me>``), for a peer on another host that waits in a step for this
  worker: its PeerWatch reads it (``EndedPeers``) and ends with an error naming this worker,
  how it ended and at which step, within seconds instead of after the farewell's minute.
  Gives up after ``seconds``: a stopped peer accepts connections but never answers (its
  session would wait forever), and this process must still end."""
  thread = threading.Thread(target=_tell, args=(state, peers, steps, code, seconds),
                            name="epl-tell-peers", daemon=True)
  thread.start()
  thread.join(seconds)


def _tell(state, peers, steps, code, seconds):
  peers = [w for w in peers if reachable(state.cluster.worker_hosts[w], timeout=1.0)]
  if not peers:
    return
  me = state.cluster.worker_index
  graph = tf.Graph()
  with graph.as_default():
    value = tf.constant([steps, code], tf.int64)
    told = tf.group(*[tf.assign(_ended_flag(state.cluster.host(w), me), value,
                                validate_shape=False) for w in peers])
  config = session_target_config(state.cluster, tf.ConfigProto())
  config.device_filters.extend("/job:worker/task:%d" % w for w in peers)
  try:
    with tf.Session(state.server.target, graph=graph, config=config) as sess:
      sess.run(told, options=tf.RunOptions(timeout_in_ms=int(seconds * 1000)))
  except tf.errors.OpError as e:                 # a peer already gone
    log.debug("could not tell the peers this worker ended: %s", e)


class EndedPeers:
  """``()`` -> {worker: (steps, exit code)} of the peers that left their flag on this
  worker's server as they ended (``tell_peers_ended``). Its own graph and session."""

  def __init__(self, state):
    self._state = state
    self._session = None
    self._reads = {}

  def __call__(self):
    state = self._state
    me, cluster = state.cluster.worker_index, state.cluster
    if self._session is None:
      graph = tf.Graph()
      with graph.as_default():
        for w in range(cluster.worker_num):
          if w != me:
            flag = _ended_flag(cluster.host(me), w)
            self._reads[w] = (state_ops.is_variable_initialized(flag), tf.identity(flag))
      config = session_target_config(cluster, tf.ConfigProto())
      self._session = tf.Session(state.server.target, graph=graph, config=config)
    found = {}
    try:
      known = self._session.run({w: r[0] for w, r in self._reads.items()},
                                options=tf.RunOptions(timeout_in_ms=5000))
      for w in sorted(w for w, set_ in known.items() if set_):
        steps, code = self._session.run(self._reads[w][1])
        found[w] = (int(steps), int(code))
    except tf.errors.OpError as e:
      log.debug("could not read the peers' ended flags: %s", e)
    return found


def _say_goodbye(state, goodbye, servers_only):
  config = session_target_config(state.cluster, tf.ConfigProto())
  config.device_filters.extend("/job:worker/task:%d" % w for w in servers_only)
  try:
    with tf.Session(state.server.target, graph=state.graph, config=config) as sess:
      sess.run(goodbye, options=tf.RunOptions(timeout_in_ms=10000))
  except tf.errors.OpError as e:                 # a serve-only worker already gone
    log.debug("goodbye not delivered: %s", e)


def _said_goodbye(state, client):
  """True when ``client`` set its flag on this worker."""
  graph = tf.Graph()
  with graph.as_default():
    value = tf.identity(_flag(state.cluster.host(state.cluster.worker_index), client))
  config = session_target_config(state.cluster, tf.ConfigProto())
  try:
    with tf.Session(state.server.target, graph=graph, config=config) as sess:
      return bool(sess.run(value, options=tf.RunOptions(timeout_in_ms=10000)))
  except tf.errors.OpError:                        # never set: the client did not finish
    return False


def serve(state, poll_seconds=1.0):
  """Blocks while the job's clients are alive, then ends the process: exit code 0 when every
  client finished, a PeerError naming the lost one otherwise."""
  cluster, plan = state.cluster, state.parallel.plan
  log.warning("worker %d holds no first stage of a model replica: it serves its devices to "
              "the clients until the job ends", cluster.worker_index)
  clients = list(plan.clients) or [0]
  while any(reachable(cluster.worker_hosts[c]) for c in clients):
    time.sleep(poll_seconds)
  lost = [c for c in clients if not _said_goodbye(state, c)]
  if lost:
    raise PeerError(
        "epl worker %d stops: lost worker %s: %s no longer accept%s connections and did not "
        "finish. The job cannot continue without every worker; restart it (from the last "
        "checkpoint)." % (cluster.worker_index, ", ".join(map(str, lost)),
                          ", ".join(cluster.worker_hosts[c] for c in lost),
                          "s" if len(lost) == 1 else ""))
  log.warning("worker %d: the clients finished; the job has ended", cluster.worker_index)
  raise SystemExit(0)
