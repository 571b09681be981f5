"""race_delay: the race amplifier (``testing.race_delay_ms``, for tests only; 0: off).

Every read of a variable that a training step also writes (``ordering.readers_of``: through
every alias, in every copy and micro-batch) starts ``race_delay_ms`` after its inputs are
ready, while writes run as soon as theirs are. A read the graph does not order before a write
of its variable -- the race ``writes_after_reads`` exists to prevent -- then runs after the
write in almost every run instead of now and then, so a parity test sees the other model at
once. Each delay is an op that waits on a thread of its own (``compat.delay_op``), so TF's
inter-op threads stay free for the writes.

Expects: every other pass run (it is the last). Adds: one delay op per read. Returns
``RaceDelay``.
"""
import dataclasses

from epl import _tf_compat as compat
from epl.passes.ordering import readers_of, step_ops, writes_of


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
  delayed = set()
  for ends in ctx.result("analyze").train_ends:
    step = step_ops(ends)
    written = {var: None for op in step for var in writes_of(op)}
    for var in written:
      for r in readers_of(var):
        if r in step and r not in delayed and var not in writes_of(r) and \
            not compat.in_control_flow(r) and not r.type.endswith(("Enter", "Switch", "Merge")):
          after = list(dict.fromkeys([t.op for t in r.inputs] + list(r.control_inputs)))
          compat.add_control_inputs(r, [compat.delay_op(ctx.graph, ms * 1000, after, r.device)])
          delayed.add(r)
  return RaceDelay(ms, len(delayed))
