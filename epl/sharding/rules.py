"""Split rules: how ops built inside ``epl.split(device_count=N)`` run over N shards.

Inside a split scope every variable of rank >= 1 is created sharded (a TF PartitionedVariable:
part i lives on the scope's i-th device, holds the slice of the value the local model would
have created -- the full initial value is computed once on the host and sliced -- and is saved
in checkpoints as the whole variable): first rank 1 and rank 2 variables (and ``[1, .., nx,
nf]``) along their last axis, larger ones along their first axis (expert weights ``[E, ...]``);
the first rule that reads one settles its cut (epl.sharding.layout: rows for a row-parallel
dense or an embedding, whole for a layer norm, groups for a fused Q/K/V). Reading such a
variable gives a *sharded* value; each op built inside the scope that reads a sharded value
is replaced by the rule for its op type (the table below).
The rule builds the op's work per part -- each part's ops run on that part's device -- and
whatever combines the parts, without ever gathering the whole value:

=========================================  ===============================================
op type (what builds it)                    sharded implementation
=========================================  ===============================================
MatMul (tf.layers.dense,                    x whole: x @ kernel columns per shard, the output
  tf.keras.layers.Dense, tf.matmul,         split along its columns (column parallel); x
  GPT-2's conv1d)                           split along the contraction axis: x_i @ kernel
                                            rows_i, summed (row parallel: one all-reduce)
BatchMatMul, Transpose (attention)          per part, split along a batch axis (the heads)
Split (tf.split)                            pieces of whole parts (a fused Q/K/V in groups)
GatherV2 (embedding lookup)                 vocabulary parallel: each part's rows, summed
BiasAdd and elementwise ops (activations,   per part; an operand that is not sharded is
  add, mul, cast, comparisons, select ...)  sliced to the part (or broadcast)
Reshape                                     per part, when the sharded axis stays the last,
                                            or splits / merges the heads [.., h*d] <-> [.., h,
                                            d] with whole heads per part
Shape                                       the whole value's shape, from the parts
Sum / Mean / Max / Min                      per part; over the sharded axis the parts'
                                            results are combined (not sharded any more)
Softmax / LogSoftmax                        over the sharded axis: per part, with the global
                                            max and sum of exps; over another: per part
SparseSoftmaxCrossEntropyWithLogits         per shard max, sum of exps and the label's
  (tf.losses.sparse_softmax_cross_entropy,  logit, combined over shards: the loss needs only
  tf.nn.sparse_softmax_...)                 [batch] vectors from each shard
SoftmaxCrossEntropyWithLogits               the same with the labels sliced per shard
  (tf.nn.softmax_cross_entropy_with_logits)
ArgMax over the sharded axis (tf.argmax,    per shard max and argmax (+ the shard's offset),
  accuracy)                                 then the shard holding the first global maximum
Einsum (MoE: expert weights ``[E, ...]``)   the index of the sharded operand's sharded axis
                                            splits every operand that carries it; the output
                                            stays sharded when it keeps the index. Dispatch
                                            and combine of the model copies' own tokens are
                                            an all-to-all (epl.sharding.experts); otherwise
                                            an operand made by an einsum is computed per
                                            shard and the shards' results are summed
=========================================  ===============================================

Array ops (epl.sharding.arrays): ``tf.stack`` / ``tf.unstack`` / ``tf.concat`` along an axis
that is not split (a key/value cache), slices that take the split axis whole (``x[:, :-1]``),
``expand_dims``, ``squeeze``, ``tile``, ``pad``, ``tf.nn.top_k`` over the split axis, ``l2_loss``.

An op that reads a sharded value and has no rule here (or whose rule does not cover its
arguments: the rule returns None or raises ``NotCovered`` with the reason; a rule never ends
the job) runs on the whole value -- the parts concatenated on the first part's device, its
gradient sent back to the parts through that concatenation: the gather fallback, like GSPMD's
resharding, slower but the same model. The plan lists every such gather
(``ParallelPlan.gathers``); ``split.gather_fallback: "refuse"`` makes those the training step
needs a PlanError. Adding a rule is one row in ``RULES`` and one test.
"""
import numpy as np
import tensorflow.compat.v1 as tf

from epl.sharding import arrays, experts, layout, losses, reshapes, transformer
from epl.sharding.sharded import (NotCovered, axis_from_end, cut, enter_rule, exit_rule,
                                  part_name, part_sizes, per_part, slices)

