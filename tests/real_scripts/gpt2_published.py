"""GPT-2 as OpenAI's gpt-2 ``src/model.py`` and ``src/sample.py`` write it, trained as the
widely used fine-tuning script (nshepperd's ``train.py``) trains it -- every op they apply kept:
the attention's key/value cache ``present = tf.stack([k, v], axis=1)`` (and the ``past`` it is
concatenated to while sampling), the model's ``tf.stack(presents, axis=1)``, its own softmax
and gelu, ``expand_tile`` positions, the loss on ``logits[:, :-1]`` against ``context[:, 1:]``
with the model fed the whole context, the step as ``tf.gradients`` + ``apply_gradients``
without a global step, and ``sample_sequence``: the model rebuilt with ``reuse=AUTO_REUSE``
inside a ``tf.while_loop`` whose loop variables carry the cache, ``logits[:, :, :n_vocab]``,
``logits[:, -1, :]``, ``top_k_logits`` (``tf.nn.top_k`` in a ``tf.cond``) and
``tf.multinomial``.

The only addition is how a user annotates it: ``stage(i)`` (a context manager: an
``epl.split`` / ``epl.replicate`` scope, or nothing for the local script) around the layers of
stage i, ``stage_of(layer)`` saying which stage a layer belongs to; the embeddings go with the
first stage, the final norm and the logits with the last.
"""
import types

import numpy as np
import tensorflow.compat.v1 as tf

HPARAMS = types.SimpleNamespace(n_vocab=24, n_ctx=16, n_embd=16, n_head=4, n_layer=2)
CTX = 8                     # tokens per training row (the loss predicts CTX - 1 of them)


def shape_list(x):
  """Deal with dynamic shape in tensorflow cleanly."""
  static = x.shape.as_list()
  dynamic = tf.shape(x)
  return [dynamic[i] if s is None else s for i, s in enumerate(static)]


def softmax(x, axis=-1):
  x = x - tf.reduce_max(x, axis=axis, keepdims=True)
  ex = tf.exp(x)
  return ex / tf.reduce_sum(ex, axis=axis, keepdims=True)


def gelu(x):
  return 0.5 * x * (1 + tf.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * tf.pow(x, 3))))


def norm(x, scope, *, axis=-1, epsilon=1e-5):
  """Normalize to mean = 0, std = 1, then do a diagonal affine transform."""
  with tf.variable_scope(scope):
    n_state = x.shape[-1].value
    g = tf.get_variable("g", [n_state], initializer=tf.constant_initializer(1))
    b = tf.get_variable("b", [n_state], initializer=tf.constant_initializer(0))
    u = tf.reduce_mean(x, axis=axis, keepdims=True)
    s = tf.reduce_mean(tf.square(x - u), axis=axis, keepdims=True)
    x = (x - u) * tf.rsqrt(s + epsilon)
    x = x * g + b
    return x


