"""A BERT-style classifier in the shape of google-research BERT's run_classifier.py:
modeling.py's encoder (get_variable, truncated-normal initialisers, manual layer norm, gelu,
attention with masks), optimization.py's create_optimizer (warm-up, polynomial decay,
clip_by_global_norm(1.0), an AdamWeightDecayOptimizer that overrides apply_gradients and a
manual global_step update), fed by fixed-size placeholders ``[batch_size, seq_length]``.

The only epl lines a user adds: ``epl.init`` and one ``epl.replicate`` scope per stage (the
``stage`` argument below; a no-op context locally).
"""
import contextlib
import functools
import math
import re

import numpy as np
import tensorflow.compat.v1 as tf


class BertConfig:
  def __init__(self, vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
               max_position_embeddings=16, type_vocab_size=2, initializer_range=0.02):
    self.vocab_size = vocab_size
    self.hidden_size = hidden_size
    self.num_hidden_layers = num_hidden_layers
    self.num_attention_heads = num_attention_heads
    self.intermediate_size = intermediate_size
    self.hidden_dropout_prob = hidden_dropout_prob
    self.attention_probs_dropout_prob = attention_probs_dropout_prob
    self.max_position_embeddings = max_position_embeddings
    self.type_vocab_size = type_vocab_size
    self.initializer_range = initializer_range


def gelu(x):
  cdf = 0.5 * (1.0 + tf.tanh((np.sqrt(2 / np.pi) * (x + 0.044715 * tf.pow(x, 3)))))
  return x * cdf


def dropout(input_tensor, dropout_prob):
  if dropout_prob is None or dropout_prob == 0.0:
    return input_tensor
  return tf.nn.dropout(input_tensor, rate=dropout_prob)


def layer_norm(input_tensor, name=None):
  with tf.variable_scope(name, default_name="LayerNorm"):
    size = input_tensor.shape[-1]
    gamma = tf.get_variable("gamma", [size], initializer=tf.ones_initializer())
    beta = tf.get_variable("beta", [size], initializer=tf.zeros_initializer())
    mean, variance = tf.nn.moments(input_tensor, axes=[-1], keep_dims=True)
    return (input_tensor - mean) * tf.rsqrt(variance + 1e-12) * gamma + beta


def create_initializer(initializer_range=0.02):
  return tf.truncated_normal_initializer(stddev=initializer_range)


def embedding_lookup(input_ids, vocab_size, embedding_size, initializer_range):
  embedding_table = tf.get_variable("word_embeddings", [vocab_size, embedding_size],
                                    initializer=create_initializer(initializer_range))
  output = tf.gather(embedding_table, input_ids)
  return output, embedding_table


def embedding_postprocessor(input_tensor, token_type_ids, config):
  batch_size, seq_length, width = input_tensor.shape.as_list()
  token_type_table = tf.get_variable("token_type_embeddings", [config.type_vocab_size, width],
                                     initializer=create_initializer(config.initializer_range))
  flat_token_type_ids = tf.reshape(token_type_ids, [-1])
  one_hot_ids = tf.one_hot(flat_token_type_ids, depth=config.type_vocab_size)
  token_type_embeddings = tf.reshape(tf.matmul(one_hot_ids, token_type_table),
                                     [batch_size, seq_length, width])
  full_position_embeddings = tf.get_variable(
      "position_embeddings", [config.max_position_embeddings, width],
      initializer=create_initializer(config.initializer_range))
  position_embeddings = tf.slice(full_position_embeddings, [0, 0], [seq_length, -1])
  output = input_tensor + token_type_embeddings + tf.expand_dims(position_embeddings, 0)
  return dropout(layer_norm(output), config.hidden_dropout_prob)


