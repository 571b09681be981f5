"""Variables created in an ``epl.split`` scope: one PartitionedVariable of per-part variables
(the variable creator ``epl._tf_compat.split_variables`` enters), and ``relayout``, which makes
one again cut another way before anything but epl's split rules has read it.

A variable is created cut the default way (epl.sharding.rules.split_axis); its first use may
settle another cut (epl.sharding.layout). ``relayout`` then creates the new parts from the
same initial value, takes the first parts out of every graph collection (no saver,
initializer or optimizer sees them: they stay in the graph unread) and points the
PartitionedVariable object the user holds at the new parts. A Keras layer that listed the
first parts in its own ``trainable_weights`` keeps listing them: use
``tf.trainable_variables()`` (what the optimizers use by default) inside split scopes.
"""
import functools
import re

from tensorflow.python.framework import ops as _ops
from tensorflow.python.framework import tensor_shape as _tensor_shape
from tensorflow.python.ops import array_ops as _array_ops
from tensorflow.python.ops import variables as _variables

from epl.sharding import rules as _split_rules
from epl.sharding import sharded as _sharded


_PART_NAME = re.compile(r"/part_\d+$")


def create(scope_of, next_creator, **kwargs):
  """Creates a variable of a split scope as a PartitionedVariable (epl.sharding.rules): the
  full initial value is computed once on the host and each part starts from its slice.
  ``scope_of()``: the rules context of the split scope the variable is created in, or None."""
  scope = scope_of()
  name = kwargs.get("name") or "Variable"
  if scope is None or _sharded.in_rule() or _PART_NAME.search(name) or \
      _part_of(name, scope.recorder.shard_ops) is not None:
    # a user's own partitioner makes its parts, a hand-written optimizer its slots named
    # after a part (adopt_part_slots): leave them
    return next_creator(**kwargs)
  shape = kwargs.get("shape")
  initial = kwargs.get("initial_value")
  if shape is None and not callable(initial) and hasattr(initial, "shape"):
    shape = initial.shape
  shape = _tensor_shape.TensorShape(shape)
  layout = _split_rules.variable_layout(scope, shape.as_list()) if \
      shape.is_fully_defined() else None
  if layout is None or initial is None:
    return next_creator(**kwargs)
  axis, sizes = layout
  dtype = kwargs.get("dtype")
  scoped = _ops.get_default_graph().unique_name(name, mark_as_used=False)
  with _ops.init_scope(), _ops.name_scope(None), _ops.device("/device:CPU:0"):
    with _ops.name_scope(scoped + "/Initializer/"):
      full = initial() if callable(initial) else initial
      full = _ops.convert_to_tensor(full, dtype=dtype.base_dtype if dtype else None)
  source = _Source(full, kwargs, next_creator, name)
  parts = source.parts(axis, sizes)
  full_name = parts[0].op.name[:-len("/part_0")]
  partitions = [1] * len(shape)
  partitions[axis] = len(parts)
  variable = _variables.PartitionedVariable(full_name, shape.as_list(), parts[0].dtype.base_dtype,
                                            parts, partitions)
  variable._epl_source = source            # pylint: disable=protected-access
  whole = _split_rules.adopt_variable(scope, parts, axis)
  variable._concat = lambda: whole          # pylint: disable=protected-access
  scope.recorder.variables[whole] = functools.partial(relayout, variable)
  return variable


class _Source:
  """What a split variable's parts are made from: the full initial value (on the host), the
  creator's arguments and the creator that made the first parts."""

  def __init__(self, full, kwargs, next_creator, name):
    self.full, self.kwargs, self.next_creator, self.name = full, kwargs, next_creator, name
    self.full_name = None

  def parts(self, axis, sizes):
    """New part variables: the slices of the full value along ``axis`` (None: one part, the
    whole value)."""
    shape = self.full.shape.as_list()
    if axis is None:
      axis, sizes = 0, [shape[0]] if shape else [1]
    with _ops.init_scope(), _ops.name_scope(None), _ops.device("/device:CPU:0"):
      with _ops.name_scope(self.full.op.name.rsplit("/", 1)[0] + "/"):
        pieces = _array_ops.split(self.full, list(sizes), axis=axis) if len(sizes) > 1 \
            else [self.full]
    parts, offset = [], 0
    for i, (piece, size) in enumerate(zip(pieces, sizes)):
      part_shape = list(shape)
      if part_shape:
        part_shape[axis] = size
      part = self.next_creator(**dict(self.kwargs, initial_value=piece, shape=part_shape,
                                      name="%s/part_%d" % (self.name, i)))
      if self.full_name is None:
        self.full_name = part.op.name[:-len("/part_%d" % i)]
      offsets = [0] * len(part_shape)
      if offsets:
        offsets[axis] = offset
      offset += size
      part._set_save_slice_info(_variables.Variable.SaveSliceInfo(  # pylint: disable=protected-access
          self.full_name, shape, offsets, part_shape))
      parts.append(part)
    return parts


