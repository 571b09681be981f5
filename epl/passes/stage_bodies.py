"""Stage functions' bodies (passes/stage_functions.py): which ops of a copy's step go into
which (stage, F/B) body, and each body as a FunctionDef made from the user's NodeDefs.

``cut`` says what stays outside: variables and their reads (handed to a call as arguments),
data sources (``pre``: cloned per micro-batch), forward ops the gradients do not need
(``post``: metrics, cloned per micro-batch, reading the calls' results); or why the step
cannot run as calls (a reason, the caller falls back to clones).
"""
import tensorflow.compat.v1 as tf
from tensorflow.core.framework import function_pb2

from epl import _tf_compat as compat
from epl.op_tables import (DATA_SOURCE_OPS, PLACEHOLDER_OPS, RANDOM_OPS, READ_OPS,
                           VARIABLE_OPS, mutates)
from epl.passes.clone import live_inputs, own_seeds
from epl.passes.stage_seeds import STATELESS, stateless

CALL_ATTR = "_epl_stage_call"
_STACK_OPS = ("Stack", "TensorArray")
_SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})
_FLOW_OPS = frozenset({"Enter", "RefEnter", "Exit", "RefExit", "Switch", "RefSwitch", "Merge",
                       "RefMerge", "NextIteration", "RefNextIteration", "LoopCond"})


def _is_read(op):
  return op.type in READ_OPS and op.inputs and op.inputs[0].op.type in VARIABLE_OPS


def _is_source(op, sources):
  return op.type in PLACEHOLDER_OPS or op.type in DATA_SOURCE_OPS or op in sources


def _writes_variable(op):
  return mutates(op) and any(t.op.type in VARIABLE_OPS or t.dtype._is_ref_dtype  # pylint: disable=protected-access
                             for t in op.inputs)


def _refused(op):
  """Why ``op`` cannot run inside a call (None if it can)."""
  if compat.in_control_flow(op) or op.type in _FLOW_OPS:
    return "op %r (%s) is inside a v1 tf.cond / tf.while_loop of the step" % (op.name, op.type)
  if op.type.startswith(_STACK_OPS):
    return "op %r (%s) keeps per-step state a call cannot hand on" % (op.name, op.type)
  if op.type in RANDOM_OPS and op.type not in STATELESS:
    return ("op %r (%s) draws random numbers and has no stateless kernel a call could seed"
            % (op.name, op.type))
  if _writes_variable(op):
    return "op %r (%s) writes a variable in the forward/backward" % (op.name, op.type)
  return None


def cut(ctx, compute, needed, added=None):
  """({op: (stage, kind)} of the body ops, [pre ops], [post ops], [idle ops]) or a reason
  (str) why stage functions cannot hold this step. ``compute``: a copy's compute ops
  (originals); ``needed``: those the gradients depend on; ``added``: backward ops made by
  the rewrite (gradient checkpointing's recomputation) -> the user's forward op they stand
  for. ``post``: forward ops the gradients do not need that read a micro-batch's values
  (cloned per micro-batch); ``idle``: the other ops the gradients do not need (the backward's
  unused shapes and groupings, a second read of a weight): they stay once, as the user's,
  and a training run never runs them.

  A backward op that only takes the shape of forward tensors of its stage runs in the
  forward body: the forward call then hands on the shape, not the activation."""
  added = added or {}
  sources = set(ctx.result("analyze").sources)
  body, pre, post, idle = {}, [], [], []
  varies = set()
  for op in compute:
    if op not in needed:
      per_micro = any(t.op in varies for t in op.inputs) or any(
          x in varies for x in op.control_inputs) or _is_source(op, sources)
      if per_micro and ctx.phase.get(op) == "forward" and not unread_whole(ctx, op):
        post.append(op)
        varies.add(op)
      else:
        idle.append(op)
      continue
    varies.add(op)
    if _is_source(op, sources):
      pre.append(op)
    elif not _is_read(op):
      why = _refused(op)
      if why:
        return why
      stage = ctx.owner[added.get(op, op)]
      kind = "F" if op not in added and ctx.phase.get(op) == "forward" else "B"
      if kind == "B" and op.type in _SHAPE_OPS and _shape_only(op, stage, body, added, ctx):
        kind = "F"
      body[op] = (stage, kind)
    else:
      varies.discard(op)                      # a weight's read: the same in every micro-batch
  return body, pre, post, idle


