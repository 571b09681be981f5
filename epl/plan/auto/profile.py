"""The layer profile the planner reads: PipeDream's / DAPPLE's text format, parsed and written.

One line per layer, then one line per edge (edges are indented; PipeDream writes a tab, the
shipped BERT profiles two spaces, AmoebaNet-36 a space and a tab)::

  node4 -- Conv2d_1_1 -- forward_compute_time=3.4, backward_compute_time=6.8, activation_size=384000000.0, parameter_size=6835.0
  node5 -- LSTM(1024, 1024) -- forward_compute_time=3.4, backward_compute_time=6.5, activation_size=[9175040.0; 262144.0], parameter_size=33587200.0 -- stage_id=1
  \tnode4 -- node5

Times are milliseconds for one profiled batch, sizes are bytes; ``activation_size`` is the
layer's output, a ``[a; b]`` list when the layer has several outputs (the planner uses their
sum). The optional ``stage_id`` is PipeDream's partition output. The batch size the profile
was taken at is not in the file: callers pass it separately.

A line holding two `` -- ``-separated tokens is an edge, three or more a node, whatever its
indentation -- the shipped files disagree on indentation, never on that. ``Profile.dump()``
writes PipeDream's layout (tab-indented edges, ``repr`` numbers) and ``parse(dump(p)) == p``
for every profile, the shipped ones included.

Example:
  >>> p = Profile.parse("n1 -- a -- forward_compute_time=1, backward_compute_time=2, "
  ...                   "activation_size=8, parameter_size=4\\n")
  >>> p.nodes[0].compute_ms
  3.0
"""
import dataclasses
import os
import re
from typing import Optional, Tuple

from epl.plan.auto.errors import PlannerError

FIELDS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")


@dataclasses.dataclass(frozen=True)
class Node:
  """One profiled layer.

  ``outputs`` holds the size of each output tensor in bytes (usually one).
  """
  id: str
  name: str
  forward_ms: float
  backward_ms: float
  outputs: Tuple[float, ...]
  parameter_bytes: float
  stage_id: Optional[int] = None

  @property
  def activation_bytes(self):
    return float(sum(self.outputs))

  @property
  def compute_ms(self):
    return self.forward_ms + self.backward_ms

  def to_line(self):
    if len(self.outputs) == 1:
      activation = repr(self.outputs[0])
    else:
      activation = "[%s]" % "; ".join(repr(o) for o in self.outputs)
    line = "%s -- %s -- forward_compute_time=%r, backward_compute_time=%r, " \
           "activation_size=%s, parameter_size=%r" % (
               self.id, self.name, self.forward_ms, self.backward_ms, activation,
               self.parameter_bytes)
    if self.stage_id is not None:
      line += " -- stage_id=%d" % self.stage_id
    return line

  def __str__(self):
    return "%s %s (%.3g ms, %.3g MB out, %.3g MB params)" % (
        self.id, self.name, self.compute_ms, self.activation_bytes / 1e6,
        self.parameter_bytes / 1e6)


@dataclasses.dataclass(frozen=True)
class Profile:
  """A layer graph with per-layer costs: nodes in file order, edges ``(src_id, dst_id)``."""
  nodes: Tuple[Node, ...]
  edges: Tuple[Tuple[str, str], ...]
  source: str = dataclasses.field(default="<profile>", compare=False)

  @classmethod
  def parse(cls, text, source="<profile>"):
    """Parses the PipeDream/DAPPLE profile text.

    Args:
      text: the file's content.
      source: the name used in error messages (a path).
    Returns:
      A ``Profile``.
    Raises:
      PlannerError: a malformed line (named by ``source:line``), a duplicate node, an edge to
        an undeclared node, or a cycle.
    """
    nodes, edges, edge_lines = [], [], []
    for number, raw in enumerate(text.splitlines(), 1):
      line = raw.strip()
      if not line:
        continue
      where = "%s:%d" % (source, number)
      tokens = [t.strip() for t in line.split(" -- ")]
      if len(tokens) == 2:
        edges.append((tokens[0], tokens[1]))
        edge_lines.append(where)
      elif len(tokens) >= 3:
        nodes.append(_parse_node(tokens, where))
      else:
        raise PlannerError(
            "%s: cannot read %r: expected 'nodeN -- name -- forward_compute_time=..., ...' or "
            "an edge 'nodeA -- nodeB'" % (where, _clip(line)))
    profile = cls(tuple(nodes), tuple(edges), source)
    _check(profile, edge_lines)
    return profile

  @classmethod
  def load(cls, path):
    """Reads a profile file (see ``parse``)."""
    try:
      with open(path) as f:
        text = f.read()
    except OSError as e:
      raise PlannerError("cannot read the profile %s: %s" % (path, e.strerror)) from None
    return cls.parse(text, source=str(path))

  def dump(self):
    """Returns the profile as text in PipeDream's layout (``parse`` reads it back equal)."""
    lines = [n.to_line() for n in self.nodes]
    lines += ["\t%s -- %s" % e for e in self.edges]
    return "\n".join(lines) + "\n"

  def node(self, node_id):
    for n in self.nodes:
      if n.id == node_id:
        return n
    raise KeyError(node_id)

  def __str__(self):
    total = sum(n.compute_ms for n in self.nodes)
    params = sum(n.parameter_bytes for n in self.nodes)
    return "Profile %s: %d layers, %d edges, %.1f ms, %.1f MB of parameters" % (
        self.source, len(self.nodes), len(self.edges), total, params / 1e6)


