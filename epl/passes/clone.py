"""The clone engine: copy a set of ops under a name prefix onto other devices, and rewire.

Reused by every pass that needs copies of the user's ops: model replicas (here), micro-batches
(pipeline), recompute segments (gradient checkpointing).

``clone_ops`` serialises the ops once, edits the NodeDefs (device, colocation, while-loop frame
names, inputs from outside the set) and imports them in one call of TF's C++ importer
(``compat.import_nodes``: without ``tf.import_graph_def``'s per-op Python post-processing,
which changes nothing for these NodeDefs), so it scales to graphs of hundreds of thousands of
ops. Function-body ops
(``tf.function``, control flow v2) refer to functions already in the graph's library.
"""
import hashlib

import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat

_FRAME_OPS = ("Enter", "RefEnter")


class NodeDefCache:
  """Node defs of a graph by op name, serialised once per rewrite (one C++ call)."""

  def __init__(self, graph):
    self.graph = graph
    self._nodes = None

  def get(self, name):
    if self._nodes is None or name not in self._nodes:
      self._nodes = {n.name: n for n in self.graph.as_graph_def(add_shapes=False).node}
    return self._nodes[name]

  def refresh(self):
    """Serialise again at the next ``get``: a pass changed ops already serialised."""
    self._nodes = None


def live_inputs(op):
  """``op``'s inputs as NodeDef input strings, read from the graph now: a NodeDefCache entry
  keeps the inputs the op had when the cache was filled, and passes rewire inputs after that
  (the bridge's gathers, recomputation, calls' results)."""
  return [t.name for t in op.inputs] + ["^" + x.name for x in op.control_inputs]


def _split_input(name):
  if name.startswith("^"):
    return name[1:], None
  op_name, _, index = name.partition(":")
  return op_name, int(index) if index else 0


def clone_ops(graph, ops, prefix, device_fn, input_map=None, node_cache=None, edit=None):
  """Clones ``ops`` (a list of Operations of ``graph``) under ``prefix``.

  Args:
    graph: the graph that holds ``ops`` and receives the clones.
    ops: the operations to copy. Inputs from ops inside the list are wired clone-to-clone;
      inputs from outside read the original tensor unless ``input_map`` overrides them.
    prefix: a name scope for the clones (made unique by TF if taken).
    device_fn: op -> device string for its clone ("" to let the placer decide).
    input_map: {original Tensor: replacement Tensor} for inputs from outside ``ops``.
    node_cache: a NodeDefCache to reuse between calls on the same graph.
    edit: optional (op, NodeDef) -> None that changes a clone's NodeDef before it is built
      (epl.amp switches its type attributes).

  Returns:
    {original op name: cloned Operation}.
  """
  return Cloner(graph, ops, device_fn, node_cache, edit).clone(prefix, input_map)