def unread_whole(ctx, op):
  """True for a split value's whole concatenation (``plan.wholes``) that no op and no
  collection reads: it would only run for a fetch, and a training run's fetch of it is then
  the clear error of a tensor inside a body (fetch.py); a collection hands it out."""
  if op.name not in ctx.plan.whole_set or compat.control_outputs(op) or any(
      t.consumers() for t in op.outputs):
    return False
  graph = op.graph
  return not any(x is op or x in op.outputs for key in graph.get_all_collection_keys()
                 for x in graph.get_collection(key))


def _shape_only(op, stage, body, added, ctx):
  """True when backward op ``op`` takes only the shape of forward tensors of ``stage`` that
  nothing else in the backward reads (checkpointing rewired the others): run in the forward
  body, it makes the forward call hand on a shape instead of an activation. (Where the
  backward reads the tensor anyway, a shape result would only add to the call's results:
  each costs the call ~3 us, bench/call_cost.py.)"""
  if op.control_inputs:
    return False
  for t in op.inputs:
    if body.get(t.op) != (stage, "F"):
      return False
    for c in t.consumers():
      if c.type not in _SHAPE_OPS and (c in added or ctx.phase.get(c) not in ("forward", None)):
        return False
  return True


def constants(member, limit=1 << 16):
  """The body ops whose value is the same in every call: ``Const`` and what is computed from
  constants alone (a causal mask), up to ``limit`` elements. A body reading one holds its own
  copy instead of having another body's call hand it on (each result costs a call ~3 us,
  bench/call_cost.py)."""
  out = set()
  for op in sorted(member, key=compat.op_id):
    if op.control_inputs or op.op_def.is_stateful or op.type in _SHAPE_OPS:
      continue
    if op.type == "Const" or op.inputs and all(t.op in out for t in op.inputs) and all(
        t.shape.is_fully_defined() and t.shape.num_elements() <= limit for t in op.outputs):
      out.add(op)
  return out


def soft_wait(op, x):
  """True for a wait of ``op`` on ``x`` that only groups gradients (``tf.gradients``' ``tuple``:
  ``group_deps`` waits for every gradient of an op, each ``control_dependency`` for it).
  Across two stages' bodies such a wait would make their calls wait for each other; the
  gradients' data edges order them as the schedule needs, so it is left out there."""
  return any(o.type == "NoOp" and o.name.endswith("tuple/group_deps") for o in (op, x))


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


def _enum(t):
  return t.dtype.base_dtype.as_datatype_enum


