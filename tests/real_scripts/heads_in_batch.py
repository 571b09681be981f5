"""The widely copied TF1 Transformer (Kyubyong/transformer: ``modules.py`` and ``model.py``),
every op its training graph applies kept: token embeddings with a zero pad row
(``tf.concat((zeros, embeddings[1:, :]), 0)``) shared by encoder, decoder and the output
projection (``tf.einsum('ntd,dk->ntk', dec, tf.transpose(embeddings))``), sinusoid positions,
multi-head attention that folds the heads into the batch axis (``tf.concat(tf.split(Q, h,
axis=2), axis=0)``) with key and future masks (``tf.tile``, ``tf.ones_like(inputs[0, :, :])``,
a lower-triangular operator, ``tf.where``), a layer norm on ``tf.nn.moments``, label smoothing,
``softmax_cross_entropy_with_logits_v2`` weighted by the non-padding tokens, the Noam learning
rate and Adam's ``minimize``.

The only addition is how a user annotates it: ``stage("encoder")`` and ``stage("decoder")``
around ``encode`` and ``decode`` (``epl.split`` scopes; nothing for the local script).
"""
import contextlib
import types

import numpy as np
import tensorflow.compat.v1 as tf

HP = types.SimpleNamespace(vocab_size=20, d_model=16, d_ff=32, num_blocks=1, num_heads=4,
                           maxlen1=8, maxlen2=8, dropout_rate=0.0, lr=0.02, warmup_steps=4,
                           smoothing=0.1)


# ---- modules.py ------------------------------------------------------------------------------
def ln(inputs, epsilon=1e-8, scope="ln"):
  with tf.variable_scope(scope, reuse=tf.AUTO_REUSE):
    inputs_shape = inputs.get_shape()
    params_shape = inputs_shape[-1:]
    mean, variance = tf.nn.moments(inputs, [-1], keep_dims=True)
    beta = tf.get_variable("beta", params_shape, initializer=tf.zeros_initializer())
    gamma = tf.get_variable("gamma", params_shape, initializer=tf.ones_initializer())
    normalized = (inputs - mean) / ((variance + epsilon) ** (.5))
    outputs = gamma * normalized + beta
  return outputs


def get_token_embeddings(vocab_size, num_units, zero_pad=True):
  with tf.variable_scope("shared_weight_matrix"):
    embeddings = tf.get_variable("weight_mat", dtype=tf.float32, shape=(vocab_size, num_units),
                                 initializer=tf.glorot_uniform_initializer(seed=1))
    if zero_pad:
      embeddings = tf.concat((tf.zeros(shape=[1, num_units]), embeddings[1:, :]), 0)
  return embeddings


def scaled_dot_product_attention(Q, K, V, key_masks, causality=False, dropout_rate=0.,
                                 training=True, scope="scaled_dot_product_attention"):
  with tf.variable_scope(scope, reuse=tf.AUTO_REUSE):
    d_k = Q.get_shape().as_list()[-1]
    # dot product
    outputs = tf.matmul(Q, tf.transpose(K, [0, 2, 1]))  # (N, T_q, T_k)
    # scale
    outputs /= d_k ** 0.5
    # key masking
    outputs = mask(outputs, key_masks=key_masks, type="key")
    # causality or future blinding masking
    if causality:
      outputs = mask(outputs, type="future")
    # softmax
    outputs = tf.nn.softmax(outputs)
    attention = tf.transpose(outputs, [0, 2, 1])
    tf.summary.image("attention", tf.expand_dims(attention[:1], -1))
    # dropout
    outputs = tf.layers.dropout(outputs, rate=dropout_rate, training=training)
    # weighted sum (context vectors)
    outputs = tf.matmul(outputs, V)  # (N, T_q, d_v)
  return outputs


