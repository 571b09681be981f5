"""Memory passes vs the baseline: bytes per device and step time, measured in one run.

  offload      offload.level v0 vs none: a 4 x 1024 MLP with Adam, data parallel on 2
               virtual devices: the variables each device holds between steps, the traced
               step peak per device, the step time
  apply groups optimizer.num_apply_group 4 vs 1: the same MLP with a hand-written Adam (the
               update as plain ops, BERT-style) on 1 device: the step peak, the step time

  checkpoint   gradient_checkpoint.type auto vs none, one device: a residual MLP stack
               (12 blocks, width 1024, batch 512) and a 12-layer transformer stack: the
               process's allocator peak (each run in a fresh process with TF's BFC CPU
               allocator), the traced step peak, the step time, and the largest loss difference

Memory is epl.memory.measure (variables = bytes the variables hold on the device; step peak =
the traced peak of one step's allocations on it) and, for checkpointing, the process peak.
  zero         zero.level v0, v1 and v2 vs none: the MLP with Adam, data parallel on 2 and 4
               devices: the variables each device holds (v0: weights + its share of the
               slots; v2: its share of both), the traced step peak, the step time
  tp           the GPT-2-style LM of bench/transformer.py (2 blocks, hidden 256, Adam): the
               bytes of the blocks' weights, of all weights and of Adam's slots on the
               fullest device, DP 2 vs TP 2 (epl.split(2)), and TP 2 x DP 2 with zero.level
               v1 vs without

usage: python bench/memory.py [--width 1024] [--layers 4] [--batch 256] [--steps 10]
                              [--only offload,groups,checkpoint,zero,tp]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()

import epl  # noqa: E402

MiB = 1024.0 ** 2


class HandWrittenAdam(tf.train.Optimizer):
  """BERT's AdamWeightDecayOptimizer in spirit: slots by get_variable, the update as ops."""

  def __init__(self, lr):
    super().__init__(False, "HandWrittenAdam")
    self.lr = lr

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    updates = []
    for grad, var in grads_and_vars:
      m = tf.get_variable(var.op.name + "/adam_m", var.shape, trainable=False,
                          initializer=tf.zeros_initializer())
      v = tf.get_variable(var.op.name + "/adam_v", var.shape, trainable=False,
                          initializer=tf.zeros_initializer())
      next_m = 0.9 * m + 0.1 * grad
      next_v = 0.999 * v + 0.001 * tf.square(grad)
      update = next_m / (tf.sqrt(next_v) + 1e-6) + 0.01 * var
      updates += [var.assign(var - self.lr * update), m.assign(next_m), v.assign(next_v)]
    with tf.control_dependencies(updates):
      return global_step.assign_add(1)


def run(args, devices, keys, optimizer):
  graph = tf.Graph()
  with graph.as_default():
    epl.init(epl.Config(dict({"cluster.devices_per_worker": devices, "log.level": "warning",
                              "log.progress_secs": 0}, **keys)))
    x = tf.placeholder(tf.float32, [None, args.width])
    y = tf.placeholder(tf.int64, [None])
    with epl.replicate(1, name="model"):
      h = x
      for i in range(args.layers):
        h = tf.layers.dense(h, args.width, activation=tf.nn.relu, name="dense_%d" % i)
      loss = tf.losses.sparse_softmax_cross_entropy(y, tf.layers.dense(h, 10, name="logits"))
    step = tf.train.get_or_create_global_step()
    opt = HandWrittenAdam(1e-3) if optimizer == "hand" else tf.train.AdamOptimizer(1e-3)
    train = opt.minimize(loss, global_step=step)
    rng = np.random.RandomState(0)
    feed = {x: rng.randn(args.batch, args.width).astype(np.float32),
            y: rng.randint(0, 10, args.batch)}
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      for _ in range(3):
        sess.run(train, feed)
      start = time.perf_counter()
      for _ in range(args.steps):
        sess.run(train, feed)
      seconds = (time.perf_counter() - start) / args.steps
      report = epl.memory.measure(sess, train, feed)
  return seconds, report


