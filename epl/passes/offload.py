"""CPU offload pass (``offload.level: "v0"``): weights, optimizer slots and the update live
on the host.

Expects: the ``replicate`` clones (every copy's variables) and the plan's apply phase. Moves,
in every model copy of this worker, to the host CPU of the worker that holds the copy:

* every variable of the copy (its weights, the optimizer's slots and bookkeeping such as
  Adam's beta powers) and the job's shared ones (``global_step``) -- the device keeps no
  persistent copy of any of them;
* whatever TF keeps with a variable: its reads, initialisers, the replica sync's assigns and
  every op colocated with it (``colocate_with(var)``: the optimizer's update ops);
* the copy's apply phase (the optimizer's computation and the writes);
* epl.amp's casts of a weight to float16 / bfloat16 (amp.level O1): the weight travels to
  the device in half the bytes.

A forward or backward op on an accelerator that reads a weight receives it from the host in
each step (TF's send/recv): the copy lives only as long as the step needs it. The gradients
are computed (and all-reduced) on the devices and travel to the host once per step. Returns
``Offloaded``.
"""
import dataclasses
import re
from typing import Tuple

import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl.op_tables import VARIABLE_OPS

_DEVICE = re.compile(r"/device:[^/]*$")


@dataclasses.dataclass(frozen=True)
class Offloaded:
  variables: Tuple[str, ...]        # variable ops (every local copy's) now on a host
  moved: int                        # ops moved in all

  def __str__(self):
    return "Offloaded(%d variables, %d ops on the host)" % (len(self.variables), self.moved)


def _host_of(device, default):
  """The host CPU of the task that holds ``device`` (``default`` when it is not placed)."""
  if not device:
    return default
  return _DEVICE.sub("/device:CPU:0", device) if "/device:" in device else default


def _low_precision_casts(read):
  """epl.amp's casts of a weight's read to float16 / bfloat16: on the host, the weight
  travels to the device in half the bytes (epl.amp casts per use, so nothing outlives it)."""
  return [c for t in read.outputs for c in t.consumers()
          if c.type == "Cast" and c.name.startswith("epl_amp/") and
          c.outputs[0].dtype.base_dtype in (tf.float16, tf.bfloat16)]


def offload(ctx):
  """Runs the pass; see the module docstring."""
  if ctx.plan.memory.offload != "v0":
    return Offloaded((), 0)
  graph, worker = ctx.graph, ctx.worker
  clones = ctx.clones()
  analysis = ctx.result("analyze")
  moved = {}

  def move(op, host):
    if op not in moved:
      compat.set_device(op, host)
      moved[op] = host

  apply_ops = [op for op in analysis.cloned if ctx.phase.get(op) == "apply"]
  for c in range(worker.num_copies):
    for op in apply_ops:
      clone = clones.op(c, op)
      if clone is not None:
        move(clone, _host_of(clone.device, worker.host))
  variables = [op for op in graph.get_operations() if op.type in VARIABLE_OPS]
  for var in variables:
    host = _host_of(var.device, worker.host)
    move(var, host)
    for consumer in var.outputs[0].consumers():   # reads, assigns, initialisers, updates
      move(consumer, host)
      for cast in _low_precision_casts(consumer):
        move(cast, host)
  names = {var.name: moved[var] for var in variables}
  for op in graph.get_operations():                # ops TF colocates with a moved variable
    for group in op.colocation_groups():
      target = group.decode()[len("loc:@"):]
      if target in names:
        move(op, names[target])
  return Offloaded(tuple(sorted(v.name for v in variables)), len(moved))