def mask(inputs, key_masks=None, type=None):  # pylint: disable=redefined-builtin
  padding_num = -2 ** 32 + 1
  if type in ("k", "key", "keys"):
    key_masks = tf.to_float(key_masks)
    key_masks = tf.tile(key_masks, [tf.shape(inputs)[0] // tf.shape(key_masks)[0], 1])
    key_masks = tf.expand_dims(key_masks, 1)  # (h*N, 1, seqlen)
    outputs = inputs + key_masks * padding_num
  elif type in ("f", "future", "right"):
    diag_vals = tf.ones_like(inputs[0, :, :])  # (T_q, T_k)
    tril = tf.linalg.LinearOperatorLowerTriangular(diag_vals).to_dense()  # (T_q, T_k)
    future_masks = tf.tile(tf.expand_dims(tril, 0), [tf.shape(inputs)[0], 1, 1])
    paddings = tf.ones_like(future_masks) * padding_num
    outputs = tf.where(tf.equal(future_masks, 0), paddings, inputs)
  else:
    raise ValueError("Check if you entered type correctly!")
  return outputs


def multihead_attention(queries, keys, values, key_masks, num_heads=8, dropout_rate=0,
                        training=True, causality=False, scope="multihead_attention"):
  d_model = queries.get_shape().as_list()[-1]
  with tf.variable_scope(scope, reuse=tf.AUTO_REUSE):
    # Linear projections
    Q = tf.layers.dense(queries, d_model, use_bias=True)  # (N, T_q, d_model)
    K = tf.layers.dense(keys, d_model, use_bias=True)  # (N, T_k, d_model)
    V = tf.layers.dense(values, d_model, use_bias=True)  # (N, T_k, d_model)
    # Split and concat
    Q_ = tf.concat(tf.split(Q, num_heads, axis=2), axis=0)  # (h*N, T_q, d_model/h)
    K_ = tf.concat(tf.split(K, num_heads, axis=2), axis=0)  # (h*N, T_k, d_model/h)
    V_ = tf.concat(tf.split(V, num_heads, axis=2), axis=0)  # (h*N, T_k, d_model/h)
    # Attention
    outputs = scaled_dot_product_attention(Q_, K_, V_, key_masks, causality, dropout_rate,
                                           training)
    # Restore shape
    outputs = tf.concat(tf.split(outputs, num_heads, axis=0), axis=2)  # (N, T_q, d_model)
    # Residual connection
    outputs += queries
    # Normalize
    outputs = ln(outputs)
  return outputs


def ff(inputs, num_units, scope="positionwise_feedforward"):
  with tf.variable_scope(scope, reuse=tf.AUTO_REUSE):
    # Inner layer
    outputs = tf.layers.dense(inputs, num_units[0], activation=tf.nn.relu)
    # Outer layer
    outputs = tf.layers.dense(outputs, num_units[1])
    # Residual connection
    outputs += inputs
    # Normalize
    outputs = ln(outputs)
  return outputs


def label_smoothing(inputs, epsilon=0.1):
  V = inputs.get_shape().as_list()[-1]  # number of channels
  return ((1 - epsilon) * inputs) + (epsilon / V)


def positional_encoding(inputs, maxlen, masking=True, scope="positional_encoding"):
  E = inputs.get_shape().as_list()[-1]  # static
  N, T = tf.shape(inputs)[0], tf.shape(inputs)[1]  # dynamic
  with tf.variable_scope(scope, reuse=tf.AUTO_REUSE):
    # position indices
    position_ind = tf.tile(tf.expand_dims(tf.range(T), 0), [N, 1])  # (N, T)
    # First part of the PE function: sin and cos argument
    position_enc = np.array([
        [pos / np.power(10000, (i - i % 2) / E) for i in range(E)]
        for pos in range(maxlen)])
    # Second part, apply the cosine to even columns and sin to odds.
    position_enc[:, 0::2] = np.sin(position_enc[:, 0::2])  # dim 2i
    position_enc[:, 1::2] = np.cos(position_enc[:, 1::2])  # dim 2i+1
    position_enc = tf.convert_to_tensor(position_enc, tf.float32)  # (maxlen, E)
    # lookup
    outputs = tf.nn.embedding_lookup(position_enc, position_ind)
    # masks
    if masking:
      outputs = tf.where(tf.equal(inputs, 0), inputs, outputs)
    return tf.to_float(outputs)


def noam_scheme(init_lr, global_step, warmup_steps=4000.):
  step = tf.cast(global_step + 1, dtype=tf.float32)
  return init_lr * warmup_steps ** 0.5 * tf.minimum(step * warmup_steps ** -1.5, step ** -0.5)


# ---- model.py --------------------------------------------------------------------------------
def local_stage(name):
  del name
  return contextlib.nullcontext()


class Transformer:
  def __init__(self, hp, stage=local_stage):
    self.hp = hp
    self.stage = stage
    self.embeddings = get_token_embeddings(self.hp.vocab_size, self.hp.d_model, zero_pad=True)

  def encode(self, xs, training=True):
    with self.stage("encoder"), tf.variable_scope("encoder", reuse=tf.AUTO_REUSE):
      x = xs
      # src_masks
      src_masks = tf.math.equal(x, 0)  # (N, T1)
      # embedding
      enc = tf.nn.embedding_lookup(self.embeddings, x)  # (N, T1, d_model)
      enc *= self.hp.d_model ** 0.5  # scale
      enc += positional_encoding(enc, self.hp.maxlen1)
      enc = tf.layers.dropout(enc, self.hp.dropout_rate, training=training)
      ## Blocks
      for i in range(self.hp.num_blocks):
        with tf.variable_scope("num_blocks_{}".format(i), reuse=tf.AUTO_REUSE):
          # self-attention
          enc = multihead_attention(queries=enc, keys=enc, values=enc, key_masks=src_masks,
                                    num_heads=self.hp.num_heads,
                                    dropout_rate=self.hp.dropout_rate, training=training,
                                    causality=False)
          # feed forward
          enc = ff(enc, num_units=[self.hp.d_ff, self.hp.d_model])
    memory = enc
    return memory, src_masks

  def decode(self, ys, memory, src_masks, training=True):
    with self.stage("decoder"):
      with tf.variable_scope("decoder", reuse=tf.AUTO_REUSE):
        decoder_inputs, y = ys
        # tgt_masks
        tgt_masks = tf.math.equal(decoder_inputs, 0)  # (N, T2)
        # embedding
        dec = tf.nn.embedding_lookup(self.embeddings, decoder_inputs)  # (N, T2, d_model)
        dec *= self.hp.d_model ** 0.5  # scale
        dec += positional_encoding(dec, self.hp.maxlen2)
        dec = tf.layers.dropout(dec, self.hp.dropout_rate, training=training)
        # Blocks
        for i in range(self.hp.num_blocks):
          with tf.variable_scope("num_blocks_{}".format(i), reuse=tf.AUTO_REUSE):
            # Masked self-attention (Note that causality is True at this time)
            dec = multihead_attention(queries=dec, keys=dec, values=dec, key_masks=tgt_masks,
                                      num_heads=self.hp.num_heads,
                                      dropout_rate=self.hp.dropout_rate, training=training,
                                      causality=True, scope="self_attention")
            # Vanilla attention
            dec = multihead_attention(queries=dec, keys=memory, values=memory,
                                      key_masks=src_masks, num_heads=self.hp.num_heads,
                                      dropout_rate=self.hp.dropout_rate, training=training,
                                      causality=False, scope="vanilla_attention")
            ### Feed Forward
            dec = ff(dec, num_units=[self.hp.d_ff, self.hp.d_model])
      # Final linear projection (embedding weights are shared)
      weights = tf.transpose(self.embeddings)  # (d_model, vocab_size)
      logits = tf.einsum("ntd,dk->ntk", dec, weights)  # (N, T2, vocab_size)
      y_hat = tf.to_int32(tf.argmax(logits, axis=-1))
    return logits, y_hat, y

  def train(self, xs, ys):
    # forward
    memory, src_masks = self.encode(xs)
    logits, preds, y = self.decode(ys, memory, src_masks)
    del preds
    # train scheme
    with self.stage("decoder"):
      y_ = label_smoothing(tf.one_hot(y, depth=self.hp.vocab_size))
      ce = tf.nn.softmax_cross_entropy_with_logits_v2(logits=logits, labels=y_)
      nonpadding = tf.to_float(tf.not_equal(y, 0))  # 0: <pad>
      loss = tf.reduce_sum(ce * nonpadding) / (tf.reduce_sum(nonpadding) + 1e-7)
    global_step = tf.train.get_or_create_global_step()
    lr = noam_scheme(self.hp.lr, global_step, self.hp.warmup_steps)
    optimizer = tf.train.AdamOptimizer(lr)
    train_op = optimizer.minimize(loss, global_step=global_step)
    return loss, train_op, global_step


def build(stage=local_stage):
  x = tf.placeholder(tf.int32, [None, None], name="x")
  decoder_inputs = tf.placeholder(tf.int32, [None, None], name="decoder_inputs")
  y = tf.placeholder(tf.int32, [None, None], name="y")
  model = Transformer(HP, stage)
  loss, train_op, _ = model.train(x, (decoder_inputs, y))
  return dict(inputs=(x, decoder_inputs, y), loss=loss, train_op=train_op)


def make_data(rows, seed=0, pad=True):
  """Source and target token rows, padded with 0 when ``pad``; the decoder reads <s> (1) +
  y[:-1]. (The loss is a mean over the batch's non-padding tokens: split into micro-batches or
  copies with other token counts, the mean of their means is another number -- data
  parallelism's, not epl's; ``pad=False`` gives every row all its tokens.)"""
  rng = np.random.RandomState(seed)
  length = HP.maxlen1
  x = rng.randint(3, HP.vocab_size, (rows, length))
  y = rng.randint(3, HP.vocab_size, (rows, length))
  for r in range(rows if pad else 0):
    x[r, rng.randint(4, length + 1):] = 0
    y[r, rng.randint(4, length + 1):] = 0
  decoder_inputs = np.concatenate([np.ones((rows, 1), int), y[:, :-1]], axis=1)
  return tuple(a.astype(np.int32) for a in (x, decoder_inputs, y))
