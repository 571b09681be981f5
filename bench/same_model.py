"""Issue #48's acceptance runs, repeated: does every run train the local model?

  python bench/same_model.py [--runs 10] [--delay 0] [--cases minimal,adam,gpt2]

``minimal``: two replicate(1) stages with GPT-2's layer norm, replicated twice on 4 devices,
ZeRO v1 and v2 x 1, 2 and 4 micro-batches, 3 SGD steps, the step written three ways
(tests/test_ordering.py); ``adam``: the same with Adam (2 micro-batches), ref and resource
variables; ``gpt2``: GPT-2 as OpenAI's model.py writes it with the usual trainer's step
(tf.gradients, no global step, the session opened first) on DP 2 x PP 2 x TP 2 with 2 and 4
micro-batches + ZeRO v1 (4: + gradient checkpointing). Each run is a fresh graph compared with
the race-free local run at 1e-5; ``--delay`` is the race amplifier (testing.race_delay_ms; 0:
the runs as users run them). Prints, per configuration, how many runs trained the local model.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()    # as the tests (and the scripts they stand for) run

import numpy as np  # noqa: E402

import epl  # noqa: E402
from tests import test_ordering as to  # noqa: E402
from tests.real_scripts import gpt2_lm  # noqa: E402


def _configurations(cases, delay):
  out = []
  if "minimal" in cases:
    for level in ("v1", "v2"):
      for micro in (1, 2, 4):
        for style in to.STYLES:
          out.append(("minimal %s m%d %s" % (level, micro, style), to._two_stages(style),
                      to._feeds(), {"cluster.devices_per_worker": 4,
                                    "pipeline.num_micro_batch": micro, "zero.level": level},
                      to._stages))
  if "adam" in cases:
    for resource in (False, True):
      for level in ("v1", "v2"):
        for style in ("tf.gradients", "minimize"):
          out.append(("adam %s %s %s" % ("resource" if resource else "ref", level, style),
                      to._two_stages(style, "adam", resource), to._feeds(),
                      {"cluster.devices_per_worker": 4, "pipeline.num_micro_batch": 2,
                       "zero.level": level}, to._stages))
  if "gpt2" in cases:
    feeds = [{"context": c} for c in np.split(gpt2_lm.make_data(16 * 2)["context"], 2)]
    for micro, extra in ((2, {}), (4, {"gradient_checkpoint.type": "auto"})):
      out.append(("gpt2 DP2xPP2xTP2 m%d ZeRO v1%s" % (micro, " +ckpt" if extra else ""),
                  to._gpt2_trainer, feeds,
                  dict({"cluster.devices_per_worker": 8, "pipeline.num_micro_batch": micro,
                        "zero.level": "v1"}, **extra),
                  lambda i: epl.split(2, name="stage%d" % i)))
  for _, _, _, config, _ in out:
    config["testing.race_delay_ms"] = delay
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--runs", type=int, default=10)
  parser.add_argument("--delay", type=int, default=0)
  parser.add_argument("--cases", default="minimal,adam,gpt2")
  args = parser.parse_args()
  bad_total = 0
  for name, build, feeds, config, scopes in _configurations(args.cases.split(","), args.delay):
    local = to._train(build, feeds=feeds)
    good, began, worst = 0, time.time(), 0.0
    for _ in range(args.runs):
      try:
        to._same(local, build, config, feeds, scopes)
        good += 1
      except AssertionError as e:
        worst = max(worst, float(str(e).split("= ")[1].split(" ")[0]) if "= " in str(e) else 1)
    bad_total += args.runs - good
    print("%-48s %2d of %d runs the local model%s (%.1f s a run)" % (
        name, good, args.runs, "" if good == args.runs else ", worst |diff| %.2g" % worst,
        (time.time() - began) / args.runs), flush=True)
  return 1 if bad_total else 0


if __name__ == "__main__":
  sys.exit(main())
