"""``epl.Env``: the one piece of process state the public API requires.

``epl.init`` creates it for the current default graph (epl.entry is its only writer and the
only module below the public API that reads it); everything else receives what it needs as
arguments. ``Env.get()`` is a read-only view for users.
"""
import os

from epl.errors import RuntimeStateError


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

  @classmethod
  def _reset_to(cls, state):
    cls._current = cls(state)


def set_env_defaults():
  """``TF_USE_LEGACY_KERAS=1`` must be set before tf.layers is touched."""
  os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
