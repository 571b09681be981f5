# A small MoE transformer language model (EPL manual §5.3.2): attention and the gate are
# replicated on every device, the experts' weights are split over the devices along the
# expert dimension, and the MoE computation built after the split scope joins it. Each device
# holds NUM_EXPERTS / N experts; the dispatched tokens of the whole batch reach the device of
# their expert and come back combined.
#
# The gate is GShard's top-2 gate with a capacity factor (the contract epl.split expects from
# a MoE layer: a dispatch mask and combine weights [groups, tokens, experts, capacity], and
# expert weights with a leading expert dimension, used through tf.einsum).
#
#   python train.py                                   # 1 worker, EPL_CLUSTER_DEVICES_PER_WORKER devices
#   epl-launch --num_workers 2 --gpu_per_worker 1 run.sh
# The lines marked "epl" are all that parallelises the local script.
import math

import numpy as np
import tensorflow.compat.v1 as tf
import epl  # epl

tf.disable_v2_behavior()
VOCAB, LENGTH, MODEL, HIDDEN, NUM_EXPERTS, BATCH, STEPS = 32, 16, 32, 64, 4, 8, 30
CAPACITY = int(math.ceil(2 * LENGTH / NUM_EXPERTS * 1.25))   # top-2, capacity factor 1.25

config = epl.Config({"cluster.colocate_split_and_replicate": True})  # epl
epl.init(config)  # epl
total_gpu_num = epl.Env.get().cluster.total_gpu_num  # epl

# Sequences that count up from a random start with a random stride: learnable next tokens.
rng = np.random.RandomState(0)
starts, strides = rng.randint(0, VOCAB, 256), rng.randint(1, 4, 256)
num_tokens = ((starts[:, None] + strides[:, None] * np.arange(LENGTH + 1)) % VOCAB)
dataset = tf.data.Dataset.from_tensor_slices(num_tokens.astype(np.int32))
sequence = tf.data.make_one_shot_iterator(dataset.batch(BATCH).repeat()).get_next()
inputs, targets = sequence[:, :-1], sequence[:, 1:]


def layer_norm(x, name):
  with tf.variable_scope(name):
    gain = tf.get_variable("gain", [MODEL], initializer=tf.ones_initializer())
    mean, variance = tf.nn.moments(x, [-1], keep_dims=True)
    return (x - mean) * tf.rsqrt(variance + 1e-6) * gain


def attention(x):
  q, k, v = (tf.layers.dense(x, MODEL, use_bias=False, name=n) for n in ("query", "key", "value"))
  scores = tf.matmul(q, k, transpose_b=True) / math.sqrt(MODEL)
  causal = tf.linalg.band_part(tf.ones([LENGTH, LENGTH]), -1, 0)
  scores = scores * causal - 1e9 * (1.0 - causal)
  return tf.layers.dense(tf.matmul(tf.nn.softmax(scores), v), MODEL, name="attention_out")


def top2_gate(x):
  """GShard's top-2 gate: combine weights and dispatch mask [G, S, E, C], auxiliary loss."""
  probs = tf.nn.softmax(tf.layers.dense(x, NUM_EXPERTS, use_bias=False, name="gate"))
  mask1 = tf.one_hot(tf.argmax(probs, axis=-1), NUM_EXPERTS)
  mask2 = tf.one_hot(tf.argmax(probs * (1.0 - mask1), axis=-1), NUM_EXPERTS)
  position1 = tf.cumsum(mask1, axis=1, exclusive=True) * mask1
  mask1 *= tf.cast(position1 < CAPACITY, tf.float32)        # tokens over capacity are dropped
  position2 = (tf.cumsum(mask2, axis=1, exclusive=True) +
               tf.reduce_sum(mask1, axis=1, keepdims=True)) * mask2
  mask2 *= tf.cast(position2 < CAPACITY, tf.float32)
  gate1, gate2 = tf.reduce_sum(probs * mask1, -1), tf.reduce_sum(probs * mask2, -1)
  norm = gate1 + gate2 + 1e-9
  slot1 = tf.one_hot(tf.cast(tf.reduce_sum(position1, -1), tf.int32), CAPACITY)
  slot2 = tf.one_hot(tf.cast(tf.reduce_sum(position2, -1), tf.int32), CAPACITY)
  combine = ((gate1 / norm)[..., None, None] * mask1[..., None] * slot1[..., None, :] +
             (gate2 / norm)[..., None, None] * mask2[..., None] * slot2[..., None, :])
  dispatch = tf.cast(combine > 0, tf.float32)
  aux_loss = tf.reduce_mean(tf.reduce_mean(mask1, 1) * tf.reduce_mean(probs, 1))
  return combine, dispatch, aux_loss * NUM_EXPERTS ** 2


def attention_and_gating():
  embedding = tf.get_variable("embedding", [VOCAB, MODEL])
  position = tf.get_variable("position", [LENGTH, MODEL])
  x = tf.nn.embedding_lookup(embedding, inputs) + position
  x = layer_norm(x + attention(x), "attention_norm")
  return (x,) + top2_gate(x)


def moe_variable_define():
  w_in = tf.get_variable("experts_in", [NUM_EXPERTS, MODEL, HIDDEN])
  w_out = tf.get_variable("experts_out", [NUM_EXPERTS, HIDDEN, MODEL])
  return w_in, w_out


def moe_calculation_define(x, combine, dispatch, w_in, w_out):
  expert_inputs = tf.einsum("gsec,gsm->egcm", dispatch, x)      # tokens to their experts
  hidden = tf.nn.relu(tf.einsum("egcm,emh->egch", expert_inputs, w_in))
  expert_outputs = tf.einsum("egch,ehm->egcm", hidden, w_out)
  return tf.einsum("gsec,egcm->gsm", combine, expert_outputs)    # back to their tokens


epl.set_default_strategy(epl.replicate(total_gpu_num))  # epl
x, combine, dispatch, aux_loss = attention_and_gating()
with epl.split(total_gpu_num):  # epl
  w_in, w_out = moe_variable_define()
y = layer_norm(x + moe_calculation_define(x, combine, dispatch, w_in, w_out), "moe_norm")
logits = tf.layers.dense(y, VOCAB, name="output")
loss = tf.losses.sparse_softmax_cross_entropy(targets, logits) + 0.01 * aux_loss

global_step = tf.train.get_or_create_global_step()
train_op = tf.train.AdamOptimizer(0.01).minimize(loss, global_step=global_step)

with tf.train.MonitoredTrainingSession() as sess:
  while not sess.should_stop():
    step_loss, _, step = sess.run([loss, train_op, global_step])
    if step % 5 == 0:
      print("step %d loss %.4f" % (step, step_loss), flush=True)
    if step >= STEPS:
      break
print(epl.Graph.get().format())  # epl
