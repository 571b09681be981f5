"""Real model sizes: what a worker pays before its first step, per layout (#36).

  python bench/scale.py [--layers 6,12,24] [--layouts local,dp8,dp8_m4,pipe4_dp2_m8] [--bert]
                        [--bert-rows 32] [--bert-seq 128] [--bert-parts] [--local-bfc]
                        [--steps 5] [--grappler on|off|auto]
                        [--micro-batches auto|runs|functions|clones] [--split 2]
                        [--hidden 256] [--json]

Each configuration runs in a fresh process (one worker, ``cluster.devices_per_worker`` virtual
CPU devices): a GPT-style stack of L transformer blocks (hidden 256, 4 heads, sequence 32,
vocabulary 512, Adam), 8 rows per model copy per step. Layouts:
  local          the plain TF script (no epl), 8 rows
  dp8            epl, replicate(1) on 8 devices: 8 copies, 64 rows
  dp8_m4         the same with pipeline.num_micro_batch 4 (gradient accumulation), 64 rows
  pipe4_dp2_m8   4 pipeline stages x 2 replicas on 8 devices, 8 micro-batches, 16 rows
  pipe4_m16      4 pipeline stages on 4 devices, 16 micro-batches of 2 rows (32 rows)
  pipe4_m64      the same with 64 micro-batches (128 rows)
  local_rN       the plain TF script with N rows (the pipelines' global batch: local_r32,
                 local_r128; dp8_m4's: local_r64)
``--bert``: a BERT-base-sized encoder (12 x 768, 12 heads, sequence ``--bert-seq``: 128, BERT's
own; ``--bert-rows`` rows per step: 32, 4 per micro-batch) local, and on 2 devices x 4
micro-batches at the same global batch. ``--bert-parts`` adds where that step goes: the local
script accumulating the same 8 micro-batches by hand (TF1's usual recipe: a sum variable per
weight, one run per micro-batch, then the update), the local script at one micro-batch's
rows, DP 2 without micro-batches.
``--local-bfc``: the local rows with the pooled CPU allocator epl sets on import.

Per configuration it prints: the user's ops, the ops in the process's graph after the rewrite,
epl's rewrite seconds, seconds from the process's start to the end of the first step, the
steady step (median of ``--steps`` after two warm ones) and the process's peak RSS (one process
per host here: the host's too). Then the ratios the issue sets targets for, measured in this
run: start -> first step over the local script's (target <= 3 for 12 and 24 layers), host RSS
over the local script's per device copy (target <= 2), DP 8's steady step over 8x the local
one (<= 1.2), BERT DP 2 x 4 micro-batches over the local step (<= 1.1).
"""
import argparse
import json
import os
import subprocess
import sys
import time

STARTED = time.time()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = ("local", "dp8", "dp8_m4", "pipe4_dp2_m8")
ROWS = 8                      # per model copy per step
BERT_ROWS, BERT_SEQ = 32, 128
SEQ, VOCAB = 32, 512


def _gelu(tf):
  return lambda x: 0.5 * x * (1.0 + tf.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))


def _block(tf, h, hidden, heads, name):
  size = hidden // heads

  def norm(x, scope):
    with tf.variable_scope(scope):
      mean, var = tf.nn.moments(x, [-1], keep_dims=True)
      gamma = tf.get_variable("gamma", [hidden], initializer=tf.ones_initializer())
      beta = tf.get_variable("beta", [hidden], initializer=tf.zeros_initializer())
      return (x - mean) * tf.rsqrt(var + 1e-5) * gamma + beta

  with tf.variable_scope(name):
    a = norm(h, "ln_1")
    qkv = tf.layers.dense(a, 3 * hidden, name="c_attn")
    q, k, v = [tf.transpose(tf.reshape(t, [-1, SEQ, heads, size]), [0, 2, 1, 3])
               for t in tf.split(qkv, 3, axis=-1)]
    scores = tf.matmul(q, k, transpose_b=True) / size ** 0.5
    mask = tf.linalg.band_part(tf.ones([SEQ, SEQ]), -1, 0)
    scores = scores * mask - 1e4 * (1 - mask)
    ctx = tf.reshape(tf.transpose(tf.matmul(tf.nn.softmax(scores), v), [0, 2, 1, 3]),
                     [-1, SEQ, hidden])
    h = h + tf.layers.dense(ctx, hidden, name="c_proj")
    m = tf.layers.dense(norm(h, "ln_2"), 4 * hidden, activation=_gelu(tf), name="c_fc")
    return h + tf.layers.dense(m, hidden, name="mlp_proj")