PROFILES_ENV = "EPL_PIPEDREAM_PROFILES"


def published_profiles():
  """Where DAPPLE's published layer profiles (PipeDream's text format) are: the directory
  ``$EPL_PIPEDREAM_PROFILES`` names, else ``../shared/data/pipedream_profiles`` beside the
  checkout epl is imported from. The path may not exist: they are reference data, not part of
  epl (tests and bench/planner.py say so and skip them)."""
  found = os.environ.get(PROFILES_ENV)
  if found:
    return os.path.abspath(found)
  checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__)))))
  return os.path.join(os.path.dirname(checkout), "shared", "data", "pipedream_profiles")


def pbs_from_name(path):
  """The profiled batch size a file name states as ``pbs-N`` (PipeDream's and DAPPLE's naming,
  e.g. ``vgg-19-pbs-32.txt`` -> 32), or ``None``."""
  found = re.search(r"pbs-(\d+)", os.path.basename(str(path)))
  return int(found.group(1)) if found else None


def _clip(text, width=80):
  return text if len(text) <= width else text[:width - 3] + "..."


def _number(text, key, where):
  try:
    return float(text)
  except ValueError:
    raise PlannerError("%s: %s=%r is not a number" % (where, key, _clip(text))) from None


def _parse_node(tokens, where):
  node_id, metadata = tokens[0], tokens[-1]
  stage_id = None
  if metadata.startswith("stage_id="):      # PipeDream's optional 4th field
    stage_text = metadata.split("=", 1)[1]
    if not stage_text.strip().lstrip("-").isdigit():
      raise PlannerError("%s: stage_id=%r is not an integer" % (where, stage_text))
    stage_id = int(stage_text)
    metadata = tokens[-2]
    tokens = tokens[:-1]
    if len(tokens) < 3:
      raise PlannerError("%s: a node line needs 'id -- name -- fields'" % where)
  name = " -- ".join(tokens[1:-1])
  values = {}
  for item in metadata.split(", "):
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or key not in FIELDS:
      raise PlannerError(
          "%s: unexpected field %r in %s; a node line has exactly %s" % (
              where, _clip(item), node_id, ", ".join(k + "=" for k in FIELDS)))
    if key in values:
      raise PlannerError("%s: %s is given twice for %s" % (where, key, node_id))
    values[key] = value.strip()
  missing = [k for k in FIELDS if k not in values]
  if missing:
    raise PlannerError("%s: node %s lacks %s" % (where, node_id, ", ".join(missing)))
  activation = values["activation_size"]
  if activation.startswith("["):
    if not activation.endswith("]"):
      raise PlannerError("%s: activation_size=%r lacks its closing ']'" % (where, activation))
    parts = [p for p in activation[1:-1].split(";") if p.strip()]
    outputs = tuple(_number(p.strip(), "activation_size", where) for p in parts)
  else:
    outputs = (_number(activation, "activation_size", where),)
  node = Node(node_id, name,
              _number(values["forward_compute_time"], "forward_compute_time", where),
              _number(values["backward_compute_time"], "backward_compute_time", where),
              outputs, _number(values["parameter_size"], "parameter_size", where), stage_id)
  for key, value in (("forward_compute_time", node.forward_ms),
                     ("backward_compute_time", node.backward_ms),
                     ("parameter_size", node.parameter_bytes),
                     ("activation_size", min(outputs, default=0.0))):
    if value < 0:
      raise PlannerError("%s: %s=%r of %s is negative" % (where, key, value, node_id))
  return node


def _check(profile, edge_lines):
  """Rejects duplicate ids, dangling edges and cycles, naming the offending line."""
  if not profile.nodes:
    raise PlannerError("%s holds no node lines" % profile.source)
  ids = set()
  for n in profile.nodes:
    if n.id in ids:
      raise PlannerError("%s: node %s is declared twice" % (profile.source, n.id))
    ids.add(n.id)
  for (a, b), where in zip(profile.edges, edge_lines):
    for end in (a, b):
      if end not in ids:
        raise PlannerError("%s: edge %s -- %s names %s, which no node line declares" % (
            where, a, b, end))
    if a == b:
      raise PlannerError("%s: edge %s -- %s is a self-loop" % (where, a, b))
  order = topological_order(profile)
  if len(order) != len(profile.nodes):
    stuck = sorted(ids - set(order))
    raise PlannerError("%s: the edges form a cycle through %s" % (
        profile.source, ", ".join(stuck[:6])))


def topological_order(profile):
  """Node ids in a topological order that keeps file order among ready nodes (Kahn)."""
  import heapq
  position = {n.id: i for i, n in enumerate(profile.nodes)}
  children = {n.id: [] for n in profile.nodes}
  indegree = dict.fromkeys(position, 0)
  for a, b in profile.edges:
    children[a].append(b)
    indegree[b] += 1
  ready = [position[i] for i, d in indegree.items() if d == 0]
  heapq.heapify(ready)
  order = []
  while ready:
    node_id = profile.nodes[heapq.heappop(ready)].id
    order.append(node_id)
    for child in children[node_id]:
      indegree[child] -= 1
      if indegree[child] == 0:
        heapq.heappush(ready, position[child])
  return order
