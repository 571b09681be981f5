"""What a worker tells the epl-launch that started it, through ``launch.status_file``.

The launcher decides whether a failed job is worth restarting: a job that never ran (a
Config or plan error, an exception in the script before its first step) would only fail the
same way again. A worker appends one JSON line per event; the launcher reads them. Pure (no
TensorFlow): both sides import it.

Events:
  ``running``: the worker started its part of the training (its first training step ran, or,
  serving devices only, it started serving); ``global_step`` is the step the job resumed at,
  when the worker could read it.
  ``stalled``: a step (``step``) has run for ``seconds``, over the worker's stall limit.
  ``ended``: the worker's Python is ending (``code``: its exit code as Python knows it,
  ``steps``: the steps it ran); written before it waits for its peers in the farewell.

Beside it, ``<status_file>.beat`` (epl.runtime.heartbeat): the worker's pid, training steps
done, when its running step started (``since``), the median step and the stall limit; one
record (``BEAT``) the worker rewrites in place through a memory map at every run.
"""
import json
import math
import os
import struct

RUNNING = "running"
STALLED = "stalled"
ENDED = "ended"


def report(path, event, **fields):
  """Appends ``event`` (with ``fields``) to the status file ``path``; never raises."""
  if not path:
    return
  try:
    with open(path, "a") as f:
      f.write(json.dumps(dict(fields, event=event)) + "\n")
  except OSError:
    pass


def read(path):
  """The events of the status file ``path`` (a list of dicts; [] when there is none)."""
  try:
    with open(path) as f:
      lines = f.read().splitlines()
  except OSError:
    return []
  events = []
  for line in lines:
    try:
      events.append(json.loads(line))
    except ValueError:
      continue                    # a line cut short by a kill
  return events


def clear(path):
  try:
    os.remove(path)
  except OSError:
    pass


def beat_path(path):
  return path + ".beat" if path else ""


# the beat: one fixed-size record the worker rewrites in place (a shared memory map): pid,
# training steps done, whether the running run trains, when it started (NaN: none runs),
# median step, stall limit
BEAT = struct.Struct("<qqqddd")


def read_beat(path):
  """The beat of the worker whose status file is ``path`` (a dict), or None."""
  try:
    with open(beat_path(path), "rb") as f:
      raw = f.read(BEAT.size)
  except OSError:
    return None
  if len(raw) < BEAT.size:
    return None
  pid, steps, training, since, median, limit = BEAT.unpack(raw)
  nan = lambda x: None if math.isnan(x) else x      # noqa: E731
  return {"pid": pid, "steps": steps, "training": bool(training), "since": nan(since),
          "median": nan(median), "limit": limit}


def last(path, event):
  """The last ``event`` of the status file ``path`` (a dict), or None."""
  found = [e for e in read(path) if e.get("event") == event]
  return found[-1] if found else None


def sibling(path, worker):
  """The status file of ``worker`` beside ``path`` (the same epl-launch started both)."""
  return os.path.join(os.path.dirname(path), "worker_%d.status" % worker) if path else ""
