"""Where stages land: device orders, and the tables the search reads for each.

A *layout* is an order of the devices. The search lays stages along it one after another, in
units of ``rp`` devices, so a stage is a range of units ``[a, b)`` and its cost follows from
that range alone. Orders:

=============  ==========================================================================
pack           server-major (0, 1, ..., 7 | 8, ..., 15): stages fill a server before the
               next one -- DAPPLE's *append*; with a gap to the next server boundary -- its
               *fresh*
scatter        round-robin over servers (0, 8, 1, 9, ...): every stage spans servers --
               DAPPLE's *scatter*, cheap transfers into spanning stages, slow all-reduce
wrapped        pack rotated by half a server: the last stages come back to the rest of
               server 0 (DAPPLE's *fresh* for a middle stage, then *append* back)
reversed,      pack with the servers in reverse order, or fastest server first (only when
fastest-first  the servers differ in size or speed; otherwise they cost what pack costs)
pack-fastest   pack with each server's devices fastest first (only when speeds differ
               inside a server): consecutive units, hence stages, group fast devices
=============  ==========================================================================

Mixing these per stage (a scattered stage between packed ones) is the ``placements`` DP's
job. For each layout and unit ``rp`` the ``Tables`` hold, per unit range ``[a, b)``: summed
speed, the largest per-device share of a micro-batch, all-reduce seconds per byte, whether the
range stays on one server, and the transfer seconds per byte from the range into the next
stage, given whether that stage stays on one server. A stage option is ``(b, a)``: the stage
ends at unit ``b`` and the next stage starts at unit ``a`` -- ``a == b`` (contiguous) or ``b``
is the last server boundary before ``a`` (fresh: the rest of that server stays idle).
"""
import dataclasses
from typing import Tuple

import numpy as np


@dataclasses.dataclass(frozen=True)
class Layout:
  name: str
  order: Tuple[int, ...]

  def __str__(self):
    return "%s layout" % self.name


def server_devices(spec, speeds):
  """Each server's devices, fastest first (stable: by id among equal speeds)."""
  servers, start = [], 0
  for n in spec.servers:
    servers.append(sorted(range(start, start + n), key=lambda d: (-speeds[d], d)))
    start += n
  return servers


def layouts(spec, speeds):
  """The device orders worth searching for ``spec`` (deduplicated, deterministic)."""
  by_id = [sorted(s) for s in server_devices(spec, speeds)]
  fast = server_devices(spec, speeds)
  pack = tuple(d for server in by_id for d in server)
  found = [Layout("pack", pack), Layout("pack-fastest", tuple(d for s in fast for d in s))]
  if len(by_id) > 1:
    half = len(by_id[0]) // 2
    if half:
      # Rotated by half a server: the first and the last stage may share server 0.
      found.append(Layout("wrapped", pack[half:] + pack[:half]))
    rounds = max(len(s) for s in fast)
    found.append(Layout("scatter", tuple(s[i] for i in range(rounds) for s in fast
                                         if i < len(s))))
    profiles = {(len(s), tuple(sorted(speeds[d] for d in s))) for s in by_id}
    if len(profiles) > 1:
      found.append(Layout("reversed", tuple(d for s in reversed(by_id) for d in s)))
      by_speed = sorted(range(len(fast)), key=lambda i: (-speeds[fast[i][0]], i))
      found.append(Layout("fastest-first", tuple(d for i in by_speed for d in fast[i])))
  unique, seen = [], set()
  for layout in found:
    if layout.order not in seen:
      seen.add(layout.order)
      unique.append(layout)
  return tuple(unique)


@dataclasses.dataclass(frozen=True, eq=False)
class Tables:
  """Cost tables of one layout at one unit size (see the module docstring); read-only arrays.
  Build with ``Tables.build``. ``pair_*`` arrays list the valid (start unit, option) pairs,
  grouped into segments of equal (stage locality, start unit) -- the DP's states -- so one
  ``minimum.reduceat`` per cut does all its minimising."""
  layout: Layout
  unit: int
  units: int                              # U: the layout's devices // unit
  devices: Tuple[Tuple[int, ...], ...]    # per unit
  pair_start: np.ndarray
  pair_loc: np.ndarray                    # the stage stays on one server
  pair_end: np.ndarray
  pair_next: np.ndarray                   # where the next stage starts
  pair_inverse_speed: np.ndarray
  pair_allreduce: np.ndarray              # seconds per parameter byte
  pair_share: np.ndarray                  # largest speed / summed speed
  pair_units_after: np.ndarray            # units left for the later stages
  pair_xfer: np.ndarray                   # (P, 2): s/byte into a spanning / one-server stage
  seg_first: np.ndarray
  seg_start: np.ndarray
  seg_loc: np.ndarray

  @classmethod
  def build(cls, spec, speeds, layout, unit):
    order = layout.order
    u = len(order) // unit
    ranges = _range_tables(spec, speeds, order, unit, u)
    options = _options(ranges, _fresh(spec, order, unit, u), u)
    fields = _pairs(options, u)
    for value in fields.values():
      value.flags.writeable = False
    devices = tuple(tuple(order[i * unit:(i + 1) * unit]) for i in range(u))
    return cls(layout=layout, unit=unit, units=u, devices=devices, **fields)

  def stage_devices(self, start, end):
    return tuple(d for i in range(start, end) for d in self.devices[i])


