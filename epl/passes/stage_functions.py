"""Stage functions: each stage's forward and backward built once, run once per micro-batch.

The micro_batch pass's other way (``plan.stage_functions``; graph.micro_batches "functions",
or "auto" on a pipeline): instead of cloning a copy's compute ops per micro-batch, the ops of
each (stage, F/B) become the body of one graph function (a ``FunctionDef`` made from the
user's own NodeDefs, placed as they are) and every action of the schedule is one
``StatefulPartitionedCall`` of it. TF instantiates a function once per device and reuses it
for every call, so the graph and TF's per-op work stay the size of one micro-batch whatever
M is (docs/design/micro_batches_without_clones.md).

What stays outside the bodies: variables and their reads (a call takes the read as an
argument: one read per copy and step), data sources (placeholders and ``get_next``; cloned
per micro-batch as before, few ops), and the forward ops the gradients do not need (metrics,
predictions, summaries: cloned per micro-batch, reading the calls' results). A body's
arguments are the outside tensors it reads; its results are the tensors anything outside it
reads -- another body of the same micro-batch, an update, a metric -- plus the tensors a
run may fetch (its computed float scalars, the loss, and tensors in collections).

Gradient accumulation happens in the backward bodies: a body that computes a dense
gradient takes the running sum and the micro-batch's row weight and returns
``sum + weight * gradient`` (micro-batch 0: ``weight * gradient``); gradient_sync reads the
last call's sum. Sparse gradients are returned per call and concatenated outside, as with
clones.

The user's own ops stay the evaluation path (a run without an update runs copy 0's ops on
the whole fed batch); ops outside the bodies that read a body tensor of micro-batch 0 (a
metric, an update reading a forward value) read the first call's result instead.

Falls back (returns ``why``) when a body would hold what a call cannot: v1 control flow
(a ``tf.cond`` / ``tf.while_loop`` in the step: its gradient's stacks die with a call), an op
that writes a variable, a cycle between calls, a gradient computed outside the backward.
"""
import dataclasses
import functools
import zlib
from typing import Dict, Mapping, Tuple

import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl.passes.clone import Cloner
from epl.passes.replicate import device_function
from epl.passes.stage_bodies import (Body, acyclic, call_node, config_proto, constants, cut,
                                    executor_type, soft_wait, unread_whole)
from epl.passes.stage_seeds import seed_source


@dataclasses.dataclass(frozen=True)
class StageCalls:
  """What the pass built: the call of every (copy, stage, action), the tensors each
  (copy, micro-batch) exports by the user's tensor name, the accumulated dense gradients
  per (copy, the user's gradient tensor name), the bodies' op names by (stage, kind), the
  per-micro-batch clones of the ops outside the bodies (m >= 1)."""
  calls: Mapping[Tuple[int, int, str], tf.Operation]
  exported: Mapping[Tuple[int, int], Dict[str, tf.Tensor]]
  sums: Mapping[Tuple[int, str], tf.Tensor]
  bodies: Mapping[Tuple[int, str], Tuple[str, ...]]
  outside: Mapping[Tuple[int, int], Dict[str, tf.Operation]]
  idle: Tuple[str, ...] = ()        # backward ops no gradient needs: not run per micro-batch

  def __str__(self):
    return "StageCalls(%d bodies, %d calls)" % (len(self.bodies), len(self.calls))

  @functools.cached_property
  def body_ops(self):
    """The user's ops a training run runs only inside calls (or not at all: ``idle``)."""
    return frozenset(n for names in self.bodies.values() for n in names) | set(self.idle)


def _gradients(ctx, member):
  """(every tensor of the plan's gradients, the dense ones) or a reason (str): a dense
  gradient is summed in the backward body that computes it."""
  get = ctx.graph.get_tensor_by_name
  parts, dense = set(), set()
  for g in ctx.plan.gradients:
    tensors = [get(n) for n in g.tensors if n]
    parts.update(tensors)
    if len(g.tensors) != 3:
      if member.get(tensors[0].op, (None, None))[1] != "B":
        return "the gradient of %r is not computed by the backward ops (%s)" % (
            g.variable, tensors[0].op.name)
      dense.add(tensors[0])
  return parts, dense


