"""A job's ranks, size and hosts as the scheduler that started the process says (#52).

``detect(environ)`` reads, in this order (the first present wins; the others, when present
too, must agree with it):

1. ``TF_CONFIG`` -- Kubernetes' TFJob, or epl-launch's own workers: not read here
   (``epl.cluster``), but a scheduler that started a different number of tasks than it
   names is an error (``check_tf_config``);
2. Open MPI: ``OMPI_COMM_WORLD_RANK`` / ``_SIZE`` / ``_LOCAL_RANK``;
3. PMI (MPICH / Intel MPI's Hydra): ``PMI_RANK`` / ``PMI_SIZE``, ``MPI_LOCALRANKID``;
4. Slurm (``srun``): ``SLURM_PROCID`` / ``SLURM_NTASKS`` (the step's ``SLURM_STEP_NUM_TASKS``
   first), ``SLURM_LOCALID``, ``SLURM_NODEID``, the nodes ``SLURM_STEP_NODELIST`` /
   ``SLURM_JOB_NODELIST`` in Slurm's compressed form (``node[01-03,07]``) and the tasks per
   node ``SLURM_STEP_TASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE`` (``2(x3),1``). Tasks are
   placed on nodes in blocks (srun's default distribution); a task whose ``SLURM_NODEID`` /
   ``SLURM_LOCALID`` say otherwise (``--distribution=cyclic``) is an error naming the fix.

MPI does not tell a process where the other ranks run: their hosts come from
``EPL_LAUNCH_MACHINE_LIST`` (or epl-launch's ``--machine_list``), one per rank in rank order, else
from Slurm's node list when mpirun runs inside a Slurm allocation with as many tasks.

A task's server listens on the base port (``DEFAULT_PORT`` or ``EPL_LAUNCH_PORT_RANGE``'s
low end) plus its index on its host, so tasks sharing a host never share a port. Pure: no
TensorFlow.

Example:
  >>> expand_nodelist("node[01-03,07],gpu5")
  ['node01', 'node02', 'node03', 'node07', 'gpu5']
  >>> expand_counts("2(x3),1")
  [2, 2, 2, 1]
"""
import dataclasses
import json
import re
from typing import Optional, Tuple

from epl.errors import PlanError

DEFAULT_PORT = 22220


class SchedulerError(PlanError):
  """The scheduler's variables are malformed or contradict each other."""


@dataclasses.dataclass(frozen=True)
class Placement:
  """This process's place in a job a scheduler started."""
  source: str                  # "Slurm", "Open MPI", "PMI"
  rank: int
  size: int
  local_rank: int              # its index among the tasks on its host
  hosts: Tuple[str, ...]       # host:port of every rank
  job_id: str

  def tf_config(self):
    return json.dumps({"cluster": {"worker": list(self.hosts)},
                       "task": {"type": "worker", "index": self.rank}})

  def describe(self):
    return "%s: task %d of %d (task %d on its host %s), workers %s" % (
        self.source, self.rank, self.size, self.local_rank,
        self.hosts[self.rank].rsplit(":", 1)[0], ",".join(self.hosts))


def expand_nodelist(text):
  """Slurm's compressed host list: ``a[1-3,7],b`` -> a1 a2 a3 a7 b; zero padding kept
  (``n[08-10]``: n08 n09 n10); several bracket groups in one name multiply out."""
  if not text or not text.strip():
    raise SchedulerError("the Slurm node list is empty")
  names, depth, start = [], 0, 0
  for i, c in enumerate(text + ","):
    if c == "[":
      depth += 1
    elif c == "]":
      depth -= 1
      if depth < 0:
        raise SchedulerError("the Slurm node list %r has an unmatched ']'" % text)
    elif c == "," and depth == 0:
      item = text[start:i].strip()
      if item:
        names.extend(_expand_one(item, text))
      start = i + 1
  if depth:
    raise SchedulerError("the Slurm node list %r has an unmatched '['" % text)
  return names


