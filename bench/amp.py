"""AMP O1 vs float32: step time, memory and loss, measured in one run.

  python bench/amp.py [--steps 5] [--blocks 6]

Models (bench/memory.py's, one device): a residual MLP (BLOCKS x 256, batch 256) and a
transformer stack (BLOCKS layers, 128 x 256, batch 16), trained with momentum. Each
configuration runs in a fresh process with TF's BFC CPU allocator, so the process peak is
that run's own:
  float32           no AMP
  O1 float16        amp.level O1, dynamic loss scale
  O1 bfloat16       amp.level O1, amp.dtype bfloat16
Printed per model and configuration: the process allocator peak, the traced step peak
(epl.memory.measure: the largest live set of the step's buffers), the mean step time, the
largest relative loss difference from float32 over the run and, for float16, the dynamic loss
scale at the end (each halving from 2^15 is a step skipped for inf/nan: the loss then differs
from float32's because that update did not happen). Ratios are O1 / float32.

On a CPU the low-precision kernels are not faster (Eigen emulates float16 matmuls: a
256 x 1024 x 4096 float16 matmul takes seconds here, which is why the MLP is 256 wide;
bfloat16 uses oneDNN where the CPU has it): the step-time ratio here says what AMP costs on this machine, not
what it gains on a GPU with tensor cores. The memory ratios carry over.
"""
import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()

from memory import residual_mlp, train_and_measure, transformer  # noqa: E402  (bench/memory.py)

MiB = 1024.0 ** 2
CONFIGS = {"float32": {}, "O1 float16": {"amp.level": "O1"},
           "O1 bfloat16": {"amp.level": "O1", "amp.dtype": "bfloat16"}}


def _models(blocks):
  return {"residual MLP (%d x 256, batch 256)" % blocks:
          (lambda x: residual_mlp(x, blocks=blocks, width=256), 256),
          "transformer (%d layers, 128 x 256, batch 16)" % blocks:
          (lambda x: transformer(x, layers=blocks, length=128, model=256, heads=4), 16)}


def child(model, config, steps, blocks):
  body, batch = _models(blocks)[model]

  def scale(sess):
    found = [v for v in tf.global_variables() if v.op.name == "epl_amp/loss_scale"]
    return {"scale": float(sess.run(found[0])) if found else None}
  print(json.dumps(train_and_measure(body, batch, CONFIGS[config], steps, rows=batch,
                                     extra=scale)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--blocks", type=int, default=6)
  parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    child(args.child[0], args.child[1], args.steps, args.blocks)
    return
  env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2")
  print("AMP O1 vs float32, 1 device, %d timed steps, each run in a fresh process (BFC CPU "
        "allocator)" % args.steps)
  for model in _models(args.blocks):
    results = {}
    for config in CONFIGS:
      out = subprocess.run([sys.executable, __file__, "--child", model, config, "--steps",
                            str(args.steps), "--blocks", str(args.blocks)], env=env,
                           capture_output=True, text=True)
      if out.returncode:
        raise SystemExit("%s / %s failed:\n%s" % (model, config, out.stderr[-3000:]))
      results[config] = json.loads(out.stdout.strip().splitlines()[-1])
    base = results["float32"]
    print("  %s" % model)
    for config, r in results.items():
      diff = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(r["losses"], base["losses"]))
      skipped = ("" if r["scale"] is None else ", loss scale 2^%d at the end" %
                 round(np.log2(r["scale"])))
      print("    %-12s process peak %7.1f MiB (%.2f), traced step peak %7.1f MiB (%.2f), "
            "%6.0f ms/step (%.2f), largest loss difference %.1e%s" % (
                config, r["peak"] / MiB, r["peak"] / base["peak"], r["traced"] / MiB,
                r["traced"] / base["traced"], r["step"] * 1e3, r["step"] / base["step"], diff,
                skipped))


if __name__ == "__main__":
  main()
