"""Bytes the CPU allocator holds for a split vs a data-parallel classifier's variables.

Run in a fresh process with TF_CPU_ALLOCATOR_USE_BFC=true (TF's allocator statistics need the
BFC allocator; all virtual devices share it, so this is the sum over the devices). Prints
JSON {"split": bytes, "data_parallel": bytes}: the allocator's growth when the variables and
optimizer slots are initialised.

usage: allocator_bytes.py CLASSES DEVICES [split|data_parallel ...]  (default: both, in order)
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()

import epl  # noqa: E402
from tests import split_models as sm  # noqa: E402


def initialised_bytes(classes, devices, split):
  with tf.Graph().as_default():
    epl.init(epl.Config({"cluster.devices_per_worker": devices, "log.level": "warning",
                         "cluster.colocate_split_and_replicate": True}))
    if split:
      trunk, head = sm.scopes(devices, devices)
    else:
      trunk = head = lambda: epl.replicate(1, name="all")    # noqa: E731
    sm.classifier(classes, trunk, head)
    init = tf.global_variables_initializer()
    with tf.Session() as sess:
      before = tf.config.experimental.get_memory_info("CPU:0")["current"]
      sess.run(init)
      return tf.config.experimental.get_memory_info("CPU:0")["current"] - before


if __name__ == "__main__":
  classes, devices = int(sys.argv[1]), int(sys.argv[2])
  layouts = sys.argv[3:] or ["split", "data_parallel"]
  print(json.dumps({k: initialised_bytes(classes, devices, k == "split") for k in layouts}))