def build(tf, epl, layers, hidden, heads, stages, by_hand=1, split=1):
  """The model; ``stages`` > 1 cuts its blocks into that many epl.replicate scopes (with
  ``split`` > 1: epl.split scopes of that many parts, tensor parallelism in each stage).
  ``by_hand`` > 1: the local script's own gradient accumulation over that many micro-batches,
  as TF1 users write it (``train`` is then (accumulate, apply and zero): ``by_hand`` runs of
  the first, each on its rows, then one of the second)."""
  tokens = tf.placeholder(tf.int32, [None, SEQ], name="tokens")
  labels = tf.placeholder(tf.int32, [None, SEQ], name="labels")
  def scope(i):
    if stages == 1:
      import contextlib
      return contextlib.nullcontext()
    name = "stage_%d" % (i * stages // layers)
    return epl.split(split, name=name) if split > 1 else epl.replicate(1, name=name)

  with scope(0):
    wte = tf.get_variable("wte", [VOCAB, hidden],
                          initializer=tf.random_normal_initializer(stddev=0.02))
    wpe = tf.get_variable("wpe", [SEQ, hidden],
                          initializer=tf.random_normal_initializer(stddev=0.01))
    h = tf.gather(wte, tokens) + wpe
  for i in range(layers):
    with scope(i):
      h = _block(tf, h, hidden, heads, "h%d" % i)
  with scope(layers - 1):
    logits = tf.layers.dense(h, VOCAB, name="lm_head")
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits))
    optimizer = tf.train.AdamOptimizer(1e-4)
    if by_hand == 1:
      return tokens, labels, loss, optimizer.minimize(loss)
  pairs = optimizer.compute_gradients(loss)
  sums = [tf.Variable(tf.zeros(v.shape), trainable=False) for _, v in pairs]
  accumulate = tf.group([s.assign_add(g) for s, (g, _) in zip(sums, pairs)])
  apply = optimizer.apply_gradients([(s / by_hand, v) for s, (_, v) in zip(sums, pairs)])
  with tf.control_dependencies([apply]):
    zero = tf.group([s.assign(tf.zeros(s.shape)) for s in sums])
  return tokens, labels, loss, (accumulate, zero)


def child(spec):
  os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")         # tf.layers (epl sets it too)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
  global SEQ
  SEQ = spec.get("seq", SEQ)
  import resource
  import numpy as np
  import tensorflow.compat.v1 as tf
  tf.disable_v2_behavior()
  layout = spec["layout"]
  devices, micro, stages = {"local": (1, 1, 1), "dp8": (8, 1, 1), "dp8_m4": (8, 4, 1),
                            "pipe4_dp2_m8": (8, 8, 4), "dp2_m4": (2, 4, 1), "dp2": (2, 1, 1),
                            "dp1_m4": (1, 4, 1), "local_m8": (1, 1, 1),
                            "pipe4_m16": (4, 16, 4), "pipe4_m64": (4, 64, 4)}.get(
                                layout, (1, 1, 1))          # local_rN: the local script, N rows
  by_hand = 8 if layout == "local_m8" else 1
  split = spec.get("split", 1)            # > 1: every stage an epl.split of that many parts
  copies = devices // stages
  devices *= split
  epl, rewrite = None, {}
  if not layout.startswith("local"):
    import epl
    from epl.runtime import driver
    original = driver.rewrite

    def timed(state):
      began = time.time()
      try:
        return original(state)
      finally:
        rewrite.setdefault("seconds", time.time() - began)
    driver.rewrite = timed
    epl.init(epl.Config({"cluster.devices_per_worker": devices,
                         "pipeline.num_micro_batch": micro, "log.progress_secs": 0,
                         "graph.grappler": spec.get("grappler", "auto"),
                         **({"graph.micro_batches": spec.get("micro_batches", "auto")}
                            if micro > 1 else {}), **spec.get("config", {})}))
    if stages == 1:
      epl.set_default_strategy(epl.replicate(1))
  imported = time.time()
  tokens, labels, loss, train = build(tf, epl, spec["layers"], spec["hidden"], spec["heads"],
                                      stages, by_hand, split)
  built = time.time()
  graph = tf.get_default_graph()
  user_ops = len(graph.get_operations())
  rows = spec.get("rows") or (int(layout[7:]) if layout.startswith("local_r") else
                              2 * micro if layout.startswith("pipe4_m") else ROWS * copies)
  rng = np.random.RandomState(0)
  feed = {tokens: rng.randint(0, VOCAB, [rows, SEQ]), labels: rng.randint(0, VOCAB, [rows, SEQ])}
  times = []
  with tf.Session() as sess:
    sess.run(tf.global_variables_initializer())
    initialised = time.time()
    for step in range(spec["steps"] + 3):
      began = time.time()
      if by_hand == 1:
        sess.run(train, feed)
      else:
        for m in range(by_hand):
          sess.run(train[0], {t: v[m::by_hand] for t, v in feed.items()})
        sess.run(train[1])
      times.append(time.time() - began)
      if step == 0:
        first = time.time() - STARTED
  steady = sorted(times[3:])[len(times[3:]) // 2]
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20      # KiB -> GiB
  print(json.dumps(dict(spec, user_ops=user_ops, ops=len(graph.get_operations()),
                        rewrite=rewrite.get("seconds"), first=first, steady=steady,
                        rss=rss, host_rss=rss, copies=copies, rows=rows,
                        phases=dict(imports=imported - STARTED, build=built - imported,
                                    init=initialised - built, step=first - initialised +
                                    STARTED))), flush=True)


def run(spec):
  out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                       capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT, **spec.get("env", {})))
  lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
  if out.returncode or not lines:
    return dict(spec, error=(out.stderr or out.stdout)[-600:])
  return json.loads(lines[-1])


