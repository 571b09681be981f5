"""Reads a sliced TextLineDataset under epl (io.slicing) and records every value it read.

usage: io_worker.py OUT_DIR FILE [FILE ...]
"""
import os
import sys

import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()

import epl  # noqa: E402


def main():
  out, files = sys.argv[1], sys.argv[2:]
  env = epl.init(epl.Config({"io.slicing": True, "io.unbalanced_io_slicing": True}))
  with epl.replicate(1):
    ds = tf.data.TextLineDataset(files).map(lambda s: tf.strings.to_number(s, tf.float32))
    value = tf.data.make_one_shot_iterator(ds.batch(1)).get_next()
    doubled = value * 2.0
  seen = []
  with tf.Session() as sess:
    try:
      while True:
        seen.append(float(sess.run(doubled)[0]) / 2)
    except tf.errors.OutOfRangeError:
      pass
  with open(os.path.join(out, "read_%d.txt" % env.cluster.worker_index), "w") as f:
    f.write(" ".join(str(int(v)) for v in seen))


if __name__ == "__main__":
  main()
