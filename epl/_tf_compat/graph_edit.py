"""Accessors for TensorFlow's private graph-editing methods (op ids, in-place input, device
and control-input edits), so that a TF upgrade that renames them breaks this file only.
Re-exported by ``epl._tf_compat``."""
from tensorflow.core.framework import attr_value_pb2 as _attr_value


def op_id(op):
  """Creation-order id of ``op`` in its graph (monotonic; not equal to ``graph.version``)."""
  return op._id  # pylint: disable=protected-access


def set_device(op, device):
  op._set_device(device)  # pylint: disable=protected-access


def update_input(op, index, tensor):
  op._update_input(index, tensor)  # pylint: disable=protected-access


def control_outputs(op):
  """Ops that have ``op`` as a control input."""
  return op._control_outputs  # pylint: disable=protected-access


def downstream(ops, within=None):
  """``ops`` and every op after them by data or control edges (only through ops in
  ``within``, when given)."""
  seen, work = set(), list(ops)
  while work:
    op = work.pop()
    if op in seen or (within is not None and op not in within):
      continue
    seen.add(op)
    work.extend(c for t in op.outputs for c in t.consumers())
    work.extend(control_outputs(op))
  return seen


def in_control_flow(op):
  """True for an op built inside a v1 ``tf.cond`` branch or ``tf.while_loop`` body (its
  Python control-flow context; ops TF imported or epl cloned have none)."""
  return getattr(op, "_control_flow_context", None) is not None


def drop_colocation(op, names):
  """Removes ``op``'s colocation with each variable in ``names`` (its ``_class`` entries)."""
  groups = [g for g in op.node_def.attr["_class"].list.s if g[len(b"loc:@"):].decode() not in
            names] if "_class" in op.node_def.attr else None
  if groups:
    op._set_attr("_class", _attr_value.AttrValue(list=_attr_value.AttrValue.ListValue(s=groups)))
  elif groups is not None:
    op._clear_attr("_class")  # pylint: disable=protected-access


def add_control_inputs(op, control_ops):
  if control_ops:
    op._add_control_inputs(list(control_ops))  # pylint: disable=protected-access


def replace_control_inputs(op, replacements):
  """Makes ``op`` wait for ``replacements[x]`` instead of each control input ``x`` it names
  (``None``: no longer wait for ``x``)."""
  old = list(op.control_inputs)
  if not any(x in replacements for x in old):
    return
  new = []
  for x in old:
    y = replacements.get(x, x)
    if y is not None and y not in new:
      new.append(y)
  op._remove_all_control_inputs()  # pylint: disable=protected-access
  op._add_control_inputs(new)  # pylint: disable=protected-access


def import_nodes(graph, graph_def, input_map, names, prefix):
  """``tf.import_graph_def`` without its Python post-processing: returns the Operations named
  ``names`` of ``graph_def``, imported into ``graph`` under a unique ``prefix`` scope.

  Only for NodeDefs whose device is set as it should stay and that carry no colocation
  (``_class``), imported outside every device, control-dependency and control-flow scope
  (epl's clones): for them TF's post-processing (re-applying device functions under a device
  scope per op, reading each op's ``_class``) changes nothing and costs two thirds of the
  import. The C++ import and the Operation objects are TF's own; tests/test_clone.py checks
  that both paths build the same graph.
  """
  from tensorflow.python.framework import c_api_util, importer  # pylint: disable=import-outside-toplevel
  from tensorflow.python.client import pywrap_tf_session as c_api  # pylint: disable=import-outside-toplevel
  with graph.as_default(), graph.name_scope(prefix) as scope:
    unique = scope[:-1]
  scoped = c_api_util.ScopedTFImportGraphDefOptions()
  importer._PopulateTFImportGraphDefOptions(  # pylint: disable=protected-access
      scoped.options, unique, dict(input_map), [], True, False)
  with graph._mutation_lock():  # pylint: disable=protected-access
    buffer = c_api.TF_NewBufferFromString(graph_def.SerializeToString())
    try:
      with graph._c_graph.get() as c_graph:  # pylint: disable=protected-access
        results = c_api.TF_GraphImportGraphDefWithResults(c_graph, buffer, scoped.options)
      c_api_util.ScopedTFImportGraphDefResults(results)     # frees them
    finally:
      c_api.TF_DeleteBuffer(buffer)
    _wrap_new_operations(graph)
    _register_functions(graph, graph_def)
  return [graph._get_operation_by_name(  # pylint: disable=protected-access
      "%s/%s" % (unique, name)) for name in names]


class _ImportedFunction:
  """What ``Graph._functions`` holds for a FunctionDef the C++ import added (epl's stage
  functions): a name, and no Python graph (``as_graph_def(add_shapes=True)`` skips it)."""

  def __init__(self, name):
    self.name = name


def _register_functions(graph, graph_def):
  """Python's view of the functions an import added to the C++ graph's library, as
  ``Graph._add_function`` keeps it (a saver's ``export_meta_graph`` looks each one up)."""
  # pylint: disable=protected-access
  for fdef in graph_def.library.function:
    graph._functions.setdefault(fdef.signature.name, _ImportedFunction(fdef.signature.name))
  if graph_def.library.function and graph._graph_def_versions.min_consumer < 12:
    graph._graph_def_versions.min_consumer = 12


def _wrap_new_operations(graph):
  """TF's Operation objects for the ops an import created. Outside every control-dependency
  and control-flow scope, ``Graph._add_new_tf_operations``'s second pass over them (control
  inputs from the dependency scopes, control-flow context checks) finds nothing to do and
  costs as much as creating them (reading every op's inputs): only the first pass runs."""
  # pylint: disable=protected-access
  # (``tf.control_dependencies(None)`` pushes a controller with no inputs: nothing to add)
  if any(c.control_inputs for c in graph._control_dependencies_stack) or \
      graph._get_control_flow_context() is not None:
    graph._add_new_tf_operations(compute_devices=False)
    return
  for c_op in graph.new_operations():
    graph._create_op_from_tf_operation(c_op, compute_device=False)


def delay_op(graph, microseconds, after, device):
  """An op that ends ``microseconds`` after the ops ``after`` ran, without holding one of
  TF's inter-op threads meanwhile (a one-shot iterator over TF's test-only ``SleepDataset``:
  its ``IteratorGetNext`` waits on the iterator's own thread). Used by the race amplifier
  (``testing.race_delay_ms``) only."""
  import tensorflow.compat.v1 as tf   # pylint: disable=import-outside-toplevel
  from tensorflow.python.data.experimental.ops import testing as _data_testing  # pylint: disable=import-outside-toplevel
  with graph.as_default(), tf.name_scope(None), tf.device(device), \
      tf.control_dependencies(None), tf.name_scope("epl_race_delay"):
    data = tf.data.Dataset.from_tensors(0).repeat().apply(_data_testing.sleep(microseconds))
    options = tf.data.Options()       # no prefetch thread or autotuner per delay
    options.autotune.enabled = False
    options.experimental_optimization.inject_prefetch = False
    data = data.with_options(options)
    iterator = tf.data.make_one_shot_iterator(data)
    with tf.control_dependencies(after):
      return iterator.get_next().op
