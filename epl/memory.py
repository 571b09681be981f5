"""Per-device memory of a training step: what each device holds and its peak during a step.

All virtual CPU devices share one allocator, and TF reports only per-node peaks, so the peak
of one device is rebuilt from a traced step: each node's output buffers are allocated when the
node ends and freed when the last node reading them (on that device) ends; a buffer forwarded
by several outputs (Identity) counts once. A stage function's call (graph.micro_batches
"functions") counts as one node: its results from its end, its body's intermediates not at all
(they are freed within the call, and the trace does not say which call a body node ran in). Variables live for the whole run: they are counted
from the graph (their shape and device), outside the step.

Example:
  >>> report = epl.memory.measure(sess, train_op, feed_dict=feed)
  >>> print(report)                       # a table: device, variables, step peak, total
  >>> report.peak("/device:CPU:1")
"""
import collections
import dataclasses
import re
from typing import Dict

import numpy as np
import tensorflow.compat.v1 as tf

from epl.op_tables import VARIABLE_OPS, variable_dtype, variable_shape

_DEVICE = re.compile(
    r"(?:/job:([^/]+))?(?:/replica:\d+)?(?:/task:(\d+))?/device:([A-Za-z]+):(\d+)")


def short_device(name):
  """``/job:worker/replica:0/task:1/device:CPU:2`` -> ``/task:1/device:CPU:2``; a local
  session's ``/job:localhost/replica:0/task:0/device:CPU:2`` -> ``/device:CPU:2``."""
  m = _DEVICE.search(name or "")
  if not m:
    return name
  task = "/task:%s" % m.group(2) if m.group(2) is not None and m.group(1) != "localhost" \
      else ""
  return "%s/device:%s:%s" % (task, m.group(3).upper(), m.group(4))


def step_peaks(run_metadata):
  """{device: peak bytes of the buffers the traced step allocated there}.

  ``run_metadata`` comes from a run with ``RunOptions(trace_level=FULL_TRACE,
  output_partition_graphs=True)``.
  """
  consumers = collections.defaultdict(list)          # (node, slot) -> consumer node names
  nodes = set()
  for graph_def in run_metadata.partition_graphs:
    for node in graph_def.node:
      nodes.add(node.name)
      for name in node.input:
        if name.startswith("^"):
          continue
        src, _, slot = name.partition(":")
        consumers[(src, int(slot or 0))].append(node.name)
  peaks = {}
  for dev in run_metadata.step_stats.dev_stats:
    if "stream:" in dev.device or "memcpy" in dev.device:
      continue
    # the nodes of the step's graph: a function body's (a stage function's call) are traced
    # too; its intermediates die with the call, its results are the call node's outputs
    stats = [n for n in dev.node_stats if n.node_name in nodes]
    ends = {n.node_name: n.all_start_micros + max(n.all_end_rel_micros, 0) for n in stats}
    # A buffer is an address from its allocation to its last reader. An output at an address
    # still in use is the same buffer (an op that forwarded its input in place); one at an
    # address whose buffer was already read for the last time is a new allocation that
    # reuses the address.
    outputs = []
    for n in stats:
      end = ends[n.node_name]
      for out in n.output:
        alloc = out.tensor_description.allocation_description
        if alloc.allocated_bytes <= 0:
          continue
        last = max([ends[c] for c in consumers.get((n.node_name, out.slot), ())
                    if c in ends] + [end])
        outputs.append((end, last, alloc.ptr or (n.node_name, out.slot),
                        alloc.allocated_bytes))
    current, done = {}, []                             # ptr -> [bytes, alloc time, free time]
    for end, last, key, size in sorted(outputs, key=lambda o: o[0]):
      entry = current.get(key)
      if entry is not None and end <= entry[2]:
        entry[0], entry[2] = max(entry[0], size), max(entry[2], last)
        continue
      if entry is not None:
        done.append(entry)
      current[key] = [size, end, last]
    buffers = done + list(current.values())
    events = sorted([(t0, b) for b, t0, _ in buffers] +
                    [(t1, -b) for b, _, t1 in buffers],
                    key=lambda e: (e[0], e[1] < 0))      # allocations first at equal times
    live = peak = 0
    for _, delta in events:
      live += delta
      peak = max(peak, live)
    name = short_device(dev.device)
    peaks[name] = max(peaks.get(name, 0), peak)
  return peaks


def variable_bytes(graph, only=None):
  """{device: bytes of the variables placed there} (as placed in the graph: after epl's
  rewrite, every copy's variables, optimizer slots included). ``only``: count just these
  variable ops (e.g. the initialised ones)."""
  out = collections.Counter()
  for op in graph.get_operations():
    if op.type not in VARIABLE_OPS or (only is not None and op not in only):
      continue
    dtype, shape = variable_dtype(op), variable_shape(op)
    if shape.is_fully_defined():
      out[short_device(op.device) or "(unplaced)"] += int(np.prod(shape.as_list())) * \
          dtype.size
  return dict(out)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  variables: Dict[str, int]            # device -> bytes of variables
  peaks: Dict[str, int]                # device -> peak bytes allocated in the step

  def devices(self):
    return sorted(set(self.variables) | set(self.peaks))

  def peak(self, device):
    return self.peaks.get(short_device(device), 0)

  def held(self, device):
    return self.variables.get(short_device(device), 0)

  def total(self, device):
    return self.held(device) + self.peak(device)

  def __str__(self):
    lines = ["%-28s %12s %12s %12s" % ("device", "variables", "step peak", "total")]
    for d in self.devices():
      lines.append("%-28s %12s %12s %12s" % (d, _mib(self.held(d)), _mib(self.peak(d)),
                                             _mib(self.total(d))))
    return "\n".join(lines)


def _mib(n):
  return "%.2f MiB" % (n / 2.0 ** 20)


def measure(sess, fetches, feed_dict=None):
  """Runs one traced step of ``fetches`` and returns its ``MemoryReport``."""
  options = tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE, output_partition_graphs=True)
  metadata = tf.RunMetadata()
  sess.run(fetches, feed_dict=feed_dict, options=options, run_metadata=metadata)
  return MemoryReport(variable_bytes(sess.graph, initialised(sess)), step_peaks(metadata))


def initialised(sess):
  """The variable ops that hold memory (are initialised), or None when the graph is
  finalized (then every variable counts). A variable never initialised never allocated: an
  unused copy of an optimizer slot under ZeRO, for one."""
  graph = sess.graph
  if graph.finalized:
    return None
  ops = [op for op in graph.get_operations() if op.type in VARIABLE_OPS]
  with graph.as_default(), tf.name_scope("epl_memory"):
    checks = []
    for op in ops:
      with tf.device(op.device):
        if op.type == "VarHandleOp":
          checks.append(tf.raw_ops.VarIsInitializedOp(resource=op.outputs[0]))
        else:
          checks.append(tf.raw_ops.IsVariableInitialized(ref=op.outputs[0]))
  flags = sess.run(checks)
  return {op for op, ok in zip(ops, flags) if ok}