def _exports(ctx, member, idle, parts, dense):
  """(the body tensors a call returns, {body: bodies it reads}): what anything outside its
  body reads -- another body, an update (not a dense gradient: summed), a metric -- and what
  a run may fetch (computed float scalars of the forward, tensors in collections)."""
  graph = ctx.graph
  update = {op for op, phase in ctx.phase.items() if phase == "apply"}
  fetchable = {t for key in graph.get_all_collection_keys()
               for t in graph.get_collection(key) if isinstance(t, tf.Tensor)}
  exported, reads = set(), {k: set() for k in set(member.values())}
  shared = constants(member)
  for op, key in member.items():
    for t in op.outputs:
      if t in fetchable or (t in parts and t not in dense) or (
          t.dtype.is_floating and t.shape.ndims == 0 and op.type != "Const" and key[1] == "F"):
        exported.add(t)
      for consumer in t.consumers():
        other = member.get(consumer)
        if other == key:
          continue
        if other is not None:
          if op in shared:
            continue                          # the reading body holds its own copy
          reads[other].add(key)
          exported.add(t)
        elif consumer not in idle and not (t in parts and consumer in update):
          exported.add(t)
    for x in op.control_inputs:
      if x in member and member[x] != key and not soft_wait(op, x):
        reads[key].add(member[x])
  return exported, reads


@dataclasses.dataclass(frozen=True)
class Survey:
  """What ``survey`` found: the body ops by (stage, kind), the ops outside, the gradients
  (every part, the dense ones), the tensors the calls return."""
  member: Mapping[tf.Operation, Tuple[int, str]]
  pre: list
  post: list
  idle: frozenset
  grads: tuple
  exported: frozenset


def survey(ctx, compute, needed, added=None):
  """A ``Survey`` of this step as stage functions (nothing built), or the reason (a str) why
  it cannot run as them. ``added``: see ``stage_bodies.cut``."""
  found = cut(ctx, compute, needed, added)
  if isinstance(found, str):
    return found
  member, pre, post, idle = found
  if not member:
    return "the step has no forward/backward ops to run"
  if ctx.result("replicate").source_splits:
    return ("an input pipeline's batch is cut across the devices of a stage with "
            "device_count > 1 (feed it through placeholders)")
  why = _one_process(ctx, member)
  if why:
    return why
  grads = _gradients(ctx, member)
  if isinstance(grads, str):
    return grads
  idle = frozenset(idle)
  exported, reads = _exports(ctx, member, idle, *grads)
  if not acyclic(reads):
    return "the stages' forward/backward ops read each other in a cycle"
  return Survey(member, pre, post, idle, grads, frozenset(exported))


def _one_process(ctx, member):
  """Why a body cannot hold its ops (None: it can): a body runs in one process -- TF's
  function call has no rendezvous across processes -- and a TF collective in a body would
  repeat its instance key in every call of a step (docs/design/tp_stage_functions.md)."""
  tasks = {}
  for op, (stage, _) in member.items():
    if op.type.startswith("Collective"):
      return "op %r of stage %s is a TF collective (%s)" % (
          op.name, ctx.plan.taskgraphs[stage].name, op.type)
    spec = tf.DeviceSpec.from_string(op.device or "")
    tasks.setdefault(stage, set()).add((spec.job, spec.replica, spec.task))
  spread = [s for s, found in tasks.items() if len(found) > 1]
  if spread:
    return "stage %s's ops are on several workers (a split stage's parts across workers)" % (
        ctx.plan.taskgraphs[spread[0]].name)
  return None


def build(ctx, found):
  """Builds the bodies and calls of every local copy from a ``Survey``; returns
  ``StageCalls``."""
  graph, worker = ctx.graph, ctx.worker
  member, pre, post, idle = found.member, found.pre, found.post, set(found.idle)
  grads, exported = found.grads, found.exported
  weights = ctx.result("replicate").row_weights
  pieces = None
  if weights is not None:
    with graph.as_default(), tf.name_scope(None), tf.control_dependencies(None), \
        tf.device(weights.device):
      pieces = tf.unstack(weights, name="epl_stage_weights")
  ops_of = {}
  for op, key in member.items():
    ops_of.setdefault(key, []).append(op)
  shared = constants(member)
  bodies = {key: Body(key, ops, exported, grads[1],
                      pieces[0].dtype.base_dtype if pieces else None, shared)
            for key, ops in ops_of.items()}
  # every copy's clones read the NodeDefs before any copy's outside ops are rewired to calls
  copies = [_Copy(ctx, c, bodies, member, pre, post, pieces, idle)
            for c in range(worker.num_copies)]
  base, config = graph.unique_name("epl_stage", mark_as_used=True), config_proto()
  calls, exports, sums, outside = {}, {}, {}, {}
  for copy in copies:
    copy.build("%s_c%d" % (base, copy.c), config)
    calls.update(copy.calls)
    for m in range(ctx.plan.num_micro_batch):
      exports[(copy.c, m)] = copy.exports[m]
      if m:
        outside[(copy.c, m)] = dict(copy.pre_clones[m], **copy.post_clones[m])
    sums.update({(copy.c, name): t for name, t in copy.sums.items()})
  return StageCalls(calls, exports, sums,
                    {k: tuple(op.name for op in ops) for k, ops in ops_of.items()}, outside,
                    tuple(op.name for op in idle
                          if ctx.phase.get(op) != "forward" or unread_whole(ctx, op)))