def split_states(x, n):
  """Reshape the last dimension of x into [n, x.shape[-1]/n]."""
  *start, m = shape_list(x)
  return tf.reshape(x, start + [n, m // n])


def merge_states(x):
  """Smash the last two dimensions of x into a single dimension."""
  *start, a, b = shape_list(x)
  return tf.reshape(x, start + [a * b])


def conv1d(x, scope, nf, *, w_init_stdev=0.2):
  with tf.variable_scope(scope):
    *start, nx = shape_list(x)
    w = tf.get_variable("w", [1, nx, nf],
                        initializer=tf.random_normal_initializer(stddev=w_init_stdev))
    b = tf.get_variable("b", [nf], initializer=tf.random_normal_initializer(stddev=0.05))
    c = tf.reshape(tf.matmul(tf.reshape(x, [-1, nx]), tf.reshape(w, [-1, nf])) + b,
                   start + [nf])
    return c


def attention_mask(nd, ns, *, dtype):
  """1's in the lower triangle, counting from the lower right corner."""
  i = tf.range(nd)[:, None]
  j = tf.range(ns)
  m = i >= j - ns + nd
  return tf.cast(m, dtype)


def attn(x, scope, n_state, *, past, hparams):
  assert x.shape.ndims == 3  # Should be [batch, sequence, features]
  assert n_state % hparams.n_head == 0
  if past is not None:
    assert past.shape.ndims == 5  # [batch, 2, heads, sequence, features]

  def split_heads(x):
    # From [batch, sequence, features] to [batch, heads, sequence, features]
    return tf.transpose(split_states(x, hparams.n_head), [0, 2, 1, 3])

  def merge_heads(x):
    # Reverse of split_heads
    return merge_states(tf.transpose(x, [0, 2, 1, 3]))

  def mask_attn_weights(w):
    # w has shape [batch, heads, dst_sequence, src_sequence]
    _, _, nd, ns = shape_list(w)
    b = attention_mask(nd, ns, dtype=w.dtype)
    b = tf.reshape(b, [1, 1, nd, ns])
    w = w * b - tf.cast(1e10, w.dtype) * (1 - b)
    return w

  def multihead_attn(q, k, v):
    # q, k, v have shape [batch, heads, sequence, features]
    w = tf.matmul(q, k, transpose_b=True)
    w = w * tf.rsqrt(tf.cast(v.shape[-1].value, w.dtype))
    w = mask_attn_weights(w)
    w = softmax(w)
    a = tf.matmul(w, v)
    return a

  with tf.variable_scope(scope):
    c = conv1d(x, "c_attn", n_state * 3)
    q, k, v = map(split_heads, tf.split(c, 3, axis=2))
    present = tf.stack([k, v], axis=1)
    if past is not None:
      pk, pv = tf.unstack(past, axis=1)
      k = tf.concat([pk, k], axis=-2)
      v = tf.concat([pv, v], axis=-2)
    a = multihead_attn(q, k, v)
    a = merge_heads(a)
    a = conv1d(a, "c_proj", n_state)
    return a, present


def mlp(x, scope, n_state, *, hparams):
  del hparams
  with tf.variable_scope(scope):
    nx = x.shape[-1].value
    h = gelu(conv1d(x, "c_fc", n_state))
    h2 = conv1d(h, "c_proj", nx)
    return h2


def block(x, scope, *, past, hparams):
  with tf.variable_scope(scope):
    nx = x.shape[-1].value
    a, present = attn(norm(x, "ln_1"), "attn", nx, past=past, hparams=hparams)
    x = x + a
    m = mlp(norm(x, "ln_2"), "mlp", nx * 4, hparams=hparams)
    x = x + m
    return x, present


def past_shape(*, hparams, batch_size=None, sequence=None):
  return [batch_size, hparams.n_layer, 2, hparams.n_head, sequence,
          hparams.n_embd // hparams.n_head]


def expand_tile(value, size):
  """Add a new axis of given size."""
  value = tf.convert_to_tensor(value, name="value")
  ndims = value.shape.ndims
  return tf.tile(tf.expand_dims(value, axis=0), [size] + [1] * ndims)


def positions_for(tokens, past_length):
  batch_size = tf.shape(tokens)[0]
  nsteps = tf.shape(tokens)[1]
  return expand_tile(past_length + tf.range(nsteps), batch_size)


def local_stage(i):
  del i
  import contextlib
  return contextlib.nullcontext()


def model(hparams, X, past=None, scope="model", reuse=False, stage=local_stage,
          stage_of=lambda layer: 0):
  with tf.variable_scope(scope, reuse=reuse):
    results = {}
    batch, sequence = shape_list(X)
    last = stage_of(hparams.n_layer - 1)
    with stage(0):
      wpe = tf.get_variable("wpe", [hparams.n_ctx, hparams.n_embd],
                            initializer=tf.random_normal_initializer(stddev=0.1))
      wte = tf.get_variable("wte", [hparams.n_vocab, hparams.n_embd],
                            initializer=tf.random_normal_initializer(stddev=0.3))
      past_length = 0 if past is None else tf.shape(past)[-2]
      h = tf.gather(wte, X) + tf.gather(wpe, positions_for(X, past_length))

    # Transformer
    presents = []
    pasts = tf.unstack(past, axis=1) if past is not None else [None] * hparams.n_layer
    assert len(pasts) == hparams.n_layer
    for layer, past in enumerate(pasts):
      with stage(stage_of(layer)):
        h, present = block(h, "h%d" % layer, past=past, hparams=hparams)
        presents.append(present)
    with stage(last):
      results["present"] = tf.stack(presents, axis=1)
      h = norm(h, "ln_f")

      # Language model loss.  Do tokens <n predict token n?
      h_flat = tf.reshape(h, [batch * sequence, hparams.n_embd])
      logits = tf.matmul(h_flat, wte, transpose_b=True)
      logits = tf.reshape(logits, [batch, sequence, hparams.n_vocab])
      results["logits"] = logits
    return results


# ---- src/sample.py ---------------------------------------------------------------------------
def top_k_logits(logits, k):
  if k == 0:
    # no truncation
    return logits

  def _top_k():
    values, _ = tf.nn.top_k(logits, k=k)
    min_values = values[:, -1, tf.newaxis]
    return tf.where(
        logits < min_values,
        tf.ones_like(logits, dtype=logits.dtype) * -1e10,
        logits,
    )
  return tf.cond(
      tf.equal(k, 0),
      lambda: logits,
      lambda: _top_k(),
  )


def sample_sequence(*, hparams, length, start_token=None, batch_size=None, context=None,
                    temperature=1, top_k=0, seed=None, stage=local_stage,
                    stage_of=lambda layer: 0):
  if start_token is None:
    assert context is not None, "Specify exactly one of start_token and context!"
  else:
    assert context is None, "Specify exactly one of start_token and context!"
    context = tf.fill([batch_size, 1], start_token)

  def step(hparams, tokens, past=None):
    lm_output = model(hparams=hparams, X=tokens, past=past, reuse=tf.AUTO_REUSE, stage=stage,
                      stage_of=stage_of)

    logits = lm_output["logits"][:, :, :hparams.n_vocab]
    presents = lm_output["present"]
    presents.set_shape(past_shape(hparams=hparams, batch_size=batch_size))
    return {
        "logits": logits,
        "presents": presents,
    }

  with tf.name_scope("sample_sequence"):
    def body(past, prev, output):
      next_outputs = step(hparams, prev, past=past)
      logits = next_outputs["logits"][:, -1, :] / tf.to_float(temperature)
      logits = top_k_logits(logits, k=top_k)
      samples = tf.multinomial(logits, num_samples=1, output_dtype=tf.int32, seed=seed)
      return [
          next_outputs["presents"] if past is None else tf.concat(
              [past, next_outputs["presents"]], axis=-2),
          samples,
          tf.concat([output, samples], axis=1)
      ]

    past, prev, output = body(None, context, context)

    def cond(*args):
      del args
      return True

    _, _, tokens = tf.while_loop(
        cond=cond, body=body,
        maximum_iterations=length - 1,
        loop_vars=[
            past,
            prev,
            output
        ],
        shape_invariants=[
            tf.TensorShape(past_shape(hparams=hparams, batch_size=batch_size)),
            tf.TensorShape([batch_size, None]),
            tf.TensorShape([batch_size, None]),
        ],
        back_prop=False,
    )

    return tokens


# ---- the fine-tuning script's step -----------------------------------------------------------
def build(stage=local_stage, stage_of=lambda layer: 0, lr=0.01, sample_length=0, top_k=1,
          sample_batch=2):
  """The trainer's graph: the loss on ``logits[:, :-1]``, Adam over ``tf.gradients`` without
  a global step; with ``sample_length`` also its sampler (greedy with ``top_k`` 1) from a fed
  ``prompt`` placeholder."""
  hparams = HPARAMS
  context = tf.placeholder(tf.int32, [None, None], name="context")
  output = model(hparams=hparams, X=context, stage=stage, stage_of=stage_of)
  loss = tf.reduce_mean(
      tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=context[:, 1:], logits=output["logits"][:, :-1]))
  all_vars = [v for v in tf.trainable_variables() if "model" in v.name]
  train_vars = all_vars
  # epsilon: the key bias of c_attn has a zero gradient (softmax over the keys does not see
  # it); Adam's default 1e-8 turns float noise there into full-size steps in any two runs
  opt = tf.train.AdamOptimizer(learning_rate=lr, epsilon=1e-5)
  opt_grads = tf.gradients(loss, train_vars)
  opt_grads = list(zip(opt_grads, train_vars))
  opt_apply = opt.apply_gradients(opt_grads)
  out = dict(placeholders={"context": context}, loss=loss, train_op=opt_apply)
  if sample_length:
    prompt = tf.placeholder(tf.int32, [sample_batch, None], name="prompt")
    out["prompt"] = prompt
    out["sample"] = sample_sequence(hparams=hparams, length=sample_length, context=prompt,
                                    batch_size=sample_batch, top_k=top_k, stage=stage,
                                    stage_of=stage_of)
  return out


def make_data(rows, seed=0):
  rng = np.random.RandomState(seed)
  return {"context": rng.randint(0, HPARAMS.n_vocab, (rows, CTX)).astype(np.int32)}