def attention_layer(from_tensor, attention_mask, config, batch_size, seq_length):
  heads = config.num_attention_heads
  size = config.hidden_size // heads

  def transpose_for_scores(tensor):
    return tf.transpose(tf.reshape(tensor, [batch_size, seq_length, heads, size]), [0, 2, 1, 3])

  query = tf.layers.dense(from_tensor, heads * size, name="query",
                          kernel_initializer=create_initializer(config.initializer_range))
  key = tf.layers.dense(from_tensor, heads * size, name="key",
                        kernel_initializer=create_initializer(config.initializer_range))
  value = tf.layers.dense(from_tensor, heads * size, name="value",
                          kernel_initializer=create_initializer(config.initializer_range))
  scores = tf.matmul(transpose_for_scores(query), transpose_for_scores(key), transpose_b=True)
  scores = tf.multiply(scores, 1.0 / math.sqrt(float(size)))
  adder = (1.0 - tf.cast(tf.expand_dims(attention_mask, axis=[1]), tf.float32)) * -10000.0
  probs = dropout(tf.nn.softmax(scores + adder), config.attention_probs_dropout_prob)
  context = tf.transpose(tf.matmul(probs, transpose_for_scores(value)), [0, 2, 1, 3])
  return tf.reshape(context, [batch_size * seq_length, heads * size])


def create_attention_mask(input_mask, batch_size, seq_length):
  to_mask = tf.cast(tf.reshape(input_mask, [batch_size, 1, seq_length]), tf.float32)
  return tf.ones([batch_size, seq_length, 1], tf.float32) * to_mask


