"""Errors epl raises for its users.

Every message names what the user wrote (a config key, a scope and where it was entered, an
op), the conflicting values and the fix. Internal invariants use ``assert`` instead.
"""
import difflib


class EplError(Exception):
  """Base class of every error epl raises on purpose."""


class ConfigError(EplError, ValueError):
  """A configuration key or value is wrong."""


class NotImplementedYetError(EplError, NotImplementedError):
  """A documented feature that this version of epl does not build yet."""


class AnnotationError(EplError):
  """Strategy scopes were used in a way epl cannot honour."""


class PlanError(EplError):
  """The annotations do not fit the devices of the job, or the graph cannot be planned."""


class RuntimeStateError(EplError, RuntimeError):
  """epl was used in the wrong state (no epl.init, eager mode, ...)."""


def closest(word, candidates):
  """Returns the candidate closest to ``word`` (or None) for 'did you mean' hints."""
  found = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.4)
  return found[0] if found else None
