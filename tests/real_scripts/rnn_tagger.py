"""A BiLSTM sequence tagger in the style of the published TF1 NER taggers: word-id and length
placeholders of unknown shape, an embedding, ``bidirectional_dynamic_rnn`` (v1 while loops),
a projection, a per-sentence loss averaged over sentences, Adam with
``compute_gradients`` -> ``clip_by_global_norm`` -> ``apply_gradients``, a last partial batch,
and ``predict`` of one sentence.
"""
import contextlib

import numpy as np
import tensorflow.compat.v1 as tf

VOCAB, TAGS, HIDDEN, MAX_LEN = 30, 5, 8, 7


def build(batch_size, stage=lambda i: contextlib.nullcontext()):
  del batch_size
  word_ids = tf.placeholder(tf.int32, shape=[None, None], name="word_ids")
  sequence_lengths = tf.placeholder(tf.int32, shape=[None], name="sequence_lengths")
  labels = tf.placeholder(tf.int32, shape=[None, None], name="labels")
  with stage(0):
    with tf.variable_scope("words"):
      _word_embeddings = tf.get_variable("_word_embeddings", dtype=tf.float32,
                                         shape=[VOCAB, 8])
      word_embeddings = tf.nn.embedding_lookup(_word_embeddings, word_ids,
                                               name="word_embeddings")
    with tf.variable_scope("bi-lstm"):
      cell_fw = tf.nn.rnn_cell.LSTMCell(HIDDEN)
      cell_bw = tf.nn.rnn_cell.LSTMCell(HIDDEN)
      (output_fw, output_bw), _ = tf.nn.bidirectional_dynamic_rnn(
          cell_fw, cell_bw, word_embeddings, sequence_length=sequence_lengths,
          dtype=tf.float32)
      output = tf.concat([output_fw, output_bw], axis=-1)
  with stage(1):
    with tf.variable_scope("proj"):
      W = tf.get_variable("W", dtype=tf.float32, shape=[2 * HIDDEN, TAGS])
      b = tf.get_variable("b", shape=[TAGS], dtype=tf.float32,
                          initializer=tf.zeros_initializer())
      nsteps = tf.shape(output)[1]
      output = tf.reshape(output, [-1, 2 * HIDDEN])
      pred = tf.matmul(output, W) + b
      logits = tf.reshape(pred, [-1, nsteps, TAGS])
    labels_pred = tf.cast(tf.argmax(logits, axis=-1), tf.int32)
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(logits=logits, labels=labels)
    mask = tf.sequence_mask(sequence_lengths, maxlen=nsteps)
    # each sentence's mean token loss, averaged over sentences (a sentence-level objective,
    # like a CRF's log-likelihood)
    sentence = tf.reduce_sum(tf.where(mask, losses, tf.zeros_like(losses)), axis=1) / \
        tf.cast(sequence_lengths, tf.float32)
    loss = tf.reduce_mean(sentence)
  optimizer = tf.train.AdamOptimizer(0.01)
  grads, vs = zip(*optimizer.compute_gradients(loss))
  grads, gnorm = tf.clip_by_global_norm(grads, 1.0)
  train_op = optimizer.apply_gradients(zip(grads, vs),
                                       global_step=tf.train.get_or_create_global_step())
  return dict(placeholders=dict(word_ids=word_ids, sequence_lengths=sequence_lengths,
                                labels=labels),
              loss=loss, train_op=train_op, labels_pred=labels_pred, grad_norm=gnorm)


def make_data(rows, seed=0):
  rng = np.random.RandomState(seed)
  lengths = rng.randint(2, MAX_LEN + 1, rows).astype(np.int32)
  ids = rng.randint(1, VOCAB, (rows, MAX_LEN)).astype(np.int32)
  mask = np.arange(MAX_LEN)[None, :] < lengths[:, None]
  tags = (ids % TAGS).astype(np.int32)
  return dict(word_ids=ids * mask, sequence_lengths=lengths, labels=tags * mask)


def predict(sess, t, words):
  """Tags of one sentence (a batch of one row)."""
  feed = {t["placeholders"]["word_ids"]: [words],
          t["placeholders"]["sequence_lengths"]: [len(words)]}
  return sess.run(t["labels_pred"], feed)[0]
