"""Collective communication behind one narrow API.

Passes never build collective ops themselves. A ``Collectives`` object is made once per
rewrite; it picks the implementation (NCCL on GPU, ring on CPU), logs the choice once, and
hands out group/instance keys deterministically so that every worker building the same plan
gets the same keys. Every op carries a timeout: a dead peer becomes an error, not a hang.

Example:
  >>> coll = Collectives(timeout=60, on_gpu=False)
  >>> reduced = coll.all_reduce([t0, t1], ["/device:CPU:1", "/device:CPU:2"], "mean")
"""
import logging

import tensorflow.compat.v1 as tf
from tensorflow.python.ops import collective_ops

log = logging.getLogger("epl")


class Collectives:
  """Builds all-reduce / all-gather / broadcast among tensors placed on known devices."""

  def __init__(self, timeout, on_gpu):
    self.timeout = float(timeout)
    self.hint = "nccl" if on_gpu else "ring"
    self._groups = {}
    self._next_instance = 1
    log.info("epl collectives: %s (timeout %.0f s)", self.hint, self.timeout)

  def group_key(self, devices):
    """One key per distinct ordered device set (the same on every worker)."""
    key = tuple(devices)
    if key not in self._groups:
      self._groups[key] = len(self._groups) + 1
    return self._groups[key]

  def _instance(self):
    self._next_instance += 1
    return self._next_instance

  def all_reduce(self, tensors, devices, method, group=None):
    """Returns one reduced tensor per local input, each on its input's device.

    Args:
      tensors: one tensor per participant on this worker (same shape and dtype).
      devices: the device of each of them.
      method: "mean" or "sum".
      group: every participant's device, all workers included (default: ``devices``); other
        workers build their own part with the same ``group``.
    """
    assert len(tensors) == len(devices) and method in ("mean", "sum")
    group = tuple(group or devices)
    if len(group) == 1:
      return list(tensors)
    key, instance = self.group_key(group), self._instance()
    out = []
    for t, d in zip(tensors, devices):
      with tf.device(d):
        out.append(collective_ops.all_reduce_v2(
            t, group_size=len(group), group_key=key, instance_key=instance,
            merge_op="Add", final_op="Div" if method == "mean" else "Id",
            communication_hint=self.hint, timeout=self.timeout))
    return out

  def all_gather(self, tensors, devices, group=None):
    """Concatenates the participants' tensors along dimension 0, on every participant."""
    group = tuple(group or devices)
    if len(group) == 1:
      return list(tensors)
    key, instance = self.group_key(group), self._instance()
    out = []
    for t, d in zip(tensors, devices):
      with tf.device(d):
        out.append(collective_ops.all_gather_v2(
            t, group_size=len(group), group_key=key, instance_key=instance,
            communication_hint=self.hint, timeout=self.timeout))
    return out

  def broadcast(self, tensor, device, group, root):
    """Returns ``group[root]``'s ``tensor`` on this member (``device``, one of ``group``).

    Args:
      tensor: the value on the root; elsewhere any tensor of the same shape and dtype.
    """
    group = tuple(group)
    if len(group) == 1:
      return tensor
    key, instance = self.group_key(group), self._instance()
    with tf.device(device):
      if device == group[root]:
        return collective_ops.broadcast_send_v2(
            tensor, group_size=len(group), group_key=key, instance_key=instance,
            communication_hint="auto", timeout=self.timeout)
      return collective_ops.broadcast_recv_v2(
          tf.shape(tensor), tensor.dtype, group_size=len(group), group_key=key,
          instance_key=instance, communication_hint="auto", timeout=self.timeout)
