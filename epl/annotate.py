"""Strategy scopes (``replicate``, ``split``, ``set_default_strategy``) and op capture.

A scope records which ops the user created inside it by op id: the graph's version at entry
and exit bound the ids (the "capture ops" idea; nothing in TF is patched for it). Ops outside
every scope are assigned by EPL's rules (see ``Recorder.taskgraph_of``). The scope stack is
thread-local and only lives while the graph is built.

The public ``epl.replicate`` / ``epl.split`` / ``epl.set_default_strategy`` (epl.entry) build
these objects and hand over the recorder of the graph being built.

Example:
  >>> with epl.replicate(device_count=1, name="stage_0"):
  ...   hidden = tf.layers.dense(x, 16)
"""
import bisect
import dataclasses
import os
import sys
import threading
from typing import Optional

from epl.errors import AnnotationError

REPLICATE = "replicate"
SPLIT = "split"

_local = threading.local()


def _stack():
  if not hasattr(_local, "stack"):
    _local.stack = []
  return _local.stack


def _user_location():
  """file:line of the user's code that entered a scope (first frame outside epl)."""
  here = os.path.dirname(os.path.abspath(__file__))
  frame = sys._getframe(1)
  while frame and os.path.abspath(frame.f_code.co_filename).startswith(here):
    frame = frame.f_back
  if frame is None:
    return "<unknown>"
  return "%s:%d" % (os.path.basename(frame.f_code.co_filename), frame.f_lineno)


@dataclasses.dataclass(frozen=True)
class TaskGraphSpec:
  """What one annotation asked for: recorded at graph-build time."""
  index: int
  kind: str                # REPLICATE or SPLIT
  device_count: Optional[int]
  name: str
  location: str            # file:line where the user opened the scope

  def describe(self):
    return "%s(device_count=%s, name=%r) at %s" % (
        self.kind, self.device_count, self.name, self.location)


class Strategy:
  """A strategy annotation; use as a context manager or pass to ``set_default_strategy``.

  ``recorder_of_default_graph`` is called when the scope is entered: it hands over the
  Recorder of the graph being built (epl.entry supplies it).
  """

  def __init__(self, kind, device_count, name, recorder_of_default_graph, context=None):
    if device_count is not None and (isinstance(device_count, bool) or
                                     not isinstance(device_count, int) or device_count < 1):
      raise AnnotationError("epl.%s(device_count=%r): device_count must be a positive int" %
                            (kind, device_count))
    self.kind, self.device_count, self.name = kind, device_count, name
    self._recorder_of_default_graph = recorder_of_default_graph
    self._recorder = None
    self._context = context       # () -> a context manager entered with the scope
    self._entered = None

  def __enter__(self):
    stack = _stack()
    location = _user_location()
    if stack:
      outer = stack[-1]
      raise AnnotationError(
          "epl scopes cannot be nested: %s opened inside %s. Close the outer scope first; "
          "each scope is one TaskGraph." % (self._describe(location), outer[1].describe()))
    recorder = self._recorder_of_default_graph()
    spec = recorder.enter_scope(self, location)
    stack.append((self, spec))
    self._recorder = recorder
    if self._context is not None:
      self._entered = self._context()
      self._entered.__enter__()
    return self

  def __exit__(self, *exc):
    if self._entered is not None:
      self._entered.__exit__(*exc)
      self._entered = None
    _, spec = _stack().pop()
    self._recorder.exit_scope(spec)
    self._recorder = None
    return False

  def _describe(self, location):
    return "%s(device_count=%s, name=%r) at %s" % (self.kind, self.device_count, self.name,
                                                   location)

  def __repr__(self):
    return "epl.%s(device_count=%s, name=%r)" % (self.kind, self.device_count, self.name)


def set_default(strategy, recorder_of_default_graph):
  """Ops created outside any scope from now on form a new TaskGraph with ``strategy``.

  Raises:
    AnnotationError: ``strategy`` is not an epl strategy, or a scope is open.
  """
  if not isinstance(strategy, Strategy):
    raise AnnotationError("epl.set_default_strategy expects epl.replicate(...) or epl.split(...), "
                          "got %r" % (strategy,))
  location = _user_location()
  if strategy.kind == SPLIT:
    raise AnnotationError(
        "epl.set_default_strategy(%r) at %s: a default strategy must be epl.replicate; put "
        "the ops to split inside `with epl.split(...):`" % (strategy, location))
  if _stack():
    raise AnnotationError("epl.set_default_strategy(%r) called at %s inside the scope %s; call it "
                          "outside every scope" % (strategy, location, _stack()[-1][1].describe()))
  recorder_of_default_graph().set_default(strategy, location)


