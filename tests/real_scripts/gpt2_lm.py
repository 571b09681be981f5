"""A GPT-2-style transformer language model, written as OpenAI's gpt-2 ``model.py`` and the
usual fine-tuning loop write it (not epl's style): every weight of a projection is a
``conv1d`` weight ``[1, nx, nf]`` read through ``tf.reshape``, layer norm by hand, residuals,
causal self-attention with a mask, the input embedding ``wte`` tied to the output
projection, and the step as ``tf.gradients`` + ``tf.clip_by_global_norm`` + Adam's
``apply_gradients``. Stage 0 holds the embeddings and the first block; stage 1 the second
block, the final norm, the tied logits and the loss: the residual stream and ``wte`` (read
by both stages) cross the boundary.

``GRADS`` selects how the step is written: ``"tf.gradients"`` (the default above),
``"minimize"``, ``"compute_gradients"`` (``compute_gradients`` + ``apply_gradients``).
"""
import numpy as np
import tensorflow.compat.v1 as tf

VOCAB, CTX, EMBD, HEADS, LAYERS = 24, 8, 16, 2, 2


def shape_list(x):
  static = x.shape.as_list()
  dynamic = tf.shape(x)
  return [dynamic[i] if s is None else s for i, s in enumerate(static)]


def norm(x, scope, axis=-1, epsilon=1e-5):
  with tf.variable_scope(scope):
    n_state = x.shape[-1].value
    g = tf.get_variable("g", [n_state], initializer=tf.constant_initializer(1))
    b = tf.get_variable("b", [n_state], initializer=tf.constant_initializer(0))
    u = tf.reduce_mean(x, axis=axis, keepdims=True)
    s = tf.reduce_mean(tf.square(x - u), axis=axis, keepdims=True)
    x = (x - u) * tf.rsqrt(s + epsilon)
    return x * g + b


def conv1d(x, scope, nf, w_init_stdev=0.2):
  with tf.variable_scope(scope):
    *start, nx = shape_list(x)
    w = tf.get_variable("w", [1, nx, nf],
                        initializer=tf.random_normal_initializer(stddev=w_init_stdev))
    b = tf.get_variable("b", [nf], initializer=tf.random_normal_initializer(stddev=0.05))
    c = tf.reshape(tf.matmul(tf.reshape(x, [-1, nx]), tf.reshape(w, [-1, nf])) + b,
                   start + [nf])
    return c


def attention_mask(nd, ns, dtype):
  i = tf.range(nd)[:, None]
  j = tf.range(ns)
  m = i >= j - ns + nd
  return tf.cast(m, dtype)


def split_heads(x, n_head):
  *start, m = shape_list(x)
  return tf.transpose(tf.reshape(x, start + [n_head, m // n_head]), [0, 2, 1, 3])


def merge_heads(x):
  x = tf.transpose(x, [0, 2, 1, 3])
  *start, a, b = shape_list(x)
  return tf.reshape(x, start + [a * b])


def attn(x, scope, n_state, n_head):
  with tf.variable_scope(scope):
    c = conv1d(x, "c_attn", n_state * 3)
    q, k, v = map(lambda t: split_heads(t, n_head), tf.split(c, 3, axis=2))
    w = tf.matmul(q, k, transpose_b=True)
    w = w * tf.rsqrt(tf.cast(v.shape[-1].value, w.dtype))
    _, _, nd, ns = shape_list(w)
    b = tf.reshape(attention_mask(nd, ns, dtype=w.dtype), [1, 1, nd, ns])
    w = w * b - tf.cast(1e10, w.dtype) * (1 - b)
    w = tf.nn.softmax(w)
    a = merge_heads(tf.matmul(w, v))
    return conv1d(a, "c_proj", n_state)


def mlp(x, scope, n_state):
  with tf.variable_scope(scope):
    nx = x.shape[-1].value
    h = tf.nn.tanh(conv1d(x, "c_fc", n_state))
    return conv1d(h, "c_proj", nx)


def block(x, scope, heads=HEADS):
  with tf.variable_scope(scope):
    nx = x.shape[-1].value
    a = attn(norm(x, "ln_1"), "attn", nx, heads)
    x = x + a
    m = mlp(norm(x, "ln_2"), "mlp", nx * 4)
    return x + m


def model(tokens, stage, heads=HEADS):
  with tf.variable_scope("model"):
    batch, seq = shape_list(tokens)
    with stage(0):
      wpe = tf.get_variable("wpe", [CTX, EMBD],
                            initializer=tf.random_normal_initializer(stddev=0.1))
      wte = tf.get_variable("wte", [VOCAB, EMBD],
                            initializer=tf.random_normal_initializer(stddev=0.3))
      positions = tf.tile(tf.range(seq)[None, :], [batch, 1])
      h = tf.gather(wte, tokens) + tf.gather(wpe, positions)
      h = block(h, "h0", heads)
    with stage(1):
      for layer in range(1, LAYERS):
        h = block(h, "h%d" % layer, heads)
      h = norm(h, "ln_f")
      h_flat = tf.reshape(h, [batch * seq, EMBD])
      logits = tf.matmul(h_flat, wte, transpose_b=True)      # tied to the input embedding
      return tf.reshape(logits, [batch, seq, VOCAB])


def build(batch_size, stage, grads="tf.gradients", lr=0.01, clip=1.0, heads=HEADS):
  del batch_size                       # the context placeholder is [None, CTX + 1]
  context = tf.placeholder(tf.int32, [None, CTX + 1], name="context")
  logits = model(context[:, :-1], stage, heads)
  with stage(1):
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=context[:, 1:], logits=logits))
  global_step = tf.train.get_or_create_global_step()
  # epsilon: the key bias of c_attn has a zero gradient (softmax over the keys does not see
  # it); Adam's default 1e-8 turns float noise there into full-size steps in any two runs
  opt = tf.train.AdamOptimizer(lr, epsilon=1e-5)
  tvars = [v for v in tf.trainable_variables() if "model" in v.name]
  if grads == "minimize":
    train_op = opt.minimize(loss, global_step=global_step, var_list=tvars)
  elif grads == "compute_gradients":
    pairs = opt.compute_gradients(loss, tvars)
    clipped, _ = tf.clip_by_global_norm([g for g, _ in pairs], clip)
    train_op = opt.apply_gradients(zip(clipped, tvars), global_step=global_step)
  else:
    gradients = tf.gradients(loss, tvars)
    clipped, _ = tf.clip_by_global_norm(gradients, clip)
    train_op = opt.apply_gradients(zip(clipped, tvars), global_step=global_step)
  return dict(placeholders={"context": context}, loss=loss, train_op=train_op)


def make_data(rows, seed=0):
  rng = np.random.RandomState(seed)
  return {"context": rng.randint(0, VOCAB, (rows, CTX + 1)).astype(np.int32)}
