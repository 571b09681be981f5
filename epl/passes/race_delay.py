"""race_delay: the race amplifier (``testing.race_delay_ms``, for tests only; 0: off).

A read of a variable that no write of the variable in the step waits for runs before or after
the write as TF's threads happen to go: the race ``writes_after_reads`` (the next and last
pass) exists to prevent. This pass runs just before it and finds those reads as the other
passes left them (``ordering.readers_of``: the read's buffer through every alias, in every
copy and micro-batch, not upstream of a write of the variable); each then starts
``race_delay_ms`` after its inputs are ready, and nothing else is delayed. If the invariant's
edge holds, the write waits for the late read and the result is the same; if it is missing
(or wrong, or dead at run time), the write runs first in almost every run instead of now and
then, and a parity test sees the other model at once.

Two wider designs hid races, measured on the historical ones: delaying every read of a
written variable also delays the reads the write itself waits for (a 1:2 pipeline's
beta-power race then passed 10 of 10 runs, against 4 of 10 undelayed), and delaying every
op computed from a variable delays the backward chain the write waits for (the micro-batch
``tf.gradients`` race passed 10 of 10). Each delay is an op that waits on a thread of its
own (``compat.delay_op``), so TF's inter-op threads stay free.

Expects: every pass but ``writes_after_reads`` run. Adds: one delay op per such read.
Returns ``RaceDelay``.
"""
import dataclasses

from epl import _tf_compat as compat
from epl.passes.ordering import _CONTROL_FLOW, Step, readers_of, step_ops, writes_of


@dataclasses.dataclass(frozen=True)
class RaceDelay:
  milliseconds: int = 0
  reads: int = 0                 # reads delayed

  def __str__(self):
    if not self.milliseconds:
      return "RaceDelay(off)"
    return "RaceDelay(%d read(s) of written variables start %d ms late)" % (
        self.reads, self.milliseconds)


def race_delay(ctx):
  """Runs the pass; see the module docstring."""
  ms = ctx.plan.race_delay_ms
  if not ms:
    return RaceDelay()
  late = set()
  for ends in ctx.result("analyze").train_ends:
    step = Step(ends)
    for var, ops in step.writes.items():
      before = step_ops(ops)
      late.update(r for r in readers_of(var) if r in step and r not in before and
                  var not in writes_of(r) and not compat.in_control_flow(r) and
                  r.type not in _CONTROL_FLOW)
  for op in sorted(late, key=lambda o: o.name):
    after = list(dict.fromkeys([t.op for t in op.inputs] + list(op.control_inputs)))
    compat.add_control_inputs(op, [compat.delay_op(ctx.graph, ms * 1000, after, op.device)])
  return RaceDelay(ms, len(late))
