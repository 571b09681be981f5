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
from typing import Dict, Mapping, Optional, Tuple

import tensorflow.compat.v1 as tf
from tensorflow.core.framework import attr_value_pb2, function_pb2, node_def_pb2

from epl import _tf_compat as compat
from epl.op_tables import (DATA_SOURCE_OPS, PLACEHOLDER_OPS, READ_OPS, VARIABLE_OPS,
                           mutates)
from epl.passes.clone import Cloner, _prefix_free, _rename_for_clone
from epl.passes.replicate import device_function

CALL_ATTR = "_epl_stage_call"
_STACK_OPS = ("Stack", "TensorArray")
_FLOW_OPS = frozenset({"Enter", "RefEnter", "Exit", "RefExit", "Switch", "RefSwitch", "Merge",
                       "RefMerge", "NextIteration", "RefNextIteration", "LoopCond"})


@dataclasses.dataclass(frozen=True)
class StageCalls:
  """What the pass built: the calls of every (copy, stage, action), the tensors each
  (copy, micro-batch) exports by the user's tensor name, the accumulated dense gradients
  per (copy, gradient tensor name), the bodies' op names by (stage, kind)."""
  calls: Mapping[Tuple[int, int, str], tf.Operation]
  exported: Mapping[Tuple[int, int], Dict[str, tf.Tensor]]
  sums: Mapping[Tuple[int, str], tf.Tensor]
  bodies: Mapping[Tuple[int, str], Tuple[str, ...]]
  outside: Mapping[Tuple[int, int], Dict[str, tf.Operation]]   # per-micro-batch clones (m>=1)

  def __str__(self):
    return "StageCalls(%d bodies, %d calls)" % (len(self.bodies), len(self.calls))

  @functools.cached_property
  def body_ops(self):
    return frozenset(n for names in self.bodies.values() for n in names)


def _is_read(op):
  return op.type in READ_OPS and op.inputs and op.inputs[0].op.type in VARIABLE_OPS


def _is_source(op, sources):
  return op.type in PLACEHOLDER_OPS or op.type in DATA_SOURCE_OPS or op in sources


def _writes_variable(op):
  return mutates(op) and any(t.op.type in VARIABLE_OPS or t.dtype._is_ref_dtype  # pylint: disable=protected-access
                             for t in op.inputs)


def cut(ctx, compute, needed):
  """({op: (stage, kind)} of the body ops, [pre ops], [post ops]) or a reason (str) why
  stage functions cannot hold this step. ``compute``: a copy's compute ops (originals);
  ``needed``: those the gradients depend on."""
  sources = set(ctx.result("analyze").sources)
  body, pre, post = {}, [], []
  for op in compute:
    if op not in needed:
      post.append(op)
      continue
    if _is_read(op):
      continue
    if _is_source(op, sources):
      pre.append(op)
      continue
    if compat.in_control_flow(op) or op.type in _FLOW_OPS:
      return "op %r (%s) is inside a v1 tf.cond / tf.while_loop of the step" % (op.name, op.type)
    if op.type.startswith(_STACK_OPS):
      return "op %r (%s) keeps per-step state a call cannot hand on" % (op.name, op.type)
    if _writes_variable(op):
      return "op %r (%s) writes a variable in the forward/backward" % (op.name, op.type)
    kind = "F" if ctx.phase.get(op) == "forward" else "B"
    body[op] = (ctx.owner[op], kind)
  return body, pre, post


def _output_refs(op):
  """The FunctionDef names of ``op``'s outputs ("op:arg:k"), by output index."""
  names = []
  for arg in op.op_def.output_arg:
    if arg.number_attr:
      n = op.get_attr(arg.number_attr)
    elif arg.type_list_attr:
      n = len(op.get_attr(arg.type_list_attr))
    else:
      n = 1
    names.extend("%s:%s:%d" % (op.name, arg.name, k) for k in range(n))
  return names


