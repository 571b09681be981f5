"""``Gather``: an op of a split TaskGraph that reads a split value whole (the gather fallback of
epl.sharding.rules), as the plan lists it."""
import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gather:
  """An op of a split TaskGraph that reads a split value no split rule covers it for: it runs
  on the whole value (the parts concatenated on the first part's device) and its gradient
  goes back to the parts through that concatenation (the gather fallback).

  ``bytes``: the whole value's size per micro-batch (-1 when its shape is not static);
  ``in_step``: the training step needs the op (else it runs only when fetched: sampling, a
  cache); ``backward``: the gathered value's gradient flows back to the parts too;
  ``location``: the user's file:line that built the op."""
  op: str
  op_type: str
  tensor: str
  taskgraph: str
  bytes: int
  in_step: bool
  backward: bool
  reason: str
  location: str

  def __str__(self):
    return "%s (%s, %s) reads %s whole (%s%s%s): %s" % (
        self.op, self.op_type, self.location, self.tensor,
        "? bytes" if self.bytes < 0 else size_text(self.bytes),
        " forward + backward" if self.backward else " forward",
        "" if self.in_step else ", outside the training step", self.reason)


def size_text(count):
  """``count`` bytes as B / KiB / MiB / GiB."""
  if count < 1024:
    return "%d B" % count
  for unit in ("KiB", "MiB", "GiB"):
    count /= 1024.0
    if count < 1024 or unit == "GiB":
      return "%.1f %s" % (count, unit)
