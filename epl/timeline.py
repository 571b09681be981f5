"""The executed schedule of one step: chrome-trace JSON and a PNG timeline.

Run one step with ``RunOptions(trace_level=FULL_TRACE)`` and pass its ``RunMetadata``:

  >>> meta = tf.RunMetadata()
  >>> sess.run(train_op, options=tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE),
  ...          run_metadata=meta)
  >>> epl.timeline.save(meta, epl.Graph.get(), "step.json", "step.png")

With micro-batches, one row per pipeline stage (copy 0) shows its actions (``F3``: forward of
micro-batch 3, ``B3``: its backward); otherwise one row per device shows forward, backward
and update compute and each fused all-reduce bucket (``AR0``, ``AR1`` ...). Spans are
measured on ops that compute (constants, variable reads and no-ops run at the start of every
step and would stretch every span to t=0). The JSON opens in chrome://tracing or Perfetto;
the PNG needs matplotlib (``pip install epl[plot]``). A trace with nothing epl knows is a
warning, not an empty picture.
"""
import json
import logging
import re

log = logging.getLogger("epl")

_TRIVIAL = frozenset({"Const", "NoOp", "Identity", "VariableV2", "VarHandleOp", "ReadVariableOp",
                      "Shape", "Size", "Rank", "Placeholder", "PlaceholderWithDefault"})
_PREFIX = re.compile(r"^(EPL_REPLICA_\d+/|EPL_MB_\d+_R_\d+/)")
_BUCKET = re.compile(r"epl_all_reduce(?:_(\d+))?/")
_GAP_US = 500
_PHASE_LABEL = {"forward": "forward", "backward": "backward", "apply": "update"}


def _node_times(run_metadata):
  """{node name: (device, start_us, end_us)} of a traced step (earliest start, latest end)."""
  times = {}
  for dev in run_metadata.step_stats.dev_stats:
    for node in dev.node_stats:
      start = node.all_start_micros
      end = start + max(node.all_end_rel_micros, 1)
      old = times.get(node.node_name)
      times[node.node_name] = (dev.device, min(start, old[1]), max(end, old[2])) if old else \
          (dev.device, start, end)
  return times


def _compute(graph, names):
  """The names among ``names`` whose ops compute (not constants, reads or no-ops)."""
  out = []
  for name in names:
    try:
      op = graph.get_operation_by_name(name)
    except KeyError:
      continue
    if op.type not in _TRIVIAL:
      out.append(name)
  return out


def _pipeline_spans(times, pg, copy=0):
  spans = []
  for (c, stage), actions in sorted(pg.schedule.items()):
    if c != copy:
      continue
    row = "stage %d (%s)" % (stage, pg.worker.device_of(c, stage))
    for name, ops in actions:
      seen = [times[n] for n in _compute(pg.graph, [op.name for op in ops]) if n in times]
      if seen:
        spans.append((row, name, min(s for _, s, _ in seen), max(e for _, _, e in seen)))
  return spans


def _device_spans(times, pg):
  phases = pg.plan.op_index
  rows = {}
  for name in _compute(pg.graph, times):
    device, start, end = times[name]
    bucket = _BUCKET.search(name)
    if bucket:
      label = "AR%d" % int(bucket.group(1) or 0)
    elif name.startswith("epl_grad_sync/"):
      label = "accumulate"
    else:
      phase = phases.get(_PREFIX.sub("", name), (None, None))[1]
      if phase is None:
        continue
      label = _PHASE_LABEL[phase]
    rows.setdefault(device, []).append((start, end, label))
  spans = []
  for device, intervals in sorted(rows.items()):
    current = None
    for start, end, label in sorted(intervals):
      if current and current[0] == label and start <= current[2] + _GAP_US:
        current[2] = max(current[2], end)
        continue
      if current:
        spans.append((device, current[0], current[1], current[2]))
      current = [label, start, end]
    if current:
      spans.append((device, current[0], current[1], current[2]))
  return spans


def action_spans(run_metadata, parallel_graph, copy=0):
  """[(row, label, start_us, end_us)] measured in one traced step, from its first span."""
  times = _node_times(run_metadata)
  if parallel_graph.schedule:
    spans = _pipeline_spans(times, parallel_graph, copy)
  else:
    spans = _device_spans(times, parallel_graph)
  if spans:
    origin = min(s[2] for s in spans)
    spans = [(row, name, s - origin, e - origin) for row, name, s, e in spans]
  return spans


def save(run_metadata, parallel_graph, json_path, png_path=None, title="epl step"):
  """Writes the chrome trace (and the PNG when ``png_path`` is given); returns the spans."""
  spans = action_spans(run_metadata, parallel_graph)
  if not spans:
    log.warning("timeline: the traced step ran nothing epl placed (was it run with "
                "RunOptions(trace_level=FULL_TRACE) on the epl graph?); nothing written")
    return spans
  events = [{"name": name, "ph": "X", "pid": row, "tid": 0, "ts": start,
             "dur": end - start, "cat": name[0]} for row, name, start, end in spans]
  with open(json_path, "w") as f:
    json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
  if png_path:
    _draw(spans, png_path, title)
  return spans


_COLOURS = {"F": "#4c9be8", "f": "#4c9be8", "B": "#f28e2b", "b": "#f28e2b", "A": "#59a14f",
            "u": "#b07aa1", "a": "#76b7b2"}


def _draw(spans, path, title):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = sorted({s[0] for s in spans})
  fig, ax = plt.subplots(figsize=(12, 0.7 * len(rows) + 1.2))
  for row, name, start, end in spans:
    y = rows.index(row)
    ax.broken_barh([(start / 1e3, max(end - start, 1) / 1e3)], (y - 0.4, 0.8),
                   facecolors=_COLOURS.get(name[0], "#bab0ac"), edgecolor="black",
                   linewidth=0.5)
    if end - start > 0.03 * max(s[3] for s in spans):
      ax.text((start + end) / 2e3, y, name, ha="center", va="center", fontsize=7)
  ax.set_yticks(range(len(rows)))
  ax.set_yticklabels([r.rsplit("/", 1)[-1] if r.startswith("/") else r for r in rows])
  ax.invert_yaxis()
  ax.set_xlabel("time (ms)")
  ax.set_title(title + "  (blue: forward, orange: backward, purple: update, green: all-reduce)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