def _input(name):
  if name.startswith("^"):
    return name[1:], None
  op_name, _, index = name.partition(":")
  return op_name, int(index) if index else 0


class Body:
  """One (stage, kind)'s ops as a FunctionDef for one copy: its arguments (outside tensors,
  then the running sums and the row weight), its results (exported tensors, then sums)."""

  def __init__(self, key, ops, members, exported, grads, weighted):
    self.key, self.ops = key, ops
    self.members = members                        # every body's ops: {op: key}
    names = {op.name for op in ops}
    self.args, self.controls = [], []              # outside tensors read; outside ops waited
    seen = set()
    for op in ops:
      for t in op.inputs:
        if t.op.name not in names and t not in seen:
          seen.add(t)
          self.args.append(t)
      for x in op.control_inputs:
        if x.name not in names and x not in self.controls:
          self.controls.append(x)
    self.results = [t for op in ops for t in op.outputs if t in exported]
    self.grads = [t for op in ops for t in op.outputs if t in grads]     # summed in the body
    self.weighted = weighted                       # the row weight's dtype, or None

  def function_def(self, name, nodes, device_fn, prefix, first):
    """The FunctionDef ``name`` of this body for a copy (``device_fn``, seeds of
    ``prefix``); ``first``: micro-batch 0's variant (no running sums in)."""
    fdef = function_pb2.FunctionDef()
    fdef.signature.name = name
    fdef.attr["_noinline"].b = True
    ref = {}
    for i, t in enumerate(self.args):
      arg = fdef.signature.input_arg.add(name="a%d" % i, type=t.dtype.base_dtype.as_datatype_enum)
      del arg
      ref[t.name] = "a%d" % i
    sums_in = []
    if not first:
      for i, g in enumerate(self.grads):
        fdef.signature.input_arg.add(name="s%d" % i, type=g.dtype.base_dtype.as_datatype_enum)
        sums_in.append("s%d" % i)
    if self.grads and self.weighted:
      fdef.signature.input_arg.add(name="w", type=self.weighted.as_datatype_enum)
    outs = {}
    names = {op.name for op in self.ops}
    for op in self.ops:
      outs.update(zip((t.name for t in op.outputs), _output_refs(op)))
    for op in self.ops:
      node = fdef.node_def.add()
      node.CopyFrom(nodes.get(op.name))
      node.device = device_fn(op) or ""
      if "_class" in node.attr:
        del node.attr["_class"]
      own = _prefix_free(node)
      if own and prefix:
        own.pop("frame_name", None)
        own.pop("shared_name", None)
        _rename_for_clone(node, own, prefix)
      inputs = list(node.input)
      del node.input[:]
      for text in inputs:
        src, index = _input(text)
        if index is None:
          if src in names:
            node.input.append(text)
          continue
        key = "%s:%d" % (src, index)
        node.input.append(outs[key] if src in names else ref[key])
      if op.op_def.is_stateful:
        fdef.signature.is_stateful = True
    for i, t in enumerate(self.results):
      fdef.signature.output_arg.add(name="r%d" % i, type=t.dtype.base_dtype.as_datatype_enum)
      fdef.ret["r%d" % i] = outs[t.name]
    for i, g in enumerate(self.grads):
      value = outs[g.name]
      dtype = g.dtype.base_dtype.as_datatype_enum
      if self.weighted:
        w = "w"
        if g.dtype.base_dtype != self.weighted:
          _node(fdef, "epl_w%d" % i, "Cast", ["w"], SrcT=self.weighted.as_datatype_enum,
                DstT=dtype, Truncate=False)
          w = "epl_w%d:y:0" % i
        _node(fdef, "epl_weighted%d" % i, "Mul", [value, w], T=dtype)
        value = "epl_weighted%d:z:0" % i
      if not first:
        _node(fdef, "epl_sum%d" % i, "AddV2", [sums_in[i], value], T=dtype)
        value = "epl_sum%d:z:0" % i
      fdef.signature.output_arg.add(name="g%d" % i, type=dtype)
      fdef.ret["g%d" % i] = value
    return fdef