SUPPORTED = (
    "tf.layers.dense / tf.keras.layers.Dense / tf.matmul (column or row parallel, "
    "transpose_b for tied logits)", "attention: batched tf.matmul and tf.transpose over the "
    "split heads, tf.split of a fused projection, reshapes splitting / merging the heads",
    "tf.gather of an embedding (vocabulary parallel)",
    "bias add and elementwise ops (relu, gelu, tanh, sigmoid, add, mul, cast, equal, ...)",
    "reshape keeping the split axis last", "tf.shape",
    "tf.reduce_sum / reduce_mean / reduce_max / reduce_min", "tf.nn.softmax / log_softmax",
    "tf.losses.sparse_softmax_cross_entropy / tf.nn.sparse_softmax_cross_entropy_with_logits",
    "tf.nn.softmax_cross_entropy_with_logits", "tf.argmax (accuracy)",
    "tf.einsum with expert weights [E, ...] (MoE dispatch / experts / combine)") + \
    arrays.SUPPORTED

def apply(scope, op_type, build, keywords, name):
  """Runs the rule of ``op_type`` when one of its inputs is sharded.

  ``build(**keywords)`` builds the op as TF would (returns its outputs). Returns (outputs,
  None) with the outputs the op would have had, or (None, reason) when the op is to be built
  as usual on the whole values -- it has no rule, or its rule does not cover these arguments
  (the gather fallback: ``reason`` says why; None when no input is sharded).
  """
  if not any(scope.lookup(t) is not None for t in tensors(keywords)):
    return None, None
  rule = RULES.get(op_type)
  if rule is None:
    return None, "no split rule for %s" % op_type
  first = scope.recorder.graph.version + 1
  enter_rule()
  try:
    outputs = rule(scope, op_type, build, dict(keywords), name)
    reason = None if outputs is not None else \
        "the %s rule does not cover these arguments" % op_type
  except NotCovered as e:
    outputs, reason = None, "%s: %s" % (op_type, e)
  except Exception as e:           # pylint: disable=broad-except
    # a rule never ends the job: what it cannot build runs on the whole values (listed)
    outputs, reason = None, "the %s rule failed on these arguments (%s: %s)" % (
        op_type, type(e).__name__, e)
  finally:
    exit_rule()
  # what a rule built, even one that gave up (unread then: it never runs), is its own: it
  # reads parts, not a gather
  scope.recorder.add_rule_interval(first, scope.recorder.graph.version, scope.taskgraph)
  if outputs is not None:
    layout.count_uses(scope, keywords, tensors)
  return outputs, reason


def current(scope, keywords):
  """``keywords`` with every split value a relayout made again replaced by the new one."""
  replaced = scope.recorder.replaced
  if not replaced:
    return keywords
  def now(value):
    if isinstance(value, (list, tuple)):
      return type(value)(now(v) for v in value)
    while isinstance(value, tf.Tensor) and value in replaced:
      value = replaced[value]
    return value
  return {k: now(v) for k, v in keywords.items()}


def tensors(keywords):
  for value in keywords.values():
    if isinstance(value, (list, tuple)):
      yield from (v for v in value if isinstance(v, tf.Tensor))
    elif isinstance(value, tf.Tensor):
      yield value


# ---- rules -----------------------------------------------------------------------------------
def elementwise(scope, op_type, build, kw, name):
  whole = layout.whole_weights(scope, kw, tensors)
  if whole is not None:              # x * g + b of a layer norm: its weights whole
    return build(name=name, **whole)
  split = [t for t in tensors(kw) if scope.lookup(t) is not None]
  # the operands cut like the first split one that is not a variable (a variable's cut is
  # still open); failing that, like another (a value cut otherwise that can still be remade
  # takes that one's cut: a residual ``dense(x) + x``)
  leads = sorted(split, key=lambda t: t in scope.recorder.variables)
  for lead in leads:
    first = scope.lookup(lead)
    operands = _cut_like(scope, kw, first)
    if operands is not None:
      break
  else:
    return None
  outs = per_part(scope, first, lambda i: build(name=part_name(name, i), **{
      k: v[i] for k, v in operands.items()})[0])
  rank = outs[0].shape.rank
  remake = layout.replayer(elementwise, scope, op_type, build, kw, name,
                           lambda t, axis: layout.from_end(t, axis, rank)) if rank else None
  return [scope.register(outs, first.axis, first.sizes, name, first.shards, remake)]


def _cut_like(scope, kw, first):
  """{key: per-part operands} of ``kw`` cut like ``first``, or None."""
  operands = {}
  for key, value in kw.items():
    pieces = cut(scope, value, first)
    if pieces is None and isinstance(value, tf.Tensor):
      mine = scope.lookup(value)
      pieces = None if mine is None or axis_from_end(mine) != axis_from_end(first) else \
          layout.align(scope, value, mine.axis, first)
    if pieces is None:
      return None
    operands[key] = pieces
  return operands


