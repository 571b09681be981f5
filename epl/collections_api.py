"""``epl.add_to_collection`` / ``epl.get_collection`` / ``epl.GraphKeys``: merged outputs.

Fetching a tensor added under a key returns its merge over the model copies: mean, sum or
concatenation along dimension 0. ``GLOBAL_*`` merge job-wide, ``LOCAL_*`` over this worker's
copies (the same on a single worker).
"""


class GraphKeys:
  GLOBAL_MEAN_OBJECTS = "global_mean_objects"
  GLOBAL_SUM_OBJECTS = "global_sum_objects"
  GLOBAL_CONCAT_OBJECTS = "global_concat_objects"
  LOCAL_MEAN_OBJECTS = "local_mean_objects"
  LOCAL_SUM_OBJECTS = "local_sum_objects"
  LOCAL_CONCAT_OBJECTS = "local_concat_objects"


# key -> (how copies merge, whether the merge spans every worker)
MERGE_KINDS = {
    GraphKeys.GLOBAL_MEAN_OBJECTS: ("mean", True), GraphKeys.LOCAL_MEAN_OBJECTS: ("mean", False),
    GraphKeys.GLOBAL_SUM_OBJECTS: ("sum", True), GraphKeys.LOCAL_SUM_OBJECTS: ("sum", False),
    GraphKeys.GLOBAL_CONCAT_OBJECTS: ("concat", True),
    GraphKeys.LOCAL_CONCAT_OBJECTS: ("concat", False),
}


def add_to_collection(tensor, key):
  """Marks ``tensor`` so that fetching it returns its merge over the model copies.

  Args:
    tensor: a tensor of the model (the loss, a metric, predictions).
    key: one of ``epl.GraphKeys``.
  Raises:
    ConfigError: ``key`` is not one of ``epl.GraphKeys``.
  """
  from epl.env import Env
  from epl.errors import ConfigError, closest
  if key not in MERGE_KINDS:
    hint = closest(str(key), MERGE_KINDS)
    raise ConfigError("epl.add_to_collection: unknown key %r%s; use one of epl.GraphKeys" % (
        key, " (did you mean %r?)" % hint if hint else ""))
  Env.get().state().collections.setdefault(key, []).append(tensor)


def get_collection(key):
  """The tensors added under ``key`` (a list, empty if none)."""
  from epl.env import Env
  return list(Env.get().state().collections.get(key, []))
