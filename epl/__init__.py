"""epl: distributed training for TensorFlow 1.x graphs (data, pipeline, tensor parallelism).

Public API (names fixed by EPL's documentation):

  epl.init(config=None)            start epl for the current default graph
  epl.Config(param_dict)           typed configuration
  epl.replicate(device_count, name) / epl.split(device_count, name)   strategy scopes
  epl.set_default_strategy(s)      strategy of ops outside any scope
  epl.Env.get()                    .config, .cluster
  epl.add_to_collection / epl.get_collection / epl.GraphKeys   merged outputs
  epl.Graph.get()                  introspection of the parallel graph (.format())
  epl.memory.measure(sess, fetches)   per-device memory of one step (variables + step peak)

``import epl`` does not import TensorFlow (the names load on first use), so the command-line
tools answer ``--help`` at once; it sets ``TF_USE_LEGACY_KERAS=1`` if unset, which must happen
before ``tf.layers`` is first touched, and ``TF_CPU_ALLOCATOR_USE_BFC=true`` if unset (TF's
pooling allocator for CPU memory; epl.env.set_env_defaults says why).
"""
import importlib

from epl.env import set_env_defaults as _set_env_defaults

_set_env_defaults()

# public name -> the module that defines it
_EXPORTS = {
    "init": "epl.entry", "replicate": "epl.entry", "split": "epl.entry",
    "set_default_strategy": "epl.entry", "add_to_collection": "epl.entry",
    "get_collection": "epl.entry", "Graph": "epl.entry",
    "Config": "epl.config", "Env": "epl.env", "EplError": "epl.errors",
    "GraphKeys": "epl.collections_api",
}
_SUBMODULES = ("timeline", "testing", "errors", "cluster", "config", "memory", "profiler")

__all__ = ["init", "Config", "replicate", "split", "set_default_strategy", "Env",
           "add_to_collection", "get_collection", "GraphKeys", "Graph", "EplError"]
__version__ = "0.1.0"


def __getattr__(name):
  if name in _EXPORTS:
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
  elif name in _SUBMODULES:
    value = importlib.import_module("epl." + name)
  else:
    raise AttributeError("module 'epl' has no attribute %r" % name)
  globals()[name] = value
  return value


def __dir__():
  return sorted(list(globals()) + __all__ + list(_SUBMODULES))
