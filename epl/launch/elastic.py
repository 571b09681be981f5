"""Elastic jobs (``epl-launch --min_workers N``): the launchers of a multi-host job agree on
which hosts train, so a job that lost a host for good goes on without it, and grows back
when it returns.

One launcher runs per host (``--machine_list`` with ``--machine_rank``, or a scheduler's
tasks). Each answers its peers on its *launcher port* (``launcher_port``: the worker's port
+ 10000) with one JSON line: its original rank, its phase, the epoch (how many memberships
the job has had) and that epoch's members (original ranks; a member's worker index is its
position). Pure sockets and threads: no TensorFlow.

Phases:
  ``running``  its worker trains in ``epoch``;
  ``gathering``  its worker's run ended with a failure; it looks for the next membership;
  ``waiting``  it is not a member of the running epoch (its host was dropped) and asks to
  join; the epoch's coordinator (its lowest original rank) notes it, and has its own worker
  -- the chief -- stop after the next checkpoint, so that everyone gathers again;
  ``done`` / ``failed``  the job ended (a launcher lingers a moment so waiting peers learn it).

The next membership is decided by the lowest-ranked launcher of the old epoch that can be
reached (the coordinator), once no reachable peer still runs the old epoch and every silent
host has been silent for ``host_timeout`` seconds (at once when all answer): the gathering
and waiting launchers, in rank order, if there are at least ``min_workers`` of them. The others
adopt what it decided (they ask it). With ``min_workers`` over half the hosts, two halves of a
cut network cannot both train.
"""
import concurrent.futures
import dataclasses
import json
import os
import socket
import threading
import time

PORT_OFFSET = 10000
POLL = 0.5                   # seconds between two rounds of questions
CONNECT_TIMEOUT = 1.0
GIVE_UP = 300                # seconds without a membership, at least, before a launcher gives up
RESIZE_EXIT = 75             # the chief's exit code after the checkpoint a resize waited for

RUNNING, GATHERING, WAITING, DONE, FAILED = "running", "gathering", "waiting", "done", "failed"


class GaveUp(Exception):
  """No membership of at least min_workers hosts could be formed in time."""


def launcher_port(host):
  """The port a host's launcher answers on: its worker's port + 10000 (- 10000 above 65535)."""
  port = int(host.rsplit(":", 1)[1])
  return port + PORT_OFFSET if port + PORT_OFFSET <= 65535 else port - PORT_OFFSET


@dataclasses.dataclass(frozen=True)
class Membership:
  epoch: int
  members: tuple             # original ranks; worker index = position

  def index_of(self, rank):
    return self.members.index(rank)


def _ask(host, message, timeout=CONNECT_TIMEOUT):
  """One question to the launcher of ``host``; its answer (a dict), or None when silent."""
  address = host.rsplit(":", 1)[0]
  try:
    with socket.create_connection((address, launcher_port(host)), timeout=timeout) as s:
      s.settimeout(timeout)
      s.sendall((json.dumps(message) + "\n").encode())
      data = b""
      while not data.endswith(b"\n"):
        chunk = s.recv(4096)
        if not chunk:
          break
        data += chunk
    return json.loads(data.decode()) if data else None
  except (OSError, ValueError):
    return None


def _from(rank, answer, job=""):
  """``answer`` if launcher ``rank`` of job ``job`` gave it, else None. A connection to a
  local port nobody listens on can connect to itself (TCP's simultaneous open, when the
  kernel picks that very port as the source): the question then comes back as its own
  answer; another job's launcher answers without a rank."""
  return answer if isinstance(answer, dict) and answer.get("rank") == rank and \
      answer.get("job", "") == job else None


