"""The executed schedule of one step: chrome-trace JSON and a PNG timeline.

Run one step with ``RunOptions(trace_level=FULL_TRACE)`` and pass its ``RunMetadata``:

  >>> meta = tf.RunMetadata()
  >>> sess.run(train_op, options=tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE),
  ...          run_metadata=meta)
  >>> epl.timeline.save(meta, epl.Graph.get(), "step.json", "step.png")

Every op of a pipeline action (``F3``: forward of micro-batch 3 on a stage) is labelled with
it; the JSON opens in chrome://tracing or Perfetto (one process per device), the PNG has one
row per device with F/B blocks labelled by micro-batch. The PNG needs matplotlib
(``pip install epl[plot]``).
"""
import json


def action_spans(run_metadata, parallel_graph, copy=0):
  """[(stage, device, action, start_us, end_us)] measured in one traced step."""
  times = {}
  for dev in run_metadata.step_stats.dev_stats:
    for node in dev.node_stats:
      start = node.all_start_micros
      end = start + max(node.all_end_rel_micros, 1)
      old = times.get(node.node_name)
      times[node.node_name] = (min(start, old[0]), max(end, old[1])) if old else (start, end)
  spans = []
  for (c, stage), actions in sorted((parallel_graph.schedule or {}).items()):
    if c != copy:
      continue
    device = parallel_graph.plan.device_of(c, stage)
    for name, ops in actions:
      seen = [times[op.name] for op in ops if op.name in times]
      if seen:
        spans.append((stage, device, name, min(s for s, _ in seen), max(e for _, e in seen)))
  if spans:
    origin = min(s[3] for s in spans)
    spans = [(st, d, n, s - origin, e - origin) for st, d, n, s, e in spans]
  return spans


def save(run_metadata, parallel_graph, json_path, png_path=None, title="epl pipeline step"):
  """Writes the chrome trace (and the PNG when ``png_path`` is given); returns the spans."""
  spans = action_spans(run_metadata, parallel_graph)
  events = [{"name": name, "ph": "X", "pid": "stage %d (%s)" % (stage, device), "tid": 0,
             "ts": start, "dur": end - start, "cat": name[0]}
            for stage, device, name, start, end in spans]
  with open(json_path, "w") as f:
    json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
  if png_path:
    _draw(spans, png_path, title)
  return spans


def _draw(spans, path, title):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  stages = sorted({s[0] for s in spans})
  fig, ax = plt.subplots(figsize=(12, 0.7 * len(stages) + 1.2))
  for stage, _, name, start, end in spans:
    color = "#4c9be8" if name[0] == "F" else "#f28e2b"
    ax.broken_barh([(start / 1e3, (end - start) / 1e3)], (stage - 0.4, 0.8), facecolors=color,
                   edgecolor="black", linewidth=0.5)
    ax.text((start + end) / 2e3, stage, name, ha="center", va="center", fontsize=8)
  ax.set_yticks(stages)
  ax.set_yticklabels(["stage %d" % s for s in stages])
  ax.invert_yaxis()
  ax.set_xlabel("time (ms)")
  ax.set_title(title + "  (blue: forward, orange: backward)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
