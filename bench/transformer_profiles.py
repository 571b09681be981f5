"""Writes the planner's committed transformer profiles (epl/plan/auto/profiles/, #51).

  python bench/transformer_profiles.py [--measure]

The analytic ones (``transformer.ANALYTIC_PROFILES``: GPT-2 1.5B on V100s, GPT-3 6.7B and
13B on A100s) from the published shapes; with ``--measure`` also the measured one:
epl.profiler on bench/scale.py's 6-block GPT stack (hidden 256, 4 heads, sequence 32, 8
rows) on this machine's CPU (TensorFlow imported only then). tests/test_planner3d.py checks
the analytic files equal what the code makes; the planner's generic tests plan from them,
so they never need DAPPLE's published profiles.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from epl.plan.auto import transformer  # noqa: E402


def measure(rows=8):
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import numpy as np
  import tensorflow.compat.v1 as tf
  tf.disable_v2_behavior()
  import epl
  from bench import scale
  graph = tf.Graph()
  with graph.as_default():
    tokens, labels, _, train = scale.build(tf, epl, 6, 256, 4, 1)
    rng = np.random.RandomState(0)
    feed = {tokens: rng.randint(0, scale.VOCAB, (rows, scale.SEQ)),
            labels: rng.randint(0, scale.VOCAB, (rows, scale.SEQ))}
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      return epl.profiler.profile(sess, train, feed, steps=3)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--measure", action="store_true", help="also measure the CPU profile")
  args = p.parse_args()
  for name, shape, cluster, rows in transformer.ANALYTIC_PROFILES:
    text = transformer.to_profile(transformer.SHAPES[shape], cluster(), rows).dump()
    with open(transformer.profile_path(name), "w") as f:
      f.write(text)
    print("wrote", transformer.profile_path(name))
  if args.measure:
    with open(transformer.profile_path(transformer.MEASURED_PROFILE), "w") as f:
      f.write(measure().dump())
    print("wrote", transformer.profile_path(transformer.MEASURED_PROFILE))


if __name__ == "__main__":
  main()
