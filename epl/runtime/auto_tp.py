"""``auto.auto_parallel``'s tensor parallelism: when no data-parallel or pipeline plan fits
``auto.device_memory``, the planner tries the whole model as one ``epl.split`` of degree t
(2, 4, ... dividing a worker's devices; Megatron's rule: tensor parallelism inside a node, as
much as memory needs) with data parallelism over the rest of the devices.

Cost apart from search: tensor parallelism of degree t is a transformation of the profile
(``tp_profile``) -- each layer's compute / t plus Megatron's two all-reduces forward and two
backward of its output (a layer with a sharded weight), its weights (and so gradients and
optimizer slots) / t where a split scope shards them (``epl.sharding.rules.variable_layout``),
its activations kept whole (conservative: the split rules shard some) -- planned by the same
``plan_pipeline`` on t-device groups, one stage.

Split rules act while the model is built, so the plan runs in a second pass: the process is
re-executed (same pid, same command line, ``sys.orig_argv``) with ``auto.layout`` in its
environment (``EPL_AUTO_LAYOUT='{"split": t, "micro_batches": m}'``); there ``epl.init``
opens a split scope of degree t named ``auto_split`` that holds everything the script builds
until its first ``tf.gradients`` (``minimize`` and ``compute_gradients`` call it), and the
step keeps the data-parallel model's global batch with m = t x ``pipeline.num_micro_batch``
micro-batches per model replica. Setting ``auto.layout`` yourself skips the planning.
"""
import json
import logging
import os
import sys
import threading

from epl import annotate
from epl import profiler
from epl.config import KEYS
from epl.errors import ConfigError, PlanError
from epl.op_tables import VARIABLE_OPS
from epl.plan.auto.profile import Profile
from epl.sharding.rules import split_axis

log = logging.getLogger("epl")

SCOPE_NAME = "auto_split"


# ---- cost: tensor parallelism as a profile transformation -------------------------------------
def sharded_fractions(layering, trainable, degree):
  """{layer: the share of its trained variables' bytes a split scope of ``degree`` shards}."""
  out = {}
  for layer, variables in profiler.layer_parameters(trainable, layering).items():
    total = sum(nbytes for _, _, nbytes in variables)
    cut = sum(nbytes for _, shape, nbytes in variables if _shardable(shape, degree))
    out[layer] = cut / total if total else 0.0
  return out


def _shardable(shape, degree):
  axis = split_axis(shape)
  return axis is not None and shape[axis] is not None and shape[axis] >= degree


def tp_profile(profile, degree, fractions, spec):
  """``profile`` as one group of ``degree`` devices running it split (module docstring)."""
  nodes = []
  for node in profile.nodes:
    share = fractions.get(node.name, 0.0)
    reduce_ms = 0.0
    if share:
      reduce_ms = 2 * 1e3 * spec.allreduce_s(range(degree), node.activation_bytes)
    nodes.append(node.__class__(
        node.id, node.name, node.forward_ms / degree + reduce_ms,
        node.backward_ms / degree + reduce_ms, node.outputs,
        node.parameter_bytes * (1 - share + share / degree), node.stage_id))
  return Profile(tuple(nodes), profile.edges, source="%s (split %d)" % (profile.source, degree))


def degrees(per_worker):
  """The tensor-parallel degrees tried, smallest first: those dividing a worker's devices."""
  return [t for t in range(2, per_worker + 1) if per_worker % t == 0]


def choose(profile, plan_at, per_worker, layering, trainable):
  """The smallest degree whose plan fits: (degree, plan), or None. ``plan_at(tp_profile,
  degree)`` plans one stage over the job's devices / degree (PlanError: nothing fits)."""
  for degree in degrees(per_worker):
    fractions = sharded_fractions(layering, trainable, degree)
    if not any(fractions.values()):
      return None
    try:
      return degree, plan_at(lambda spec, d=degree, f=fractions: tp_profile(profile, d, f, spec),
                             degree)
    except PlanError:
      continue
  return None