class Rendezvous:
  """This host's launcher in the membership protocol (see the module docstring).

  Args:
    hosts: every original worker's host:port (the launch's --machine_list).
    rank: this launcher's original rank.
    min_workers: the fewest hosts the job may train on.
    host_timeout: seconds a host stays silent before it is dropped.
    on_joiner(rank): called (coordinator only) when a dropped host asks to join again.
    give_up: seconds a launcher may spend without a membership before GaveUp (default
      max(300, 10 x host_timeout)).
    job: the job's id; a launcher of another job that answers on a host's port is not that
      host's.
  """

  def __init__(self, hosts, rank, min_workers, host_timeout, on_joiner=None, give_up=None,
               ask=_ask, clock=time.monotonic, listen=True, job="", on_epoch=None):
    self.hosts, self.rank, self.job = tuple(hosts), rank, job
    self.min_workers, self.host_timeout = min_workers, host_timeout
    self.give_up = give_up if give_up is not None else max(GIVE_UP, 10 * host_timeout)
    self.on_joiner, self.on_epoch, self._ask, self._clock = on_joiner, on_epoch, ask, clock
    self.phase = RUNNING
    self.current = Membership(0, tuple(range(len(self.hosts))))
    self.joiners = set()
    self.told = None               # FAILED: a host of this epoch ended the job while it ran
    self.why = ""                  # why next_membership ended the job (DONE / FAILED)
    self._heard_after_end = set()
    self._lock = threading.Lock()
    self._sock = None
    if listen:
      self._listen()

  # ---- answering ------------------------------------------------------------------------
  def _listen(self):
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    port = launcher_port(self.hosts[self.rank])
    try:
      sock.bind(("", port))
    except OSError as e:
      sock.close()
      raise SystemExit("epl-launch: error: --min_workers: this host's launcher cannot listen "
                       "on port %d, its worker's port %s +/- 10000 (%s); give the worker a "
                       "port whose launcher port is free" % (port, self.hosts[self.rank], e))
    sock.listen(16)
    self._sock = sock
    threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

  def _serve(self, sock):
    while True:
      try:
        conn, _ = sock.accept()
      except OSError:
        return                                   # closed
      with conn:
        try:
          conn.settimeout(CONNECT_TIMEOUT)
          line = conn.makefile().readline()
          conn.sendall((json.dumps(self.answer(json.loads(line))) + "\n").encode())
        except Exception:  # pylint: disable=broad-except
          pass                                   # one bad question never ends the answering

  def answer(self, question):
    """What this launcher tells a peer that sent ``question`` (its own state)."""
    if not isinstance(question, dict) or question.get("job", "") != self.job:
      return {"job": self.job}                   # another job's launcher: not a peer
    asker = question.get("rank")
    if not isinstance(asker, int) or not 0 <= asker < len(self.hosts) or asker == self.rank:
      return {"job": self.job}
    with self._lock:
      if self.phase in (DONE, FAILED):
        self._heard_after_end.add(asker)
      elif self.phase == RUNNING and question.get("phase") == FAILED and \
          asker in self.current.members and question.get("epoch") == self.current.epoch:
        # the job failed on a host of this epoch for good (a finished one is not told: its
        # peers' workers may still be writing their last outputs)
        self.told = FAILED
      if question.get("phase") == WAITING and self.phase == RUNNING and \
          self.rank == self.current.members[0] and asker not in self.current.members and \
          asker not in self.joiners:
        self.joiners.add(asker)
        if self.on_joiner is not None:
          self.on_joiner(asker)
      return {"rank": self.rank, "job": self.job, "phase": self.phase,
              "epoch": self.current.epoch, "members": list(self.current.members)}

  def close(self):
    if self._sock is not None:
      self._sock.close()
      self._sock = None

  # ---- asking ---------------------------------------------------------------------------
  def _round(self):
    """Every other launcher's answer (None: silent)."""
    me = {"rank": self.rank, "job": self.job, "phase": self.phase,
          "epoch": self.current.epoch}
    others = [(r, h) for r, h in enumerate(self.hosts) if r != self.rank]
    if not others:
      return {}
    # at once: a silent host costs its connect timeout, which one after another would add up
    with concurrent.futures.ThreadPoolExecutor(min(32, len(others))) as pool:
      answers = list(pool.map(lambda rh: _from(rh[0], self._ask(rh[1], me), self.job),
                              others))
    return {r: a for (r, _), a in zip(others, answers)}

  def next_membership(self, failed=True, allow=None):
    """After this launcher's run ended (``failed``: with an error; else it is not a member
    and waits to join): the next Membership this host is in, or DONE / FAILED when the job
    ended. ``allow()``: asked by the coordinator before it restarts the same hosts (the
    restart budget; None: always). Raises GaveUp after ``give_up`` seconds without one; the
    clock stops while this host waits to join a job that runs."""
    with self._lock:
      self.phase = GATHERING if failed else WAITING
      self.joiners = set()
    started = self._clock()
    heard = {}                                   # rank -> when it last answered
    while True:
      old = self.current.epoch
      answers = self._round()
      now = self._clock()
      heard.update((r, now) for r, a in answers.items() if a is not None)
      found = self._decide(answers, old, started, heard, now, allow)
      if found is not None:
        return found
      if self.phase == WAITING and any(a is not None and a["phase"] == RUNNING
                                       for a in answers.values()):
        started = now                            # a job runs: wait for its next checkpoint
      if now - started > self.give_up:
        raise GaveUp("no job of at least %d host(s) could be formed within %d s (heard from "
                     "%s)" % (self.min_workers, self.give_up, ", ".join(
                         "host %d" % r for r in sorted(heard)) or "no other host"))
      time.sleep(POLL)

  def _decide(self, answers, old, started, heard, now, allow):
    live = {r: a for r, a in answers.items() if a is not None}
    for phase, what in ((FAILED, "failed"), (DONE, "finished")):
      ended = sorted(r for r, a in live.items() if a["phase"] == phase and a["epoch"] >= (
          old if phase == DONE else 0))
      if ended:
        return self._end(phase, "host %d's launcher %s the job" % (ended[0], what))
    # an epoch decided elsewhere -- a newer one, or this one's number with other members
    # (decided by a launcher that could not hear this host): a running one is adopted, a
    # gathering one taken as this host's old epoch, one without this host joined
    decided = [a for a in live.values() if a["epoch"] > old or (
        a["epoch"] == old and a["phase"] == RUNNING and
        tuple(a["members"]) != self.current.members)]
    if decided:
      best = max(decided, key=lambda a: (a["epoch"], a["phase"] == RUNNING))
      found = Membership(best["epoch"], tuple(best["members"]))
      if self.rank not in found.members:
        with self._lock:
          self.phase = WAITING                     # decided without me: ask to join
        return None
      if best["phase"] == RUNNING:
        return self._adopt(found)
      with self._lock:
        self.current = found                       # that epoch ended too: gather from it
      return None
    peers = [r for r, a in live.items() if a["epoch"] == old and a["phase"] != WAITING]
    if self.rank != min([self.rank] + peers):
      return None                                  # the coordinator decides
    if any(a["phase"] == RUNNING and a["epoch"] == old for a in live.values()):
      return None                                  # its worker has not seen the end yet
    silent = [r for r in answers if r not in live]
    if silent and any(now - heard.get(r, started) < self.host_timeout for r in silent):
      return None
    members = tuple(sorted([self.rank] + [r for r, a in live.items()
                                          if a["phase"] in (GATHERING, WAITING)]))
    if len(members) < self.min_workers:
      return None
    if members == self.current.members and allow is not None and not allow():
      return self._end(FAILED, "the same hosts failed again, past --max_restarts")
    return self._adopt(Membership(old + 1, members))

  def _adopt(self, membership):
    with self._lock:
      self.current, self.phase, self.joiners, self.told = membership, RUNNING, set(), None
      if self.on_epoch is not None:
        self.on_epoch(membership)                  # under the lock: no joiner heard between
    return membership

  def _end(self, phase, why):
    with self._lock:
      self.phase, self.why = phase, why
    return phase

  def finish(self, phase, linger=None):
    """The job ended here (DONE or FAILED): answers so for up to ``linger`` seconds (default
    min(10, host_timeout)), until every other host of the epoch and every host that asked to
    join has heard it or ended too (a peer that gathers for a run it lost learns that the
    job is over, instead of dropping this host as silent)."""
    with self._lock:
      self.phase = phase
      others = (set(self.current.members) | self.joiners) - {self.rank}
    deadline = self._clock() + (min(10.0, self.host_timeout) if linger is None else linger)
    while others and self._clock() < deadline:
      me = {"rank": self.rank, "job": self.job, "phase": phase, "epoch": self.current.epoch}
      with self._lock:
        others -= self._heard_after_end
      others -= {r for r in others if (_from(r, self._ask(self.hosts[r], me), self.job) or
                                       {}).get("phase") in (DONE, FAILED)}
      if others:
        time.sleep(POLL)
    self.close()


