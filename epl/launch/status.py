"""What a worker tells the epl-launch that started it, through ``launch.status_file``.

The launcher decides whether a failed job is worth restarting: a job that never ran (a
Config or plan error, an exception in the script before its first step) would only fail the
same way again. A worker appends one JSON line per event; the launcher reads them. Pure (no
TensorFlow): both sides import it.

Events:
  ``running``: the worker started its part of the training (its first training step ran, or,
  serving devices only, it started serving); ``global_step`` is the step the job resumed at,
  when the worker could read it.
"""
import json
import os

RUNNING = "running"


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
