"""epl's figures in TensorBoard (``log.summary_dir``, #52): the chief's progress and where a
step goes, as summaries beside the user's own.

On worker 0, at every progress report (``log.progress_secs``), the reported step is run
traced (``RunOptions(trace_level=FULL_TRACE)``, that one step only) and epl writes, at its
step count:

* ``epl/steps_per_sec``, ``epl/samples_per_sec``, ``epl/job_samples_per_sec`` (the console's
  figures);
* ``epl/step_ms/wall``: the traced step from its first to its last span, and
  ``epl/step_ms/<kind>``: the time a device spends per step in forward, backward, update,
  all-reduce and accumulation (epl.timeline's spans, summed per device, averaged over the
  devices that ran any);
* once, ``epl/plan``: the plan's picture (epl.plan.picture; skipped without matplotlib).

Its own event file (``*.epl``) in the directory; the user's summaries keep theirs (only the
chief writes summaries: epl._tf_compat's FileWriter hook), so pointing both at one directory
shows them side by side. TensorBoard: ``tensorboard --logdir DIR``.
"""
import io
import logging
import os
import re

import tensorflow.compat.v1 as tf

from epl import timeline

log = logging.getLogger("epl")

_KIND = (("F", "forward"), ("B", "backward"), ("forward", "forward"),
         ("backward", "backward"), ("update", "update"), ("AR", "allreduce"),
         ("accumulate", "accumulate"))


def _kind(label):
  for prefix, kind in _KIND:
    if label.startswith(prefix) and (len(prefix) > 2 or re.fullmatch(prefix + r"\d*", label)):
      return kind
  return None


def breakdown(spans):
  """{kind: ms per device, "wall": ms} of one traced step's spans (epl.timeline)."""
  if not spans:
    return {}
  busy, rows = {}, set()
  for row, label, start, end in spans:
    kind = _kind(label)
    if kind is None:
      continue
    rows.add(row)
    busy[kind] = busy.get(kind, 0.0) + (end - start) / 1000.0
  out = {kind: ms / max(1, len(rows)) for kind, ms in busy.items()}
  out["wall"] = (max(s[3] for s in spans) - min(s[2] for s in spans)) / 1000.0
  return out


class Board:
  """The chief's epl event file in ``directory`` (made at the first write)."""

  def __init__(self, directory, parallel_graph):
    self.directory, self._pg = directory, parallel_graph
    self._writer = None
    self._pictured = False

  def _write(self, values, step, images=()):
    if self._writer is None:
      os.makedirs(self.directory, exist_ok=True)
      self._writer = tf.summary.FileWriter(self.directory, filename_suffix=".epl")
    summary = tf.Summary(value=[tf.Summary.Value(tag=tag, simple_value=float(value))
                                for tag, value in sorted(values.items())] + list(images))
    self._writer.add_summary(summary, step)
    self._writer.flush()

  def report(self, step, rates, run_metadata):
    """Writes a progress report's figures (``rates``: Progress.step's) and the breakdown of
    its traced step."""
    values = {"epl/" + k: v for k, v in rates.items()}
    if run_metadata is not None:
      parts = breakdown(timeline.action_spans(run_metadata, self._pg))
      values.update({"epl/step_ms/" + k: v for k, v in parts.items()})
    images = []
    if not self._pictured:
      self._pictured = True
      picture = self._picture()
      if picture is not None:
        images.append(tf.Summary.Value(tag="epl/plan", image=picture))
    self._write(values, step, images)

  def _picture(self):
    try:
      from epl.plan import picture    # pylint: disable=import-outside-toplevel
      buffer = io.BytesIO()
      picture.draw(self._pg.plan, buffer)
    except (ImportError, ValueError) as e:        # no matplotlib; a local plan
      log.info("log.summary_dir: no plan picture (%s)", e)
      return None
    data = buffer.getvalue()
    width, height = (int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big"))
    return tf.Summary.Image(height=height, width=width, colorspace=4,
                            encoded_image_string=data)

  def close(self):
    if self._writer is not None:
      self._writer.close()
      self._writer = None
