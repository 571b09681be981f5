"""The clone engine's import (compat.import_nodes) builds what tf.import_graph_def builds."""
import numpy as np
import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl.passes.clone import Cloner, NodeDefCache, clone_ops


def _model():
  graph = tf.Graph()
  with graph.as_default():
    x = tf.placeholder(tf.float32, [None, 4], name="x")
    with tf.variable_scope("m"):
      h = tf.layers.dense(x, 8, activation=tf.nn.relu)
      h = tf.nn.dropout(h, rate=0.5, seed=3)
      i, acc = tf.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, a + tf.reduce_sum(h)),
                             (tf.constant(0), tf.constant(0.0)))
      loss = acc + tf.reduce_mean(tf.layers.dense(h, 1))
    with tf.control_dependencies([loss.op]):
      done = tf.no_op(name="done")
    tf.train.GradientDescentOptimizer(0.1).minimize(loss)
  return graph, x, loss, done


def _clone(via):
  graph, x, loss, done = _model()
  ops = [op for op in graph.get_operations() if op.type != "Placeholder"]
  if via == "tf":
    original = compat.import_nodes
    compat.import_nodes = lambda g, gd, im, names, prefix: tf.import_graph_def(
        gd, input_map=im, return_elements=list(names), name=prefix)
  try:
    devices = {"": "/device:CPU:0"}
    mapping = clone_ops(graph, ops, "copy", lambda op: devices.get(op.device, op.device),
                        node_cache=NodeDefCache(graph))
  finally:
    if via == "tf":
      compat.import_nodes = original
  return graph, x, loss, mapping


def _nodes(graph):
  return {n.name: n for n in graph.as_graph_def().node}


def test_import_nodes_builds_the_graph_tf_import_graph_def_builds():
  ours, _, _, mapping = _clone("ours")
  theirs, _, _, _ = _clone("tf")
  assert _nodes(ours) == _nodes(theirs)
  assert all(op.name.startswith("copy/") for op in mapping.values())
  assert {op.graph for op in mapping.values()} == {ours}
  # the Python side knows the new ops as TF's importer leaves them
  for name, op in mapping.items():
    assert ours.get_operation_by_name(op.name) is op
    assert op.device == "/device:CPU:0" and not compat.in_control_flow(op)
    assert [t.op.name for t in op.inputs] == [t.op.name for t in theirs.get_operation_by_name(
        op.name).inputs]


def test_a_clone_computes_what_the_original_computes_and_a_taken_prefix_is_made_unique():
  graph = tf.Graph()
  with graph.as_default():
    x = tf.placeholder(tf.float32, [None, 4])
    out = tf.reduce_sum(tf.layers.dense(tf.layers.dense(x, 8, activation=tf.nn.relu), 2))
  forward = [op for op in graph.get_operations()
             if op.type not in ("Placeholder", "VariableV2", "Assign") and
             "Initializer" not in op.name and "init" not in op.name.split("/")[-1]]
  first = clone_ops(graph, forward, "copy", lambda op: "/device:CPU:0")
  second = clone_ops(graph, forward, "copy", lambda op: "")
  assert first[out.op.name].name == "copy/" + out.op.name
  assert second[out.op.name].name == "copy_1/" + out.op.name
  with tf.Session(graph=graph) as sess:
    sess.run(tf.variables_initializer(graph.get_collection("variables")))
    feed = {x: np.arange(8, dtype=np.float32).reshape(2, 4)}
    values = sess.run([out, first[out.op.name].outputs[0], second[out.op.name].outputs[0]],
                      feed)
  assert values[0] == values[1] == values[2]


def test_an_import_inside_control_dependencies_waits_for_them_as_tfs_import_does():
  """compat.import_nodes wraps the new ops without TF's control-scope pass only where that
  pass has nothing to add (no scope, or ``control_dependencies(None)``)."""
  source = tf.Graph()
  with source.as_default():
    tf.add(tf.constant(1.0, name="a"), 1.0, name="b")
  names = ["a", "b", "b/y"]

  def imported(scope, via_tf):
    graph = tf.Graph()
    with graph.as_default():
      gate = tf.no_op(name="gate")
      with tf.control_dependencies({"none": [], "cleared": None, "inputs": [gate]}[scope]):
        ops = tf.import_graph_def(source.as_graph_def(), return_elements=names,
                                  name="copy") if via_tf else \
            compat.import_nodes(graph, source.as_graph_def(), {}, names, "copy")
      assert all(graph.get_operation_by_name(op.name) is op for op in ops)
      return [[c.name for c in op.control_inputs] for op in ops]
  for scope in ("none", "cleared", "inputs"):
    ours = imported(scope, via_tf=False)
    assert ours == imported(scope, via_tf=True), scope
    assert any(ours) == (scope == "inputs"), scope


def test_a_cloner_builds_each_prefix_what_clone_ops_builds_for_it():
  """The pipeline's micro-batches share one Cloner per copy: every clone must be the one
  clone_ops makes alone (its own while frame, dropout seed and resource variable name)."""
  def build(shared):
    graph, x, loss, done = _model()
    with graph.as_default():
      with tf.variable_scope("r", use_resource=True):
        tf.get_variable("w", [2], initializer=tf.ones_initializer())
    ops = [op for op in graph.get_operations() if op.type != "Placeholder"]
    assert any(op.type == "VarHandleOp" for op in ops) and any(op.type == "Enter" for op in ops)
    devices = lambda op: "/device:CPU:0"
    if shared:
      cloner = Cloner(graph, ops, devices, NodeDefCache(graph))
      maps = [cloner.clone("mb_%d" % m) for m in (1, 2)]
    else:
      maps = [clone_ops(graph, ops, "mb_%d" % m, devices, node_cache=NodeDefCache(graph))
              for m in (1, 2)]
    return graph, maps
  (ours, maps), (theirs, _) = build(True), build(False)
  assert _nodes(ours) == _nodes(theirs)
  first, second = (_nodes(ours)[m["r/w"].name] for m in maps)
  assert first.attr["shared_name"].s != second.attr["shared_name"].s