def _expand_one(item, text):
  match = re.search(r"\[([^\]]*)\]", item)
  if not match:
    return [item]
  out = []
  for part in match.group(1).split(","):
    bounds = part.split("-")
    if len(bounds) == 1 and bounds[0].isdigit():
      values = [bounds[0]]
    elif len(bounds) == 2 and all(b.isdigit() for b in bounds) and \
        int(bounds[0]) <= int(bounds[1]):
      width = len(bounds[0])
      values = ["%0*d" % (width, v) for v in range(int(bounds[0]), int(bounds[1]) + 1)]
    else:
      raise SchedulerError("the Slurm node list %r has a range %r that is not N or N-M"
                           % (text, part))
    for v in values:
      out.extend(_expand_one(item[:match.start()] + v + item[match.end():], text))
  return out


def expand_counts(text):
  """Slurm's tasks per node: ``2(x3),1`` -> [2, 2, 2, 1]."""
  out = []
  for part in text.split(","):
    match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
    if not match:
      raise SchedulerError("the Slurm tasks per node %r: %r is not N or N(xK)" % (text, part))
    out += [int(match.group(1))] * int(match.group(2) or 1)
  return out


def _launch(environ):
  """The launch.* Config keys of ``environ`` (epl.config reads every EPL_ variable)."""
  from epl.config import Config              # pylint: disable=import-outside-toplevel
  return Config(environ=environ).launch


def _int(environ, name, low=0):
  text = environ.get(name)
  if text is None:
    return None
  try:
    value = int(text)
  except ValueError:
    raise SchedulerError("%s=%r is not a whole number" % (name, text)) from None
  if value < low:
    raise SchedulerError("%s=%d must be >= %d" % (name, value, low))
  return value


def _first(environ, *names):
  for name in names:
    if environ.get(name):
      return name, environ[name]
  return None, None


