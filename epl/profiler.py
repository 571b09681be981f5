"""Profile a TF model per layer, in the PipeDream / DAPPLE profile format the planner reads.

``profile(sess, fetches, feed_dict, steps)`` runs ``fetches`` (a training step) ``steps``
times with TF's full trace and groups the graph's ops into layers:

* a layer is a top-level name scope (``layer_3/...``, ``embed/...``); a backward op belongs to
  the layer of the forward op it differentiates (``gradients/layer_3/...``); ops without a
  scope, what reads a gradient (clipping, the optimizer's update) and epl's own ops are not
  layers;
* layers are ordered by their first forward op (creation order);
* ``forward_compute_time`` / ``backward_compute_time``: the summed compute time of the
  layer's forward / backward ops in one step (milliseconds, the mean over the traced steps);
* ``activation_size``: bytes of the layer's forward outputs that other layers read (for one
  step's batch, from the traced allocations);
* ``parameter_size``: bytes of the trainable variables created in the layer's scope (exact);
* an edge ``A -- B`` for every layer B that reads a forward output of layer A.

The batch size is not in the file: it is the batch the profiled step ran (the caller knows
it). ``epl.plan.auto.profile.Profile.dump()`` writes it; ``epl-plan`` plans from it.

Example:
  >>> p = epl.profiler.profile(sess, train_op, feed, steps=3)
  >>> open("model.txt", "w").write(p.dump())
"""
import collections

import numpy as np
import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl.op_tables import READ_OPS, VARIABLE_OPS, mutates, variable_dtype, variable_shape
from epl.plan.auto.profile import Node, Profile

_NOT_LAYERS = ("gradients", "epl_", "EPL_", "save", "init", "report_uninitialized")


def layer_of(name):
  """The layer (top-level scope) of an op name, and whether it is a backward op."""
  parts = name.split("/")
  backward = parts[0] == "gradients" or parts[0].startswith("gradients_")
  if backward:
    parts = parts[1:]
  if len(parts) < 2 or parts[0].startswith(_NOT_LAYERS):
    return None, backward
  return parts[0], backward


def _trace(sess, fetches, feed_dict):
  meta = tf.RunMetadata()
  sess.run(fetches, feed_dict, options=tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE),
           run_metadata=meta)
  return meta


def profile(sess, fetches, feed_dict=None, steps=3, graph=None, trainable=None):
  """Returns the ``Profile`` of the model ``fetches`` trains (see the module docstring).

  ``trainable``: the trained variables' ops (default: the graph's trainable collection).
  """
  graph = graph or sess.graph
  trainable = [v.op for v in graph.get_collection(tf.GraphKeys.TRAINABLE_VARIABLES)] \
      if trainable is None else list(trainable)
  forward_ops, order = _layers(graph, trainable)
  index = {layer: i for i, layer in enumerate(order)}
  crossing = set()                            # (op name, output slot) read by another layer
  for layer in order:
    for op in forward_ops[layer]:
      for t in op.outputs:
        if any(_reader(c, index) not in (None, layer) for c in t.consumers()):
          crossing.add((op.name, t.value_index))
  forward_ms, backward_ms, out_bytes = _timed(sess, fetches, feed_dict, steps, index, crossing)
  params = collections.Counter()
  for var in trainable:
    layer, _ = layer_of(var.name + "/x")
    if layer in index:
      shape, dtype = variable_shape(var), variable_dtype(var)
      params[layer] += int(np.prod(shape.as_list())) * dtype.size
  edges = []
  for layer in order:
    readers = {_reader(c, index) for op in forward_ops[layer] for t in op.outputs
               for c in t.consumers()} - {None, layer}
    edges += [("node%d" % (index[layer] + 1), "node%d" % (index[r] + 1))
              for r in sorted(readers, key=index.get)]
  nodes = tuple(Node("node%d" % (i + 1), layer, forward_ms[layer] / steps,
                     backward_ms[layer] / steps, (out_bytes[layer] / steps,),
                     float(params[layer]))
                for i, layer in enumerate(order))
  return Profile(nodes, tuple(edges))


def _layers(graph, trainable):
  """({layer: its forward ops}, the model's layers in graph order): a layer is a name scope
  holding computing forward ops, not one that updates the trained variables."""
  after = _after_gradients(graph)            # clipping, the optimizer: not model layers
  forward_ops = {}
  for op in graph.get_operations():
    layer, backward = layer_of(op.name)
    if layer is not None and not backward and op not in after:
      forward_ops.setdefault(layer, []).append(op)
  trained = set(trainable)
  initialisers = {v.initializer for v in graph.get_collection(tf.GraphKeys.GLOBAL_VARIABLES)} | {
      c for var in trained for c in var.outputs[0].consumers()
      if c.type in ("Assign", "AssignVariableOp") and "/Initializer/" in c.inputs[1].name}
  updates = {layer_of(op.name)[0] for op in graph.get_operations()      # the optimizer
             if mutates(op) and op.type not in READ_OPS and op not in initialisers and
             any(t.op in trained for t in op.inputs)}
  order = sorted((layer for layer, ops in forward_ops.items()
                  if layer not in updates and any(_computes(op) for op in ops)),
                 key=lambda layer: min(compat.op_id(op) for op in forward_ops[layer]))
  return forward_ops, order


def _timed(sess, fetches, feed_dict, steps, index, crossing):
  """Per layer, summed over ``steps`` traced steps (after a warm-up): forward ms, backward
  ms, and bytes of the ``crossing`` outputs."""
  forward_ms, backward_ms = collections.Counter(), collections.Counter()
  out_bytes = collections.Counter()
  sess.run(fetches, feed_dict)                # warm-up: not traced
  for _ in range(steps):
    meta = _trace(sess, fetches, feed_dict)
    for dev in meta.step_stats.dev_stats:
      if "stream:" in dev.device or "memcpy" in dev.device:
        continue
      for n in dev.node_stats:
        layer, backward = layer_of(n.node_name)
        if layer not in index:
          continue
        ms = max(n.op_end_rel_micros - n.op_start_rel_micros, 0) / 1000.0
        (backward_ms if backward else forward_ms)[layer] += ms
        if not backward:
          for out in n.output:
            if (n.node_name, out.slot) in crossing:
              out_bytes[layer] += out.tensor_description.allocation_description.requested_bytes
  return forward_ms, backward_ms, out_bytes


def _after_gradients(graph):
  """Ops that read (transitively) a gradient: gradient clipping, the optimizer's update."""
  work = [op for op in graph.get_operations() if layer_of(op.name)[1]]
  seen = set(work)
  while work:
    op = work.pop()
    for t in op.outputs:
      for c in t.consumers():
        if c not in seen:
          seen.add(c)
          work.append(c)
  return seen


def _reader(op, index):
  """The layer of a forward op among ``index``, else None."""
  layer, backward = layer_of(op.name)
  return layer if not backward and layer in index else None


def _computes(op):
  """A forward op of the step (not a variable, its read or its initialiser)."""
  return any(t.op.type != "Const" for t in op.inputs) and op.type not in VARIABLE_OPS and \
      "/Initializer/" not in op.name \
      and not (op.type in READ_OPS and op.inputs[0].op.type in VARIABLE_OPS) and \
      not (mutates(op) and op.inputs[0].op.type in VARIABLE_OPS)