class Cloner:
  """Clones of one list of ops, as many as asked, each under its own prefix and input map
  (``clone``): the NodeDefs are edited once (device, colocation, ``edit``, inputs from outside
  the list); a clone changes only what depends on its prefix (while frames, random seeds,
  resource variable names). The pipeline's micro-batches of a copy are such clones: editing
  the NodeDefs per clone was a fifth of their cost. Arguments as ``clone_ops``'s."""

  def __init__(self, graph, ops, device_fn, node_cache=None, edit=None):
    self.graph, self.names = graph, [op.name for op in ops]
    node_cache = node_cache or NodeDefCache(graph)
    members = set(self.names)
    by_name = {}
    self.graph_def = tf.GraphDef()
    self.graph_def.versions.CopyFrom(graph.graph_def_versions)
    self.imports = {}                        # "src:index" -> the original tensor
    self.control_after = {}
    self.prefixed = []                       # (NodeDef, its prefix-free attributes)
    for op in ops:
      node = self.graph_def.node.add()
      node.CopyFrom(node_cache.get(op.name))
      node.device = device_fn(op) or ""
      if "_class" in node.attr:
        del node.attr["_class"]              # no colocation with the original
      node.input[:] = live_inputs(op)
      if edit is not None:
        edit(op, node)
      own = _prefix_free(node)
      if own:
        self.prefixed.append((node, own))
      inputs = list(node.input)
      del node.input[:]
      for name in inputs:
        src, index = _split_input(name)
        if src in members:
          node.input.append(name)
          continue
        if index is None:                     # control input from outside: re-added below
          self.control_after.setdefault(op.name, []).append(graph.get_operation_by_name(src))
          continue
        original = by_name.get(src) or graph.get_operation_by_name(src)
        by_name[src] = original
        key = "%s:%d" % (src, index)
        self.imports[key] = original.outputs[index]
        node.input.append(key)

  def clone(self, prefix, input_map=None):
    """{original op name: its clone under ``prefix``}; ``input_map`` as ``clone_ops``'s."""
    if not self.names:
      return {}
    input_map = input_map or {}
    for node, own in self.prefixed:
      _rename_for_clone(node, own, prefix)
    imports = {key: input_map.get(t, t) for key, t in self.imports.items()}
    with self.graph.as_default(), tf.name_scope(None), tf.control_dependencies(None), \
        tf.device(None):
      new_ops = compat.import_nodes(self.graph, self.graph_def, imports, self.names, prefix)
    mapping = dict(zip(self.names, new_ops))
    for name, controls in self.control_after.items():
      compat.add_control_inputs(mapping[name], list(controls))
    return mapping


  def nodes_into(self, graph_def, scope, prefix, outside):
    """This clone's NodeDefs added to ``graph_def`` (the caller imports it with other nodes)
    under the node-name scope ``scope``, made its own as ``clone(prefix)`` makes them (while
    frames, seeds, resource names). ``outside(x, name)``: the input text, for new node
    ``name``, naming the original tensor or op ``x`` from outside the list (a "^..." text for
    an op), or None for a wait the caller adds after the import. Returns the new node names, in ``self.names``' order."""
    members = set(self.names)
    for node in self.graph_def.node:
      new = graph_def.node.add()
      new.CopyFrom(node)
      new.name = "%s/%s" % (scope, node.name)
      own = _prefix_free(node)
      if own:
        _rename_for_clone(new, own, prefix)
      del new.input[:]
      for text in node.input:
        if text.lstrip("^").partition(":")[0] in members:
          new.input.append("%s%s/%s" % ("^" if text.startswith("^") else "", scope,
                                        text.lstrip("^")))
        else:
          new.input.append(outside(self.imports[text], new.name))
      for x in self.control_after.get(node.name, ()):
        text = outside(x, new.name)
        if text:
          new.input.append(text)
    return ["%s/%s" % (scope, name) for name in self.names]


def own_seeds(node, prefix):
  """Gives NodeDef ``node`` the random seed a clone under ``prefix`` draws with (what
  ``_rename_for_clone`` does for seeds alone: a function body keeps its frames and names)."""
  own = _prefix_free(node)
  if "seed2" in own:
    _rename_for_clone(node, {"seed2": own["seed2"]}, prefix)


def _prefix_free(node):
  """The attributes of ``node`` a clone's prefix changes, as the original has them
  ({} when none)."""
  own = {}
  if node.op in _FRAME_OPS:
    own["frame_name"] = node.attr["frame_name"].s.decode()
  if "seed2" in node.attr and (node.attr["seed"].i or node.attr["seed2"].i):
    own["seed2"] = node.attr["seed2"].i
  if node.op == "VarHandleOp" and node.attr["shared_name"].s:
    own["shared_name"] = node.attr["shared_name"].s.decode()
  return own


def _rename_for_clone(node, own, prefix):
  """What makes a clone's NodeDef its own (``own``: ``_prefix_free(node)``): its own while
  frame, random seed and resource variable name."""
  if "frame_name" in own:
    node.attr["frame_name"].s = ("%s/%s" % (prefix, own["frame_name"])).encode()
  if "seed2" in own:
    # a clone draws its own numbers (dropout masks, synthetic batches), reproducibly
    node.attr["seed2"].i = _clone_seed(own["seed2"], prefix)
  if "shared_name" in own:
    # A resource variable's name is its identity on a device: give the copy its own.
    node.attr["shared_name"].s = ("%s/%s" % (prefix, own["shared_name"])).encode()


def _clone_seed(seed2, prefix):
  digest = hashlib.sha256(("%d/%s" % (seed2, prefix)).encode()).digest()
  return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF or 1


def rewire(tensor, new_tensor, consumers):
  """Makes each op of ``consumers`` that reads ``tensor`` read ``new_tensor`` instead."""
  consumers = set(consumers)
  for consumer in list(tensor.consumers()):
    if consumer in consumers:
      for i, inp in enumerate(consumer.inputs):
        if inp is tensor:
          compat.update_input(consumer, i, new_tensor)


def wait_for_clones(ops, clone_maps, members):
  """Makes each op of ``ops`` (run once per step) also wait for the clones of its control
  inputs that are in ``members``, in every clone map ({original name: clone})."""
  for op in ops:
    extra = [clones[x.name] for x in op.control_inputs if x in members
             for clones in clone_maps if x.name in clones]
    compat.add_control_inputs(op, extra)