def _slurm_nodes(environ, size):
  """(node of every rank, index of every rank on its node) from Slurm's node list and tasks
  per node, tasks in blocks; None without a node list."""
  name, nodelist = _first(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                          "SLURM_NODELIST")
  if nodelist is None:
    return None
  nodes = expand_nodelist(nodelist)
  counts_name, counts_text = _first(environ, "SLURM_STEP_TASKS_PER_NODE",
                                    "SLURM_TASKS_PER_NODE")
  if counts_text is not None:
    counts = expand_counts(counts_text)
  elif size % len(nodes) == 0:
    counts = [size // len(nodes)] * len(nodes)
  else:
    raise SchedulerError("%d tasks on %d nodes (%s) and no SLURM_TASKS_PER_NODE to say how "
                         "many on each" % (size, len(nodes), nodelist))
  if len(counts) != len(nodes) or sum(counts) != size:
    raise SchedulerError("%s=%r (%d nodes) and %s=%r (%d tasks) do not describe the job's %d "
                         "tasks" % (name, nodelist, len(nodes), counts_name, counts_text,
                                    sum(counts), size))
  node_of, local_of = [], []
  for node, count in zip(nodes, counts):
    node_of += [node] * count
    local_of += list(range(count))
  return node_of, local_of, nodes


def _hosts_list(text, size, source):
  hosts = [h.strip() for h in text.split(",") if h.strip()]
  if len(hosts) != size:
    raise SchedulerError("EPL_LAUNCH_MACHINE_LIST names %d host(s) but %s started %d task(s): name "
                         "every rank's host, in rank order" % (len(hosts), source, size))
  return hosts


def _with_ports(names, locals_, base):
  return tuple(n if ":" in n else "%s:%d" % (n, base + local) for n, local in zip(names, locals_))


def tasks(environ):
  """(source, rank, size, local rank or None) of the scheduler that started this process,
  or None; the first of Open MPI, PMI, Slurm present, the others checked against it.

  Raises:
    SchedulerError: a variable that is not a number, a rank outside the job, half a pair,
      two schedulers that disagree.
  """
  found = []
  for source, rank_var, size_var, local_var in (
      ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
      ("PMI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
      ("Slurm", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID")):
    rank = _int(environ, rank_var)
    size = _int(environ, size_var, low=1)
    if source == "Slurm" and size is None:
      size_var, size = "SLURM_NTASKS", _int(environ, "SLURM_NTASKS", low=1)
    if rank is None and size is None:
      continue
    if rank is None or size is None:
      raise SchedulerError("%s: %s is set but %s is not" % (
          source, rank_var if rank is not None else size_var,
          size_var if rank is not None else rank_var))
    if rank >= size:
      raise SchedulerError("%s=%d is not a task of the job: %s=%d (ranks 0-%d); check the "
                           "scheduler's variables" % (rank_var, rank, size_var, size, size - 1))
    found.append((source, rank, size, _int(environ, local_var), rank_var, size_var))
  if not found:
    return None
  source, rank, size, local, rank_var, size_var = found[0]
  for other in found[1:]:
    if (other[1], other[2]) != (rank, size):
      raise SchedulerError(
          "%s says task %d of %d (%s, %s) but %s says task %d of %d (%s, %s): one process "
          "cannot be both; start it with one launcher" % (
              source, rank, size, rank_var, size_var, other[0], other[1], other[2], other[4],
              other[5]))
  return source, rank, size, local


def detect(environ, base_port=DEFAULT_PORT, machine_list=None) -> Optional[Placement]:
  """This process's ``Placement`` from the scheduler's variables (see the module docstring),
  or None when no scheduler started it (or only one task). ``machine_list``: every rank's
  host (epl-launch's ``--machine_list``), else ``EPL_LAUNCH_MACHINE_LIST``.

  Raises:
    SchedulerError: malformed or contradicting variables, a rank outside the job, MPI
      without hosts.
  """
  found = tasks(environ)
  if found is None:
    return None
  source, rank, size, local = found
  if size == 1:
    return None
  listed = machine_list or _launch(environ).machine_list
  slurm = _slurm_nodes(environ, size) if (source == "Slurm" or not listed) else None
  if listed:
    names = _hosts_list(listed, size, source)
    locals_ = [names[:r].count(names[r]) for r in range(size)]
  elif slurm is not None:
    names, locals_, _ = slurm
  else:
    raise SchedulerError(
        "%s started this process as task %d of %d but does not tell it where the other "
        "tasks run: give every rank's host in rank order with epl-launch --machine_list or "
        "EPL_LAUNCH_MACHINE_LIST (e.g. mpirun -x EPL_LAUNCH_MACHINE_LIST=node01,node01,node02,node02 ...)"
        % (source, rank, size))
  if source == "Slurm" and slurm is not None:
    node_id, local_id = _int(environ, "SLURM_NODEID"), local
    nodes = slurm[2]
    if (node_id is not None and nodes.index(names[rank]) != node_id) or \
        (local_id is not None and locals_[rank] != local_id):
      raise SchedulerError(
          "Slurm placed task %d on node %s as its task %s, but in blocks it would be task %d "
          "of %s: run srun with --distribution=block (epl numbers tasks host by host)" % (
              rank, nodes[node_id] if node_id is not None and node_id < len(nodes) else
              node_id, local_id, locals_[rank], names[rank]))
  if local is not None and local != locals_[rank] and source != "Slurm":
    raise SchedulerError("%s says this is task %d on its host, but the hosts given place rank "
                         "%d as task %d there: list the hosts in rank order" % (
                             source, local, rank, locals_[rank]))
  job = environ.get("SLURM_JOB_ID")
  job_id = ("slurm-%s.%s" % (job, environ.get("SLURM_STEP_ID", "0")) if job and
            source == "Slurm" else "")
  return Placement(source, rank, size, locals_[rank], _with_ports(names, locals_, base_port),
                   job_id)


def check_tf_config(environ, workers):
  """Refuses a TF_CONFIG of ``workers`` workers in a process a scheduler started as one of a
  different number of tasks (not through epl-launch): the tasks would train separate models.

  Raises:
    SchedulerError: the two disagree.
  """
  if _launch(environ).worker_index >= 0:
    return                                     # epl-launch's worker: its TF_CONFIG rules
  found = tasks(environ)
  if found is not None and found[2] != workers:
    raise SchedulerError(
        "TF_CONFIG names %d worker(s) but %s started %d task(s): they would train separate "
        "models; unset TF_CONFIG (epl reads %s's variables) or make the two agree" % (
            workers, found[0], found[2], found[0]))


def base_port(environ):
  """The first port of a scheduler's tasks: EPL_LAUNCH_PORT_RANGE's low end, else
  ``DEFAULT_PORT``."""
  text = _launch(environ).port_range
  try:
    return int(text.split("-")[0]) if text else DEFAULT_PORT
  except ValueError:
    raise SchedulerError("EPL_LAUNCH_PORT_RANGE=%r: expected LOW-HIGH" % text) from None
