"""epl.Config: typed configuration, the only reader of ``EPL_*`` environment variables.

Precedence: the dict given to ``Config`` > ``EPL_<SECTION>_<KEY>`` > the default. Every key of
the user contract (docs/configuration.md) is in ``KEYS``; an unknown key is an error that
suggests the closest valid key, and a key whose feature is not built yet is refused when set to
anything but its default.

Example:
  >>> config = Config({"pipeline.num_micro_batch": 1})
  >>> config.pipeline.num_micro_batch
  1
"""
import dataclasses
import os
from typing import Any, Optional, Tuple

from epl.errors import ConfigError, NotImplementedYetError, closest


# What a key does on a graph without any epl annotation (``Key.unannotated``); every key
# decides (tests/test_config_keys.py walks KEYS): a key a user sets acts or is refused, never
# accepted and ignored.
IMPLICIT = "implicit"   # acts on the one model copy epl then makes of the whole graph
ACTS = "acts"           # acts whatever the annotations (AMP, logging, the job's set-up)
MOOT = "moot"           # only concerns several copies (communication) or a split: nothing to
                        # do with one copy, and nothing different happens
REFUSED = "refused"     # set on an unannotated graph: a PlanError names the key and the fix


@dataclasses.dataclass(frozen=True)
class Key:
  """One configuration key: its type, default, allowed values and whether it is built."""
  name: str
  kind: str                          # "int", "bool", "str", "loss_scale"
  default: Any
  choices: Tuple[str, ...] = ()      # for "str": allowed spellings (matched case-insensitively)
  minimum: Optional[int] = None      # for "int"
  built: Any = True                  # False: only the default is accepted; a tuple: the
                                     # values that are built (the others are refused)
  help: str = ""
  unannotated: str = ACTS            # IMPLICIT / ACTS / MOOT / REFUSED (above)
  requires: Optional[str] = None     # a key it only refines: set without that key's being
                                     # set too, it is refused (ConfigError names both)

  def is_built(self, value):
    if isinstance(self.built, tuple):
      return value in self.built
    return self.built or value == self.default

  @property
  def env_name(self):
    return "EPL_" + self.name.replace(".", "_").upper()


def _k(*args, **kwargs):
  return Key(*args, **kwargs)


