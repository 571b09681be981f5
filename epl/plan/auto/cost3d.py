"""What a 3D layout of a transformer costs on a cluster: step time and memory per GPU (#51).

Kept apart from the search (``search3d.py``): the search proposes ``Layout`` s, ``price``
says what each costs. A layout is the tensor-parallel degree ``tp`` (innermost: a block's
matmuls split over ``tp`` GPUs of one node), ``pp`` pipeline stages of consecutive blocks,
``dp`` data-parallel copies of the whole, micro-batches of ``rows`` sequences, the ZeRO level
(epl's ``zero.level``: "v0" optimizer state, "v1" and gradients, "v2" and weights, over the
``dp`` copies), ``offload`` (``offload.level`` v0: weights and state on the host), and which
stages recompute their activations (``gradient_checkpoint``, per stage).

The step, with ``m`` micro-batches per copy (global batch / (dp x rows)):

* compute of stage s per micro-batch: its blocks' forward, twice that backward, once more
  forward where it recomputes (FLOPs / the cluster's sustained FLOP/s, or the measured time
  of a block); the last stage adds the logits;
* tensor parallelism: per block two all-reduces of the s x rows x h activations forward and
  two backward (Megatron's f and g), two more where the block recomputes, a ring at the
  node's bandwidth (across nodes when ``tp`` exceeds a node), 2 (t - 1) / t of the bytes;
* pipeline: each micro-batch's boundary tensor to the next stage and its gradient back
  (1 / tp of it per GPU: Megatron's scatter/gather), across nodes when a stage's GPUs fill
  one; the schedule's bubble: (m - 1) x the slowest stage + every stage once;
* data parallelism: each stage's gradients all-reduced over ``dp`` copies after the last
  micro-batch, as float16 (``communication.fp16``), not overlapped; ZeRO v0 adds the
  owners' broadcast of the updated weights (1.5 x the bytes), v1 and v2 send each gradient
  to its owner only (a reduce-scatter) and broadcast the weights (1 x);
* the optimizer's update streaming its state (weights, gradients, Adam's two slots)
  through device memory, or with offload the gradients down and weights up over PCIe and
  the host's updates.

Memory per GPU of stage s: float32 weights (4 bytes), gradients (4) and Adam's slots (8) per
parameter of the stage's share (/ tp) as epl keeps them (``state_bytes``: what ZeRO and
offload take off the device at the step's peak); activations of the micro-batches in flight (1F1B: pp - s; GPipe: m)
per block -- or, recomputing, each block's input plus one block's activations. A layout fits
when every stage's total is within the cluster's usable memory.
"""
import dataclasses
from typing import Optional, Tuple

from epl.plan.auto.errors import PlannerError

ZERO_LEVELS = ("", "v0", "v1", "v2")


@dataclasses.dataclass(frozen=True)
class Layout:
  tp: int
  pp: int
  dp: int
  rows: int                       # sequences per micro-batch
  zero: str = ""
  offload: bool = False
  recompute: Tuple[bool, ...] = ()    # per stage; () = none
  schedule: str = "1f1b"
  stage_layers: Tuple[int, ...] = ()  # blocks per stage; () = as even as possible

  @property
  def gpus(self):
    return self.tp * self.pp * self.dp

  def layers(self, model):
    if self.stage_layers:
      return self.stage_layers
    base, extra = divmod(model.layers, self.pp)
    # the extra blocks go to the middle stages: the first holds the embedding, the last the
    # logits and loss
    order = sorted(range(self.pp), key=lambda s: (s in (0, self.pp - 1), abs(s - self.pp / 2)))
    more = set(order[:extra])
    return tuple(base + (s in more) for s in range(self.pp))

  def recomputes(self, s):
    return bool(self.recompute) and self.recompute[s]

  def describe(self):
    ckpt = "".join("r" if r else "-" for r in self.recompute) if any(self.recompute) else "none"
    return "TP %d x PP %d x DP %d, %d-row micro-batches, ZeRO %s%s, recompute %s, %s" % (
        self.tp, self.pp, self.dp, self.rows, self.zero or "off",
        " + offload" if self.offload else "", ckpt, self.schedule)


