"""Streamed gradients (grad_sync.py's pass calls this): across workers on the ring, a weight
gradient larger than a ring piece that is one ``MatMul(x, dy, transpose_a=True)`` (a dense
layer's kernel, as ``tf.gradients`` builds it) is computed in blocks of rows, each block a
piece all-reduced as soon as it is computed, instead of waiting for the whole product.

On a link-bound model the sync then starts while backprop still writes the gradient:
bench/cluster.py's comm model (two 32 MiB kernels, 2 hosts, 1 Gbit/s) started its first
all-reduce at 73 ms of backprop before and at 19 ms after; step / max(compute, the ring
bound) 1.20-1.22 -> 1.14-1.18, and at 10 Gbit/s the step 0.314 s -> 0.228 s
(docs/benchmarks.md, "Across hosts"). A gradient summed over micro-batches, weighted or cast
before the sync is not one MatMul: it travels whole in its bucket.
"""
import tensorflow.compat.v1 as tf

from epl import _tf_compat as compat
from epl import collectives
from epl.collectives import by_worker


def _product(grad):
  """The MatMul(x, dy, transpose_a=True) that computes ``grad`` (directly or through the
  Identity of ``tf.gradients``' gating tuple) and that only feeds it, or None."""
  op = grad.op
  if op.type == "Identity" and op.inputs[0].op.type == "MatMul":
    if op.inputs[0].consumers() != [op]:
      return None
    op = op.inputs[0].op
  if (op.type != "MatMul" or not op.get_attr("transpose_a") or op.get_attr("transpose_b")
      or op.inputs[0].shape.rank != 2):
    return None
  return op


def streamable(ctx, tg, part, item):
  """Whether ``item`` (grad_sync's) is streamed: across workers on the ring, larger
  than a piece, and in every copy one MatMul(x, dy, transpose_a=True) whose result only the
  update reads (a micro-batch sum, a row weight or a cast in between: not streamed)."""
  plan = ctx.plan
  if (ctx.collectives.hint != "ring" or isinstance(item.grad, tf.IndexedSlices)
      or item.size is None or item.grad.shape.rank != 2
      or item.size * item.grad.dtype.size <= collectives.PIECE_BYTES
      or len(by_worker(plan.group_of(tg, part), plan.clients_of(tg, part))) < 2):
    return False
  clones = ctx.clones()
  for c, grad in zip(item.copies, item.per_copy):
    users = {clones.op(c, u) for u in item.readers[item.grad]}
    if _product(grad) is None or not set(grad.consumers()) <= users:
      return False
  return True


def stream(ctx, tg, part, item, collective_ops, chain):
  """Each copy's all-reduced gradient (for grad_sync to rewire its readers to), in blocks of
  rows, one all-reduce each (appended to ``collective_ops``), assembled back as they arrive
  (collectives.assemble): block j =
  MatMul(x[:, rows j], dy, transpose_a=True); its all-reduce starts once the block
  PIECES_IN_FLIGHT before it in ``chain`` (the blocks of the gradients streamed before this
  one, in the order backprop computes them; this one's are appended) is done
  (collectives.in_flight; the blocks' compute does not wait): the comm model's two kernels
  with 4 blocks in flight each (8 on the link) took 0.634-0.665 s a step, one limit of 4 for
  both 0.613-0.649 s (bench/cluster.py, 5 runs each, interleaved). The
  whole product is no longer computed: ``tf.gradients``' gate (the other gradients of its
  op wait for it) lets go of it."""
  worker, plan = ctx.worker, ctx.plan
  comm = plan.communication
  devices = [worker.device_of(c, tg, part) for c in item.copies]
  rows, cols = item.grad.shape.as_list()
  per = max(1, collectives.PIECE_BYTES // (cols * item.grad.dtype.size))
  edges = list(range(0, rows, per)) + [rows]
  products = [_product(grad) for grad in item.per_copy]
  blocks = []                          # [block][copy]
  for lo, hi in zip(edges, edges[1:]):
    block = []
    for product, device in zip(products, devices):
      x, dy = product.inputs[0], product.inputs[1]
      with tf.device(device):
        block.append(tf.matmul(x[:, lo:hi], dy, transpose_a=True))
    blocks.append(block)
  compress = comm.fp16_scale if comm.fp16 and item.grad.dtype == tf.float32 else None
  reduced = collectives.in_flight(len(blocks), lambda j: ctx.collectives.all_reduce(
      blocks[j], devices, comm.reduce_method, group=plan.group_of(tg, part),
      clients=plan.clients_of(tg, part), fp16_scale=compress), chain)
  collective_ops.extend(r.op for block in reduced for r in block)
  chain.extend(reduced)
  news = []
  for c, device in enumerate(devices):
    with tf.device(device):
      news.append(collectives.assemble([r[c] for r in reduced], item.grad.shape))
  for product in products:
    for gate in compat.control_outputs(product):
      compat.replace_control_inputs(gate, {product: None})
  return news
