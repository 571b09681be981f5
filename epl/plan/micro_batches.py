"""How a step's micro-batches are built (graph.micro_batches), decided at plan time: as session
runs of one copy (gradient accumulation on one stage), as stage functions (one call per
schedule action), or as clones of the model in the graph."""
import logging

from epl.annotate import REPLICATE
from epl.errors import NotImplementedYetError
from epl.plan.plan import ZeroLevel

log = logging.getLogger("epl")


def accumulate_runs(config, placements, micro, gradients):
  """How many session runs one step's micro-batches take (graph.micro_batches): M for
  gradient accumulation as runs, else 1 (micro-batches cloned in the graph).

  A sparse gradient that the step transforms before ``apply_gradients`` (clipping by a
  global norm) keeps its micro-batches as clones: the runs sum its rows into one dense sum,
  and a norm over the values of the local ``IndexedSlices``, which keeps a row once per
  lookup, is another number (GPT-2's tied embedding with ``clip_by_global_norm`` trained
  ~7e-5 off the local model as runs; as clones it matches)."""
  setting = config.graph.micro_batches
  if micro == 1 or setting == "clones":
    return 1
  why = None
  if len(placements) > 1:
    why = "the model has %d stages (a pipeline interleaves its micro-batches in one run)" % (
        len(placements))
  elif placements and placements[0].kind != REPLICATE:
    why = "its TaskGraph is split"
  elif ZeroLevel(config.zero.level).partitions_weights:
    why = "zero.level v2 reduces every micro-batch's gradient to its owner"
  elif setting == "auto" and (config.zero.level or config.offload.level):
    # runs keep a gradient-sized sum per copy between runs, on the device: what ZeRO and
    # offload save would come back (clones' sums live only inside the step)
    why = "zero.level / offload.level"
  else:
    read = [g.variable for g in gradients if g.sparse and g.applied and
            g.applied[0] != g.tensors[0]]
    if read:
      why = ("variable %r has a sparse gradient (IndexedSlices) that the step transforms "
             "before apply_gradients (clip_by_global_norm): its norm over the lookups' rows "
             "is not the norm of the runs' summed rows" % read[0])
  if why is None:
    return micro
  if setting == "runs":
    raise NotImplementedYetError(
        "graph.micro_batches 'runs' does not apply here: %s; use 'auto' (micro-batches as runs "
        "where they apply, clones otherwise) or 'clones'" % why)
  return 1


def stage_functions(config, placements, micro, crossings, shards):
  """graph.micro_batches "functions" (or "auto" on a pipeline): "required" / "auto" when the
  plan has nothing stage functions do not build yet, else "" (clones); the rewrite may still
  fall back ("auto") for what it finds in the graph (passes/stage_functions.py)."""
  setting = config.graph.micro_batches
  if micro == 1 or setting in ("clones", "runs"):
    return ""
  if setting == "auto" and len(placements) < 2:
    return ""                       # one stage: accumulation as runs, or clones
  why = None
  # a split stage beside device_count-1 stages is one multi-device body per (stage, F/B):
  # crossings then need no bridge (docs/design/tp_stage_functions.md)
  if shards > 1 and any(p.kind != REPLICATE for p in placements):
    why = "a split stage (epl.split) runs beside a stage with device_count > 1"
  elif crossings and shards > 1:
    why = "stages are replicated on different numbers of devices"
  if why is None:
    return "required" if setting == "functions" else "auto"
  if setting == "functions":
    raise NotImplementedYetError(
        "graph.micro_batches 'functions' is not built for this model yet: %s; use 'auto' "
        "(functions where they apply, clones otherwise) or 'clones'" % why)
  log.info("micro-batches as clones, not stage functions: %s", why)
  return ""
