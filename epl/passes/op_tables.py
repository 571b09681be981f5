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
