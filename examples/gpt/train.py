# A GPT-2-style language model trained with the large-model recipe ("3D" parallelism): each
# transformer block is tensor parallel over 2 devices (Megatron-LM's pattern: attention heads
# and the MLP split, two all-reduces forward per block), the blocks are 2 pipeline stages
# with micro-batches, and the pipeline is data parallel over the rest of the job's devices --
# with ZeRO v1 optimizer state and gradient checkpointing. A model replica needs 4 devices.
#
# The model is written as OpenAI's gpt-2 model.py writes it (conv1d weights [1, nx, nf] read
# through tf.reshape, layer norm by hand, a fused Q/K/V projection, the input embedding tied
# to the logits); nothing in it is epl's. How each weight is split follows from how it is
# used (docs/user_guide.md, "Large models (3D)").
#
#   EPL_CLUSTER_DEVICES_PER_WORKER=8 python train.py   # 1 worker of 8 devices: 2 replicas
#   epl-launch --num_workers 2 --gpu_per_worker 4 run.sh
# The lines marked "epl" are all that parallelises the local script.
import numpy as np
import tensorflow.compat.v1 as tf
import epl  # epl

tf.disable_v2_behavior()
VOCAB, CTX, EMBD, HEADS, LAYERS, BATCH, STEPS = 32, 16, 32, 4, 2, 8, 30

epl.init(epl.Config({"pipeline.num_micro_batch": 4, "zero.level": "v1",  # epl
                     "gradient_checkpoint.type": "auto"}))  # epl


rng = np.random.RandomState(0)
starts, strides = rng.randint(0, VOCAB, 256), rng.randint(1, 4, 256)
tokens = ((starts[:, None] + strides[:, None] * np.arange(CTX + 1)) % VOCAB).astype(np.int32)
context = tf.placeholder(tf.int32, [None, CTX + 1], name="context")   # as gpt-2's train.py


def sample_batch(step):
  return tokens[step * BATCH % len(tokens):][:BATCH]


SEEDS = iter(range(1, 1000))   # seeded initializers: the same first weights under epl and alone


def shape_list(x):
  static, dynamic = x.shape.as_list(), tf.shape(x)
  return [dynamic[i] if s is None else s for i, s in enumerate(static)]


def norm(x, scope, epsilon=1e-5):
  with tf.variable_scope(scope):
    n = x.shape[-1].value
    g = tf.get_variable("g", [n], initializer=tf.constant_initializer(1))
    b = tf.get_variable("b", [n], initializer=tf.constant_initializer(0))
    u = tf.reduce_mean(x, axis=-1, keepdims=True)
    s = tf.reduce_mean(tf.square(x - u), axis=-1, keepdims=True)
    return (x - u) * tf.rsqrt(s + epsilon) * g + b


def conv1d(x, scope, nf):
  with tf.variable_scope(scope):
    *start, nx = shape_list(x)
    w = tf.get_variable("w", [1, nx, nf],
                        initializer=tf.random_normal_initializer(stddev=0.1, seed=next(SEEDS)))
    b = tf.get_variable("b", [nf], initializer=tf.constant_initializer(0))
    return tf.reshape(tf.matmul(tf.reshape(x, [-1, nx]), tf.reshape(w, [-1, nf])) + b,
                      start + [nf])


def split_heads(x):
  *start, m = shape_list(x)
  return tf.transpose(tf.reshape(x, start + [HEADS, m // HEADS]), [0, 2, 1, 3])


def merge_heads(x):
  x = tf.transpose(x, [0, 2, 1, 3])
  *start, a, b = shape_list(x)
  return tf.reshape(x, start + [a * b])


def attn(x, scope):
  with tf.variable_scope(scope):
    q, k, v = map(split_heads, tf.split(conv1d(x, "c_attn", EMBD * 3), 3, axis=2))
    w = tf.matmul(q, k, transpose_b=True) * tf.rsqrt(float(EMBD // HEADS))
    _, _, nd, ns = shape_list(w)
    mask = tf.reshape(tf.cast(tf.range(nd)[:, None] >= tf.range(ns), w.dtype), [1, 1, nd, ns])
    w = tf.nn.softmax(w * mask - 1e10 * (1 - mask))
    return conv1d(merge_heads(tf.matmul(w, v)), "c_proj", EMBD)


def block(x, scope):
  with tf.variable_scope(scope):
    x = x + attn(norm(x, "ln_1"), "attn")
    with tf.variable_scope("mlp"):
      h = tf.nn.tanh(conv1d(norm(x, "ln_2"), "c_fc", EMBD * 4))
      return x + conv1d(h, "c_proj", EMBD)


def positions(seq):
  """Sinusoidal position encodings (no variable)."""
  angle = tf.cast(tf.range(seq)[:, None], tf.float32) / tf.pow(
      10000.0, tf.range(0, EMBD, 2, dtype=tf.float32)[None, :] / EMBD)
  return tf.reshape(tf.stack([tf.sin(angle), tf.cos(angle)], axis=-1), [seq, EMBD])


inputs, targets = context[:, :-1], context[:, 1:]
batch, seq = shape_list(inputs)
with epl.split(device_count=2, name="stage0"):  # epl
  wte = tf.get_variable("wte", [VOCAB, EMBD],
                        initializer=tf.random_normal_initializer(stddev=0.3, seed=next(SEEDS)))
  h = tf.gather(wte, inputs) + positions(seq)
  for layer in range(LAYERS // 2):
    h = block(h, "h%d" % layer)
with epl.split(device_count=2, name="stage1"):  # epl
  for layer in range(LAYERS // 2, LAYERS):
    h = block(h, "h%d" % layer)
  h = norm(h, "ln_f")
  logits = tf.matmul(tf.reshape(h, [batch * seq, EMBD]), wte, transpose_b=True)  # tied
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=tf.reshape(targets, [-1]), logits=logits))
opt = tf.train.AdamOptimizer(0.003)
grads = tf.gradients(loss, tf.trainable_variables())
clipped, _ = tf.clip_by_global_norm(grads, 1.0)
train_op = opt.apply_gradients(zip(clipped, tf.trainable_variables()),
                               global_step=tf.train.get_or_create_global_step())

with tf.train.MonitoredTrainingSession() as sess:
  for step in range(1, STEPS + 1):
    value, _ = sess.run([loss, train_op], {context: sample_batch(step)})
    if step % 5 == 0:
      print("step %d loss %.6f" % (step, value), flush=True)
