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
  """What epl sets in the environment on import, each only where the user has not:

  ``TF_USE_LEGACY_KERAS=1``: must be set before tf.layers is touched.
  ``TF_CPU_ALLOCATOR_USE_BFC=true``: TF's pooling (BFC) allocator for CPU memory, read when
  the process creates its first device. With TF's default (malloc where oneDNN is off, as
  on CPUs without AVX-512) every large tensor, a gradient bucket or an all-reduce's result,
  is a fresh mmap whose pages fault in and are zeroed in every step: the concatenation of a
  64 MiB all-reduce's pieces took 80 ms of a 0.65 s step, and the all-reduce between 2 hosts
  reached 0.83 of a 1 Gbit/s link's ring bound with malloc, 0.92 pooled (bench/cluster.py,
  docs/benchmarks.md). ``TF_CPU_ALLOCATOR_USE_BFC=false`` keeps malloc.
  """
  os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
  os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
