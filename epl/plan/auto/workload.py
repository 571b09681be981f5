"""What the cost models and the search read: the cuts of a profile as flat arrays, scaled to
the global batch, plus the devices, their speeds and memory.

Cut 0 is the empty cut (the model's start); cuts 1..n are the kept states (see
``states.representative_states``) in topological order; cut n holds every layer. A stage is a
pair of cuts ``(k, j)`` with ``k`` in ``preds[j]``: the layers of cut j that cut k lacks.

Scaling (DAPPLE's): with ``f = gbs / pbs``, a stage's compute for the whole global batch on
one device of speed 1 is ``f x sum(forward + backward ms) / 1000`` seconds, the bytes a cut
sends for the global batch are ``f x`` the profiled ones; parameters are not scaled.

Memory of a device (bytes): ``parameter_factor x`` the stage's parameters (weights, gradients
and optimizer slots; 4 = Adam) plus the activations it keeps for backward: the stage's layer
outputs per sample x the samples it holds per micro-batch x micro-batches in flight.
"""
import dataclasses
from typing import Optional, Tuple

import numpy as np

from epl.plan.auto.devices import DeviceSpec, check_speeds
from epl.plan.auto.errors import PlannerError
from epl.plan.auto.profile import Profile
from epl.plan.auto.states import States, build_states, representative_states

SCHEDULES = ("1f1b", "gpipe")


def _derived():
  return dataclasses.field(init=False, repr=False)


@dataclasses.dataclass(frozen=True, eq=False)
class Workload:
  """A profile planned for one global batch on one set of devices. Frozen: the arrays are
  read-only too, so a cost model cannot change what the search reads.

  Args:
    profile: a ``Profile``, a path to one, or prebuilt ``States``.
    pbs: the batch size the profile was taken at.
    gbs: the global batch size of one training step.
    spec: ``DeviceSpec``.
    speeds: relative speed per device (``None``: all 1.0).
    memory: bytes per device (``None``: unlimited).
    parameter_factor: bytes held per parameter byte.
    schedule: "1f1b" (DAPPLE's early backward) or "gpipe".
  Raises:
    PlannerError: a batch size, speed or limit is out of range.
  """
  profile: dataclasses.InitVar[object]
  pbs: int
  gbs: int
  spec: DeviceSpec
  speeds: Optional[Tuple[float, ...]] = None
  memory: Optional[float] = None
  parameter_factor: float = 4.0
  schedule: str = "1f1b"
  states: States = _derived()
  f: float = _derived()                    # gbs / pbs
  cut_state: Tuple[int, ...] = _derived()  # cut -> index in states (-1: the empty cut)
  final: int = _derived()                  # the cut holding every layer
  fwd_ms: np.ndarray = _derived()          # per cut: cumulative profiled costs
  cmp_ms: np.ndarray = _derived()
  params: np.ndarray = _derived()
  acts: np.ndarray = _derived()
  outs: np.ndarray = _derived()
  preds: Tuple[np.ndarray, ...] = _derived()

  def __post_init__(self, profile):
    if not isinstance(self.spec, DeviceSpec):
      raise PlannerError("devices must be a DeviceSpec, e.g. DeviceSpec.parse('8,16')")
    for name in ("pbs", "gbs"):
      value = getattr(self, name)
      if int(value) != value or value < 1:
        raise PlannerError("%s=%r must be a whole number >= 1" % (name, value))
    if self.schedule not in SCHEDULES:
      raise PlannerError("schedule=%r; choose one of %s" % (self.schedule, ", ".join(SCHEDULES)))
    if self.memory is not None and not self.memory > 0:
      raise PlannerError("memory=%r must be > 0 bytes per device" % (self.memory,))
    if not self.parameter_factor >= 1:
      raise PlannerError("parameter_factor=%r must be >= 1 (weights alone are 1)" %
                         (self.parameter_factor,))
    if isinstance(profile, States):
      states = profile
    else:
      states = build_states(profile if isinstance(profile, Profile) else Profile.load(profile))
    put = lambda name, value: object.__setattr__(self, name, value)
    put("pbs", int(self.pbs))
    put("gbs", int(self.gbs))
    put("speeds", check_speeds(self.speeds, self.spec))
    put("parameter_factor", float(self.parameter_factor))
    put("states", states)
    put("f", self.gbs / self.pbs)
    for name, value in _cuts(states).items():
      put(name, value)

  # --- scaled quantities of a stage (k, j) --------------------------------------------------
  @property
  def t1(self):
    """Seconds for the whole global batch on one device of speed 1."""
    return self.f * self.cmp_ms[self.final] / 1000.0

  @property
  def total_parameters(self):
    return float(self.params[self.final])

  def compute_s(self, k, j):
    return self.f * (self.cmp_ms[j] - self.cmp_ms[k]) / 1000.0

  def forward_s(self, k, j):
    return self.f * (self.fwd_ms[j] - self.fwd_ms[k]) / 1000.0

  def parameters(self, k, j):
    return float(self.params[j] - self.params[k])

  def activation_per_sample(self, k, j):
    return float(self.acts[j] - self.acts[k]) / self.pbs

  def cut_bytes(self, c):
    """Bytes cut ``c`` sends forward for the whole global batch."""
    return 0.0 if c in (0, self.final) else self.f * float(self.outs[c])

  def speed_of(self, devices):
    return sum(self.speeds[d] for d in devices)

  def stage_memory(self, k, j, devices, samples_per_device):
    """Peak bytes of each device of a stage, given the samples each holds in flight."""
    params = self.parameters(k, j) * self.parameter_factor
    act = self.activation_per_sample(k, j)
    return tuple(params + act * s for s in samples_per_device)

  def layers(self, k, j):
    return self.states.stage_layers(self.cut_state[k], self.cut_state[j])

  def __str__(self):
    return "gbs %d (profiled at %d) on %s; %s, %d cuts kept" % (
        self.gbs, self.pbs, self.spec, self.states, self.final)


def _cuts(states):
  """The per-cut arrays of ``Workload`` (see the module docstring), read-only."""
  kept = representative_states(states)
  rows = [(0.0, 0.0, 0.0, 0.0, 0.0)] + [
      (states[i].forward_ms, states[i].compute_ms, states[i].parameter_bytes,
       states[i].activation_bytes, states[i].output_bytes) for i in kept]
  table = np.array(rows, dtype=float)
  table.flags.writeable = False
  cut_state = (-1,) + kept
  final = len(kept)
  position = {s: c for c, s in enumerate(cut_state)}
  signature = [tuple(r[:4]) for r in rows]
  preds = [np.zeros(0, dtype=int)]
  for c in range(1, final + 1):
    inner = [position[k] for k in states.predecessors[cut_state[c]] if k in position]
    # Zero-cost stages (only __getitem__-like layers) never help a plan.
    preds.append(np.array([k for k in [0] + inner if signature[k] != signature[c]], dtype=int))
  for p in preds:
    p.flags.writeable = False
  fwd_ms, cmp_ms, params, acts, outs = table.T
  return dict(cut_state=cut_state, final=final, fwd_ms=fwd_ms, cmp_ms=cmp_ms, params=params,
              acts=acts, outs=outs, preds=tuple(preds))
