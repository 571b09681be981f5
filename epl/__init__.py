"""epl: distributed training for TensorFlow 1.x graphs (data, pipeline, tensor parallelism).

Public API (names fixed by EPL's documentation):

  epl.init(config=None)            start epl for the current default graph
  epl.Config(param_dict)           typed configuration
  epl.replicate(device_count, name) / epl.split(device_count, name)   strategy scopes
  epl.set_default_strategy(s)      strategy of ops outside any scope
  epl.Env.get()                    .config, .cluster
  epl.add_to_collection / epl.get_collection / epl.GraphKeys   merged outputs
  epl.Graph.get()                  introspection of the parallel graph (.format())
"""
from epl.env import set_env_defaults as _set_env_defaults

_set_env_defaults()

# pylint: disable=wrong-import-position
from epl.collections_api import GraphKeys  # noqa: E402
from epl.config import Config  # noqa: E402
from epl.entry import (Graph, add_to_collection, get_collection, init, replicate,  # noqa: E402
                       set_default_strategy, split)
from epl.env import Env  # noqa: E402
from epl.errors import EplError  # noqa: E402
from epl import timeline  # noqa: E402,F401

__all__ = ["init", "Config", "replicate", "split", "set_default_strategy", "Env",
           "add_to_collection", "get_collection", "GraphKeys", "Graph", "EplError"]
__version__ = "0.1.0"