def _range_tables(spec, speeds, order, unit, u):
  """Per unit range [a, b): speed, share, all-reduce s/byte, locality; and ``xfer[a, b, c,
  loc]``, s/byte from [a, b) into a stage starting at unit c that spans servers (loc=0) or
  stays on one (loc=1)."""
  n = u + 1
  speed, share, allreduce = (np.full((n, n), np.nan) for _ in range(3))
  local = np.zeros((n, n), dtype=bool)
  xfer = np.full((n, n, n, 2), np.nan)
  for a in range(u):
    for b in range(a + 1, u + 1):
      devs = order[a * unit:b * unit]
      speed[a, b] = sum(speeds[d] for d in devs)
      share[a, b] = max(speeds[d] for d in devs) / speed[a, b]
      allreduce[a, b] = spec.allreduce_s(devs, 1.0)
      local[a, b] = not spec.spans(devs)
      for c in range(b, u):
        # Into a spanning stage everything moves at the all-reduce rate; into a one-server
        # stage only the position of its first device matters.
        xfer[a, b, c, 0] = 1.0 / spec.allreduce_bandwidth
        xfer[a, b, c, 1] = spec.transfer_s(1.0, devs, (order[c * unit],))
  return dict(speed=speed, share=share, allreduce=allreduce, local=local, xfer=xfer)


def _fresh(spec, order, unit, u):
  """Per unit a: the last unit before a that starts another server than unit a-1 (-1: none)."""
  server = [spec.server_of(d) for d in order]
  starts = [i for i in range(1, u) if server[i * unit] != server[i * unit - 1]]
  return [max([i for i in starts if i < a], default=-1) for a in range(u + 1)]


def _options(r, fresh, u):
  """Flattens the (end b, next start a) choices into option arrays, per stage start a'."""
  ends, nexts = [], []
  for a in range(1, u + 1):
    ends.append(a)
    nexts.append(a)
    if 0 < fresh[a] < a:
      ends.append(fresh[a])
      nexts.append(a)
  opt_end, opt_next = np.array(ends, dtype=int), np.array(nexts, dtype=int)
  starts = np.arange(u + 1)[:, None]                    # a' (stage start)
  valid = starts < opt_end[None, :]
  safe = np.where(valid, opt_end[None, :], starts + 1).clip(max=u)
  first = np.minimum(starts, u - 1)
  fill = lambda t: np.where(valid, t[first, safe], np.nan)
  has_next = opt_next[None, :] < u
  idx_next = np.broadcast_to(np.where(has_next, opt_next[None, :], 0), valid.shape)
  x = r["xfer"][first[:, :, None], safe[:, :, None], idx_next[:, :, None],
                np.arange(2)[None, None, :]]
  return dict(valid=valid, end=opt_end, next=opt_next, speed=fill(r["speed"]),
              share=fill(r["share"]), allreduce=fill(r["allreduce"]),
              local=np.where(valid, r["local"][first, safe], False),
              xfer=np.where((valid & has_next)[:, :, None], x, 0.0),
              units_after=(u - opt_next)[None, :].repeat(u + 1, axis=0))


def _pairs(o, u):
  """The valid (start unit, option) pairs as flat arrays, sorted into DP-state segments."""
  starts, opts = np.nonzero(o["valid"])
  loc = o["local"][starts, opts].astype(int)
  order = np.lexsort((opts, starts, loc))
  starts, opts, loc = starts[order], opts[order], loc[order]
  key = loc * (u + 1) + starts
  seg_first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
  return dict(pair_start=starts, pair_loc=loc, pair_end=o["end"][opts],
              pair_next=o["next"][opts], pair_inverse_speed=1.0 / o["speed"][starts, opts],
              pair_allreduce=o["allreduce"][starts, opts], pair_share=o["share"][starts, opts],
              pair_units_after=o["units_after"][starts, opts],
              pair_xfer=o["xfer"][starts, opts], seg_first=seg_first,
              seg_start=starts[seg_first], seg_loc=loc[seg_first])