class Recorder:
  """Records TaskGraphs and op-id intervals of one graph while the user builds it.

  Positions are ``graph.version`` values (the op count): the i-th op created has rank i.
  Segments map ranks to TaskGraphs: segment i covers ranks in (start_i, start_{i+1}].
  Phase intervals (backward/apply) come from the compat hooks around gradient and optimizer
  calls; ``gradients`` are the (gradient, variable op) pairs every ``tf.gradients`` call
  returned (the raw gradients, before any clipping), ``grads_and_vars`` the pairs every
  ``apply_gradients`` call saw.
  """

  def __init__(self, graph):
    self.graph = graph
    self.specs = []          # TaskGraphSpec, in creation order
    self.micro_batches = None  # auto.auto_parallel's planner: micro-batches per step
    self._starts = []        # segment start versions (sorted)
    self._owners = []        # TaskGraph index per segment
    self._default = None     # TaskGraph index of the current default strategy
    self.phase_intervals = []  # (first_id, last_id, phase)
    self.grads_and_vars = []   # (grad, var) pairs given to apply_gradients
    self.gradients = []        # (grad, variable op) pairs tf.gradients returned
    self.twins = {}            # op name -> name of the op whose TaskGraph and phase it takes:
                               # ops a transform built for another one (epl.amp)
    # epl.split: what its rules built (epl.sharding.rules)
    self.shard_intervals = []  # (first, last, shard) ops of one shard
    self.rule_intervals = []   # (first, last) ops built by a rule (they may read sharded values)
    self._claimed = []         # (first, last, TaskGraph index): ops a split rule built outside
                               # its scope (they read a sharded value): they join its TaskGraph
    self.shard_ops = {}        # op name -> shard (variable parts)
    self.sharded = {}          # whole tensor -> epl.sharding.sharded.Sharded
    self.sharded_shapes = {}   # tf.shape of a sharded value -> its Sharded
    self.variables = {}        # whole read of a split variable whose cut is not settled ->
                               # its relayout(scope, axis, sizes, shards)
    self.uses = {}             # sharded or split-variable tensor -> rules that read it
    self.reductions = []       # (TaskGraph, "forward"/"backward", op name): where the parts'
                               # partial results are summed (a tensor-parallel all-reduce)
    self.replaced = {}         # split value -> the value a relayout made again in its place
                               # (an op built after reads the new one)
    self.fallbacks = {}        # op name -> why a rule did not build it (it reads the whole
                               # value: a gather, epl.plan.split.gathers)
    self.retired = set()       # names of variable ops a relayout replaced (no collection
                               # holds them; the plan leaves out them and what reads them)
    self.exchange_axes = {}    # op name -> batch axis of the values it exchanges between the
                               # copies and the split parts (MoE all-to-all: the copies' expert
                               # slices, the concatenation of the parts' outputs)

  def _new_spec(self, strategy, location):
    spec = TaskGraphSpec(len(self.specs), strategy.kind, strategy.device_count,
                         strategy.name or "taskgraph_%d" % len(self.specs), location)
    self.specs.append(spec)
    return spec

  def _segment(self, owner):
    version = self.graph.version
    if self._starts and self._starts[-1] == version:
      self._owners[-1] = owner     # nothing was created in the previous segment
    else:
      self._starts.append(version)
      self._owners.append(owner)

  def enter_scope(self, strategy, location):
    """A new TaskGraph, or the earlier one of the same name (a scope can be reopened)."""
    spec = next((s for s in self.specs if strategy.name and s.name == strategy.name), None)
    if spec is None:
      spec = self._new_spec(strategy, location)
    elif (spec.kind, spec.device_count) != (strategy.kind, strategy.device_count):
      raise AnnotationError(
          "epl.%s(device_count=%s, name=%r) at %s reopens TaskGraph %r of %s with another "
          "strategy; use the same strategy or another name" % (
              strategy.kind, strategy.device_count, strategy.name, location, spec.name,
              spec.describe()))
    self._segment(spec.index)
    return spec

  def exit_scope(self, spec):
    self._segment(self._default if self._default is not None else spec.index)

  def set_default(self, strategy, location):
    spec = self._new_spec(strategy, location)
    self._default = spec.index
    self._segment(spec.index)

  def auto_stages(self, starts, location, counts=None):
    """``auto.auto_parallel``: TaskGraphs ``stage_0..stage_k-1`` of replicate(counts[i]
    (default 1)), stage i holding the ops of rank > ``starts[i]`` (``starts[0]`` is 0) up to
    the next start."""
    assert not self.specs and starts and starts[0] == 0
    for i in range(len(starts)):
      self.specs.append(TaskGraphSpec(i, REPLICATE, counts[i] if counts else 1,
                                      "stage_%d" % i, location))
    self._starts, self._owners = list(starts), list(range(len(starts)))

  def whole_graph(self, name, location):
    """A copy of this recorder (nothing recorded yet) in which every op belongs to one
    replicate(1) TaskGraph: what epl plans for an unannotated graph whose Config keys act on
    its one copy (epl.plan.build)."""
    assert not self.specs
    copy = Recorder.__new__(Recorder)
    copy.__dict__.update(self.__dict__)
    copy.specs = [TaskGraphSpec(0, REPLICATE, 1, name, location)]
    copy._starts, copy._owners, copy._default = [0], [0], 0
    return copy

  def add_shard_interval(self, first, last, shard):
    if last >= first:
      self.shard_intervals.append((first, last, shard))

  def add_rule_interval(self, first, last, taskgraph=None):
    if last >= first:
      self.rule_intervals.append((first, last))
      if taskgraph is not None and self.taskgraph_of(first) != taskgraph:
        self._claimed.append((first, last, taskgraph))

  def add_phase(self, first_id, last_id, phase):
    if last_id >= first_id:
      self.phase_intervals.append((first_id, last_id, phase))

  def taskgraph_of(self, op_id):
    """TaskGraph index of a (forward) op by EPL's rules, or None without annotations.

    Inside a scope: that scope. Outside: the default strategy's TaskGraph if one is set,
    else the most recent TaskGraph; ops created before the first annotation join the first.
    An op that reads a value sharded by a split TaskGraph joins that TaskGraph wherever it is
    built (its split rule builds it).
    """
    if not self.specs:
      return None
    for first, last, index in self._claimed:
      if first <= op_id <= last:
        return index
    i = bisect.bisect_left(self._starts, op_id) - 1
    return self._owners[i] if i >= 0 else self._owners[0]