# ---- the second pass ---------------------------------------------------------------------------
def layout_of(config):
  """The layout ``auto.layout`` gives ({"split": t, "micro_batches": m}), or None."""
  text = config.auto.layout
  if not text:
    return None
  try:
    layout = json.loads(text)
  except ValueError as e:
    raise ConfigError("auto.layout=%r is not JSON (%s): give e.g. '{\"split\": 2, "
                      "\"micro_batches\": 4}', or leave it unset to let auto.auto_parallel "
                      "plan" % (text, e)) from None
  if not isinstance(layout, dict) or set(layout) - {"split", "micro_batches"} or not all(
      isinstance(layout.get(k), int) and not isinstance(layout.get(k), bool) and
      layout.get(k) >= 1 for k in ("split", "micro_batches")):
    raise ConfigError("auto.layout=%r: expected {\"split\": t, \"micro_batches\": m} with "
                      "whole numbers >= 1" % text)
  return layout


def open_scope(state, layout, recorder_of_graph):
  """Opens the ``auto_split`` scope the second pass builds the model in (epl.init)."""
  from epl import _tf_compat as compat
  if any(op.type in VARIABLE_OPS for op in state.graph.get_operations()):
    raise PlanError("auto.layout=%s splits the model built after epl.init, but this graph "
                    "has variables already: call epl.init before building the model"
                    % json.dumps(layout, sort_keys=True))
  scope = annotate.Strategy(annotate.SPLIT, layout["split"], SCOPE_NAME, recorder_of_graph,
                            context=compat.split_variables)
  scope.__enter__()
  state.auto_scope, state.auto_scope_thread = scope, threading.get_ident()
  state.recorder.micro_batches = layout["micro_batches"]
  log.info("auto.auto_parallel: the model is built in epl.split(%d) (auto.layout), %d "
           "micro-batch(es) per model replica", layout["split"], layout["micro_batches"])


def close_scope(state):
  """Closes the ``auto_split`` scope (before the first gradients, or at the rewrite)."""
  scope = state.auto_scope
  if scope is None or state.auto_scope_thread != threading.get_ident():
    return               # another thread's graph building: the opening thread closes it
  state.auto_scope = None
  scope.__exit__(None, None, None)


def relaunch(layout, cluster):
  """Re-executes this process with ``layout`` as ``auto.layout`` (does not return)."""
  text = json.dumps(layout, sort_keys=True)
  how = "%s=true %s='%s' python %s" % (KEYS["auto.auto_parallel"].env_name,
                                         KEYS["auto.layout"].env_name, text,
                                         " ".join(sys.orig_argv[1:]))
  if cluster.worker_num > 1:
    raise PlanError(
        "auto.auto_parallel: only tensor parallelism fits auto.device_memory (layout %s), and "
        "a job of %d workers is not re-executed by epl (each worker would need to agree); set "
        "auto.layout=%s on every worker (e.g. %s=true %s=%r before epl-launch)"
        % (text, cluster.worker_num, text, KEYS["auto.auto_parallel"].env_name,
           KEYS["auto.layout"].env_name, text))
  if os.environ.get("PYTEST_CURRENT_TEST"):
    raise PlanError("auto.auto_parallel chose the layout %s, which runs in a re-executed "
                    "process, but this one is a pytest run (re-executing it would run the "
                    "tests again): run the script as a process, or %s" % (text, how))
  if not sys.argv or sys.argv[0] in ("", "-c") or hasattr(sys, "ps1"):
    raise PlanError("auto.auto_parallel chose the layout %s, which runs in a re-executed "
                    "process, but this one is interactive or `python -c`: run the script as "
                    "a file, or %s" % (text, how))
  log.warning("auto.auto_parallel: only tensor parallelism fits auto.device_memory: "
              "re-executing this process with auto.layout=%s (skip the planning next time: "
              "%s)", text, how)
  for handler in logging.getLogger("epl").handlers:
    handler.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  env = dict(os.environ)
  env[KEYS["auto.layout"].env_name] = text
  env[KEYS["auto.auto_parallel"].env_name] = "true"     # Configs read from the environment
  os.execve(sys.executable, [sys.executable] + sys.orig_argv[1:], env)
