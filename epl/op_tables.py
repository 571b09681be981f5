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


def mutates(op):
  """True for ops with side effects: stateful ones, and those writing through a ref input
  (``Assign``, ``ApplyMomentum``: TF does not mark them stateful)."""
  return op.op_def.is_stateful or any(arg.is_ref for arg in op.op_def.input_arg)