KEYS = {k.name: k for k in [
    _k("pipeline.num_micro_batch", "int", 1, minimum=1,
       help="micro-batches per step (pipeline / gradient accumulation)", unannotated=IMPLICIT),
    _k("pipeline.num_stages", "int", -1, help="stages for auto.auto_parallel",
       requires="auto.auto_parallel"),
    _k("pipeline.strategy", "str", "PreferBackward", ("PreferBackward", "PreferForward"),
       help="pipeline schedule", unannotated=MOOT),
    _k("gradient_checkpoint.type", "str", "", ("", "collection", "auto"),
       help="recompute forward activations in backward from checkpoints",
       unannotated=IMPLICIT),
    _k("gradient_checkpoint.end_taskgraph", "int", -1,
       help="last TaskGraph index gradient checkpointing applies to (-1: all)",
       unannotated=IMPLICIT, requires="gradient_checkpoint.type"),
    _k("gradient_checkpoint.check_gradients", "bool", False,
       help="check in the first training step that recomputed tensors equal forward's",
       unannotated=IMPLICIT, requires="gradient_checkpoint.type"),
    _k("zero.level", "str", "", ("", "v0", "v1", "v2"), built=("", "v0", "v1", "v2"),
       help="v0: each data-parallel replica keeps and updates the optimizer state of its "
            "share of the variables; v1: also reduces each gradient on its owner only; v2: "
            "also the weights, sent to the other replicas just in time",
       unannotated=REFUSED),
    _k("offload.level", "str", "", ("", "v0"),
       help="v0: weights, optimizer slots and the update live on the host CPU",
       unannotated=IMPLICIT),
    _k("amp.level", "str", "", ("", "O1"),
       help="O1: compute-heavy ops (matmul, conv) and what follows them run in amp.dtype; "
            "weights stay float32 and are cast just before each use"),
    _k("amp.loss_scale", "loss_scale", "dynamic",
       help="float16 loss scaling: 'dynamic' (2^15, halve and skip the update on inf/nan, "
            "double after 2000 good steps) or a fixed number", requires="amp.level"),
    _k("amp.debug_log", "bool", False, help="log every op AMP converts and why others stay",
       requires="amp.level"),
    _k("amp.dtype", "str", "float16", ("float16", "bfloat16"),
       help="the low precision of amp.level O1 (bfloat16: no loss scaling needed)",
       requires="amp.level"),
    _k("graph.grappler", "str", "auto", ("on", "off", "auto"),
       help="TF's graph optimizer (Grappler) in sessions on epl's graph; off: its whole-graph "
            "passes are skipped (the first step of a cloned graph compiles ~8x faster here); "
            "auto: off where the worker's graph holds several model copies or micro-batches",
       unannotated=ACTS),
    _k("graph.micro_batches", "str", "auto", ("auto", "runs", "functions", "clones"),
       help="how micro-batches (pipeline.num_micro_batch > 1) are built: runs -- gradient "
            "accumulation on one stage, one session run per micro-batch, the update in the "
            "last; functions -- each stage's forward and backward one graph function, called "
            "once per micro-batch in the schedule's order (the graph does not grow with "
            "them); clones -- every micro-batch a clone of the model in one run; auto: runs "
            "for one replicated stage without zero.level or offload.level, functions for a "
            "pipeline where they apply, clones otherwise",
       unannotated=ACTS, requires="pipeline.num_micro_batch"),
    _k("optimizer.num_apply_group", "int", 1, minimum=1,
       help="run the optimizer update in this many sequential groups balanced by size",
       unannotated=IMPLICIT),
    _k("cluster.device_place_prefer_intra_node", "bool", True, built=(True,),
       help="a model replica stays inside one worker when it fits (False: not built)"),
    _k("cluster.run_visible_devices", "str", ""),
    _k("cluster.colocate_split_and_replicate", "bool", False, unannotated=MOOT),
    _k("cluster.startup_timeout", "int", 45, minimum=1,
       help="seconds every worker waits for all workers to start before failing"),
    _k("cluster.devices_per_worker", "int", 0, minimum=0,
       help="accelerators per worker; 0 = all visible GPUs, or 1 virtual CPU device"),
    _k("communication.num_communicators", "int", 2, minimum=1,
       help="independent collective channels the gradient buckets are spread over",
       unannotated=MOOT),
    _k("communication.sparse_as_dense", "bool", False, unannotated=MOOT),
    _k("communication.max_splits", "int", 5, minimum=1, unannotated=MOOT),
    _k("communication.fp16", "bool", False,
       help="float32 gradient buckets travel between workers as float16", unannotated=MOOT),
    _k("communication.fp16_scale", "int", 128, minimum=1,
       help="multiplies a bucket before its float16 cast (divided back after)",
       unannotated=MOOT, requires="communication.fp16"),
    _k("communication.clip_after_allreduce", "bool", True,
       help="the user's clipping and optimizer see the all-reduced gradients (EPL: False)",
       unannotated=MOOT),
    _k("communication.gradients_reduce_method", "str", "mean", ("mean", "sum"),
       unannotated=MOOT),
    _k("communication.collective_timeout", "int", 300, minimum=1,
       help="seconds a collective may wait for its peers before failing (no hangs)",
       unannotated=MOOT),
    _k("communication.unique_request_ids", "bool", True,
       help="multi-worker jobs draw TF's RPC request ids from one process-wide 64-bit stream, "
            "so that TF never rejects a step as a duplicate request (False: TF's own ids; a "
            "rejected step is then run again)"),
    _k("communication.release_aborted_rendezvous", "bool", True,
       help="multi-worker jobs free the per-step rendezvous TF aborts at a step's cleanup "
            "(TF keeps each one forever: memory grows with the steps; False: TF's own)"),
    _k("communication.native_hooks_untested_tf", "bool", False,
       help="install unique_request_ids / release_aborted_rendezvous (hooks below Python) on "
            "a TensorFlow version they were not tested on (default: skipped with a warning)"),
    _k("io.slicing", "bool", False, help="shard constant file lists across workers"),
    _k("io.unbalanced_io_slicing", "bool", False, requires="io.slicing"),
    _k("io.drop_last_files", "bool", False, requires="io.slicing"),
    _k("auto.auto_parallel", "bool", False,
       help="cut an un-annotated model into pipeline.num_stages stages by profiled cost"),
    _k("auto.device_memory", "str", "",
       help="memory per device the planner's plan must fit (16GiB, 512MB, bytes); "
            "auto.auto_parallel then picks stages where data parallelism does not fit",
       requires="auto.auto_parallel"),
    _k("auto.layout", "str", "",
       help="the layout auto.auto_parallel runs without planning: '{\"split\": t, "
            "\"micro_batches\": m}' (set by epl when it re-executes a process whose plan is "
            "tensor parallel)", requires="auto.auto_parallel"),
    _k("launch.worker_index", "int", -1, help="set by epl-launch: this worker's rank"),
    _k("launch.machine_list", "str", "",
       help="under mpirun: every rank's host, in rank order (MPI does not tell a process "
            "where the other ranks run); epl.scheduler"),
    _k("launch.parent_pid", "int", 0,
       help="set by epl-launch: the worker stops when this process (the launcher) is gone"),
    _k("launch.job_id", "str", "",
       help="the job's name; a worker given another job's address fails at start-up naming "
            "both (default: derived from the workers' addresses; epl-launch --job_id)"),
    _k("launch.attempt", "int", 0, minimum=0,
       help="set by epl-launch: how many times the job was restarted before this run"),
    _k("launch.status_file", "str", "",
       help="set by epl-launch: where this worker reports its first step (restart decisions)"),
    _k("launch.max_restarts", "int", 0, minimum=0,
       help="epl-launch --max_restarts: restart every worker from the last checkpoint after a "
            "failure, at most this often (within launch.restart_window)"),
    _k("launch.restart_window", "int", 0, minimum=0,
       help="epl-launch --restart_window: seconds in which launch.max_restarts counts "
            "restarts (0: the whole run)"),
    _k("launch.python", "str", "",
       help="the command epl-launch runs a .py script with: an interpreter and its options, "
            "split as a shell would (default: epl-launch's own interpreter)"),
    _k("launch.elastic_workers", "int", 0, minimum=0,
       help="set by epl-launch --min_workers: the workers the elastic job started with; on "
            "fewer, pipeline.num_micro_batch grows by that ratio (the global batch is kept)"),
    _k("launch.resize_file", "str", "",
       help="set by epl-launch --min_workers: when this file exists, the chief stops (exit "
            "code 75) after its next checkpoint, so the job can grow back"),
    _k("launch.port_range", "str", "",
       help="epl-launch --port_range LOW-HIGH: the ports the workers' servers may use"),
    _k("split.gather_fallback", "str", "allow", ("allow", "refuse"),
       help="an op of a split TaskGraph that no split rule covers runs on the whole value "
            "(its parts gathered on the first part's device, its gradient sent back): "
            "\"allow\" runs it (the plan lists each gather), \"refuse\" makes a gather the "
            "training step needs a PlanError before training", unannotated=MOOT),
    _k("testing.race_delay_ms", "int", 0, minimum=0,
       help="tests only, the race amplifier: every read of a variable the training step "
            "writes starts this many ms after its inputs are ready, so a write the graph does "
            "not order after it runs first in almost every run (0: off)", unannotated=MOOT),
    _k("log.summary_dir", "str", "",
       help="worker 0 writes epl's progress figures and each reported step's breakdown as "
            "TensorBoard summaries (and the plan's picture) into this directory"),
    _k("log.progress_secs", "int", 30, minimum=0,
       help="worker 0 logs steps/s and samples/s of the parallel step this often (0: off)",
       unannotated=MOOT),
    _k("log.stall_secs", "int", 60, minimum=1,
       help="a multi-worker step running max(this, 10 x the median step) is reported as "
            "stalled (by the worker and by epl-launch), before collective_timeout ends it",
       unannotated=MOOT),
    _k("log.level", "str", "info", ("debug", "info", "warning", "error"),
       help="epl's own messages (plan, passes, collectives at debug); epl-launch --debug"),
]}

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off", "")


