"""Variables created in an ``epl.split`` scope: one PartitionedVariable of per-part variables
(the variable creator ``epl._tf_compat.split_variables`` enters)."""
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
  if scope is None or _sharded.in_rule() or _PART_NAME.search(name):
    return next_creator(**kwargs)    # a user's own partitioner makes its parts: leave them
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
      pieces = _array_ops.split(full, list(sizes), axis=axis)
  parts, offset = [], 0
  for i, (piece, size) in enumerate(zip(pieces, sizes)):
    part_shape = shape.as_list()
    part_shape[axis] = size
    part = next_creator(**dict(kwargs, initial_value=piece, shape=part_shape,
                               name="%s/part_%d" % (name, i)))
    offsets = [0] * len(part_shape)
    offsets[axis] = offset
    offset += size
    full_name = part.op.name[:-len("/part_%d" % i)]
    part._set_save_slice_info(_variables.Variable.SaveSliceInfo(  # pylint: disable=protected-access
        full_name, shape.as_list(), offsets, part_shape))
    parts.append(part)
  partitions = [1] * len(shape)
  partitions[axis] = len(parts)
  variable = _variables.PartitionedVariable(full_name, shape.as_list(), parts[0].dtype.base_dtype,
                                            parts, partitions)
  whole = _split_rules.adopt_variable(scope, parts, axis)
  variable._concat = lambda: whole          # pylint: disable=protected-access
  return variable
