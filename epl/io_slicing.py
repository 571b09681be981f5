"""IO slicing (``io.slicing``): each worker reads its own share of a file list.

The list is cut as the dataset is built (a compat hook on the op behind
``Dataset.from_tensor_slices``, which ``TFRecordDataset`` / ``TextLineDataset`` /
``FixedLengthRecordDataset`` use for their file names), so one-shot iterators — which copy
the dataset into a function — read the sliced list too. Worker ``i`` of ``W`` takes files
``i, i+W, i+2W, ...``; every worker holds the same number of model replicas, so equal shares
are shares in proportion to replicas.
"""
from epl.errors import PlanError


def assign_files(files, workers, index, unbalanced=False, drop_last=False):
  """This worker's files (pure).

  Raises:
    PlanError: fewer files than workers, or a remainder with neither
      ``io.unbalanced_io_slicing`` nor ``io.drop_last_files`` set.
  """
  n = len(files)
  if n < workers:
    raise PlanError(
        "io.slicing: %d file(s) cannot be shared by %d workers (each would need at least one); "
        "give at least %d files or turn io.slicing off" % (n, workers, workers))
  if n % workers:
    if drop_last:
      files = files[:n - n % workers]
    elif not unbalanced:
      raise PlanError(
          "io.slicing: %d files do not divide evenly among %d workers; set "
          "io.unbalanced_io_slicing=True (some workers read one more file) or "
          "io.drop_last_files=True (drop the last %d file(s))" % (n, workers, n % workers))
  return list(files[index::workers])


def file_list(element):
  """The file names in a from_tensor_slices element, if it is one constant string vector
  (the io.slicing hook in epl._tf_compat cuts such lists)."""
  import numpy as np
  import tensorflow.compat.v1 as tf
  if isinstance(element, (list, tuple)) and element and all(
      isinstance(e, (str, bytes)) for e in element):
    values = list(element)
  elif isinstance(element, np.ndarray) and element.ndim == 1 and element.dtype.kind in "SUO":
    values = element.tolist()
  elif hasattr(element, "dtype") and hasattr(element, "op") and element.dtype == "string":
    if element.op.type == "Reshape":            # readers flatten the list first
      element = element.op.inputs[0]
    value = tf.get_static_value(element)
    if value is None or np.ndim(value) > 1:
      return None
    values = np.atleast_1d(value).tolist()
  else:
    return None
  return [v.decode() if isinstance(v, bytes) else str(v) for v in values]