def _devices(report):
  return [d for d in report.devices() if not d.endswith("CPU:0") and d.startswith("/")]


# ---- gradient checkpointing: each run in its own process ----------------------------------
def _gelu(x):
  return 0.5 * x * (1.0 + tf.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))


def _norm(x, name):
  with tf.variable_scope(name):
    mean, var = tf.nn.moments(x, [-1], keep_dims=True)
    gamma = tf.get_variable("gamma", [x.shape[-1]], initializer=tf.ones_initializer())
    return (x - mean) * tf.rsqrt(var + 1e-12) * gamma


def residual_mlp(x, blocks=12, width=1024):
  h = tf.layers.dense(x, width, name="embed")
  for i in range(blocks):
    with tf.variable_scope("block_%d" % i):
      z = tf.layers.dense(_norm(h, "norm"), 4 * width, activation=_gelu, name="up")
      h = h + tf.layers.dense(z, width, name="down")
  return h


def transformer(x, layers=12, length=128, model=256, heads=4):
  size = model // heads
  h = tf.reshape(tf.layers.dense(x, length * model, name="embed"), [-1, length, model])
  for i in range(layers):
    with tf.variable_scope("layer_%d" % i):
      def split(t):
        return tf.transpose(tf.reshape(t, [-1, length, heads, size]), [0, 2, 1, 3])
      q, k, v = (split(tf.layers.dense(h, model, name=n)) for n in ("query", "key", "value"))
      probs = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / size ** 0.5)
      ctx = tf.reshape(tf.transpose(tf.matmul(probs, v), [0, 2, 1, 3]), [-1, length, model])
      h = _norm(h + tf.layers.dense(ctx, model, name="attention_output"), "attention_norm")
      ffn = tf.layers.dense(tf.layers.dense(h, 4 * model, activation=_gelu, name="inter"),
                            model, name="output")
      h = _norm(h + ffn, "output_norm")
  return tf.reduce_mean(h, axis=1)


MODELS = {"residual MLP (12 x 1024, batch 512)": (residual_mlp, 512),
          "transformer (12 layers, 128 x 256, batch 32)": (transformer, 32)}


def train_and_measure(body, batch, keys, steps, rows=None, extra=None):
  """Trains ``body`` (x -> features) with a 10-class head in this process under epl with
  ``keys``; returns {"peak", "traced", "step", "losses"} (+ ``extra(sess)``'s items): the
  allocator peak over ``steps`` timed steps, the traced step peak, seconds per step."""
  graph = tf.Graph()
  with graph.as_default():
    tf.set_random_seed(0)
    epl.init(epl.Config(dict(keys, **{"log.level": "warning", "log.progress_secs": 0})))
    x = tf.placeholder(tf.float32, [rows, 64])
    y = tf.placeholder(tf.int64, [rows])
    with epl.replicate(1, name="model"):
      logits = tf.layers.dense(body(x), 10, name="logits")
      loss = tf.losses.sparse_softmax_cross_entropy(y, logits)
    train = tf.train.MomentumOptimizer(0.01, 0.9).minimize(loss)
    rng = np.random.RandomState(0)
    feed = {x: rng.randn(batch, 64).astype(np.float32), y: rng.randint(0, 10, batch)}
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      losses = [float(sess.run([loss, train], feed)[0])]
      tf.config.experimental.reset_memory_stats("CPU:0")
      start = time.perf_counter()
      for _ in range(steps):
        losses.append(float(sess.run([loss, train], feed)[0]))
      seconds = (time.perf_counter() - start) / steps
      peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
      traced = max(epl.memory.measure(sess, train, feed).peaks.values())
      out = dict(peak=peak, traced=traced, step=seconds, losses=losses)
      out.update(extra(sess) if extra else {})
  return out


def checkpoint_child(model, kind, steps):
  """One run in this process: prints {"peak", "traced", "step", "losses"} as JSON."""
  body, batch = MODELS[model]
  print(json.dumps(train_and_measure(body, batch, {"gradient_checkpoint.type": kind}, steps)))