def _parse(key, value, from_env):
  """Returns ``value`` converted to ``key``'s type, or raises ConfigError naming the key."""
  def bad(expected):
    source = " (from environment variable %s)" % key.env_name if from_env else ""
    return ConfigError("Config key %r%s got %r; expected %s." % (key.name, source, value, expected))

  if key.kind == "bool":
    if isinstance(value, bool):
      return value
    if from_env and isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
      return value.strip().lower() in _TRUE
    raise bad("a bool (True/False%s)" % ("; true/false/1/0 in the environment" if from_env else ""))
  if key.kind == "int":
    if isinstance(value, bool):
      raise bad("an int")
    if isinstance(value, str) and from_env:
      try:
        value = int(value.strip())
      except ValueError:
        raise bad("an int") from None
    if not isinstance(value, int):
      raise bad("an int")
    if key.minimum is not None and value < key.minimum and value != key.default:
      raise bad("an int >= %d" % key.minimum)
    return value
  if key.kind == "str":
    if not isinstance(value, str):
      raise bad("a string, one of %s" % ", ".join(repr(c) for c in key.choices))
    if key.choices:
      for choice in key.choices:
        if choice.lower() == value.strip().lower():
          return choice
      raise bad("one of %s" % ", ".join(repr(c) for c in key.choices))
    return value
  if key.kind == "loss_scale":
    if isinstance(value, str):
      if value.strip().lower() == "dynamic":
        return "dynamic"
      try:
        value = float(value)
      except ValueError:
        raise bad('"dynamic" or a positive number') from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
      raise bad('"dynamic" or a positive number')
    return value
  raise AssertionError(key.kind)


