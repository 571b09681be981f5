"""Random ops in stage functions (passes/stage_functions.py): each body's random op becomes
its stateless twin, seeded per call from one stateful op outside the calls."""
import tensorflow.compat.v1 as tf

# A stateful kernel inside a function lives in its instantiation, and TF instantiates per run
# signature (an evaluation run, a step that fetches one more tensor): a random op's stream
# would restart there. A body's random ops are stateless instead, seeded per call from a
# stateful op outside (one stream for the whole job, as the user's own ops have).
STATELESS = {"RandomUniform": "StatelessRandomUniform",
             "RandomStandardNormal": "StatelessRandomNormal",
             "TruncatedNormal": "StatelessTruncatedNormal",
             "RandomUniformInt": "StatelessRandomUniformInt"}


def stateless(fdef, node, index):
  """Turns random NodeDef ``node`` (the body's ``index``-th) into its stateless twin, seeded
  by the call's ``seed`` argument plus ``[0, index]``."""
  offset = fdef.node_def.add(name="epl_seed%d_offset" % index, op="Const")
  offset.attr["dtype"].type = tf.int64.as_datatype_enum
  offset.attr["value"].tensor.CopyFrom(tf.make_tensor_proto([0, index], tf.int64))
  add = fdef.node_def.add(name="epl_seed%d" % index, op="AddV2")
  add.input.extend(["seed", "epl_seed%d_offset:output:0" % index])
  add.attr["T"].type = tf.int64.as_datatype_enum
  if node.op == "RandomUniformInt":
    node.attr["dtype"].type = node.attr["Tout"].type
    del node.attr["Tout"]
  for key in ("seed", "seed2"):
    del node.attr[key]
  node.attr["Tseed"].type = tf.int64.as_datatype_enum
  node.op = STATELESS[node.op]
  node.input.insert(1, "epl_seed%d:z:0" % index)


def seed_source(graph_def, name, count, device, seeds):
  """Nodes of ``graph_def`` that draw ``count`` call seeds (int64 [2] each) from one stateful
  op: ``name``'s outputs 0..count-1. ``seeds``: its (seed, seed2)."""
  shape = graph_def.node.add(name=name + "/shape", op="Const", device=device)
  shape.attr["dtype"].type = tf.int32.as_datatype_enum
  shape.attr["value"].tensor.CopyFrom(tf.make_tensor_proto([count, 2], tf.int32))
  bounds = []
  for bound, value in (("min", 0), ("max", 2 ** 62)):
    node = graph_def.node.add(name="%s/%s" % (name, bound), op="Const", device=device)
    node.attr["dtype"].type = tf.int64.as_datatype_enum
    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value, tf.int64))
    bounds.append(node.name)
  draw = graph_def.node.add(name=name + "/draw", op="RandomUniformInt", device=device)
  draw.input.extend([shape.name] + bounds)
  draw.attr["Tout"].type = tf.int64.as_datatype_enum
  draw.attr["T"].type = tf.int32.as_datatype_enum
  draw.attr["seed"].i, draw.attr["seed2"].i = seeds
  unpack = graph_def.node.add(name=name, op="Unpack", device=device)
  unpack.input.append(draw.name)
  unpack.attr["T"].type = tf.int64.as_datatype_enum
  unpack.attr["num"].i = count
  unpack.attr["axis"].i = 0
  return [name + "/draw", name]
