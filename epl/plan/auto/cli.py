"""``epl-plan``: plan a pipeline for a layer profile, or a transformer's 3D layout.

  epl-plan PROFILE --pbs N --gbs N --devices 8,16 [--cost-model dapple|dapple-published|simulate]
           [--memory 16GiB] [--speeds 1,2] [--json] [--png plan.png]
  epl-plan --transformer gpt3-175b --cluster selene --gpus 1024 --gbs 1536 [--memory 40GB]
           [--json] [--png plan.png]

With ``--transformer`` (a published shape's name or a JSON file of
``epl.plan.auto.transformer.Transformer``'s fields) it chooses tensor x pipeline x data
parallelism, micro-batches, ZeRO, offload and recomputation (``search3d.plan_3d``) and
prints the layout, where the step goes, each stage and the Config keys that run it.

Prints a table -- stages, then every device's predicted peak memory -- or, with ``--json``,
exactly the ``PipelinePlan.to_json_dict()`` object on stdout; progress goes to stderr once
planning has taken more than a second (``Progress``), through to the final re-scoring. Only
argparse is imported until the arguments are parsed, so ``--help`` answers at once.
"""
import argparse
import sys
import time

PROGRESS_AFTER_S = 1.0      # planning faster than this prints nothing to stderr
PROGRESS_EVERY_S = 1.0      # within a phase, at most one line per this many seconds


def parser():
  p = argparse.ArgumentParser(
      prog="epl-plan",
      description="Plan pipeline stages, their devices and the micro-batch count for a "
                  "PipeDream/DAPPLE layer profile (DAPPLE's planner, re-done).",
      epilog="Example: epl-plan vgg-19-pbs-32.txt --pbs 32 --gbs 2048 --devices 8,16")
  p.add_argument("profile", nargs="?", help="profile file: 'nodeN -- name -- forward_compute_time=...' "
                                 "lines and indented 'nodeA -- nodeB' edges")
  p.add_argument("--pbs", type=int, help="batch size the profile was taken at "
                                         "(default: the N of 'pbs-N' in the file name)")
  p.add_argument("--gbs", type=int, required=True, help="global batch size of one step")
  p.add_argument("--transformer", help="plan a transformer's 3D layout instead: a published "
                                       "shape (gpt3-175b, megatron-1t, ...) or a JSON file")
  p.add_argument("--cluster", default="selene", choices=("selene", "v100"),
                 help="with --transformer: the GPUs (selene: 80-GB A100 DGX nodes)")
  p.add_argument("--gpus", type=int, help="with --transformer: how many GPUs")
  p.add_argument("--devices",
                 help="cumulative server boundaries (DAPPLE's seps, e.g. 8,16 = 2 servers x "
                      "8) or SERVERSxDEVICES (e.g. 2x8)")
  p.add_argument("--cost-model", default="dapple",
                 choices=("dapple", "dapple-published", "simulate"),
                 help="dapple: DAPPLE's analytical formula (default); dapple-published: the "
                      "same with the published planner's quirks; simulate: event-level replay "
                      "of the schedule with memory")
  p.add_argument("--memory", help="memory per device: bytes, or with a unit (16GiB, 32GB); a "
                                  "bare number below 4096 is GiB (default: unlimited)")
  p.add_argument("--speeds", help="relative device speeds, one per device or per server "
                                  "(e.g. 1,2), for mixed GPU generations")
  p.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"),
                 help="pipeline schedule (simulate replays it; memory counts its in-flight "
                      "micro-batches)")
  p.add_argument("--parameter-factor", type=float, default=4.0,
                 help="memory bytes per parameter byte: weights + gradients + optimizer "
                      "slots (default 4, Adam)")
  p.add_argument("--intra-bw", type=float, default=25.0, help="GB/s inside a server")
  p.add_argument("--inter-bw", type=float, default=1.0,
                 help="GB/s point-to-point across servers")
  p.add_argument("--allreduce-bw", type=float, default=3.0,
                 help="GB/s all-reduce across servers")
  p.add_argument("--json", action="store_true", help="print only the plan as JSON")
  p.add_argument("--png", help="also draw the plan (devices x stages) into this PNG file "
                               "(needs matplotlib)")
  return p


