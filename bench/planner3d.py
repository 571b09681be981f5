"""The 3D planner against Megatron-LM's scaling table, and its planning time (#51).

  python bench/planner3d.py

Prints docs/planner.md's table. For each row of Megatron's table (Narayanan et al. 2021, table 1): Megatron's own
configuration priced by epl's cost model (predicted TFLOP/s per GPU vs the published figure),
and the layout ``plan_3d`` chooses for that model, cluster and batch (its predicted step vs
Megatron's configuration's, under the same cost model). Then the time to plan a 175B-shaped
model on 1024 GPUs (#51: under 60 s). Pure Python; no TensorFlow.
"""
import argparse
import time

from epl.plan.auto.search3d import megatron_table, plan_3d
from epl.plan.auto.transformer import SHAPES, selene


def _layout(priced):
  layout = priced.layout
  ckpt = sum(layout.recompute)
  return "TP%d PP%d DP%d b%d%s%s%s" % (
      layout.tp, layout.pp, layout.dp, layout.rows,
      " ZeRO-" + layout.zero if layout.zero else "", " offload" if layout.offload else "",
      " recompute %d/%d" % (ckpt, layout.pp) if ckpt else "")


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.parse_args()
  start = time.perf_counter()
  rows = megatron_table()
  head = ("| model | GPUs | batch | Megatron's layout | published TFLOP/s | predicted | error "
          "| epl's plan | its step vs Megatron's | peak GB | planned in |")
  print(head)
  print("|" + "---|" * (head.count("|") - 1))
  within = 0
  for r in rows:
    theirs, ours = r["megatron"], r["plan"]
    within += abs(r["error"]) <= 0.25
    print("| %s | %d | %d | %s | %d | %.0f | %+.0f %% | %s | %.2fx faster | %.0f | %.2f s |" % (
        r["model"], r["gpus"], r["batch"], _layout(theirs), r["published"],
        theirs.tflops_per_gpu, 100 * r["error"], _layout(ours.best), r["speedup"],
        max(ours.best.memory) / 1e9, ours.seconds))
  print("\n%d of %d rows within 25 %% of the published TFLOP/s; table in %.1f s" % (
      within, len(rows), time.perf_counter() - start))
  start = time.perf_counter()
  plan = plan_3d(SHAPES["gpt3-175b"], selene(1024), 1536)
  print("gpt3-175b on 1024 GPUs, batch 1536: planned in %.2f s (%d layouts): %s" % (
      time.perf_counter() - start, plan.considered, plan.best.describe()))


if __name__ == "__main__":
  main()
