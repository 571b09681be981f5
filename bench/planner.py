"""Automatic pipeline planner: planning time and predicted speedups for every shipped profile.

  python bench/planner.py [--cost-model dapple|dapple-published|simulate] [--only gnmt]
                          [--clusters 1x8,2x8,16x1,4x8] [--gbs N] [--markdown]
                          [--profiles DIR]   (default: $EPL_PIPEDREAM_PROFILES, else
                                              ../shared/data/pipedream_profiles beside
                                              the checkout)

For each profile (DAPPLE's V100 profiles) on each cluster it plans with
``epl.plan.auto.plan_pipeline`` and prints: the stage replica counts (e.g. 15:1), the
predicted speedup over one device, pure data parallelism's speedup on the same cost model,
and the wall time of planning. The profiled batch comes from the file name (``pbs-N``;
``vgg16.txt`` does not say and is taken as 32); the global batch per model family is
DAPPLE's evaluation setting (VGG 2048, GNMT 1024, BERT 64, XLNet 128, AmoebaNet 128), or
``--gbs`` for all. The published planner takes > 9 min on GNMT-16 at 2x8 and crashes on 4x8;
the target here is < 30 s per plan, a few seconds typical.
"""
import argparse
import glob
import os
import re
import sys
import time

CLUSTERS = "1x8,2x8,16x1,4x8"
GBS = {"vgg": 2048, "gnmt": 1024, "bert": 64, "xlnet": 128, "amoeba": 128}
DEFAULT_PBS = 32        # vgg16.txt (PipeDream's) does not say; assumed
HEAD = ("profile", "pbs", "gbs", "states", "devices", "plan", "speedup", "pure DP", "time s")
WIDTHS = (28, 3, 4, 19, 7, 34, 7, 7, 6)


def setting(path, gbs=None):
  """``(name, pbs, gbs)`` of a profile file; ``gbs`` overrides the family's default.

  Raises:
    SystemExit: the family has no known global batch and ``gbs`` is not given.
  """
  from epl.plan.auto.profile import pbs_from_name
  name = os.path.basename(path)[:-4]
  pbs = pbs_from_name(path) or DEFAULT_PBS
  family = re.match(r"[a-z]*", name).group(0)
  if gbs is None and family not in GBS:
    raise SystemExit("bench/planner.py: no global batch known for %s (family %r; known: %s); "
                     "pass --gbs N" % (path, family, ", ".join(sorted(GBS))))
  return name, pbs, gbs or GBS[family]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cost-model", default="dapple",
                      choices=("dapple", "dapple-published", "simulate"))
  from epl.plan.auto.profile import published_profiles
  parser.add_argument("--profiles", default=published_profiles())
  parser.add_argument("--only", default="", help="substring of the profile names to run")
  parser.add_argument("--clusters", default=CLUSTERS, help="comma-separated, e.g. 2x8,4x8")
  parser.add_argument("--gbs", type=int, help="global batch for every profile")
  parser.add_argument("--markdown", action="store_true", help="print a markdown table")
  args = parser.parse_args(argv)
  from epl.plan.auto import DeviceSpec, Profile, build_states, plan_pipeline
  from epl.plan.auto.states import representative_states

  if not os.path.isdir(args.profiles):
    raise SystemExit("bench/planner.py: no profiles at %s; pass --profiles DIR or set "
                     "EPL_PIPEDREAM_PROFILES" % args.profiles)
  rows, worst, start = [], 0.0, time.perf_counter()
  for path in sorted(glob.glob(os.path.join(args.profiles, "*.txt"))):
    name, pbs, gbs = setting(path, args.gbs)
    if args.only not in name:
      continue
    states = build_states(Profile.load(path))
    count = "%d%s (%d kept)" % (len(states), " linear" if states.linear else "",
                                len(representative_states(states)))
    for cluster in args.clusters.split(","):
      began = time.perf_counter()
      plan = plan_pipeline(path, pbs, gbs, DeviceSpec.parse(cluster),
                           cost_model=args.cost_model)
      took = time.perf_counter() - began
      worst = max(worst, took)
      rows.append((name, str(pbs), str(gbs), count, cluster, ":".join(map(str, plan.replicas)),
                   "%.2f" % plan.speedup, "%.2f" % plan.data_parallel_speedup, "%.2f" % took))
      print_row(rows[-1], args.markdown, first=len(rows) == 1)
  print("\ncost model %s; %d plans in %.1f s, slowest %.2f s" % (
      args.cost_model, len(rows), time.perf_counter() - start, worst))


def print_row(row, markdown, first):
  fmt = lambda r: "  ".join(v.ljust(w) for v, w in zip(r, WIDTHS)).rstrip()
  if markdown:
    fmt = lambda r: "| " + " | ".join(r) + " |"
  if first:
    print(fmt(HEAD))
    print(fmt(["-" * w for w in WIDTHS]) if not markdown else
          "|" + "|".join("---" for _ in HEAD) + "|")
  print(fmt(row), flush=True)


if __name__ == "__main__":
  sys.exit(main())
