"""Op-type tables the passes consult. Adding an op kind is one row here (and one test)."""
import tensorflow.compat.v1 as tf

VARIABLE_OPS = frozenset({"VariableV2", "Variable", "VarHandleOp"})

# Ops that hand out a new batch each time they run: every model replica runs its own.
DATA_SOURCE_OPS = frozenset({
    "IteratorGetNext", "IteratorGetNextSync", "IteratorGetNextAsOptional",
    "QueueDequeue", "QueueDequeueV2", "QueueDequeueMany", "QueueDequeueManyV2",
    "QueueDequeueUpTo", "QueueDequeueUpToV2",
})

# Stateful random ops: a replica that shares one would share its dropout mask.
RANDOM_OPS = frozenset({
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal",
    "Multinomial", "RandomShuffle", "RandomGamma", "RandomPoisson", "RandomPoissonV2",
    "ParameterizedTruncatedNormal",
})

# Ops that write a variable given as their first input.
ASSIGN_OPS = frozenset({
    "Assign", "AssignAdd", "AssignSub", "AssignVariableOp", "AssignAddVariableOp",
    "AssignSubVariableOp",
})

# Placeholders: every copy gets its own; the runtime feeds each its piece of a fed batch.
PLACEHOLDER_OPS = frozenset({"Placeholder", "PlaceholderV2", "PlaceholderWithDefault"})

# Ops every copy shares (with what only feeds or only follows them): checkpoints,
# initialisation checks, iterator set-up. Queue enqueue/close and table initialisers are
# matched by prefix in epl.passes.analyze; stateful ops without inputs (queues, readers,
# tables) and the input pipeline (is_host_op) are shared too.
SHARED_SINK_OPS = frozenset({
    "SaveV2", "Save", "SaveSlices", "RestoreV2", "Restore", "RestoreSlice",
    "MergeV2Checkpoints", "IsVariableInitialized", "VarIsInitializedOp", "MakeIterator",
})

# Ops that only read a variable (never make it diverge between copies).
READ_OPS = frozenset({"Identity", "ReadVariableOp", "VarIsInitializedOp",
                      "IsVariableInitialized"})

# Ops whose output can be their input's buffer: TF hands the input tensor on (set_output or
# a reshaped/sliced CopyFrom) instead of copying it, unconditionally or for some shapes
# (Slice/StridedSlice/Split/Unpack along axis 0, Transpose by the identity, Tile/Pad/
# BroadcastTo that change nothing, Cast to the same type). A reader of their output reads a ref
# variable's memory when their input is the variable's read: GPT-2's conv1d reads every weight
# as tf.reshape(w, [-1, nf]). (Element-wise ops forward a buffer only when nothing else holds
# it, never a variable's.) Listing too many costs at most an unneeded control edge; missing
# one lets an update run under a reader. Used by ``buffer_readers`` (docs/architecture.md).
ALIASING_OPS = frozenset({
    "Identity", "IdentityN", "RefIdentity", "StopGradient", "PreventGradient",
    "PlaceholderWithDefault", "DebugIdentity", "DebugIdentityV2", "EnsureShape",
    "CheckNumerics", "CheckNumericsV2", "Print", "Reshape", "ExpandDims", "Squeeze",
    "Bitcast", "Slice", "StridedSlice", "Split", "SplitV", "Unpack", "Transpose",
    "ConjugateTranspose", "Tile", "Pad", "PadV2", "BroadcastTo", "Cast", "ConcatV2",
    "Concat",
})


def buffer_readers(tensor):
  """(op, input index) of every op that reads ``tensor``'s buffer: its consumers and, through
  ``ALIASING_OPS``, the consumers of every tensor that may share that buffer (the aliasing ops
  themselves included)."""
  out, seen, work = [], set(), [tensor]
  while work:
    t = work.pop()
    if t in seen:
      continue
    seen.add(t)
    for op in t.consumers():
      out.extend((op, i) for i, x in enumerate(op.inputs) if x is t)
      if op.type in ALIASING_OPS:
        work.extend(op.outputs)
  return out


# Input-pipeline ops stay on the host; the placer colocates them with their iterator.
def is_host_op(op):
  t = op.type
  return (t in DATA_SOURCE_OPS or t.endswith("Dataset") or t.endswith("DatasetV2") or
          t.startswith("Iterator") or t in ("MakeIterator", "OneShotIterator",
                                            "AnonymousIteratorV2", "AnonymousIteratorV3"))


def pinned_to_host(op):
  """True if the user placed ``op`` on the host CPU (``/cpu:0``): epl keeps that."""
  if not op.device:
    return False
  spec = tf.DeviceSpec.from_string(op.device)
  return (spec.device_type or "").upper() == "CPU" and spec.device_index in (None, 0)


# Ops TF marks stateful that only read a resource variable (their order against its writes
# matters; they change nothing): not updates.
RESOURCE_READ_OPS = frozenset({"ReadVariableOp", "VarIsInitializedOp", "ResourceGather",
                               "ResourceGatherNd", "VariableShape"})


def mutates(op):
  """True for ops with side effects: stateful ones (but a resource variable's reads), and
  those writing through a ref input (``Assign``, ``ApplyMomentum``: TF does not mark them
  stateful)."""
  if op.type in RESOURCE_READ_OPS or is_stage_call(op):
    return False
  return op.op_def.is_stateful or any(arg.is_ref for arg in op.op_def.input_arg)


def is_stage_call(op):
  """True for epl's call of a stage function (passes/stage_functions.py): its body reads the
  weights it is handed and writes no variable."""
  return op.type == "StatefulPartitionedCall" and "_epl_stage_call" in op.node_def.attr


def variable_shape(op):
  """The shape of the value variable op ``op`` holds (its ``shape`` attr: a resource
  variable's output is a scalar handle, not the value)."""
  return tf.TensorShape(op.get_attr("shape"))


def variable_dtype(op):
  """The dtype of the value variable op ``op`` holds (a resource handle's is ``resource``)."""
  return tf.as_dtype(op.get_attr("dtype")).base_dtype


def variable_size(op):
  """Elements in variable op ``op`` (0 when its shape is not fully known)."""
  shape = variable_shape(op)
  return shape.num_elements() if shape.is_fully_defined() else 0
