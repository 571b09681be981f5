"""Showing a ``PipelinePlan``: a text table, and a PNG of devices x stages.

matplotlib is optional (``pip install epl[plot]``); it is imported only when a picture is
asked for, and its absence is a clear error, not a crash at import time.
"""
from epl.plan.auto.errors import PlannerError
from epl.plan.auto.pipeline import ranges

GIB = 2.0 ** 30
PER_LINE = 8           # devices per line of the memory table


def table(plan, spec=None):
  """Returns the plan as text: a one-line summary, a table of stages, and every device's
  predicted peak memory (``memory_table``)."""
  head = ("%d stage(s) %s on %d device(s), %d micro-batches (%s): %.4g s/iteration, "
          "speedup %.2f x one device (pure data parallelism: %.2f) [cost model %s]" % (
              len(plan.stages), ":".join(map(str, plan.replicas)),
              sum(plan.replicas), plan.micro_batches, plan.schedule,
              plan.predicted_iteration_s, plan.speedup, plan.data_parallel_speedup,
              plan.cost_model))
  total = sum(s.compute_ms for s in plan.stages) or 1.0
  rows = [("stage", "layers", "#", "devices", "servers", "compute", "params MB", "peak GiB")]
  for i, s in enumerate(plan.stages):
    servers = "-" if spec is None else ranges({spec.server_of(d) for d in s.devices})
    peak = max(plan.peak_memory_per_device[d] for d in s.devices) / GIB
    rows.append((str(i), "%s..%s" % (s.first_layer, s.last_layer), str(len(s.layers)),
                 ranges(s.devices), servers, "%.1f%%" % (100.0 * s.compute_ms / total),
                 "%.1f" % (s.parameter_bytes / 1e6), "%.2f" % peak))
  widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
  lines = [head, ""]
  for n, r in enumerate(rows):
    lines.append("  ".join(v.ljust(widths[c]) if c < 2 else v.rjust(widths[c])
                           for c, v in enumerate(r)).rstrip())
    if n == 0:
      lines.append("  ".join("-" * w for w in widths))
  return "\n".join(lines + ["", memory_table(plan, spec)])


def memory_table(plan, spec=None):
  """Every device's predicted peak in GiB, idle devices included: one line per server (per
  ``PER_LINE`` devices on larger ones), e.g. ``server 1, devices 8-15:  0.52 ... idle``."""
  peaks = plan.peak_memory_per_device
  used = {d for s in plan.stages for d in s.devices}
  cells = ["%.2f" % (peaks[d] / GIB) if d in used else "idle" for d in range(len(peaks))]
  width = max(len(c) for c in cells)
  rows, start = [], 0
  for server, n in enumerate(spec.servers if spec is not None else (len(peaks),)):
    for first in range(start, start + n, PER_LINE):
      devices = range(first, min(first + PER_LINE, start + n))
      label = "%s %s:" % ("devices" if len(devices) > 1 else "device", ranges(devices))
      if spec is not None:
        label = "server %d, %s" % (server, label)
      rows.append((label, "  ".join(cells[d].rjust(width) for d in devices)))
    start += n
  pad = max(len(label) for label, _ in rows)
  return "\n".join(["peak memory per device (GiB):"] +
                   ["  %s  %s" % (label.ljust(pad), values) for label, values in rows])


def _pyplot():
  """matplotlib's pyplot on the Agg backend; PlannerError when matplotlib is absent."""
  try:
    import matplotlib                                 # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt              # pylint: disable=import-outside-toplevel
  except ImportError:
    raise PlannerError("--png needs matplotlib: pip install matplotlib (or epl[plot])") from None
  return plt


