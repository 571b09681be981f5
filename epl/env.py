"""``epl.Env``: the one piece of process state the public API requires.

``epl.init`` creates it for the current default graph; everything else receives what it needs
as arguments (the plan, the config, the cluster). ``Env.get()`` is a read-only view for users.
"""
import os

from epl.errors import RuntimeStateError


class GraphState:
  """What epl knows about the graph it was initialised for."""

  def __init__(self, graph, config, cluster):
    from epl.annotate import Recorder
    self.graph = graph
    self.config = config
    self.cluster = cluster
    self.recorder = Recorder(graph)
    self.parallel = None        # epl.runtime.parallel_graph.ParallelGraph once rewritten
    self.collections = {}       # epl.add_to_collection: key -> [tensor]
    self.server = None          # this worker's tf.train.Server in a multi-worker job
    self.fetch_mapper = None


class Env:
  """Read-only view of epl's state: ``epl.Env.get().config`` and ``.cluster``."""
  _current = None

  def __init__(self, state):
    self._state = state

  @classmethod
  def get(cls):
    """Returns the Env of the last ``epl.init``.

    Raises:
      RuntimeStateError: ``epl.init()`` was not called.
    """
    if cls._current is None:
      raise RuntimeStateError("epl is not initialised: call epl.init() before using epl")
    return cls._current

  @property
  def config(self):
    return self._state.config

  @property
  def cluster(self):
    return self._state.cluster

  def state(self):
    """The epl state of the graph, checked to still be the default graph."""
    import tensorflow.compat.v1 as tf
    if tf.get_default_graph() is not self._state.graph:
      raise RuntimeStateError(
          "epl was initialised for another graph; call epl.init() inside "
          "`with graph.as_default():` of the graph you build")
    return self._state

  @classmethod
  def _reset(cls, state):
    cls._current = cls(state) if state is not None else None

  @classmethod
  def state_for(cls, graph):
    """epl's state for ``graph`` or None when epl does not manage that graph."""
    env = cls._current
    if env is None or env._state.graph is not graph:
      return None
    return env._state


def set_env_defaults():
  """``TF_USE_LEGACY_KERAS=1`` must be set before tf.layers is touched."""
  os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
