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


class Layering:
  """The layers of a model: its top-level name scopes -- or, where one scope holds most of
  the model (OpenAI's GPT-2: ``model/h0``, ``model/h1``, ..., ``model/ln_f``), that
  scope's own sub-scopes, each run of ops directly in it (the embedding lookup before
  ``h0``, the tied logits after ``ln_f``) a layer of its own (``model/~0``, ``model/~1``).
  ``of(name)``: (layer, backward) of an op name, a backward op by the forward op it
  differentiates; ``order``: the layers in graph order; ``forward_ops``: {layer: its ops}."""

  def __init__(self, graph, trainable):
    self.expanded = {}                 # scope -> {direct op name: its run's layer}
    self.forward_ops, self.order = _layers(graph, trainable, self.of)
    while len(self.expanded) < 3:
      sizes = {layer: sum(map(_computes, self.forward_ops[layer])) for layer in self.order}
      scope = max(self.order, key=sizes.get, default=None)
      # one scope holding most of the model (not a numbered block: that is a layer already)
      if scope is None or 2 * sizes[scope] <= sum(sizes.values()) or scope[-1].isdigit():
        break
      self.expanded[scope] = _runs(scope, self.forward_ops[scope])
      forward_ops, order = _layers(graph, trainable, self.of)
      if len(order) <= len(self.order):
        del self.expanded[scope]
        break
      self.forward_ops, self.order = forward_ops, order

  def of(self, name):
    layer, backward = layer_of(name)
    if layer is None or layer not in self.expanded:
      return layer, backward
    rest = name.split("/")[1 + backward:]
    while layer in self.expanded:
      direct = self.expanded[layer]
      head = rest[0]
      if backward and head.endswith("_grad") and layer + "/" + head[:-5] in direct:
        return direct[layer + "/" + head[:-5]], True
      if len(rest) == 1 or layer + "/" + head in direct:
        return direct.get(layer + "/" + head), backward
      layer, rest = layer + "/" + head, rest[1:]
    return layer, backward


def _runs(scope, ops):
  """{op name: layer} of the ops directly in ``scope`` (not in a sub-scope): each run of
  them in creation order, between sub-scopes that compute, is one layer ``scope/~k``."""
  runs, k, inside = {}, -1, True
  for op in sorted(ops, key=compat.op_id):
    if "/" in op.name[len(scope) + 1:]:
      inside = inside or _computes(op)       # a variable's read or initialiser: no block
      continue
    if inside:
      k, inside = k + 1, False
    runs[op.name] = "%s/~%d" % (scope, k)
  return runs


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
  layering = Layering(graph, trainable)
  forward_ops, order, of = layering.forward_ops, layering.order, layering.of
  index = {layer: i for i, layer in enumerate(order)}
  crossing = set()                            # (op name, output slot) read by another layer
  for layer in order:
    for op in forward_ops[layer]:
      for t in op.outputs:
        if any(_reader(c, index, of) not in (None, layer) for c in t.consumers()):
          crossing.add((op.name, t.value_index))
  forward_ms, backward_ms, out_bytes = _timed(sess, fetches, feed_dict, steps, index, crossing,
                                              of)
  params = collections.Counter()
  for layer, variables in layer_parameters(trainable, layering).items():
    params[layer] = sum(nbytes for _, _, nbytes in variables)
  edges = []
  for layer in order:
    readers = {_reader(c, index, of) for op in forward_ops[layer] for t in op.outputs
               for c in t.consumers()} - {None, layer}
    edges += [("node%d" % (index[layer] + 1), "node%d" % (index[r] + 1))
              for r in sorted(readers, key=index.get)]
  nodes = tuple(Node("node%d" % (i + 1), layer, forward_ms[layer] / steps,
                     backward_ms[layer] / steps, (out_bytes[layer] / steps,),
                     float(params[layer]))
                for i, layer in enumerate(order))
  return Profile(nodes, tuple(edges))


def layer_parameters(trainable, layering):
  """{layer: [(variable op, shape list, bytes)]} of the trained variables ``trainable`` (ops),
  each counted in one layer of ``layering`` (``_parameter_layer``)."""
  index = {layer: i for i, layer in enumerate(layering.order)}
  out = {}
  for var in trainable:
    layer = _parameter_layer(var, index, layering.of)
    if layer is not None:
      shape, dtype = variable_shape(var), variable_dtype(var)
      out.setdefault(layer, []).append(
          (var, shape.as_list(), int(np.prod(shape.as_list())) * dtype.size))
  return out


def _parameter_layer(var, index, of):
  """The layer a trained variable's bytes count in: its scope's, else (a variable made
  directly in an expanded scope, a tied embedding) the first layer that reads it."""
  layer, _ = of(var.name + "/x")
  if layer in index:
    return layer
  readers = [c for t in var.outputs for r in t.consumers()
             for c in ([r] + [c for u in r.outputs for c in u.consumers()])]
  found = [x for x in (_reader(c, index, of) for c in readers) if x is not None]
  return min(found, key=index.get, default=None)


def _layers(graph, trainable, of=layer_of):
  """({layer: its forward ops}, the model's layers in graph order): a layer is a name scope
  holding computing forward ops, not one that updates the trained variables."""
  after = _after_gradients(graph)            # clipping, the optimizer: not model layers
  forward_ops = {}
  for op in graph.get_operations():
    layer, backward = of(op.name)
    if layer is not None and not backward and op not in after:
      forward_ops.setdefault(layer, []).append(op)
  trained = set(trainable)
  initialisers = {v.initializer for v in graph.get_collection(tf.GraphKeys.GLOBAL_VARIABLES)} | {
      c for var in trained for c in var.outputs[0].consumers()
      if c.type in ("Assign", "AssignVariableOp") and "/Initializer/" in c.inputs[1].name}
  updates = {of(op.name)[0] for op in graph.get_operations()      # the optimizer
             if mutates(op) and op.type not in READ_OPS and op not in initialisers and
             any(t.op in trained for t in op.inputs)}
  order = sorted((layer for layer, ops in forward_ops.items()
                  if layer not in updates and any(_computes(op) for op in ops)),
                 key=lambda layer: min(compat.op_id(op) for op in forward_ops[layer]))
  return forward_ops, order


def _timed(sess, fetches, feed_dict, steps, index, crossing, of):
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
        layer, backward = of(n.node_name)
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


def _reader(op, index, of=layer_of):
  """The layer of a forward op among ``index``, else None."""
  layer, backward = of(op.name)
  return layer if not backward and layer in index else None


def _computes(op):
  """A forward op of the step (not a variable, its read or its initialiser)."""
  return any(t.op.type != "Const" for t in op.inputs) and op.type not in VARIABLE_OPS and \
      "/Initializer/" not in op.name \
      and not (op.type in READ_OPS and op.inputs[0].op.type in VARIABLE_OPS) and \
      not (mutates(op) and op.inputs[0].op.type in VARIABLE_OPS)