class Resizer:
  """An elastic launcher's view of its job: the Settings of the current membership, and what
  it does after a run (``after_run``). ``say``: one line to the console."""

  def __init__(self, settings, say, rendezvous=None):
    self.original, self.say = settings, say
    self.rendezvous = rendezvous or Rendezvous(
        settings.hosts, settings.machine_rank, settings.min_workers, settings.host_timeout,
        on_joiner=self._joiner, job=settings.job_id, on_epoch=lambda _: self._clear())
    self._clear()

  def told(self):
    """FAILED when a host of the running epoch ended the job for good (the launcher then
    stops its own workers), else None."""
    return self.rendezvous.told

  def settings(self):
    """The launch Settings of the current membership (its hosts, this host's new rank)."""
    members = self.rendezvous.current.members
    hosts = tuple(self.original.hosts[r] for r in members)
    return dataclasses.replace(self.original, num_workers=len(hosts), hosts=hosts,
                               machine_rank=members.index(self.original.machine_rank))

  def _clear(self):
    try:
      os.remove(self.original.resize_file)
    except OSError:
      pass

  def _joiner(self, rank):
    self.say("epl-launch: elastic: host %d (%s) is back; the job grows back to it after its "
             "next checkpoint" % (rank, self.original.hosts[rank]))
    with open(self.original.resize_file, "w") as f:
      f.write("%d\n" % rank)

  def after_run(self, resize, refused, budget):
    """After a run that failed (``resize``: the chief stopped for a planned resize;
    ``refused``: why a restart would only repeat the failure, or ""): None to start the next
    run (``settings()``), or the launcher's exit code. ``budget``: the Restarts that a
    restart on the same hosts takes from."""
    told = self.rendezvous.told
    if told is not None:
      self.say("epl-launch: elastic: the job ended on another host (%s); stopped this host's "
               "workers" % told)
      self.rendezvous.finish(told)
      return 0 if told == DONE else 1
    if refused:
      self.say("epl-launch: elastic: not restarted (%s); the other hosts stop too" % refused)
      self.rendezvous.finish(FAILED)
      return 1
    before = self.rendezvous.current
    self.say("epl-launch: elastic: %s; gathering the hosts (a silent one is dropped after "
             "%d s)" % ("stopped to grow back" if resize else "the run failed",
                        self.original.host_timeout))
    try:
      found = self.rendezvous.next_membership(allow=None if resize else budget.allow)
    except GaveUp as e:
      self.say("epl-launch: elastic: gave up: %s" % e)
      self.rendezvous.finish(FAILED, linger=0)
      return 1
    if found in (DONE, FAILED):
      self.say("epl-launch: elastic: the job ended (%s: %s)" % (found, self.rendezvous.why))
      self.rendezvous.finish(found)
      return 0 if found == DONE else 1
    self.say(self.describe(before, found))
    return None

  def describe(self, before, after):
    left = [r for r in before.members if r not in after.members]
    back = [r for r in after.members if r not in before.members]
    change = "; ".join(filter(None, [
        "dropped %s" % ", ".join("host %d (%s)" % (r, self.original.hosts[r]) for r in left)
        if left else "", "back: %s" % ", ".join("host %d" % r for r in back) if back else ""]))
    return ("epl-launch: elastic: epoch %d on %d of %d host(s) (%s)%s; this host is worker %d "
            "of %d; resuming from the last checkpoint" % (
                after.epoch, len(after.members), len(self.original.hosts),
                ", ".join(str(r) for r in after.members), "; " + change if change else "",
                after.index_of(self.original.machine_rank), len(after.members)))

  def finish(self, phase):
    self.rendezvous.finish(phase)