def _node(fdef, name, op, inputs, **attrs):
  node = fdef.node_def.add(name=name, op=op)
  node.input.extend(inputs)
  for key, value in attrs.items():
    if isinstance(value, bool):
      node.attr[key].b = value
    else:
      node.attr[key].type = value
  return node


def _call_node(graph_def, name, fname, device, inputs, in_types, out_types, config):
  node = graph_def.node.add(name=name, op="StatefulPartitionedCall", device=device)
  node.input.extend(inputs)
  node.attr["f"].func.name = fname
  node.attr["Tin"].list.type.extend(in_types)
  node.attr["Tout"].list.type.extend(out_types)
  node.attr["config"].s = b""
  node.attr["config_proto"].s = config
  node.attr["executor_type"].s = b""
  node.attr[CALL_ATTR].b = True
  return node


def _config_proto():
  """A call's own session options: Grappler off inside bodies (epl's sessions run without
  it on such graphs; a body would otherwise be rewritten on its first call)."""
  config = tf.ConfigProto()
  config.graph_options.rewrite_options.disable_meta_optimizer = True
  return config.SerializeToString()


def _ordered_bodies(keys, reads):
  """The bodies in an order where each comes after those it reads (None on a cycle)."""
  order, state = [], {}

  def visit(k):
    if state.get(k) == 2:
      return True
    if state.get(k) == 1:
      return False
    state[k] = 1
    for d in reads[k]:
      if not visit(d):
        return False
    state[k] = 2
    order.append(k)
    return True
  for k in sorted(keys):
    if not visit(k):
      return None
  return order


def build(ctx, compute, needed):
  """Builds the bodies and calls of every local copy; returns ``StageCalls``, or the reason
  (a str) why this step cannot run as stage functions (nothing built then)."""
  graph, plan, worker = ctx.graph, ctx.plan, ctx.worker
  clones = ctx.clones()
  found = cut(ctx, compute, needed)
  if isinstance(found, str):
    return found
  member, pre, post = found
  if not member:
    return "the step has no forward/backward ops to run"
  count = plan.num_micro_batch
  get = graph.get_tensor_by_name
  gradient_parts, dense = set(), set()
  for g in plan.gradients:
    parts = [get(n) for n in g.tensors if n]
    gradient_parts.update(parts)
    if len(g.tensors) != 3:
      if parts[0].op not in member or member[parts[0].op][1] != "B":
        return "the gradient of %r is not computed by the backward ops (%s)" % (
            g.variable, parts[0].op.name)
      dense.add(parts[0])
  update = {op for op, phase in ctx.phase.items() if phase == "apply"}
  fetchable = {t for key in graph.get_all_collection_keys()
               for t in graph.get_collection(key) if isinstance(t, tf.Tensor)}
  exported, reads = set(), {k: set() for k in set(member.values())}
  for op, key in member.items():
    for t in op.outputs:
      if t in fetchable or (t in gradient_parts and t not in dense) or (
          t.dtype.is_floating and t.shape.ndims == 0 and op.type != "Const" and key[1] == "F"):
        exported.add(t)
      for consumer in t.consumers():
        other = member.get(consumer)
        if other == key:
          continue
        if other is not None:
          reads[other].add(key)
          exported.add(t)
        elif not (t in gradient_parts and consumer in update):
          exported.add(t)
    for x in op.control_inputs:
      if x in member and member[x] != key:
        reads[key].add(member[x])
  if _ordered_bodies(reads, reads) is None:
    return "the stages' forward/backward ops read each other in a cycle"
  weights = ctx.result("replicate").row_weights
  pieces = None
  if weights is not None:
    with graph.as_default(), tf.name_scope(None), tf.control_dependencies(None), \
        tf.device(weights.device):
      pieces = tf.unstack(weights, name="epl_stage_weights")
  ops_of = {}
  for op, key in member.items():
    ops_of.setdefault(key, []).append(op)
  bodies = {key: Body(key, ops, member, exported, dense,
                      pieces[0].dtype.base_dtype if pieces else None)
            for key, ops in ops_of.items()}
  pre_set = set(pre)
  config = _config_proto()
  base = graph.unique_name("epl_stage", mark_as_used=True)
  calls, exports, sums, outside = {}, {}, {}, {}
  # the clones' NodeDefs are read before any copy's outside ops are rewired to calls
  cloners = [(Cloner(graph, pre, device_function(ctx, c), ctx.nodes) if pre else None,
              Cloner(graph, post, device_function(ctx, c), ctx.nodes) if post else None)
             for c in range(worker.num_copies)]
  for c in range(worker.num_copies):
    built = _build_copy(ctx, c, clones, bodies, member, cloners[c], pre_set, count, pieces,
                        config, "%s_c%d" % (base, c))
    calls.update(built[0])
    for m in range(count):
      exports[(c, m)] = built[1][m]
      if m:
        outside[(c, m)] = built[3][m]
    sums.update({(c, name): t for name, t in built[2].items()})
  return StageCalls(calls, exports, sums,
                    {k: tuple(op.name for op in ops) for k, ops in ops_of.items()}, outside)


