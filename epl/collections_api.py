"""``epl.GraphKeys``: the keys of ``epl.add_to_collection`` (merged outputs; see epl.entry).

Fetching a tensor added under a key returns its merge over the model copies: mean, sum or
concatenation along dimension 0. ``GLOBAL_*`` merge job-wide, ``LOCAL_*`` over this worker's
copies (the same on a single worker).
"""
from epl.errors import ConfigError, closest


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


def check_key(key):
  """Raises ConfigError unless ``key`` is one of ``epl.GraphKeys``."""
  if key not in MERGE_KINDS:
    hint = closest(str(key), MERGE_KINDS)
    raise ConfigError("epl.add_to_collection: unknown key %r%s; use one of epl.GraphKeys" % (
        key, " (did you mean %r?)" % hint if hint else ""))