def checkpointing(steps):
  env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_ENABLE_ONEDNN_OPTS="0",
             TF_CPP_MIN_LOG_LEVEL="2")
  print("\ngradient checkpointing (auto) vs none, 1 device, %d timed steps, each run in a fresh "
        "process (BFC CPU allocator)" % steps)
  for model in MODELS:
    result = {}
    for kind in ("", "auto"):
      out = subprocess.run([sys.executable, __file__, "--checkpoint-child", model, kind,
                            str(steps)], env=env, capture_output=True, text=True, check=True)
      result[kind] = json.loads(out.stdout.strip().splitlines()[-1])
    base, gc = result[""], result["auto"]
    diff = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(gc["losses"], base["losses"]))
    print("  %s" % model)
    print("    none: process peak %7.1f MiB, traced step peak %7.1f MiB, %6.0f ms/step" % (
        base["peak"] / MiB, base["traced"] / MiB, base["step"] * 1e3))
    print("    auto: process peak %7.1f MiB, traced step peak %7.1f MiB, %6.0f ms/step" % (
        gc["peak"] / MiB, gc["traced"] / MiB, gc["step"] * 1e3))
    print("    auto / none: process peak %.2f, traced peak %.2f, step time %.2f; largest loss "
          "difference %.1e" % (gc["peak"] / base["peak"], gc["traced"] / base["traced"],
                               gc["step"] / base["step"], diff))


# ---- tensor parallelism and ZeRO on a transformer -----------------------------------------
BLOCK = re.compile(r"(^|/)h\d+/")