def _row(r):
  if "error" in r:
    return "%-28s failed: %s" % (r["name"], r["error"].strip().splitlines()[-1])
  return "%-28s %8d %9d %8s %9.1f %9.3f %7.2f" % (
      r["name"], r["user_ops"], r["ops"], "-" if r["rewrite"] is None else "%.1f" % r["rewrite"],
      r["first"], r["steady"], r["host_rss"])


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--child", help=argparse.SUPPRESS)
  p.add_argument("--layers", default="6,12,24")
  p.add_argument("--layouts", default=",".join(LAYOUTS))
  p.add_argument("--bert", action="store_true")
  p.add_argument("--bert-parts", action="store_true",
                 help="with --bert: where DP 2 x 4's step goes (the local script at 1 and 2 "
                      "rows, DP 2 without micro-batches, 1 device x 4 micro-batches)")
  p.add_argument("--bert-rows", type=int, default=BERT_ROWS,
                 help="with --bert: the global batch in rows (default %(default)s: 4 rows per "
                      "micro-batch of DP 2 x 4)")
  p.add_argument("--bert-seq", type=int, default=BERT_SEQ,
                 help="with --bert: the sequence length (default %(default)s)")
  p.add_argument("--local-bfc", action="store_true",
                 help="run the local script with TF's pooling CPU allocator too "
                      "(TF_CPU_ALLOCATOR_USE_BFC=true, which epl sets on import): the "
                      "local rows then differ from the epl rows only by epl")
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--grappler", default="auto", choices=["on", "off", "auto"],
                 help="epl's graph.grappler key for the epl layouts")
  p.add_argument("--micro-batches", default="auto",
                 choices=["auto", "runs", "functions", "clones"],
                 help="epl's graph.micro_batches key for the layouts with micro-batches")
  p.add_argument("--split", type=int, default=1,
                 help="every stage of the pipe4 layouts an epl.split of this many parts "
                      "(tensor parallelism inside the stages; devices x this)")
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--json", action="store_true")
  args = p.parse_args()
  if args.child:
    return child(json.loads(args.child))
  specs = [dict(name="L%s %s" % (layers, layout), layers=int(layers), hidden=args.hidden,
                heads=4, layout=layout, steps=args.steps, grappler=args.grappler,
                micro_batches=args.micro_batches,
                **({"split": args.split} if layout.startswith("pipe4") else {}))
           for layers in args.layers.split(",") if layers for layout in args.layouts.split(",")]
  if args.bert:
    specs += [dict(name="BERT-base local", layers=12, hidden=768, heads=12, layout="local",
                   steps=args.steps, rows=args.bert_rows, seq=args.bert_seq),
              dict(name="BERT-base dp2_m4", layers=12, hidden=768, heads=12, layout="dp2_m4",
                   steps=args.steps, rows=args.bert_rows, grappler=args.grappler,
                   micro_batches=args.micro_batches, seq=args.bert_seq)]
    if args.bert_parts:
      bert = dict(layers=12, hidden=768, heads=12, steps=args.steps, grappler=args.grappler,
                  micro_batches=args.micro_batches, seq=args.bert_seq)
      specs += [dict(bert, name="BERT-base local by hand x 8", layout="local_m8",
                     rows=args.bert_rows),
                dict(bert, name="BERT-base local 1 micro-batch", layout="local",
                     rows=max(1, args.bert_rows // 8)),
                dict(bert, name="BERT-base dp2", layout="dp2", rows=args.bert_rows)]
  if args.local_bfc:
    for spec in specs:
      if spec["layout"].startswith("local"):
        spec["env"] = {"TF_CPU_ALLOCATOR_USE_BFC": "true"}
  # the first process would read TF's files from disk: warm the file cache so that every row
  # (the local baseline first) starts alike
  subprocess.run([sys.executable, "-c", "import tensorflow"], capture_output=True,
                 env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
  print("%-28s %8s %9s %8s %9s %9s %7s" % ("configuration", "user ops", "graph ops",
                                          "rewrite", "1st step", "steady", "RSS GiB"))
  results = []
  for spec in specs:
    results.append(run(spec))
    print(_row(results[-1]), flush=True)
  ok = {r["name"]: r for r in results if "error" not in r}
  print("\nratios (this run):")
  for r in ok.values():
    if r["layout"].startswith("local"):
      continue
    base = ok.get("L%d local" % r["layers"]) if r["name"].startswith("L") else \
        ok.get("BERT-base local")
    if base is None:
      continue
    line = "%-28s first step %.1fx local (target <= 3 at 12, 24 layers); host RSS %.2fx " \
           "local per copy (target <= 2)" % (r["name"], r["first"] / base["first"],
                                             r["host_rss"] / (base["host_rss"] * r["copies"]))
    if r["layout"] == "dp8":
      line += "; steady %.2fx 8x local (target <= 1.2)" % (r["steady"] / (8 * base["steady"]))
    if r["layout"] in ("dp2_m4", "dp2"):
      line += "; steady %.2fx local at equal batch%s" % (
          r["steady"] / base["steady"], " (target <= 1.1)" if r["layout"] == "dp2_m4" else "")
    print(line)
  _startup(ok)
  print("\nwhere the first step goes, seconds (init: the initializer's run, with epl's rewrite "
        "in it; step: the first training run):")
  for r in ok.values():
    print("%-28s %s" % (r["name"], ", ".join("%s %.1f" % kv for kv in r["phases"].items())))
  _bert_parts(ok)
  if args.json:
    print(json.dumps(results))


def _startup(ok):
  """#50's start-up ratio: from the start of the graph build to the end of the first step
  (imports excluded), less one steady step, over the local script's at the same global batch
  (``local_rN`` with N the layout's rows, else ``local``); and the graph's ops at M = 64 over
  M = 16."""
  def startup(r):
    p = r["phases"]
    return p["build"] + p["init"] + p["step"] - r["steady"]
  lines = []
  for r in ok.values():
    if r["layout"].startswith("local") or not r["name"].startswith("L"):
      continue
    base = ok.get("L%d local_r%d" % (r["layers"], r["rows"])) or ok.get("L%d local" % r["layers"])
    if base is None:
      continue
    lines.append("%-28s build -> first step, less a steady step: %.1f s vs %.1f s local at %d "
                 "rows: %.2fx (target <= 3 at M = 64 and dp8_m4)" % (
                     r["name"], startup(r), startup(base), base["rows"],
                     startup(r) / startup(base)))
  for r in ok.values():
    other = ok.get(r["name"].replace("pipe4_m64", "pipe4_m16"))
    if r["layout"] == "pipe4_m64" and other is not None:
      lines.append("%-28s graph ops at M = 64 / M = 16: %d / %d = %.2f (target <= 1.25)" % (
          r["name"], r["ops"], other["ops"], r["ops"] / other["ops"]))
  if lines:
    print("\nstart-up and graph size (#50):")
    print("\n".join(lines))


def _bert_parts(ok):
  """Where DP 2 x 4's step goes: against the local script accumulating the same 8
  micro-batches by hand (what epl adds: the all-reduce, two updates, the runs' machinery), and
  against 8 local steps of one micro-batch's rows (each micro-batch is a whole forward and
  backward, however few its rows)."""
  dp, by_hand, one = (ok.get("BERT-base " + n) for n in ("dp2_m4", "local by hand x 8",
                                                          "local 1 micro-batch"))
  if dp is None:
    return
  if by_hand is not None:
    print("%-28s steady %.2fx the local script's own accumulation of the same 8 micro-batches"
          % (dp["name"], dp["steady"] / by_hand["steady"]))
  if one is not None:
    print("%-28s steady %.2fx 8 x the local script's %d-row step" % (
        dp["name"], dp["steady"] / (8 * one["steady"]), one["rows"]))


if __name__ == "__main__":
  main()