class Body:
  """One (stage, kind)'s ops as a FunctionDef for one copy: its arguments (outside tensors,
  then the running sums, then the row weight), its results (exported tensors, then sums).

  ``weighted``: the row weight's dtype (None: the gradients are summed unweighted)."""

  def __init__(self, key, ops, exported, grads, weighted, shared=frozenset()):
    own = set(ops)
    work = [t.op for op in ops for t in op.inputs if t.op in shared and t.op not in own]
    self.copied = set()                       # another body's constants, copied in
    while work:
      op = work.pop()
      if op not in own:
        own.add(op)
        self.copied.add(op)
        work.extend(t.op for t in op.inputs)
    self.key, self.ops = key, sorted(own, key=compat.op_id)
    self.names = {op.name for op in self.ops}
    self.args, self.controls = [], []              # outside tensors read; outside ops waited
    seen = set()
    for op in ops:
      for t in op.inputs:
        if t.op.name not in self.names and t not in seen:
          seen.add(t)
          self.args.append(t)
      for x in op.control_inputs:
        if x.name not in self.names and x not in self.controls and not soft_wait(op, x):
          self.controls.append(x)
    self.results = [t for op in ops for t in op.outputs if t in exported]
    self.result_index = {t.name: i for i, t in enumerate(self.results)}
    self.grads = [t for op in ops for t in op.outputs if t in grads]     # summed in the body
    self.weighted = weighted
    self.random = [op.name for op in ops if op.type in STATELESS]    # seeded per call

  def in_types(self, first):
    return [_enum(t) for t in self.args] + ([] if first else [_enum(g) for g in self.grads]) \
        + ([self.weighted.as_datatype_enum] if self.grads and self.weighted else []) \
        + ([tf.int64.as_datatype_enum] if self.random else [])

  def out_types(self):
    return [_enum(t) for t in self.results] + [_enum(g) for g in self.grads]

  def function_def(self, name, nodes, device_fn, prefix, first):
    """The FunctionDef ``name`` of this body for a copy (devices ``device_fn``, random
    seeds of ``prefix``); ``first``: micro-batch 0's variant (no running sums in)."""
    fdef = function_pb2.FunctionDef()
    fdef.signature.name = name
    fdef.attr["_noinline"].b = True               # Grappler must not inline the calls back
    ref = {}
    for i, t in enumerate(self.args):
      fdef.signature.input_arg.add(name="a%d" % i, type=_enum(t))
      ref[t.name] = "a%d" % i
    if not first:
      for i, g in enumerate(self.grads):
        fdef.signature.input_arg.add(name="s%d" % i, type=_enum(g))
    if self.grads and self.weighted:
      fdef.signature.input_arg.add(name="w", type=self.weighted.as_datatype_enum)
    if self.random:
      fdef.signature.input_arg.add(name="seed", type=tf.int64.as_datatype_enum)
    outs = {}
    for op in self.ops:
      outs.update(zip((t.name for t in op.outputs), _output_refs(op)))
    for op in self.ops:
      device = "" if op in self.copied else device_fn(op) or ""     # copies: the call's
      self._add_node(fdef, op, nodes.get(op.name), device, prefix, outs, ref)
    for i, t in enumerate(self.results):
      fdef.signature.output_arg.add(name="r%d" % i, type=_enum(t))
      fdef.ret["r%d" % i] = outs[t.name]
    self._add_sums(fdef, outs, first, device_fn)
    return fdef

  def _add_node(self, fdef, op, node_def, device, prefix, outs, ref):
    node = fdef.node_def.add()
    node.CopyFrom(node_def)
    node.device = device
    if "_class" in node.attr:
      del node.attr["_class"]                     # no colocation with ops outside the body
    if prefix:
      own_seeds(node, prefix)                     # a copy's own random seeds
    inputs = live_inputs(op)
    del node.input[:]
    for text in inputs:
      src, index = _input(text)
      if index is None:
        if src in self.names:
          node.input.append(text)
        continue                                  # an outside wait: the call waits instead
      key = "%s:%d" % (src, index)
      node.input.append(outs[key] if src in self.names else ref[key])
    if op.type in STATELESS:
      stateless(fdef, node, self.random.index(op.name))
    if op.op_def.is_stateful:
      fdef.signature.is_stateful = True

  def _add_sums(self, fdef, outs, first, device_fn):
    """Results ``g<i>``: sum (argument ``s<i>``, not in ``first``) + weight x gradient, on
    the gradient's device (a split stage's part 1 sums its own gradients)."""
    for i, g in enumerate(self.grads):
      value, dtype = outs[g.name], _enum(g)
      device = "" if g.op in self.copied else device_fn(g.op) or ""
      start = len(fdef.node_def)
      if self.weighted:
        w = "w"
        if g.dtype.base_dtype != self.weighted:
          _node(fdef, "epl_w%d" % i, "Cast", ["w"], SrcT=self.weighted.as_datatype_enum,
                DstT=dtype, Truncate=False)
          w = "epl_w%d:y:0" % i
        _node(fdef, "epl_weighted%d" % i, "Mul", [value, w], T=dtype)
        value = "epl_weighted%d:z:0" % i
      if not first:
        _node(fdef, "epl_sum%d" % i, "AddV2", ["s%d" % i, value], T=dtype)
        value = "epl_sum%d:z:0" % i
      for node in fdef.node_def[start:]:
        node.device = device
      fdef.signature.output_arg.add(name="g%d" % i, type=dtype)
      fdef.ret["g%d" % i] = value


