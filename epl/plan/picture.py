"""A picture of a ParallelPlan: workers x devices, which TaskGraph and copy sits where, and the
communication between them.

  >>> epl.Graph.get().draw("plan.png")                  # in a script
  $ python -m epl.plan.picture plan.json plan.png       # from ``plan.to_json()``

One row per worker, one box per device listing ``TaskGraph · copy`` (``TaskGraph · part``
for a split TaskGraph); boxes take their TaskGraph's colour. A dashed line joins the copies of a TaskGraph whose gradients are
all-reduced together; an arrow goes from each pipeline stage to the next inside a copy. The
PNG is 100 dpi, (1.6 + 2.4 D) x (1.4 + 1.6 W) inches for W workers of D devices. Needs
matplotlib (``pip install epl[plot]``).
"""
import sys

from epl.cluster import worker_of

DPI = 100
COLOURS = ("#4c9be8", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948")


def layout(plan):
  """{device: (row, column)} with one row per worker, devices in name order."""
  devices = sorted({d for c in plan.copies for ds in c.devices for d in ds},
                   key=lambda d: (worker_of(d), d))
  rows, where = {}, {}
  for d in devices:
    w = worker_of(d)
    where[d] = (w, len(rows.setdefault(w, [])))
    rows[w].append(d)
  return where, max(len(r) for r in rows.values()), len(rows)


def size_inches(plan):
  _, per_worker, workers = layout(plan)
  return 1.6 + 2.4 * per_worker, 1.4 + 1.6 * workers


def draw(plan, path):
  """Writes the picture of ``plan`` to ``path``; returns its (width, height) in pixels.

  Raises:
    ValueError: the plan has no copies (a local plan has nothing to draw).
  """
  if plan.is_local:
    raise ValueError("a local plan (no annotation) has nothing to draw")
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  where, per_worker, workers = layout(plan)
  width, height = size_inches(plan)
  fig, ax = plt.subplots(figsize=(width, height))
  centre = {d: (1.2 + 2.4 * col, -1.6 * row) for d, (row, col) in where.items()}
  labels = device_labels(plan)
  for d, (x, y) in centre.items():
    tg = labels[d][0][0]
    ax.add_patch(plt.Rectangle((x - 1.05, y - 0.55), 2.1, 1.1, facecolor=COLOURS[tg % 7],
                               alpha=0.35, edgecolor="black"))
    short = d.rsplit("/device:", 1)[-1]
    ax.text(x, y + 0.38, short, ha="center", va="center", fontsize=8, weight="bold")
    ax.text(x, y - 0.08, "\n".join(text for _, text in labels[d][:4]), ha="center",
            va="center", fontsize=7)
  _draw_groups(ax, plan, centre)
  _draw_handoffs(ax, plan, centre)
  for w in range(workers):
    ax.text(-0.3, -1.6 * w, "worker %d" % w, ha="right", va="center", fontsize=9)
  ax.set_xlim(-1.5, 2.4 * per_worker + 0.1)
  ax.set_ylim(-1.6 * workers + 0.6, 0.9)
  ax.axis("off")
  ax.set_title("%d copies, %d micro-batch(es)%s" % (
      plan.total_copies, plan.micro_batches,
      ", %s" % plan.pipeline_strategy if plan.num_micro_batch > 1 else ""), fontsize=9)
  if any(len(plan.group_of(t.index)) > 1 for t in plan.taskgraphs):
    ax.legend(loc="lower right", fontsize=7, frameon=False)
  fig.savefig(path, dpi=DPI)
  plt.close(fig)
  return round(width * DPI), round(height * DPI)


def device_labels(plan):
  """{device: [(TaskGraph, what it holds there)]}."""
  labels = {}
  for i, copy in enumerate(plan.copies):
    for t, devices in enumerate(copy.devices):
      if plan.is_split(t):
        if copy.shard == 0:                       # once per replica, a part per device
          for j, d in enumerate(devices):
            labels.setdefault(d, []).append((t, "%s · part %d/%d (replica %d)" % (
                plan.taskgraphs[t].name, j, len(devices), copy.replica)))
        continue
      if not plan.runs_in(copy, t):            # a stage on fewer devices: not in this copy
        continue
      for d in devices:
        labels.setdefault(d, []).append((t, "%s · copy %d" % (plan.taskgraphs[t].name, i)))
  return labels


def _draw_groups(ax, plan, centre):
  """The gradient all-reduce groups: a dashed line through each group's devices."""
  for t in plan.taskgraphs:
    parts = range(t.placement.devices) if plan.is_split(t.index) else [0]
    for part in parts:
      group = plan.group_of(t.index, part)
      if len(group) > 1:
        xs, ys = zip(*(centre[d] for d in group))
        ax.plot(xs, [y - 0.42 + 0.09 * (t.index % 4) for y in ys], "--",
                color=COLOURS[t.index % 7], linewidth=1.5,
                label="all-reduce %s" % t.name if part == 0 else None)


def _draw_handoffs(ax, plan, centre):
  """The pipeline hand-offs inside a copy: an arrow from each stage's (first) device to the
  next's; a split stage runs once per replica, with its replica's first copy."""
  for copy in plan.copies:
    if copy.shard and any(plan.is_split(t) for t in range(len(copy.devices))):
      continue
    for a, b in zip(copy.devices, copy.devices[1:]):
      (x0, y0), (x1, y1) = centre[a[0]], centre[b[0]]
      if (x0, y0) != (x1, y1):
        ax.annotate("", xy=(x1 - 1.05 if x1 > x0 else x1, y1),
                    xytext=(x0 + 1.05 if x1 > x0 else x0, y0),
                    arrowprops=dict(arrowstyle="->", color="gray"))


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) != 2:
    raise SystemExit("usage: python -m epl.plan.picture PLAN.json OUT.png")
  from epl.plan.plan import ParallelPlan
  with open(argv[0]) as f:
    plan = ParallelPlan.from_json(f.read())
  print("%s: %d x %d pixels" % ((argv[1],) + draw(plan, argv[1])))


if __name__ == "__main__":
  main()
