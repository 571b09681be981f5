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