@dataclasses.dataclass(frozen=True)
class Priced:
  layout: Layout
  micro_batches: int
  step_s: float
  tflops_per_gpu: float           # Megatron's eq. 3 FLOPs / step / GPUs
  memory: Tuple[float, ...]       # bytes per GPU, by stage
  fits: bool
  parts: dict                     # seconds: compute, bubble, tp, pp, dp, optimizer

  def describe(self):
    return "%s: M = %d, step %.3g s, %.0f TFLOP/s per GPU, peak %.1f GB%s" % (
        self.layout.describe(), self.micro_batches, self.step_s, self.tflops_per_gpu,
        max(self.memory) / 1e9, "" if self.fits else " (does not fit)")


def _ring(nbytes, n, bandwidth):
  return 0.0 if n <= 1 else 2.0 * (n - 1) / n * nbytes / bandwidth


def check(model, cluster, layout, batch):
  """Why ``layout`` cannot run ``model`` at ``batch`` on ``cluster`` (None: it can)."""
  if layout.gpus != cluster.gpus:
    return "TP %d x PP %d x DP %d = %d GPUs, the cluster has %d" % (
        layout.tp, layout.pp, layout.dp, layout.gpus, cluster.gpus)
  if model.heads % layout.tp or model.hidden % layout.tp:
    return "tp %d does not divide the %d heads / hidden %d" % (layout.tp, model.heads,
                                                              model.hidden)
  if layout.pp > model.layers:
    return "%d stages for %d blocks" % (layout.pp, model.layers)
  if batch % (layout.dp * layout.rows):
    return "batch %d is not a whole number of %d copies x %d-row micro-batches" % (
        batch, layout.dp, layout.rows)
  if layout.zero not in ZERO_LEVELS:
    return "zero level %r (one of %s)" % (layout.zero, ZERO_LEVELS)
  if layout.zero and layout.dp == 1:
    return "ZeRO partitions over data-parallel copies: dp is 1"
  if layout.recompute and len(layout.recompute) != layout.pp:
    return "recompute names %d stages of %d" % (len(layout.recompute), layout.pp)
  if layout.stage_layers and (len(layout.stage_layers) != layout.pp or
                              sum(layout.stage_layers) != model.layers or
                              min(layout.stage_layers) < 1):
    return "stage_layers %r do not cut %d blocks into %d stages" % (
        layout.stage_layers, model.layers, layout.pp)
  if layout.schedule not in ("1f1b", "gpipe"):
    return "schedule %r (1f1b or gpipe)" % layout.schedule
  return None


def state_bytes(params, layout):
  """(device bytes at the step's peak, host bytes) of ``params`` parameters as epl keeps
  them: float32 variables (4 bytes; AMP casts each use to float16), float32 gradients (4),
  Adam's two slots (8). ZeRO v0 and v1 keep each slot once per ``dp`` copies; v2 keeps the
  weights once too, but every copy receives its stage's weights for the whole step, so its
  peak is v1's. Offload keeps everything on the host; a device holds the weights it
  received (float16 with AMP: casts run on the host) and its gradients (float16 up to the
  host's cast)."""
  if layout.offload:
    return 4.0 * params, 16.0 * params / (layout.dp if layout.zero else 1)
  slots = 8.0 * params / (layout.dp if layout.zero else 1)
  return 8.0 * params + slots, 0.0


DP_VOLUME = {"": 1.0, "v0": 1.5, "v1": 1.0, "v2": 1.0}   # x an all-reduce of the gradients