def _node(fdef, name, op, inputs, **attrs):
  node = fdef.node_def.add(name=name, op=op)
  node.input.extend(inputs)
  for key, value in attrs.items():
    if isinstance(value, bool):
      node.attr[key].b = value
    else:
      node.attr[key].type = value
  return node


def call_node(graph_def, name, fname, device, inputs, in_types, out_types, config,
              executor=""):
  """A ``StatefulPartitionedCall`` of ``fname`` (stateful: bodies hold random ops and
  py_funcs, and CSE must not merge two micro-batches' calls), marked as epl's; ``executor``:
  the body's executor type (``executor_type``)."""
  node = graph_def.node.add(name=name, op="StatefulPartitionedCall", device=device)
  node.input.extend(inputs)
  node.attr["f"].func.name = fname
  node.attr["Tin"].list.type.extend(in_types)
  node.attr["Tout"].list.type.extend(out_types)
  node.attr["config"].s = b""
  node.attr["config_proto"].s = config
  node.attr["executor_type"].s = executor.encode()
  node.attr[CALL_ATTR].b = True
  # TF's importer would infer the outputs' shapes from the body, once per call (most of the
  # import at M = 64): the caller sets them from the user's tensors instead
  node.attr["_disable_call_shape_inference"].b = True
  return node


SINGLE_THREADED = "SINGLE_THREADED_EXECUTOR"


def executor_type(fdef, device):
  """The executor a call on ``device`` runs body ``fdef`` with: TF's single-threaded one
  (the body's ops one after another on the calling thread, each still using the device's
  intra-op threads) where it applies -- every node on ``device``, a CPU -- else TF's default.
  A stage function's body is one micro-batch of one stage: ~0.2 ms of a call went to the
  default executor's per-op scheduling across threads (docs/benchmarks.md, #50). Not on
  GPUs: that executor supports no device contexts (streams), and a body placed across devices
  has send/recv pairs, which it cannot run."""
  spec = tf.DeviceSpec.from_string(device or "")
  if spec.device_type != "CPU":
    return ""
  for node in fdef.node_def:
    other = tf.DeviceSpec.from_string(node.device)
    if any(None not in (getattr(spec, f), getattr(other, f)) and
           getattr(spec, f) != getattr(other, f)
           for f in ("job", "replica", "task", "device_type", "device_index")):
      return ""
  return SINGLE_THREADED


def config_proto():
  """A call's own session options: Grappler off inside bodies (epl's sessions run without
  it on such graphs; a body would otherwise be rewritten on its first call)."""
  config = tf.ConfigProto()
  config.graph_options.rewrite_options.disable_meta_optimizer = True
  return config.SerializeToString()


def acyclic(reads):
  """True if no body reads (data or waits), through others, a body that reads it
  (``reads``: {key: keys it reads})."""
  state = {}

  def visit(k):
    if state.get(k) == 2:
      return True
    if state.get(k) == 1:
      return False
    state[k] = 1
    if not all(visit(d) for d in reads[k]):
      return False
    state[k] = 2
    return True
  return all(visit(k) for k in sorted(reads))
