"""Transformer models and GPU clusters as the 3D planner sees them (#51; ``search3d.py``).

A ``Transformer`` is the shape of a GPT-style stack (layers, hidden, heads, sequence,
vocabulary, the MLP's width) and prices one block per sequence: its FLOPs, its weights and
the bytes its activations hold. Either from the shape alone (``flops_per_block`` and
``activation_bytes``: the counts of Narayanan et al., SC'21, eq. 3's derivation, and of
Korthikanti et al., 2022, section 4.1) or measured (``measured_block_s``: epl's profiler's
forward time of one block, ``TransformerProfile.from_profile``).

A ``Cluster`` describes the GPUs: per node, how many nodes, device memory, peak FLOP/s, the
fraction of it a transformer block sustains, and the link bandwidths (inside a node: NVLink;
across nodes: each GPU's share of the node's network adapters).

Published shapes (``SHAPES``): GPT-2 1.5B (Radford et al. 2019), GPT-3 6.7B / 13B / 175B
(Brown et al. 2020, table 2.1; sequence 2048), and the ten GPT models of Megatron-LM's
scaling table (Narayanan et al. 2021, table 1: ``MEGATRON_TABLE``, with the configuration
Megatron ran and the TFLOP/s per GPU it achieved).

Example:
  >>> g = SHAPES["gpt3-175b"]
  >>> round(g.parameters / 1e9, 1)
  174.6
  >>> round(SHAPES["megatron-1t"].parameters / 1e9)
  1008
"""
import dataclasses
import json
from typing import Optional, Tuple

from epl.plan.auto.errors import PlannerError

GB = 1e9
GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Transformer:
  """A GPT-style decoder: ``layers`` blocks of attention + MLP (``ffn`` x hidden wide), a
  tied embedding of ``vocab`` x ``hidden`` and learned positions of ``seq`` x ``hidden``.

  ``measured_block_s``: the forward time of one block on one sequence on one device of the
  cluster (seconds; epl's profiler), used instead of FLOPs / sustained FLOP/s when set;
  ``measured_head_s`` the same for the logits and loss."""
  name: str
  layers: int
  hidden: int
  heads: int
  seq: int
  vocab: int
  ffn: int = 4
  measured_block_s: Optional[float] = None
  measured_head_s: Optional[float] = None

  def __post_init__(self):
    for key in ("layers", "hidden", "heads", "seq", "vocab", "ffn"):
      if int(getattr(self, key)) != getattr(self, key) or getattr(self, key) < 1:
        raise PlannerError("transformer %r: %s=%r must be a whole number >= 1"
                           % (self.name, key, getattr(self, key)))
    if self.hidden % self.heads:
      raise PlannerError("transformer %r: hidden=%d is not a multiple of heads=%d"
                         % (self.name, self.hidden, self.heads))

  @property
  def block_parameters(self):
    """Weights of one block: QKV + projection (4h^2 + 4h), MLP (2 ffn h^2 + (ffn + 1) h),
    two layer norms (4h)."""
    h = self.hidden
    return (4 + 2 * self.ffn) * h * h + (9 + self.ffn) * h

  @property
  def embedding_parameters(self):
    return (self.vocab + self.seq) * self.hidden

  @property
  def parameters(self):
    return self.layers * self.block_parameters + self.embedding_parameters + 2 * self.hidden

  def flops_per_block(self, rows=1):
    """Forward FLOPs of one block on ``rows`` sequences: the matmuls (2 x (4 + 2 ffn) s h^2)
    and attention's scores and weighted sum (4 s^2 h)."""
    s, h = self.seq, self.hidden
    return rows * (2 * (4 + 2 * self.ffn) * s * h * h + 4 * s * s * h)

  def flops_head(self, rows=1):
    """Forward FLOPs of the logits (2 s h V)."""
    return rows * 2 * self.seq * self.hidden * self.vocab

  def megatron_flops(self, batch):
    """Narayanan et al.'s eq. 3: the FLOPs of one step of ``batch`` sequences with full
    recomputation, 96 B s l h^2 (1 + s / 6h + V / 16 l h) -- the count behind Megatron's
    published TFLOP/s (for ffn = 4)."""
    b, s, l, h, v = batch, self.seq, self.layers, self.hidden, self.vocab
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))

  def activation_bytes(self, rows, tp=1):
    """Bytes one block's forward keeps for its backward, per micro-batch of ``rows``
    sequences, with mixed precision and tensor parallelism ``tp`` (Korthikanti et al.,
    section 4.1, without sequence parallelism: s b h (10 + 24 / t + 5 a s / (h t)); the MLP
    width enters through its 2 x ffn share of the 24)."""
    s, h, a = self.seq, self.hidden, self.heads
    width = 8 + 4 * self.ffn
    return s * rows * h * (10 + width / tp + 5 * a * s / (h * tp))

  def head_activation_bytes(self, rows, tp=1):
    """The logits in float32 and their softmax (4 + 4 bytes per entry)."""
    return 8 * self.seq * rows * self.vocab / tp

  def boundary_bytes(self, rows):
    """What one stage hands the next per micro-batch (float16 s x b x h)."""
    return 2 * self.seq * rows * self.hidden

  def with_measured(self, block_s, head_s=None):
    return dataclasses.replace(self, measured_block_s=block_s, measured_head_s=head_s)

  def to_json(self):
    return json.dumps(dataclasses.asdict(self), sort_keys=True)

  @classmethod
  def from_json(cls, text):
    return cls(**json.loads(text))


