"""The large-model recipe on one model and one set of devices: DP, TP and the 3D layout.

A GPT-2-style language model (conv1d weights [1, nx, nf] read through tf.reshape, a fused
Q/K/V projection, layer norms by hand, the input embedding tied to the logits, Adam via
tf.gradients + clipping + apply_gradients) on the same 8 virtual devices and the same global
batch in every layout:

  DP 8                      epl.replicate(1): 8 copies, each 1/8 of the batch
  TP 8                      epl.split(8): every block's heads and MLP cut in 8 (Megatron)
  DP 4 x TP 2               epl.split(2): 4 copies of a 2-part model
  DP 2 x PP 2 x TP 2        two epl.split(2) stages, 4 micro-batches, 2 copies
  ... + ZeRO v1             the same with zero.level v1 (Adam's slots shared over the copies)

For each: the step time (after 2 warm-up steps), the variables each device holds and the
traced step peak (epl.memory; the largest device), and the all-reduces of the tensor-parallel
parts per step as the plan reports them, against Megatron-LM's count for the same model:
2 forward + 2 backward per block, 1 forward for the vocabulary-parallel embedding and 1
backward for the tied logits' input, per micro-batch (its cross-entropy's three per-token
reductions left out on both sides: epl combines the parts' max / sum / label logit in the
graph). Each layout runs in a fresh process (one model in the process, as a user runs it).

usage: python bench/transformer.py [--layers 4] [--embd 256] [--heads 8] [--vocab 4096]
                                   [--ctx 32] [--batch 16] [--steps 5] [--only NAME,...]
"""
import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

DEVICES = 8
MiB = 1024.0 ** 2

# name -> (scope of stage i or None (the local script), stages, extra Config keys)
LAYOUTS = {
    "DP 8": ("replicate", 1, {}),
    "TP 8": ("split8", 1, {}),
    "DP 4 x TP 2": ("split2", 1, {}),
    "DP 2 x PP 2 x TP 2": ("split2", 2, {"pipeline.num_micro_batch": 4}),
    "DP 2 x PP 2 x TP 2 + ZeRO v1": ("split2", 2, {"pipeline.num_micro_batch": 4,
                                                  "zero.level": "v1"}),
}