def relayout(variable, scope, axis, sizes, shards=None):
  """Makes ``variable`` (created by ``create``, read by no op yet but epl's rules) again,
  cut along ``axis`` into ``sizes`` (part i on shard ``shards[i]``), or whole (``axis``
  None, on the first shard); returns the value its reads now give."""
  source = variable._epl_source             # pylint: disable=protected-access
  graph = _ops.get_default_graph()
  old = list(variable._get_variable_list())  # pylint: disable=protected-access
  for key in graph.get_all_collection_keys():
    ref = graph.get_collection_ref(key)
    ref[:] = [v for v in ref if not any(v is p for p in old)]
  for part in old:
    scope.recorder.shard_ops.pop(part.op.name, None)
    scope.recorder.retired.add(part.op.name)
  for whole, again in list(scope.recorder.variables.items()):
    if again.args[0] is variable:
      del scope.recorder.variables[whole]
  parts = source.parts(axis, sizes)
  partitions = [1] * len(variable.get_shape())
  if axis is not None:
    partitions[axis] = len(parts)
  variable._variable_list = parts           # pylint: disable=protected-access
  variable._partitions = partitions         # pylint: disable=protected-access
  variable._as_tensor = None                # pylint: disable=protected-access
  if axis is None:
    scope.recorder.shard_ops[parts[0].op.name] = 0
    with _ops.control_dependencies(None), _ops.name_scope(None), \
        _ops.name_scope(source.full_name + "/"):
      whole = _array_ops.identity(parts[0], name="read_whole")
  else:
    whole = _split_rules.adopt_variable(scope, parts, axis, shards)
  variable._concat = lambda: whole          # pylint: disable=protected-access
  return whole


def _part_of(name, shards):
  """The longest ``<part>`` of a variable name ``<part>/<suffix>`` that names a split
  variable's part (``shards``: part op name -> shard), or None."""
  head = name
  while "/" in head:
    head = head.rsplit("/", 1)[0]
    if head in shards:
      return head
  return None


def adopt_part_slots(graph, shards):
  """Slots a hand-written optimizer made for a split variable's parts by name (BERT's
  AdamWeightDecayOptimizer: ``tf.get_variable(part.name + "/adam_m", shape=part.shape)``) are
  split like the part, as TF's own slot_creator splits them: each saved as its slice of
  ``<variable>/<suffix>`` (so a checkpoint restores into the local model and any layout) and
  placed with its part (``shards``, part op name -> shard, gains the slot). Returns the names
  adopted."""
  parts = {v.op.name: v for v in graph.get_collection(_ops.GraphKeys.GLOBAL_VARIABLES)
           if v.op.name in shards and v._get_save_slice_info() is not None}  # pylint: disable=protected-access
  adopted = []
  if not parts:
    return adopted
  for v in graph.get_collection(_ops.GraphKeys.GLOBAL_VARIABLES):
    if v._get_save_slice_info() is not None:  # pylint: disable=protected-access
      continue
    owner = _part_of(v.op.name, parts)
    info = owner and parts[owner]._get_save_slice_info()  # pylint: disable=protected-access
    shape = v.get_shape().as_list()
    if info is None or not shape or shape != list(info.var_shape[:len(shape)]):
      continue
    n = len(shape)
    v._set_save_slice_info(_variables.Variable.SaveSliceInfo(  # pylint: disable=protected-access
        info.full_name + v.op.name[len(owner):], list(info.full_shape[:n]),
        list(info.var_offset[:n]), shape))
    shards[v.op.name] = shards[owner]
    adopted.append(v.op.name)
  return adopted
