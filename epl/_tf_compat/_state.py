"""The hooks' shared state: TF's own functions while the hooks are in place, the listener
that receives their events, and what every hook module needs from them."""
import contextlib
import inspect

from tensorflow.python.framework import ops as _ops

ORIGINALS = {}          # (owner, attribute) -> TF's own function
listener = None         # the epl.runtime.hooks.Dispatcher of the managed graph


def manages(graph):
  return listener is not None and listener.manages(graph)


def binder(original):
  """``bind(*args, **kwargs)`` for a hook that reads or changes some of the original's arguments
  by name: the caller's arguments bound to TF's own signature (defaults filled in). Every hook
  takes ``*args, **kwargs`` and forwards what it got, so none narrows TF's API for the process
  (a keyword TF adds later still reaches TF)."""
  signature = inspect.signature(original)

  def bind(*args, **kwargs):
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound
  return bind


@contextlib.contextmanager
def unfinalized(graph):
  """Lets epl add its own ops to a finalized graph, then finalizes it again."""
  was = graph.finalized
  if was:
    graph._unsafe_unfinalize()  # pylint: disable=protected-access
  try:
    yield
  finally:
    if was:
      ORIGINALS.get((_ops.Graph, "finalize"), _ops.Graph.finalize)(graph)