def stage_parameters(model, layout, s, layers):
  """Parameters stage ``s`` holds per GPU (its blocks, the embedding on the first stage and
  its tied copy on the last, all / tp)."""
  params = layers * model.block_parameters
  if s == 0:
    params += model.embedding_parameters
  if s == layout.pp - 1:
    params += model.vocab * model.hidden + 2 * model.hidden
  return params / layout.tp


def activation_bytes(model, layout, s, layers, micro_batches):
  """Activation bytes stage ``s`` holds at its peak."""
  b, t = layout.rows, layout.tp
  in_flight = micro_batches if layout.schedule == "gpipe" else min(layout.pp - s, micro_batches)
  full = model.activation_bytes(b, t)
  if layout.recomputes(s):
    held = in_flight * layers * model.boundary_bytes(b) + full
  else:
    held = in_flight * layers * full
  if s == layout.pp - 1:
    held += model.head_activation_bytes(b, t)
  return held


def price(model, cluster, layout, batch) -> Priced:
  """The step time and memory of ``layout`` (see the module docstring); raises
  ``PlannerError`` naming why a layout cannot run."""
  why = check(model, cluster, layout, batch)
  if why:
    raise PlannerError("layout %s: %s" % (layout.describe(), why))
  t, p, d, b = layout.tp, layout.pp, layout.dp, layout.rows
  m = batch // (d * b)
  per_node = cluster.gpus_per_node
  tp_bw = cluster.intra_bandwidth if t <= per_node else cluster.inter_bandwidth
  pp_bw = cluster.intra_bandwidth if t * d < per_node else cluster.inter_bandwidth
  dp_bw = cluster.intra_bandwidth if t * d <= per_node else cluster.inter_bandwidth
  activation = model.boundary_bytes(b)
  allreduce = _ring(activation, t, tp_bw)
  stage_s, memory, sync, update = [], [], [], []
  parts = dict(compute=0.0, tp=0.0, pp=0.0)
  for s, layers in enumerate(layout.layers(model)):
    if model.measured_block_s is not None:
      forward = layers * model.measured_block_s * b / t
      head = (model.measured_head_s or 0.0) * b / t
    else:
      forward = layers * model.flops_per_block(b) / t / cluster.sustained_flops
      head = model.flops_head(b) / t / cluster.sustained_flops
    again = layout.recomputes(s)
    compute = forward * (4 if again else 3) + (3 * head if s == p - 1 else 0.0)
    tp_comm = layers * allreduce * (6 if again else 4) + (allreduce if s == 0 else 0.0)
    pp_comm = (activation / t / pp_bw) * ((s > 0) + (s < p - 1)) if p > 1 else 0.0
    stage_s.append(compute + tp_comm + pp_comm)
    parts["compute"] = max(parts["compute"], compute * m)
    parts["tp"] = max(parts["tp"], tp_comm * m)
    parts["pp"] = max(parts["pp"], pp_comm * m)
    params = stage_parameters(model, layout, s, layers)
    device, _ = state_bytes(params, layout)
    memory.append(device + activation_bytes(model, layout, s, layers, m))
    sync.append(DP_VOLUME[layout.zero] * _ring(2.0 * params, d, dp_bw))
    owned = params / d if layout.zero else params
    if layout.offload:
      update.append(4.0 * params / cluster.host_bandwidth + owned / cluster.host_updates)
    else:
      update.append(32.0 * owned / cluster.hbm_bandwidth)
  pipeline = (m - 1) * max(stage_s) + sum(stage_s)
  step = pipeline + max(sync) + max(update)
  parts.update(bubble=pipeline - m * max(stage_s), dp=max(sync), optimizer=max(update))
  limit = cluster.memory * cluster.usable_memory
  return Priced(layout, m, step, model.megatron_flops(batch) / step / layout.gpus / 1e12,
                tuple(memory), all(x <= limit for x in memory), parts)


def try_price(model, cluster, layout, batch) -> Optional[Priced]:
  """``price``, or None where the layout cannot run."""
  if check(model, cluster, layout, batch):
    return None
  return price(model, cluster, layout, batch)