class Progress:
  """``plan_pipeline``'s progress callback for a terminal: silent for the first ``after_s``
  seconds, then one line per phase and at most one per ``every_s`` within a phase, and a
  last line when ``plan_pipeline`` reports "done" -- after its final re-scoring.

  Defaults come from ``PROGRESS_AFTER_S`` / ``PROGRESS_EVERY_S`` when it is created; ``clock``
  is injectable so tests can drive it.
  """

  def __init__(self, stream, after_s=None, every_s=None, clock=time.perf_counter):
    self.stream, self.clock = stream, clock
    self.after_s = PROGRESS_AFTER_S if after_s is None else after_s
    self.every_s = PROGRESS_EVERY_S if every_s is None else every_s
    self.start = clock()
    self.last_phase, self.last_line = None, -float("inf")

  def __call__(self, phase, done, total, detail):
    now = self.clock()
    elapsed = now - self.start
    if elapsed < self.after_s:
      return
    if phase == "done":
      self._write("planned in %.1f s: %s" % (elapsed, detail))
    elif phase != self.last_phase or now - self.last_line >= self.every_s:
      self._write("%s %d/%d (%s), %.1f s" % (phase, done + 1, total, detail, elapsed))
    self.last_phase, self.last_line = phase, now

  def _write(self, text):
    self.stream.write("epl-plan: %s\n" % text)
    self.stream.flush()


def main3d(args):
  """``--transformer``: the 3D planner."""
  import dataclasses  # noqa: E402
  import json  # noqa: E402
  from epl.plan.auto import render, transformer  # noqa: E402
  from epl.plan.auto.devices import parse_bytes  # noqa: E402
  from epl.plan.auto.errors import PlannerError  # noqa: E402
  from epl.plan.auto.search3d import plan_3d, plan_config  # noqa: E402
  try:
    if not args.gpus:
      raise PlannerError("--transformer needs --gpus (how many GPUs to plan for)")
    model = transformer.shape(args.transformer)
    cluster = (transformer.selene if args.cluster == "selene" else
               transformer.v100_cluster)(args.gpus)
    if args.memory:
      cluster = dataclasses.replace(cluster, memory=float(parse_bytes(args.memory)))
    plan = plan_3d(model, cluster, args.gbs)
    if args.png:
      render.save_png3d(plan, model, args.png)
  except PlannerError as e:
    sys.stderr.write("epl-plan: error: %s\n" % e)
    return 2
  if args.json:
    best = plan.best
    sys.stdout.write(json.dumps(dict(
        model=model.name, gpus=cluster.gpus, batch=args.gbs, tp=best.layout.tp,
        pp=best.layout.pp, dp=best.layout.dp, rows=best.layout.rows,
        micro_batches=best.micro_batches, zero=best.layout.zero, offload=best.layout.offload,
        recompute=list(best.layout.recompute), schedule=best.layout.schedule,
        step_s=best.step_s, tflops_per_gpu=best.tflops_per_gpu, memory=list(best.memory),
        config=plan_config(best)), sort_keys=True) + "\n")
  else:
    sys.stdout.write(render.table3d(plan, model, cluster) + "\n")
    if args.png:
      sys.stdout.write("picture: %s\n" % args.png)
  return 0


def main(argv=None):
  """Entry point; returns the exit status (0, or 2 on a planning error)."""
  args = parser().parse_args(argv)
  if args.transformer:
    return main3d(args)
  if not args.profile or not args.devices:
    parser().error("a PROFILE and --devices (or --transformer and --gpus) are required")
  from epl.plan.auto.devices import DeviceSpec, parse_bytes, parse_speeds  # noqa: E402
  from epl.plan.auto.errors import PlannerError  # noqa: E402
  from epl.plan.auto.profile import pbs_from_name  # noqa: E402
  from epl.plan.auto.search import plan_pipeline  # noqa: E402
  from epl.plan.auto import render  # noqa: E402
  try:
    pbs = args.pbs if args.pbs is not None else pbs_from_name(args.profile)
    if pbs is None:
      raise PlannerError("--pbs is missing and the file name %s has no 'pbs-N' to take it "
                         "from; pass the batch size the profile was taken at" % args.profile)
    spec = DeviceSpec.parse(args.devices, intra_bandwidth=args.intra_bw * 1e9,
                            inter_bandwidth=args.inter_bw * 1e9,
                            allreduce_bandwidth=args.allreduce_bw * 1e9)
    memory = parse_bytes(args.memory) if args.memory else None
    speeds = parse_speeds(args.speeds, spec) if args.speeds else None
    plan = plan_pipeline(args.profile, pbs, args.gbs, spec, cost_model=args.cost_model,
                         memory=memory, speeds=speeds, parameter_factor=args.parameter_factor,
                         schedule=args.schedule, progress=Progress(sys.stderr))
    if args.png:
      render.save_png(plan, spec, args.png)
  except PlannerError as e:
    sys.stderr.write("epl-plan: error: %s\n" % e)
    return 2
  if args.json:
    sys.stdout.write(plan.to_json() + "\n")
  else:
    sys.stdout.write(render.table(plan, spec) + "\n")
    if args.png:
      sys.stdout.write("picture: %s\n" % args.png)
  return 0


if __name__ == "__main__":
  sys.exit(main())
