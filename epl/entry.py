"""``epl.init``: bind epl to the current default graph and install the compat hooks."""
import os

import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl.cluster import Cluster
from epl.config import Config
from epl.env import Env, GraphState
from epl.errors import RuntimeStateError


def _visible_gpus():
  return len(tf.config.list_physical_devices("GPU"))


def init(config=None):
  """Starts epl for the current default graph (graph mode only).

  Calling it again resets epl's state for a fresh graph.

  Args:
    config: an ``epl.Config`` (default: ``epl.Config()``, i.e. defaults + EPL_* environment).
  Returns:
    the ``epl.Env``.
  Raises:
    RuntimeStateError: TensorFlow runs eagerly (call
      ``tf.compat.v1.disable_v2_behavior()`` first).
  """
  if tf.executing_eagerly():
    raise RuntimeStateError(
        "epl.init() needs TensorFlow graph mode, but eager execution is on: call "
        "tf.compat.v1.disable_v2_behavior() (or disable_eager_execution()) before epl.init()")
  if config is None:
    config = Config()
  elif not isinstance(config, Config):
    raise RuntimeStateError("epl.init(config): expected an epl.Config, got %r" % (config,))
  cluster = Cluster.from_environment(config.cluster.devices_per_worker,
                                     os.environ.get("TF_CONFIG", ""), _visible_gpus())
  state = GraphState(tf.get_default_graph(), config, cluster)
  if cluster.distributed:
    from epl.runtime import server
    state.server = server.start_server(cluster)
    server.barrier(state.server, cluster, config.cluster.startup_timeout,
                   instance=server.next_barrier())
  Env._reset(state)  # pylint: disable=protected-access
  from epl.runtime.driver import Listener
  compat.install(Listener())
  return Env.get()