@dataclasses.dataclass(frozen=True)
class Cluster:
  """GPUs: ``nodes`` x ``gpus_per_node``; ``memory`` bytes per GPU, ``peak_flops`` (float16
  tensor-core FLOP/s), ``efficiency`` (the fraction of the peak a transformer block's
  forward and backward sustain on one GPU), ``intra_bandwidth`` (bytes/s an all-reduce inside
  a node moves per GPU, NCCL's bus bandwidth over NVLink), ``inter_bandwidth`` (bytes/s per
  GPU across nodes: the node's adapters over its GPUs), ``hbm_bandwidth`` (the optimizer's
  update streams its state), ``host_bandwidth`` (PCIe per GPU, offload), ``host_flops``
  (the host's Adam updates per second per GPU it serves, offload)."""
  name: str
  nodes: int
  gpus_per_node: int
  memory: float
  peak_flops: float
  efficiency: float
  intra_bandwidth: float
  inter_bandwidth: float
  hbm_bandwidth: float = 1.5e12
  host_bandwidth: float = 20 * GB
  host_updates: float = 1e9
  usable_memory: float = 0.92          # of ``memory``: the rest is the framework's and NCCL's

  def __post_init__(self):
    for key in ("nodes", "gpus_per_node"):
      if int(getattr(self, key)) != getattr(self, key) or getattr(self, key) < 1:
        raise PlannerError("cluster %r: %s=%r must be a whole number >= 1"
                           % (self.name, key, getattr(self, key)))
    for key in ("memory", "peak_flops", "intra_bandwidth", "inter_bandwidth",
                "hbm_bandwidth", "host_bandwidth", "host_updates"):
      if not getattr(self, key) > 0:
        raise PlannerError("cluster %r: %s=%r must be > 0" % (self.name, key, getattr(self, key)))
    if not 0 < self.efficiency <= 1 or not 0 < self.usable_memory <= 1:
      raise PlannerError("cluster %r: efficiency and usable_memory are fractions in (0, 1]"
                         % self.name)

  @property
  def gpus(self):
    return self.nodes * self.gpus_per_node

  @property
  def sustained_flops(self):
    return self.peak_flops * self.efficiency

  def sized(self, gpus):
    """The same cluster with ``gpus`` GPUs (whole nodes, or one partial node)."""
    if gpus <= self.gpus_per_node:
      return dataclasses.replace(self, nodes=1, gpus_per_node=gpus)
    if gpus % self.gpus_per_node:
      raise PlannerError("%d GPUs are not whole nodes of %d" % (gpus, self.gpus_per_node))
    return dataclasses.replace(self, nodes=gpus // self.gpus_per_node)


def selene(gpus=8):
  """NVIDIA's Selene as Megatron-LM's paper describes it (section 5): DGX A100 nodes of 8
  80-GB A100s (312 TFLOP/s float16 peak) on NVLink/NVSwitch, eight 200 Gb/s HDR InfiniBand
  adapters per node (25 GB/s per GPU). NVLink: 300 GB/s per direction per GPU (NVIDIA's
  A100 datasheet); an all-reduce's bus bandwidth is taken as 80 % of it. ``efficiency``: 0.5
  of the peak on a block's matmuls and element-wise work -- calibrated once on the table's
  data-parallel-only row (1.7B on 32 GPUs: 44 % of the peak end to end, no pipeline, no
  tensor parallelism), and used unchanged for every other row and plan."""
  return Cluster("selene", nodes=1, gpus_per_node=8, memory=80 * GB, peak_flops=312e12,
                 efficiency=0.5, intra_bandwidth=240 * GB, inter_bandwidth=25 * GB,
                 hbm_bandwidth=2.0e12, host_bandwidth=25 * GB).sized(gpus)


def v100_cluster(gpus=8):
  """DGX-1-like V100 nodes (32 GB, 125 TFLOP/s float16 peak, NVLink 2: ~130 GB/s per GPU
  all-reduce bus bandwidth, 100 Gb/s per node across)."""
  return Cluster("v100", nodes=1, gpus_per_node=8, memory=32 * GB, peak_flops=125e12,
                 efficiency=0.45, intra_bandwidth=130 * GB, inter_bandwidth=12.5 * GB / 8,
                 hbm_bandwidth=0.9e12, host_bandwidth=12 * GB).sized(gpus)


# Megatron-LM's scaling table (Narayanan et al., SC'21, table 1; NVIDIA/Megatron-LM README,
# images/cases_april2021.png): (name, heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per
# GPU). Every model: vocabulary 51,200, sequence 2048, micro-batches of 1.
MEGATRON_TABLE = (
    ("megatron-1.7b", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("megatron-3.6b", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("megatron-7.5b", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("megatron-18b", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("megatron-39b", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("megatron-76b", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("megatron-145b", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("megatron-310b", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("megatron-530b", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    ("megatron-1t", 160, 25600, 128, 8, 64, 3072, 3072, 163),
)

SHAPES = {
    "gpt2-1.5b": Transformer("gpt2-1.5b", layers=48, hidden=1600, heads=25, seq=1024,
                             vocab=50257),
    "gpt3-6.7b": Transformer("gpt3-6.7b", layers=32, hidden=4096, heads=32, seq=2048,
                             vocab=50257),
    # the GPT-3 paper prints d_model 5140 with 40 heads of 128: 5120 is what that means
    "gpt3-13b": Transformer("gpt3-13b", layers=40, hidden=5120, heads=40, seq=2048,
                            vocab=50257),
    "gpt3-175b": Transformer("gpt3-175b", layers=96, hidden=12288, heads=96, seq=2048,
                             vocab=50257),
}
SHAPES.update({row[0]: Transformer(row[0], layers=row[3], hidden=row[2], heads=row[1],
                                   seq=2048, vocab=51200) for row in MEGATRON_TABLE})


def shape(name_or_path) -> Transformer:
  """A published shape by name, or a ``Transformer`` saved as JSON (``to_json``)."""
  if name_or_path in SHAPES:
    return SHAPES[name_or_path]
  try:
    with open(name_or_path) as f:
      return Transformer.from_json(f.read())
  except OSError:
    raise PlannerError("no transformer %r: a name (%s) or a JSON file of Transformer's fields"
                       % (name_or_path, ", ".join(sorted(SHAPES)))) from None


def megatron_rows() -> Tuple[dict, ...]:
  """The scaling table as dicts: model, tp, pp, gpus, batch, tflops (published)."""
  return tuple(dict(model=SHAPES[r[0]], tp=r[4], pp=r[5], gpus=r[6], batch=r[7],
                    tflops=r[8]) for r in MEGATRON_TABLE)


def to_profile(model, cluster, rows):
  """``model`` as a layer profile (``profile.Profile``, PipeDream/DAPPLE's format) taken at
  ``rows`` sequences on one GPU of ``cluster``: the embedding, each block, the logits and
  loss, a chain. Times from FLOPs / sustained FLOP/s (the embedding from its bytes through
  device memory), backward twice forward; activations the float32 tensor handed on;
  parameters as epl keeps them (float32; the tied embedding counted once, in the first
  layer). What ``plan_pipeline`` plans from, with no profile of DAPPLE's needed."""
  from epl.plan.auto.profile import Node, Profile   # pylint: disable=import-outside-toplevel
  ms = 1000.0 / cluster.sustained_flops
  hand_on = 4.0 * model.seq * rows * model.hidden
  embed_ms = 1000.0 * 2 * hand_on / cluster.hbm_bandwidth
  layers = [("embed", embed_ms, 4.0 * model.embedding_parameters)]
  layers += [("h%d" % i, model.flops_per_block(rows) * ms, 4.0 * model.block_parameters)
             for i in range(model.layers)]
  layers.append(("head", model.flops_head(rows) * ms, 4.0 * 2 * model.hidden))
  nodes = tuple(Node("node%d" % (i + 1), name, forward, 2 * forward,
                     (hand_on if i < len(layers) - 1 else 4.0,), params)
                for i, (name, forward, params) in enumerate(layers))
  edges = tuple(("node%d" % i, "node%d" % (i + 1)) for i in range(1, len(nodes)))
  return Profile(nodes, edges)


# The profiles committed beside this module (``profiles/``; bench/transformer_profiles.py
# writes them): (file name, shape, cluster, rows). The measured one is epl's profiler on a
# 6-block GPT stack (hidden 256) on this project's CPU machines.
ANALYTIC_PROFILES = (
    ("gpt2-1.5b-v100-pbs-4", "gpt2-1.5b", v100_cluster, 4),
    ("gpt3-6.7b-a100-pbs-1", "gpt3-6.7b", selene, 1),
    ("gpt3-13b-a100-pbs-1", "gpt3-13b", selene, 1),
)
MEASURED_PROFILE = "gpt-l6-h256-cpu-pbs-8"


def profile_path(name):
  """The committed profile ``name`` (a path)."""
  import os                                          # pylint: disable=import-outside-toplevel
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles", name + ".txt")


def measured(model, profile, rows):
  """``model`` with its block and head times from a profile epl's profiler took at ``rows``
  sequences: the mean forward time of the layers named like blocks (``h3``, ``layer_3``,
  ``model/h3``: a name ending in a number), the rest (logits, loss) as the head."""
  blocks = [n for n in profile.nodes if n.name.rstrip("0123456789") != n.name]
  if not blocks:
    raise PlannerError("the profile has no block layers (names ending in a number): %s"
                       % ", ".join(n.name for n in profile.nodes))
  block_s = sum(n.forward_ms for n in blocks) / len(blocks) / 1000.0 / rows
  last = max(profile.nodes.index(n) for n in blocks)
  head_s = sum(n.forward_ms for n in profile.nodes[last + 1:]) / 1000.0 / rows
  return model.with_measured(block_s, head_s)