def save_png(plan, spec, path, title=None):
  """Draws devices (x, grouped by server) x stages (colour) into ``path``.

  Raises:
    PlannerError: matplotlib is not installed.
  """
  plt = _pyplot()
  n = spec.num_devices
  stage_of = {d: i for i, s in enumerate(plan.stages) for d in s.devices}
  fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * n + 2), 1.2 + 0.5 * len(plan.stages)))
  colors = plt.get_cmap("tab10")
  for d in range(n):
    if d not in stage_of:
      ax.barh(0, 1, left=d, color="#eeeeee", edgecolor="white")
      continue
    s = stage_of[d]
    ax.barh(len(plan.stages) - 1 - s, 1, left=d, color=colors(s % 10), edgecolor="white")
  for i, s in enumerate(plan.stages):
    y = len(plan.stages) - 1 - i
    ax.text(min(s.devices) + 0.1, y, "%s..%s" % (s.first_layer, s.last_layer),
            va="center", fontsize=7, color="black")
  for boundary in spec.seps[:-1]:
    ax.axvline(boundary, color="black", linewidth=1.5)
  ax.set_yticks(range(len(plan.stages)))
  ax.set_yticklabels(["stage %d" % (len(plan.stages) - 1 - y) for y in range(len(plan.stages))])
  ax.set_xticks([d + 0.5 for d in range(n)])
  ax.set_xticklabels([str(d) for d in range(n)], fontsize=7)
  ax.set_xlim(0, n)
  ax.set_xlabel("device (servers split by black lines)")
  ax.set_title(title or "%s: speedup %.2f (pure DP %.2f), %d micro-batches [%s]" % (
      ":".join(map(str, plan.replicas)), plan.speedup, plan.data_parallel_speedup,
      plan.micro_batches, plan.cost_model), fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def table3d(plan, model, cluster):
  """A 3D plan (``search3d.Plan3D``) as text: the layout, where its step goes, each stage's
  blocks, recomputation and memory, the runners-up and the Config keys that run it."""
  from epl.plan.auto.search3d import plan_config    # pylint: disable=import-outside-toplevel
  best = plan.best
  layout = best.layout
  lines = ["%s (%.3gB parameters) on %d x %d GPUs (%s, %.0f GB each):" % (
      model.name, model.parameters / 1e9, cluster.nodes, cluster.gpus_per_node, cluster.name,
      cluster.memory / 1e9), "  " + best.describe(), "",
           "step %.4g s = " % best.step_s + ", ".join(
               "%s %.3g" % (k, v) for k, v in best.parts.items()) + " (s; compute, tp and pp "
           "over the slowest stage's micro-batches)", ""]
  rows = [("stage", "blocks", "recompute", "GPUs", "peak GB")]
  first = 0
  for s, layers in enumerate(layout.layers(model)):
    gpus = layout.tp * layout.dp
    rows.append((str(s), "%d..%d" % (first, first + layers - 1),
                 "yes" if layout.recomputes(s) else "no",
                 "%d-%d" % (s * gpus, (s + 1) * gpus - 1), "%.1f" % (best.memory[s] / 1e9)))
    first += layers
  widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
  for n, r in enumerate(rows):
    lines.append("  ".join(v.rjust(widths[c]) for c, v in enumerate(r)))
    if n == 0:
      lines.append("  ".join("-" * w for w in widths))
  lines += ["", "next best of other shapes:"] + ["  " + p.describe() for p in plan.runners_up]
  lines += ["", "epl.Config: %s" % plan_config(best),
            "(%d layouts priced in %.2f s)" % (plan.considered, plan.seconds)]
  return "\n".join(lines)


def save_png3d(plan, model, path):
  """Draws a 3D plan: stages (rows) x data-parallel copies (columns), each cell its ``tp``
  GPUs, recomputing stages hatched.

  Raises:
    PlannerError: matplotlib is not installed.
  """
  plt = _pyplot()
  layout = plan.best.layout
  shown = min(layout.dp, 8)
  fig, ax = plt.subplots(figsize=(2 + 1.2 * shown, 1 + 0.35 * min(layout.pp, 32)))
  colors = plt.get_cmap("tab10")
  first = 0
  for s, layers in enumerate(layout.layers(model)):
    if s >= 32:
      break
    for c in range(shown):
      ax.barh(s, 1, left=c, color=colors(s % 10), edgecolor="white",
              hatch="//" if layout.recomputes(s) else None)
      ax.text(c + 0.05, s, "TP%d: blocks %d-%d" % (layout.tp, first, first + layers - 1),
              va="center", fontsize=6)
    first += layers
  ax.invert_yaxis()
  ax.set_xlabel("data-parallel copy (%d of %d shown)" % (shown, layout.dp))
  ax.set_ylabel("pipeline stage")
  ax.set_title("%s: %s" % (model.name, plan.best.describe()), fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