def shape_of(scope, op_type, build, kw, name):
  sharded = scope.lookup(kw["input"])
  out_type = tf.as_dtype(kw.get("out_type") or tf.int32)
  if sharded.parts[0].shape.rank is None:
    return None
  with scope.shard(0):
    shape = tf.shape(sharded.parts[0], out_type=out_type)
  fix = np.zeros([len(sharded.parts[0].shape)], dtype=out_type.as_numpy_dtype)
  fix[sharded.axis] = sharded.total - sharded.sizes[0]
  out = tf.add(shape, fix, name=name)
  scope.recorder.sharded_shapes[out] = sharded
  return [out]


def _axes(kw, rank):
  value = tf.get_static_value(kw["reduction_indices"])
  if value is None:
    return None
  return sorted({int(a) % rank for a in np.atleast_1d(value)})


_PART = {"Sum": tf.reduce_sum, "Mean": tf.reduce_sum, "Max": tf.reduce_max,
         "Min": tf.reduce_min}
_COMBINE = {"Sum": tf.add_n, "Mean": tf.add_n,
            "Max": lambda xs: tf.reduce_max(tf.stack(xs), axis=0),
            "Min": lambda xs: tf.reduce_min(tf.stack(xs), axis=0)}


def _count(part, axes):
  """How many elements of ``part`` one reduction over ``axes`` sums (dynamic)."""
  return tf.reduce_prod(tf.gather(tf.shape(part), axes)) if axes else tf.constant(1)


def reduction(scope, op_type, build, kw, name):
  sharded = scope.lookup(kw["input"])
  rank = sharded.parts[0].shape.rank
  axes = _axes(kw, rank) if rank is not None else None
  if axes is None:
    return None
  keep = bool(kw.get("keep_dims"))
  outs = per_part(scope, sharded, lambda i: _PART[op_type](sharded.parts[i], axis=axes,
                                                            keepdims=keep))
  if sharded.axis not in axes:
    if op_type == "Mean":
      outs = per_part(scope, sharded, lambda i: outs[i] / tf.cast(
          _count(sharded.parts[i], axes), outs[i].dtype))
    axis = sharded.axis if keep else sharded.axis - sum(1 for a in axes if a < sharded.axis)
    return [scope.register(outs, axis, sharded.sizes, name)]
  total = _COMBINE[op_type](outs)
  if op_type == "Mean":
    others = [a for a in axes if a != sharded.axis]
    total = total / tf.cast(_count(sharded.parts[0], others) * sharded.total, total.dtype)
  return [tf.identity(total, name=name)]


def _einsum_operand(scope, tensor, spec, letter, sharded):
  """``tensor`` (its einsum subscripts ``spec``) cut along ``letter`` like ``sharded``."""
  axis = spec.index(letter)
  mine = scope.lookup(tensor)
  if mine is not None:
    return list(mine.parts) if mine.axis == axis and mine.sizes == sharded.sizes else None
  made = tensor.op
  if made.type == "Einsum" and tensor.shape.rank is not None:
    exchanged = experts.dispatch(scope, tensor, axis, sharded)
    if exchanged is not None:            # the copies' dispatch, sent to the parts: all-to-all
      return exchanged
    # computed per shard: only the shard's slice is ever made (MoE dispatch)
    equation = made.get_attr("equation").decode()
    specs, out_spec = equation.replace(" ", "").split("->")
    specs = specs.split(",")
    out_letter = out_spec[axis] if axis < len(out_spec) else None
    if out_letter and "." not in out_spec and all(
        out_letter not in s or scope.lookup(t) is None for s, t in zip(specs, made.inputs)):
      cuts = []
      for s, t in zip(specs, made.inputs):
        if out_letter in s:
          cuts.append(slices(scope, t, s.index(out_letter), sharded.sizes,
                             sharded.shard_of))
        else:
          cuts.append([t] * len(sharded.parts))
      return per_part(scope, sharded, lambda i: tf.einsum(equation, *[c[i] for c in cuts]))
  return slices(scope, tensor, axis, sharded.sizes, sharded.shard_of)