def lm(tf, stage, args, stages):
  """The GPT-2-style LM; ``stage(i)``: the scope of pipeline stage i. Returns (context, loss,
  train_op)."""
  embd, heads = args.embd, args.heads
  seeds = iter(range(1, 10000))

  def norm(x, scope):
    with tf.variable_scope(scope):
      g = tf.get_variable("g", [embd], initializer=tf.constant_initializer(1))
      b = tf.get_variable("b", [embd], initializer=tf.constant_initializer(0))
      u = tf.reduce_mean(x, axis=-1, keepdims=True)
      s = tf.reduce_mean(tf.square(x - u), axis=-1, keepdims=True)
      return (x - u) * tf.rsqrt(s + 1e-5) * g + b

  def conv1d(x, scope, nf):
    with tf.variable_scope(scope):
      nx = x.shape[-1].value
      w = tf.get_variable("w", [1, nx, nf], initializer=tf.random_normal_initializer(
          stddev=0.02, seed=next(seeds)))
      b = tf.get_variable("b", [nf], initializer=tf.constant_initializer(0))
      return tf.reshape(tf.matmul(tf.reshape(x, [-1, nx]), tf.reshape(w, [-1, nf])) + b,
                        [-1, args.ctx, nf])

  def split_heads(x):
    return tf.transpose(tf.reshape(x, [-1, args.ctx, heads, embd // heads]), [0, 2, 1, 3])

  def merge_heads(x):
    return tf.reshape(tf.transpose(x, [0, 2, 1, 3]), [-1, args.ctx, embd])

  def block(x, scope):
    with tf.variable_scope(scope):
      with tf.variable_scope("attn"):
        q, k, v = map(split_heads, tf.split(conv1d(norm(x, "ln_1"), "c_attn", 3 * embd), 3,
                                            axis=2))
        w = tf.matmul(q, k, transpose_b=True) * (float(embd // heads) ** -0.5)
        mask = tf.reshape(tf.cast(tf.range(args.ctx)[:, None] >= tf.range(args.ctx),
                                  tf.float32), [1, 1, args.ctx, args.ctx])
        w = tf.nn.softmax(w * mask - 1e10 * (1 - mask))
        x = x + conv1d(merge_heads(tf.matmul(w, v)), "c_proj", embd)
      with tf.variable_scope("mlp"):
        h = tf.nn.tanh(conv1d(norm(x, "ln_2"), "c_fc", 4 * embd))
        return x + conv1d(h, "c_proj", embd)

  context = tf.placeholder(tf.int32, [None, args.ctx + 1], name="context")
  inputs, targets = context[:, :-1], context[:, 1:]
  angle = tf.cast(tf.range(args.ctx)[:, None], tf.float32) / tf.pow(
      10000.0, tf.range(0, embd, 2, dtype=tf.float32)[None, :] / embd)
  positions = tf.reshape(tf.stack([tf.sin(angle), tf.cos(angle)], axis=-1), [args.ctx, embd])
  per_stage = args.layers // stages
  with stage(0):
    wte = tf.get_variable("wte", [args.vocab, embd], initializer=tf.random_normal_initializer(
        stddev=0.02, seed=next(seeds)))
    h = tf.gather(wte, inputs) + positions
  for i in range(stages):
    with stage(i):
      for layer in range(i * per_stage, (i + 1) * per_stage):
        h = block(h, "h%d" % layer)
      if i == stages - 1:
        h = norm(h, "ln_f")
        logits = tf.matmul(tf.reshape(h, [-1, embd]), wte, transpose_b=True)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.reshape(targets, [-1]), logits=logits))
  variables = tf.trainable_variables()
  clipped, _ = tf.clip_by_global_norm(tf.gradients(loss, variables), 1.0)
  train_op = tf.train.AdamOptimizer(1e-3).apply_gradients(
      zip(clipped, variables), global_step=tf.train.get_or_create_global_step())
  return context, loss, train_op


def child(name, args):
  """One layout in this process: prints its figures as one JSON line."""
  import numpy as np
  import tensorflow.compat.v1 as tf
  tf.disable_v2_behavior()
  import epl

  kind, stages, keys = LAYOUTS[name]
  scopes = {"replicate": lambda i: epl.replicate(1, name="stage%d" % i),
            "split8": lambda i: epl.split(8, name="stage%d" % i),
            "split2": lambda i: epl.split(2, name="stage%d" % i)}
  epl.init(epl.Config(dict({"cluster.devices_per_worker": DEVICES, "log.level": "warning"},
                           **keys)))
  context, loss, train_op = lm(tf, scopes[kind], args, stages)
  rng = np.random.RandomState(0)
  data = rng.randint(0, args.vocab, (args.batch, args.ctx + 1)).astype(np.int32)
  feed = {context: data}
  with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    for _ in range(2):
      sess.run([loss, train_op], feed)       # the timed fetches: compiled before the clock
    start = time.perf_counter()
    for _ in range(args.steps):
      value, _ = sess.run([loss, train_op], feed)
    step = (time.perf_counter() - start) / args.steps
    memory = epl.memory.measure(sess, train_op, feed)
  plan = epl.Graph.get().plan
  devices = [d for d in memory.devices() if not d.endswith("CPU:0")]
  if not devices:
    raise SystemExit("no accelerator in the memory report: %s" % memory)
  micro = keys.get("pipeline.num_micro_batch", 1)
  forward = sum(f for f, _ in plan.reductions.values()) * micro
  backward = sum(b for _, b in plan.reductions.values()) * micro
  print(json.dumps(dict(step=step, loss=float(value), devices=len(devices),
                        held=max(memory.held(d) for d in devices),
                        peak=max(memory.peak(d) for d in devices),
                        forward=forward, backward=backward,
                        megatron=(2 * args.layers + 1) * micro if kind != "replicate" else 0,
                        copies=len(plan.copies))))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  for flag, default in (("layers", 4), ("embd", 256), ("heads", 8), ("vocab", 4096),
                        ("ctx", 32), ("batch", 16), ("steps", 5)):
    parser.add_argument("--" + flag, type=int, default=default)
  parser.add_argument("--only", default=",".join(LAYOUTS))
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    return child(args.child, args)
  print("GPT-2-style LM: %d layers, hidden %d, %d heads, vocabulary %d, context %d; global "
        "batch %d; Adam; %d virtual devices; %d timed steps" % (
            args.layers, args.embd, args.heads, args.vocab, args.ctx, args.batch, DEVICES,
            args.steps))
  flags = ["--%s=%d" % (f, getattr(args, f)) for f in
           ("layers", "embd", "heads", "vocab", "ctx", "batch", "steps")]
  results = {}
  print("\n%-30s %8s %10s %14s %14s %30s" % (
      "layout", "copies", "ms/step", "vars/device", "step peak", "TP all-reduces/step/replica"))
  for name in args.only.split(","):
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name] + flags,
                         capture_output=True, text=True, check=False)
    if out.returncode:
      print("%s failed:\n%s" % (name, out.stderr[-3000:]))
      continue
    r = results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    reduces = "-" if not r["megatron"] else "%d+%d (Megatron %d+%d)" % (
        r["forward"], r["backward"], r["megatron"], r["megatron"])
    print("%-30s %8d %10.0f %10.1f MiB %10.1f MiB %30s" % (
        name, r["copies"], r["step"] * 1e3, r["held"] / MiB, r["peak"] / MiB, reduces))
  if "DP 8" in results:
    base = results["DP 8"]
    print("\nagainst DP 8 (largest device):")
    for name, r in results.items():
      if name != "DP 8":
        print("  %-30s variables %.2f, step peak %.2f, step time %.2f" % (
            name, r["held"] / base["held"], r["peak"] / max(base["peak"], 1),
            r["step"] / base["step"]))


if __name__ == "__main__":
  main()
