"""The whole feature-combination matrix, every cell written every way users write it, under
the race amplifier (issue #48). CI runs each cell one way (tests/test_combinations.py:
``matrix_model.variant_for``); this runs them all.

  python bench/matrix.py [--delay 20] [--repeats 1] [--cells one,across,recipe]
                         [--pairs split+zero_v1,...] [--variants 0-23] [--stop]

Cells: ``one`` every pair on one worker (matrix_model.FEATURES; refused pairs must still be
refused), ``across`` every pair with data parallelism across 2 workers, ``recipe`` the whole
recipe set across 2 workers. Variants (matrix_model.VARIANTS, 24): the step written three
ways (``minimize``; ``compute_gradients`` + ``apply_gradients``; ``tf.gradients`` +
``apply_gradients`` without a global step) x ref / resource variables x SGD / Adam (its default
epsilon) x the session opened before the model or after it. Each run is compared with the
race-free local run at 1e-5 (AMP: its float16 tolerance); ``--delay`` is
``testing.race_delay_ms`` (0: no amplifier). Prints one line per failing run and a summary
table (failures per cell kind and variant axis); exits 1 on any failure.
"""
import argparse
import collections
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()    # as the tests (and the scripts they stand for) run

import pathlib  # noqa: E402

from tests import matrix_model as mm  # noqa: E402
from tests import test_combinations as tc  # noqa: E402

RECIPE = ("dp_workers", "pipeline", "split", "zero_v1", "amp", "checkpointing")


def _cells(kinds, pairs):
  out = []
  if "one" in kinds:
    out += [("one", p) for p in tc.ONE_WORKER]
  if "across" in kinds:
    out += [("across", p) for p in tc.ACROSS]
  if "recipe" in kinds:
    out.append(("recipe", RECIPE))
  if pairs:
    out = [(k, p) for k, p in out if "+".join(p) in pairs]
  return out


def _run(kind, pair, variant, delay):
  tc.AMPLIFY = delay
  if kind == "one":
    tc.check_cell(pair, variant, delay)
  else:
    tc._across_workers(pair, pathlib.Path(tempfile.mkdtemp(prefix="epl_matrix_")), variant)


def _variants(spec):
  lo, _, hi = spec.partition("-")
  return [mm.VARIANTS[i] for i in range(int(lo), int(hi or lo) + 1)]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--delay", type=int, default=20)
  parser.add_argument("--repeats", type=int, default=1)
  parser.add_argument("--cells", default="one,across,recipe")
  parser.add_argument("--pairs", default="")
  parser.add_argument("--variants", default="0-%d" % (len(mm.VARIANTS) - 1))
  parser.add_argument("--stop", action="store_true", help="stop at the first failure")
  args = parser.parse_args()
  cells = _cells(args.cells.split(","), set(filter(None, args.pairs.split(","))))
  variants = _variants(args.variants)
  failed, runs = collections.Counter(), 0
  began = time.time()
  for kind, pair in cells:
    for variant in variants:
      for _ in range(args.repeats):
        runs += 1
        try:
          _run(kind, pair, variant, args.delay)
        except Exception as e:   # pylint: disable=broad-except  (a failing cell is a row)
          failed[(kind, "+".join(pair), str(variant))] += 1
          print("FAIL %s %s %s: %s" % (kind, "+".join(pair), variant,
                                       str(e).strip().splitlines()[0][:200]), flush=True)
          if os.environ.get("EPL_BENCH_TRACEBACK"):
            traceback.print_exc()
          if args.stop:
            return 1
  print("\n%d run(s) of %d cell(s) x %d variant(s) x %d, amplifier %d ms, %.0f s: %d failed"
        % (runs, len(cells), len(variants), args.repeats, args.delay, time.time() - began,
           sum(failed.values())))
  by_axis = collections.Counter()
  for (kind, _, variant), n in failed.items():
    for part in variant.split("/"):
      by_axis[part] += n
    by_axis[kind] += n
  for key, n in sorted(by_axis.items()):
    print("  failures with %-20s %d" % (key, n))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