def _build_copy(ctx, c, clones, bodies, member, cloners, pre_set, count, pieces, config,
                base):
  """Copy ``c``'s functions and calls, its per-micro-batch source and post clones; returns
  ({(c, s, action): call}, [{tensor name: export}] per m, {gradient name: sum},
  [{op name: outside clone}] per m)."""
  graph, plan, worker = ctx.graph, ctx.plan, ctx.worker
  device_fn = device_function(ctx, c)

  def own(t):
    if c == 0:
      return t
    x = clones.tensor(c, t)
    return t if x is None else x

  def own_op(op):
    if c == 0:
      return op
    x = clones.op(c, op)
    return op if x is None else x

  pre_clones = [{} for _ in range(count)]
  if cloners[0] is not None:
    cloner = cloners[0]
    for m in range(1, count):
      pre_clones[m] = cloner.clone("EPL_MB_%d_R_%d" % (m, c),
                                   {t: own(t) for t in cloner.imports.values()})

  def outside_tensor(t, m):
    if m and t.op in pre_set:
      return pre_clones[m][t.op.name].outputs[t.value_index]
    return own(t)

  def outside_op(op, m):
    if m and op in pre_set:
      return pre_clones[m][op.name]
    return own_op(op)

  graph_def = tf.GraphDef()
  graph_def.versions.CopyFrom(graph.graph_def_versions)
  prefix = "" if c == 0 else "EPL_REPLICA_%d" % c
  fnames = {}
  for (s, kind), body in sorted(bodies.items()):
    variants = (True, False) if kind == "B" and body.grads and count > 1 else (True,)
    for first in variants:
      name = "%s_s%d_%s%s" % (base, s, kind, "" if first else "_more")
      graph_def.library.function.add().CopyFrom(
          body.function_def(name, ctx.nodes, device_fn, prefix, first))
      fnames[(s, kind, first)] = name
  ext, input_map = {}, {}

  def external(t):
    if t not in ext:
      ext[t] = "epl_ext_%d:0" % len(ext)
      input_map[ext[t]] = t
    return ext[t]

  call_names, waits = {}, {}
  for s, actions in enumerate(plan.schedule):
    previous = None
    for action in actions:
      kind, m = action[0], int(action[1:])
      body = bodies.get((s, kind))
      if body is None:
        continue
      name = "s%d_%s" % (s, action)
      call_names[(s, kind, m)] = name
      first = m == 0 or len([1 for f in fnames if f[:2] == (s, kind)]) == 1
      inputs, types = [], []
      for t in body.args:
        producer = member.get(t.op)
        if producer is not None:
          index = bodies[producer].results.index(t)
          inputs.append("s%d_%s%d:%d" % (producer[0], producer[1], m, index))
        else:
          inputs.append(external(outside_tensor(t, m)))
        types.append(t.dtype.base_dtype.as_datatype_enum)
      if not first:
        for i, g in enumerate(body.grads):
          inputs.append("s%d_B%d:%d" % (s, m - 1, len(body.results) + i))
          types.append(g.dtype.base_dtype.as_datatype_enum)
      if body.grads and body.weighted:
        inputs.append(external(pieces[c * count + m]))
        types.append(body.weighted.as_datatype_enum)
      controls = []
      for x in body.controls:
        producer = member.get(x)
        if producer is not None:
          controls.append("^s%d_%s%d" % (producer[0], producer[1], m))
        else:
          waits.setdefault(name, []).append(outside_op(x, m))
      if previous is not None:
        controls.append("^" + previous)
      out_types = [t.dtype.base_dtype.as_datatype_enum for t in body.results] + \
          [g.dtype.base_dtype.as_datatype_enum for g in body.grads]
      _call_node(graph_def, name, fnames[(s, kind, first)], worker.device_of(c, s),
                 inputs + controls, types, out_types, config)
      previous = name
  names = list(call_names.values())
  with graph.as_default(), tf.name_scope(None), tf.control_dependencies(None), \
      tf.device(None):
    made = dict(zip(names, compat.import_nodes(graph, graph_def, input_map, names, base)))
  for name, ops in waits.items():
    compat.add_control_inputs(made[name], list(dict.fromkeys(ops)))
  calls, exports, sums = {}, [{} for _ in range(count)], {}
  for (s, kind, m), name in call_names.items():
    call, body = made[name], bodies[(s, kind)]
    calls[(c, s, "%s%d" % (kind, m))] = call
    for i, t in enumerate(body.results):
      exports[m][t.name] = call.outputs[i]
    if m == count - 1:
      for i, g in enumerate(body.grads):
        sums[g.name] = call.outputs[len(body.results) + i]
  body_here = {own_op(op): key for op, key in member.items()}
  calls_of = {}
  for (cc, s, action), call in calls.items():
    calls_of.setdefault((s, action[0]), []).append(call)
  # outside ops of micro-batch 0 (this copy's own) read the first calls' results
  update = {own_op(op) for op, phase in ctx.phase.items() if phase == "apply"}
  gradient_parts = {own(graph.get_tensor_by_name(n)) for g in plan.gradients
                    for n in g.tensors if n}
  for op, key in member.items():
    for t in own_op(op).outputs:
      for consumer in list(t.consumers()):
        if consumer in body_here or consumer in made.values() or (
            t in gradient_parts and consumer in update):
          continue
        replacement = exports[0][op.outputs[t.value_index].name]
        for i, x in enumerate(consumer.inputs):
          if x is t:
            compat.update_input(consumer, i, replacement)
  # outside ops that waited for a body op wait for its calls
  for op in list(body_here):
    for waiter in list(compat.control_outputs(op)):
      if waiter in body_here:
        continue
      compat.replace_control_inputs(waiter, {op: None})
      compat.add_control_inputs(waiter, calls_of.get(body_here[op], []))
  post_clones = [{} for _ in range(count)]
  if cloners[1] is not None:
    cloner = cloners[1]
    for m in range(1, count):
      mapping = {}
      for t in cloner.imports.values():
        mapping[t] = exports[m][t.name] if t.op in member else outside_tensor(t, m)
      post_clones[m] = cloner.clone("EPL_MB_%d_R_%d" % (m, c), mapping)
      for clone in post_clones[m].values():
        stale = [x for x in clone.control_inputs if x in member or x in body_here]
        if stale:
          compat.replace_control_inputs(clone, {x: None for x in stale})
          mine = [made[call_names[(member.get(x) or body_here[x])[0],
                                  (member.get(x) or body_here[x])[1], m]] for x in stale]
          compat.add_control_inputs(clone, mine)
  outside = [dict(pre_clones[m], **post_clones[m]) for m in range(count)]
  return calls, exports, sums, outside