def _unknown(name, env_name=None):
  hint = closest(name, KEYS)
  fix = "did you mean %r?" % hint if hint else "see docs/configuration.md for the keys"
  if env_name and hint:
    fix = "did you mean %r (environment variable %s)?" % (hint, KEYS[hint].env_name)
  source = " (from environment variable %s)" % env_name if env_name else ""
  return ConfigError("Unknown epl config key %r%s: %s" % (name, source, fix))


class Config:
  """Typed epl configuration.

  Args:
    param_dict: optional dict of ``"section.key": value``.

  Raises:
    ConfigError: unknown key (with the closest valid key), or a value of the wrong type.
    NotImplementedYetError: a key whose feature is not built yet, set to a non-default value.

  Values are read as ``config.get("pipeline.num_micro_batch")`` or as attributes
  ``config.pipeline.num_micro_batch``.
  """

  def __init__(self, param_dict=None, environ=None):
    environ = os.environ if environ is None else environ
    param_dict = dict(param_dict or {})
    for name in param_dict:
      if not isinstance(name, str) or name not in KEYS:
        raise _unknown(str(name))
    for var in environ:
      if var.startswith("EPL_") and var not in _ENV_NAMES and var.count("_") >= 2:
        section = var[4:].split("_", 1)[0].lower()
        if section in _SECTIONS:
          raise _unknown(var[4:].lower().replace("_", ".", 1), env_name=var)
    values = {}
    for name, key in KEYS.items():
      from_env = name not in param_dict and key.env_name in environ
      if name in param_dict:
        value = _parse(key, param_dict[name], from_env=False)
      elif from_env:
        value = _parse(key, environ[key.env_name], from_env=True)
      else:
        value = key.default
      if not key.is_built(value):
        others = [v for v in key.built if v != key.default] if isinstance(key.built, tuple) \
            else []
        other = " or one of %s" % ", ".join(repr(v) for v in others) if others else ""
        raise NotImplementedYetError(
            "Config key %r=%r%s: this feature is not implemented yet in epl; remove the %s "
            "(default %r)%s." % (name, value,
                                 " (from environment variable %s)" % key.env_name if from_env
                                 else "", "variable" if from_env else "key", key.default,
                                 other))
      values[name] = value
    for name, key in KEYS.items():
      if key.requires and values[name] != key.default and \
          values[key.requires] == KEYS[key.requires].default:
        raise ConfigError(
            "Config key %r=%r has no effect unless %r is set too (it is %r): set %r, or "
            "remove %r" % (name, values[name], key.requires, values[key.requires],
                           key.requires, name))
    object.__setattr__(self, "_values", values)
    for section in _SECTIONS:
      object.__setattr__(self, section, _Section(section, values))

  def get(self, name):
    """Returns the value of key ``name`` (``"section.key"``)."""
    if name not in self._values:
      raise _unknown(name)
    return self._values[name]

  def to_dict(self):
    return dict(self._values)

  def __setattr__(self, name, value):
    raise AttributeError("epl.Config is read-only; build a new Config({...}) instead")

  def __eq__(self, other):
    return isinstance(other, Config) and other._values == self._values

  def __repr__(self):
    changed = {n: v for n, v in self._values.items() if v != KEYS[n].default}
    return "epl.Config(%r)" % changed


class _Section:
  """``config.pipeline``: read-only attribute access to one section's keys."""
  __slots__ = ("_name", "_values")

  def __init__(self, name, values):
    prefix = name + "."
    object.__setattr__(self, "_name", name)
    object.__setattr__(self, "_values", {
        n[len(prefix):]: v for n, v in values.items() if n.startswith(prefix)})

  def __getattr__(self, key):
    try:
      return self._values[key]
    except KeyError:
      raise AttributeError(str(_unknown("%s.%s" % (self._name, key)))) from None

  def __setattr__(self, key, value):
    raise AttributeError("epl.Config is read-only; build a new Config({...}) instead")

  def __repr__(self):
    return "%s(%s)" % (self._name, ", ".join("%s=%r" % kv for kv in self._values.items()))


_SECTIONS = sorted({name.split(".")[0] for name in KEYS})
_ENV_NAMES = {key.env_name for key in KEYS.values()}