def transformer_model(input_tensor, attention_mask, config, stage):
  batch_size, seq_length, width = input_tensor.shape.as_list()
  prev_output = tf.reshape(input_tensor, [-1, width])
  for layer_idx in range(config.num_hidden_layers):
    with stage(0 if layer_idx < config.num_hidden_layers // 2 else 1), \
        tf.variable_scope("layer_%d" % layer_idx):
      layer_input = prev_output
      with tf.variable_scope("attention"):
        with tf.variable_scope("self"):
          attention_output = attention_layer(layer_input, attention_mask, config, batch_size,
                                             seq_length)
        with tf.variable_scope("output"):
          attention_output = tf.layers.dense(
              attention_output, width,
              kernel_initializer=create_initializer(config.initializer_range))
          attention_output = dropout(attention_output, config.hidden_dropout_prob)
          attention_output = layer_norm(attention_output + layer_input)
      with tf.variable_scope("intermediate"):
        intermediate_output = tf.layers.dense(
            attention_output, config.intermediate_size, activation=gelu,
            kernel_initializer=create_initializer(config.initializer_range))
      with tf.variable_scope("output"):
        layer_output = tf.layers.dense(
            intermediate_output, width,
            kernel_initializer=create_initializer(config.initializer_range))
        layer_output = dropout(layer_output, config.hidden_dropout_prob)
        prev_output = layer_norm(layer_output + attention_output)
  return tf.reshape(prev_output, [batch_size, seq_length, width])


def create_model(config, input_ids, input_mask, segment_ids, labels, num_labels, stage):
  batch_size, seq_length = input_ids.shape.as_list()
  with stage(0), tf.variable_scope("bert"):
    with tf.variable_scope("embeddings"):
      embedding_output, _ = embedding_lookup(input_ids, config.vocab_size, config.hidden_size,
                                             config.initializer_range)
      embedding_output = embedding_postprocessor(embedding_output, segment_ids, config)
    attention_mask = create_attention_mask(input_mask, batch_size, seq_length)
  with tf.variable_scope("bert"):
    sequence_output = transformer_model(embedding_output, attention_mask, config, stage)
  with stage(1):
    with tf.variable_scope("bert/pooler"):
      first_token_tensor = tf.squeeze(sequence_output[:, 0:1, :], axis=1)
      pooled_output = tf.layers.dense(
          first_token_tensor, config.hidden_size, activation=tf.tanh,
          kernel_initializer=create_initializer(config.initializer_range))
    output_weights = tf.get_variable(
        "output_weights", [num_labels, config.hidden_size],
        initializer=tf.truncated_normal_initializer(stddev=0.02))
    output_bias = tf.get_variable("output_bias", [num_labels],
                                  initializer=tf.zeros_initializer())
    with tf.variable_scope("loss"):
      logits = tf.nn.bias_add(tf.matmul(pooled_output, output_weights, transpose_b=True),
                              output_bias)
      probabilities = tf.nn.softmax(logits, axis=-1)
      log_probs = tf.nn.log_softmax(logits, axis=-1)
      one_hot_labels = tf.one_hot(labels, depth=num_labels, dtype=tf.float32)
      per_example_loss = -tf.reduce_sum(one_hot_labels * log_probs, axis=-1)
      loss = tf.reduce_mean(per_example_loss)
  return loss, per_example_loss, logits, probabilities


class AdamWeightDecayOptimizer(tf.train.Optimizer):
  """A basic Adam optimizer that includes "correct" L2 weight decay (BERT's)."""

  def __init__(self, learning_rate, weight_decay_rate=0.0, beta_1=0.9, beta_2=0.999,
               epsilon=1e-6, exclude_from_weight_decay=None, name="AdamWeightDecayOptimizer"):
    super().__init__(False, name)
    self.learning_rate = learning_rate
    self.weight_decay_rate = weight_decay_rate
    self.beta_1 = beta_1
    self.beta_2 = beta_2
    self.epsilon = epsilon
    self.exclude_from_weight_decay = exclude_from_weight_decay

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    assignments = []
    for (grad, param) in grads_and_vars:
      if grad is None or param is None:
        continue
      param_name = self._get_variable_name(param.name)
      m = tf.get_variable(name=param_name + "/adam_m", shape=param.shape.as_list(),
                          dtype=tf.float32, trainable=False, initializer=tf.zeros_initializer())
      v = tf.get_variable(name=param_name + "/adam_v", shape=param.shape.as_list(),
                          dtype=tf.float32, trainable=False, initializer=tf.zeros_initializer())
      next_m = tf.multiply(self.beta_1, m) + tf.multiply(1.0 - self.beta_1, grad)
      next_v = tf.multiply(self.beta_2, v) + tf.multiply(1.0 - self.beta_2, tf.square(grad))
      update = next_m / (tf.sqrt(next_v) + self.epsilon)
      if self._do_use_weight_decay(param_name):
        update += self.weight_decay_rate * param
      next_param = param - self.learning_rate * update
      assignments.extend([param.assign(next_param), m.assign(next_m), v.assign(next_v)])
    return tf.group(*assignments, name=name)

  def _do_use_weight_decay(self, param_name):
    if not self.weight_decay_rate:
      return False
    for r in self.exclude_from_weight_decay or ():
      if re.search(r, param_name) is not None:
        return False
    return True

  @staticmethod
  def _get_variable_name(param_name):
    m = re.match("^(.*):\\d+$", param_name)
    return m.group(1) if m is not None else param_name


def create_optimizer(loss, init_lr, num_train_steps, num_warmup_steps, published=False):
  global_step = tf.train.get_or_create_global_step()
  schedule_step = global_step
  if published == "reference":
    # The local reference run of the published optimizer: its learning rate takes the value
    # the assign below writes, the order TF mostly runs it in (37 of 40 fresh local runs here;
    # the other 3 read the old value in a later step) and epl always (epl/passes/step_reads.py)
    schedule_step = global_step + 1
  learning_rate = tf.constant(value=init_lr, shape=[], dtype=tf.float32)
  learning_rate = tf.train.polynomial_decay(learning_rate, schedule_step, num_train_steps,
                                            end_learning_rate=0.0, power=1.0, cycle=False)
  if num_warmup_steps:
    global_steps_int = tf.cast(schedule_step, tf.int32)
    warmup_steps_int = tf.constant(num_warmup_steps, dtype=tf.int32)
    warmup_percent_done = tf.cast(global_steps_int, tf.float32) / tf.cast(warmup_steps_int,
                                                                          tf.float32)
    warmup_learning_rate = init_lr * warmup_percent_done
    is_warmup = tf.cast(global_steps_int < warmup_steps_int, tf.float32)
    learning_rate = (1.0 - is_warmup) * learning_rate + is_warmup * warmup_learning_rate
  optimizer = AdamWeightDecayOptimizer(
      learning_rate=learning_rate, weight_decay_rate=0.01, beta_1=0.9, beta_2=0.999,
      epsilon=1e-6, exclude_from_weight_decay=["LayerNorm", "layer_norm", "bias"])
  tvars = tf.trainable_variables()
  grads = tf.gradients(loss, tvars)
  (grads, _) = tf.clip_by_global_norm(grads, clip_norm=1.0)
  train_op = optimizer.apply_gradients(zip(grads, tvars), global_step=global_step)
  if published == "reference":
    new_global_step = schedule_step
  elif published:        # google-research/bert's optimization.py as published
    new_global_step = global_step + 1
  else:
    # Published BERT builds `global_step + 1` unordered against the learning-rate read above;
    # order it, as TF's own optimizers do (docs/user_guide.md, "Real scripts").
    with tf.control_dependencies([train_op]):
      new_global_step = global_step + 1
  train_op = tf.group(train_op, [global_step.assign(new_global_step)])
  return train_op


SEQ, LABELS = 8, 3


def make_data(rows, seed=0):
  rng = np.random.RandomState(seed)
  ids = rng.randint(1, 40, (rows, SEQ)).astype(np.int32)
  lengths = rng.randint(3, SEQ + 1, rows)
  mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.int32)
  segments = (np.arange(SEQ)[None, :] >= lengths[:, None] // 2).astype(np.int32) * mask
  labels = (ids[:, 0] % LABELS).astype(np.int32)
  return dict(input_ids=ids * mask, input_mask=mask, segment_ids=segments, label_ids=labels)


def build(batch_size, stage=lambda i: contextlib.nullcontext(), published=False):
  """run_classifier's graph for ``batch_size`` rows per step; returns its tensors.
  ``published``: google-research/bert's optimizer exactly as published (its global_step
  update is not ordered after the update that reads it); ``"reference"``: the same with its
  one race settled, for the local run epl's runs are compared with (the published one gives
  one of several trajectories, another one in 3 of 40 fresh runs)."""
  config = BertConfig()
  input_ids = tf.placeholder(tf.int32, [batch_size, SEQ], name="input_ids")
  input_mask = tf.placeholder(tf.int32, [batch_size, SEQ], name="input_mask")
  segment_ids = tf.placeholder(tf.int32, [batch_size, SEQ], name="segment_ids")
  label_ids = tf.placeholder(tf.int32, [batch_size], name="label_ids")
  loss, per_example_loss, logits, probabilities = create_model(
      config, input_ids, input_mask, segment_ids, label_ids, LABELS, stage)
  train_op = create_optimizer(loss, init_lr=5e-3, num_train_steps=20, num_warmup_steps=2,
                              published=published)
  placeholders = dict(input_ids=input_ids, input_mask=input_mask, segment_ids=segment_ids,
                      label_ids=label_ids)
  return dict(placeholders=placeholders, loss=loss, train_op=train_op,
              per_example_loss=per_example_loss, probabilities=probabilities)


class Published:
  """The script with google-research/bert's optimizer exactly as published, for the harness
  (``run(Published, ...)``)."""
  make_data = staticmethod(make_data)
  build = staticmethod(functools.partial(build, published=True))


class Reference:
  """The local run the published script is compared with: published BERT's local run is
  itself racy (``build``'s ``published="reference"``)."""
  make_data = staticmethod(make_data)
  build = staticmethod(functools.partial(build, published="reference"))