def einsum(scope, op_type, build, kw, name):
  inputs, equation = list(kw["inputs"]), kw["equation"]
  equation = equation.decode() if isinstance(equation, bytes) else equation
  if "->" not in equation or "." in equation:
    return None
  specs, out_spec = equation.replace(" ", "").split("->")
  specs = specs.split(",")
  found = [(k, scope.lookup(t)) for k, t in enumerate(inputs) if scope.lookup(t) is not None]
  if not found or len(specs) != len(inputs):
    return None
  k, sharded = found[0]
  letter = specs[k][sharded.axis]
  if letter not in out_spec and len(found) == 1:
    combined = experts.combine(scope, build, kw, specs, k, sharded)
    if combined is not None:             # the parts' outputs back to the copies: all-to-all
      return combined
  operands = []
  for spec, tensor in zip(specs, inputs):
    if letter not in spec:
      operands.append([tensor] * len(sharded.parts))
      continue
    pieces = _einsum_operand(scope, tensor, spec, letter, sharded)
    if pieces is None:
      return None
    operands.append(pieces)
  outs = per_part(scope, sharded, lambda i: build(
      inputs=[c[i] for c in operands], name=part_name(name, i), **{
          key: v for key, v in kw.items() if key not in ("inputs", "name")})[0])
  if letter in out_spec:
    return [scope.register(outs, out_spec.index(letter), sharded.sizes, name)]
  return [tf.add_n(outs, name=name)]              # the expert index is summed over: combine


UNARY = ("Relu", "Relu6", "Elu", "Selu", "Softplus", "Softsign", "LeakyRelu", "Tanh",
         "Sigmoid", "Erf", "Exp", "Log", "Log1p", "Neg", "Abs", "Square", "Sqrt", "Rsqrt",
         "Reciprocal", "Floor", "Round", "Cast", "Identity", "StopGradient", "ZerosLike",
         "OnesLike", "LogicalNot", "IsNan", "IsFinite")
BINARY = ("AddV2", "Add", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum",
          "SquaredDifference", "Pow", "Greater", "GreaterEqual", "Less", "LessEqual", "Equal",
          "NotEqual", "LogicalAnd", "LogicalOr", "SelectV2", "Select", "BiasAdd")

# op type -> rule(scope, op_type, build, keywords, name) -> outputs, or None (or raises
# NotCovered with the reason) when the rule does not cover these arguments: the op is then
# built as usual on the whole values (the gather fallback, listed in the plan)
RULES = dict(
    [(t, elementwise) for t in UNARY + BINARY] +
    [("MatMul", transformer.matmul), ("BatchMatMulV2", transformer.batch_matmul),
     ("BatchMatMulV3", transformer.batch_matmul), ("Transpose", transformer.transpose),
     ("Split", transformer.split), ("GatherV2", transformer.gather),
     ("Reshape", reshapes.reshape), ("Shape", shape_of),
     ("Sum", reduction), ("Mean", reduction), ("Max", reduction), ("Min", reduction),
     ("Softmax", losses.softmax), ("LogSoftmax", losses.softmax),
     ("SparseSoftmaxCrossEntropyWithLogits", losses.sparse_xent),
     ("SoftmaxCrossEntropyWithLogits", losses.dense_xent),
     ("ArgMax", losses.argmax), ("Einsum", einsum)] +
    list(arrays.RULES.items()))


# ---- variables -------------------------------------------------------------------------------
def split_axis(shape):
  """The axis a variable created in a split scope is sharded along first (None: not
  sharded): the last of a vector or a matrix (also a matrix with leading 1s, GPT-2's conv1d
  weight ``[1, nx, nf]``), the first (the experts) of a larger one. Its first use may settle
  another (epl.sharding.layout)."""
  rank = len(shape)
  if rank == 0:
    return None
  return rank - 1 if rank <= 2 or all(d == 1 for d in shape[:-2]) else 0


def variable_layout(scope, shape):
  """(axis, part sizes) of a variable of ``shape`` created in ``scope``, or None when it is
  not sharded (a scalar, or fewer slices than 2 along the axis)."""
  axis = split_axis(shape)
  if axis is None or shape[axis] is None or shape[axis] < 2:
    return None
  return axis, part_sizes(shape[axis], min(scope.n, shape[axis]))


def adopt_variable(scope, parts, axis, shards=None):
  """Registers a sharded variable: part i belongs to shard ``shards[i]`` (default i); returns
  the whole value every read of the variable gives (the concatenation of per-shard reads,
  registered sharded)."""
  shards = list(shards or range(len(parts)))
  for part, shard in zip(parts, shards):
    scope.recorder.shard_ops[part.op.name] = shard
  full_name = parts[0].op.name.rsplit("/", 1)[0]
  reads = []
  with tf.control_dependencies(None), tf.name_scope(None), tf.name_scope(full_name + "/"):
    for i, (part, shard) in enumerate(zip(parts, shards)):
      with scope.shard(shard):
        reads.append(tf.identity(part, name="read_part%d" % i))
    return scope.register(reads, axis, [p.get_shape().as_list()[axis] for p in parts],
                          name="sharded", shards=shards)