class _Copy:
  """Copy ``c``'s functions and calls, and its per-micro-batch clones of the ops outside."""

  def __init__(self, ctx, c, bodies, member, pre, post, pieces, idle):
    self.ctx, self.c, self.bodies, self.member, self.pieces = ctx, c, bodies, member, pieces
    self.count = ctx.plan.num_micro_batch
    self.clones = ctx.clones()
    self.idle = {self.own_op(op) for op in idle}
    self.device_fn = device_function(ctx, c)
    self.pre_set = set(pre)
    self.per_micro = {self.own_op(op) for op in list(pre) + list(post)}
    self.cloners = [Cloner(ctx.graph, ops, self.device_fn, ctx.nodes) if ops else None
                    for ops in (pre, post)]
    self.pre_clones = [{} for _ in range(self.count)]
    self.post_clones = [{} for _ in range(self.count)]
    self.calls, self.exports, self.sums = {}, [{} for _ in range(self.count)], {}

  def own(self, t):
    """This copy's version of an outside tensor of the user's graph."""
    x = t if self.c == 0 else self.clones.tensor(self.c, t)
    return t if x is None else x

  def own_op(self, op):
    x = op if self.c == 0 else self.clones.op(self.c, op)
    return op if x is None else x

  def build(self, base, config):
    """Imports this copy's functions, calls and per-micro-batch clones in one C++ import
    (each import costs a pass over the whole graph: one per micro-batch was most of the
    rewrite at M = 64)."""
    graph_def, names, waits = self._graph_def(base, config)
    with self.ctx.graph.as_default(), tf.name_scope(None), tf.control_dependencies(None), \
        tf.device(None):
      made = dict(zip(names, compat.import_nodes(self.ctx.graph, graph_def, self._input_map,
                                                 names, base)))
    for name, ops in waits.items():
      compat.add_control_inputs(made[name], list(dict.fromkeys(ops)))
    calls = {}
    for (s, kind, m), name in self._call_names.items():
      call, body = made[name], self.bodies[(s, kind)]
      calls[(s, kind, m)] = call
      self.calls[(self.c, s, "%s%d" % (kind, m))] = call
      for out, t in zip(call.outputs, body.results + body.grads):
        out.set_shape(t.shape)
      self.exports[m].update((t.name, call.outputs[i]) for i, t in enumerate(body.results))
      if m == self.count - 1:
        self.sums.update((g.name, call.outputs[len(body.results) + i])
                         for i, g in enumerate(body.grads))
    for which, cloner in zip((self.pre_clones, self.post_clones), self.cloners):
      for m in range(1, self.count if cloner is not None else 1):
        which[m] = {n: made["mb%d/%s" % (m, n)] for n in cloner.names}
    self._rewire_outside(calls)

  def _ref(self, t, m):
    """How micro-batch ``m``'s value of the user's tensor ``t`` is named in the import: a
    call's result, a clone in the import, or an input-map key for an outside tensor."""
    producer = self.member.get(t.op)
    if producer is not None:
      return "s%d_%s%d:%d" % (producer[0], producer[1], m,
                              self.bodies[producer].result_index[t.name])
    if m and t.op in self.pre_set:
      return "mb%d/%s:%d" % (m, t.op.name, t.value_index)
    return self._external(self.own(t))

  def _control(self, x, m, name, waits):
    """A wait of import node ``name`` on the user's op ``x`` in micro-batch ``m``: an input
    ("^...") within the import, or None (added after the import: ``waits``)."""
    producer = self.member.get(x)
    if producer is not None:
      return "^s%d_%s%d" % (producer[0], producer[1], m)
    if m and x in self.pre_set:
      return "^mb%d/%s" % (m, x.name)
    waits.setdefault(name, []).append(self.own_op(x))
    return None

  def _graph_def(self, base, config):
    """The GraphDef to import: this copy's FunctionDefs, one call per action chained in the
    schedule's order, and micro-batches 1..M-1's clones of the sources and of the forward ops
    the gradients do not need. Returns (it, the names to import, {node name: outside ops it
    waits for})."""
    graph_def = tf.GraphDef()
    graph_def.versions.CopyFrom(self.ctx.graph.graph_def_versions)
    prefix = "" if self.c == 0 else "EPL_REPLICA_%d" % self.c
    fnames, executors = {}, {}
    for (s, kind), body in sorted(self.bodies.items()):
      for first in (True, False) if kind == "B" and body.grads else (True,):
        fnames[(s, kind, first)] = "%s_s%d_%s%s" % (base, s, kind, "" if first else "_more")
        fdef = graph_def.library.function.add()
        fdef.CopyFrom(body.function_def(
            fnames[(s, kind, first)], self.ctx.nodes, self.device_fn, prefix, first))
        executors[fnames[(s, kind, first)]] = executor_type(
            fdef, self.ctx.worker.device_of(self.c, s))
    self._input_map, self._ext, self._call_names, self._seed_nodes = {}, {}, {}, set()
    waits, names = {}, []
    for cloner in self.cloners:
      for m in range(1, self.count if cloner is not None else 1):
        names.extend(cloner.nodes_into(
            graph_def, "mb%d" % m, "EPL_MB_%d_R_%d" % (m, self.c),
            lambda x, name, m=m: self._ref(x, m) if isinstance(x, tf.Tensor) else
            self._control(x, m, name, waits)))
    for s, actions in enumerate(self.ctx.plan.schedule):
      previous = None
      for action in actions:
        kind, m = action[0], int(action[1:])
        body = self.bodies.get((s, kind))
        if body is None:
          continue
        self._call_names[(s, kind, m)] = name = "s%d_%s" % (s, action)
        first = m == 0 or (s, kind, False) not in fnames
        inputs = [self._ref(t, m) for t in body.args]
        if not first:
          inputs.extend("s%d_B%d:%d" % (s, m - 1, len(body.results) + i)
                        for i in range(len(body.grads)))
        if body.grads and body.weighted:
          inputs.append(self._external(self.pieces[self.c * self.count + m]))
        if body.random:
          inputs.append("%s:%d" % (self._seeds(graph_def, s, kind, base, names), m))
        controls = [c for c in (self._control(x, m, name, waits) for x in body.controls) if c]
        call_node(graph_def, name, fnames[(s, kind, first)], self.ctx.worker.device_of(self.c, s),
                  inputs + controls + (["^" + previous] if previous else []),
                  body.in_types(first), body.out_types(), config,
                  executors[fnames[(s, kind, first)]])
        names.append(name)
        previous = name
    return graph_def, names, waits

  def _seeds(self, graph_def, s, kind, base, names):
    """The node whose output m seeds (s, kind)'s call of micro-batch m (made at first use):
    one stateful draw per step on the host, seeded as the user's first random op of the body
    (and the body's name), so a seeded graph draws the same masks in every run."""
    name = "seeds_s%d_%s" % (s, kind)
    if name not in self._seed_nodes:
      first = self.ctx.graph.get_operation_by_name(self.bodies[(s, kind)].random[0])
      seed, seed2 = first.get_attr("seed"), first.get_attr("seed2")
      seeds = (seed or seed2, zlib.crc32(("%s/%s" % (base, name)).encode()) & 0x7fffffff) \
          if seed or seed2 else (0, 0)
      names.extend(seed_source(graph_def, name, self.count, self.ctx.worker.host, seeds))
      self._seed_nodes.add(name)
    return name

  def _external(self, t):
    if t not in self._ext:
      self._ext[t] = "epl_ext_%d:0" % len(self._ext)
      self._input_map[self._ext[t]] = t
    return self._ext[t]

  def _rewire_outside(self, calls):
    """This copy's own ops outside the bodies (micro-batch 0's metrics, an update reading a
    forward value) read the first calls' results; what waited for a body op waits for its
    calls. A dense gradient's updates are left to gradient_sync (it reads the sums)."""
    plan, ctx = self.ctx.plan, self.ctx
    update = {self.own_op(op) for op, phase in ctx.phase.items() if phase == "apply"}
    parts = {self.own(ctx.graph.get_tensor_by_name(n)) for g in plan.gradients
             for n in g.tensors if n}
    # (ops the rewrite added to the user's bodies -- recomputation -- have no copy's own)
    here = {self.own_op(op): key for op, key in self.member.items()
            if self.c == 0 or self.clones.op(self.c, op) is not None}
    made = set(calls.values())
    for op in self.member:
      if self.own_op(op) not in here:
        continue
      for t in self.own_op(op).outputs:
        for consumer in list(t.consumers()):
          if consumer in here or consumer in made or consumer in self.idle or (
              t in parts and consumer in update):
            continue
          new = self.exports[0][op.outputs[t.value_index].name]
          for i, x in enumerate(consumer.inputs):
            if x is t:
              compat.update_input(consumer, i, new)
    for op, key in here.items():
      for waiter in list(compat.control_outputs(op)):
        if waiter not in here:
          # micro-batch 0's own sources and metrics wait for its call only
          first = waiter in self.per_micro
          compat.replace_control_inputs(waiter, {op: None})
          compat.add_control_inputs(waiter, [call for k, call in calls.items()
                                             if k[:2] == key and (k[2] == 0 or not first)])