def lm_bytes(devices, keys):
  """[(block weights, all weights, all Adam slots)] bytes held on each accelerator after the
  rewrite."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from transformer import lm      # pylint: disable=import-outside-toplevel
  sizes = argparse.Namespace(layers=2, embd=256, heads=8, vocab=4096, ctx=32)
  kind = keys.pop("_scope")
  graph = tf.Graph()
  with graph.as_default():
    epl.init(epl.Config(dict({"cluster.devices_per_worker": devices, "log.level": "warning"},
                             **keys)))
    scope = (lambda i: epl.split(2, name="tp")) if kind == "split" else \
        (lambda i: epl.replicate(1, name="dp"))
    context, _, train_op = lm(tf, scope, sizes, 1)
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(train_op, {context: np.zeros([4, sizes.ctx + 1], np.int32)})
      held = epl.memory.initialised(sess)      # ZeRO: a slot's unused copies never allocate
    slots = [op for op in held if "Adam" in op.name.split("/")[-1] or "/Adam" in op.name]
    weights = [op for op in held if op not in slots and "power" not in op.name]
    blocks = [op for op in weights if BLOCK.search(op.name)]
    counts = [epl.memory.variable_bytes(graph, ops) for ops in (blocks, weights, slots)]
  accelerators = sorted(d for d in counts[1] if not d.endswith("CPU:0") and d.startswith("/"))
  return [tuple(c.get(d, 0) for c in counts) for d in accelerators]


def tensor_parallel():
  print("\ntensor parallelism and ZeRO: the LM of bench/transformer.py (2 blocks, hidden 256, "
        "vocabulary 4096), Adam; bytes on the fullest device")
  layouts = (("DP 2", 2, {"_scope": "replicate"}), ("TP 2", 2, {"_scope": "split"}),
             ("TP 2 x DP 2", 4, {"_scope": "split"}),
             ("TP 2 x DP 2 + ZeRO v1", 4, {"_scope": "split", "zero.level": "v1"}))
  fullest = {}
  for name, devices, keys in layouts:
    per_device = lm_bytes(devices, dict(keys))
    fullest[name] = [max(d[i] for d in per_device) for i in range(3)]
    print("  %-22s %d devices: block weights %5.2f MiB, all weights %5.2f MiB, Adam slots "
          "%5.2f MiB" % ((name, devices) + tuple(b / MiB for b in fullest[name])))
  ratio = lambda a, b, i: fullest[a][i] / fullest[b][i]     # noqa: E731
  print("  TP 2 / DP 2: block weights %.2f (ideal 0.50: the layer norms and row-parallel "
        "biases stay whole, on the first part), all weights %.2f, slots %.2f" % tuple(
            ratio("TP 2", "DP 2", i) for i in range(3)))
  print("  ZeRO v1 over DP 2 (TP 2 x DP 2 + ZeRO v1 / TP 2 x DP 2): weights %.2f (ideal "
        "1.00), slots %.2f (ideal 0.50)" % (ratio("TP 2 x DP 2 + ZeRO v1", "TP 2 x DP 2", 1),
                                             ratio("TP 2 x DP 2 + ZeRO v1", "TP 2 x DP 2", 2)))


def main():
  if len(sys.argv) > 1 and sys.argv[1] == "--checkpoint-child":
    return checkpoint_child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--width", type=int, default=1024)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--only", default="offload,groups,checkpoint,zero,tp")
  args = parser.parse_args()
  only = set(args.only.split(","))
  if "checkpoint" in only:
    checkpointing(3)
  if "tp" in only:
    tensor_parallel()
  if not only & {"offload", "groups", "zero"}:
    return
  print("\nMLP %d x %d, batch %d, %d timed steps" % (args.layers, args.width, args.batch,
                                                     args.steps))

  base_t, base = run(args, 2, {}, "adam")
  off_t, off = run(args, 2, {"offload.level": "v0"}, "adam")
  print("\noffload, data parallel on 2 devices, Adam")
  print("  baseline: %.1f ms/step\n%s" % (base_t * 1e3, base))
  print("  offload v0: %.1f ms/step\n%s" % (off_t * 1e3, off))
  held = [base.held(d) for d in _devices(base)]
  held_off = [off.held(d) for d in _devices(off)]
  print("  variables per device: %.1f MiB -> %.1f MiB; host %.1f MiB; step time x%.2f" % (
      max(held) / MiB, max(held_off) / MiB,
      max(off.held(d) for d in off.devices() if d.endswith("CPU:0")) / MiB, off_t / base_t))

  one_t, one = run(args, 1, {}, "hand")
  four_t, four = run(args, 1, {"optimizer.num_apply_group": 4}, "hand")
  peak = lambda r: max(r.peak(d) for d in r.devices())    # noqa: E731
  print("\napply groups, 1 device, hand-written Adam")
  print("  1 group : step peak %.1f MiB, %.1f ms/step" % (peak(one) / MiB, one_t * 1e3))
  print("  4 groups: step peak %.1f MiB, %.1f ms/step" % (peak(four) / MiB, four_t * 1e3))
  print("  ratio 4 groups / 1: step peak %.2f, step time %.2f" % (peak(four) / peak(one),
                                                                   four_t / one_t))
  print("\nZeRO, data parallel, Adam (weights + 2 slots per weight)")
  for devices in (2, 4):
    base_t, base = run(args, devices, {}, "adam")
    for level, ideal in (("v0", (1 + 2.0 / devices) / 3), ("v1", (1 + 2.0 / devices) / 3),
                         ("v2", 1.0 / devices)):
      zero_t, zero = run(args, devices, {"zero.level": level}, "adam")
      held, held_zero = ([r.held(d) for d in _devices(r)] for r in (base, zero))
      print("  %s, %d devices: variables per device %.1f MiB -> max %.1f MiB (ratio %.2f; "
            "ideal %.2f), step peak x%.2f, step %.1f -> %.1f ms (x%.2f)" % (
                level, devices, max(held) / MiB, max(held_zero) / MiB,
                max(held_zero) / max(held), ideal,
                max(zero.peak(d) for d in _devices(zero)) /
                max(base.peak(d) for d in _devices(base)),
                base_t * 1e3, zero_t * 1e3, zero_t / base_t))


if __name__ == "__main__":
  main()
