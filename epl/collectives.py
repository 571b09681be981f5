"""Collective communication behind one narrow API.

Passes never build collective ops themselves. A ``Collectives`` object is made once per
rewrite; it picks the implementation, logs the choice once, and hands out group/instance keys
deterministically so that every worker building the same plan gets the same keys.

How a group is reduced (``group`` lists every participant of the job, worker-major; a worker
builds its own participants' part):

* inside one worker, in-graph: on CPU devices the tensors are summed on the first device and
  the others read the sum (in-process transfers share buffers); on GPUs each device sums one
  chunk of every tensor and then every device concatenates the chunks (balanced links).
  No TF collective runs inside a worker: a ``DirectSession`` keeps one collective executor per
  step id and never frees it (~700 bytes per step, measured; TF's MasterSession cleans up
  after each step), and the in-graph sum is also faster here (4 MiB on 2 virtual devices:
  0.7 ms vs 1.8 ms, docs/benchmarks.md);
* across workers, hierarchically: the worker's participants are reduced in-graph first, one
  TF collective (ring on CPU, NCCL on GPU) runs among one device per worker (one per chunk on
  GPUs), then every local participant reads the result. Cross-worker sessions run on
  ``tf.train.Server`` targets, whose master cleans the collective state of every step.
  ``reduce_scatter`` (zero.level v1) is NCCL's on GPUs and, as TF has none for CPUs, an
  all-to-all of the workers' chunks and a local sum there.

No op carries TF's per-op ``timeout``: TF implements it with one detached thread per launch that
sleeps for the whole timeout (``Env::SchedClosureAfter``), so 1,000 steps/s with a 300 s timeout
hold 300,000 threads. The promise the timeout kept -- a dead or stalled peer becomes an error,
not a hang -- is kept per step instead: the runtime puts ``communication.collective_timeout``
on every step as ``RunOptions.timeout_in_ms`` (no thread), and a peer that dies fails the
collective at once (connection reset).

Example:
  >>> coll = Collectives(on_gpu=False)
  >>> reduced = coll.all_reduce([t0, t1], ["/device:CPU:1", "/device:CPU:2"], "mean")
"""
import functools
import logging
import math

import tensorflow.compat.v1 as tf
from tensorflow.python.ops import collective_ops, gen_collective_ops

from epl.cluster import worker_of

log = logging.getLogger("epl")

# across workers on the ring, a tensor larger than this is all-reduced in pieces of this size,
# at most PIECES_IN_FLIGHT of them at a time (Collectives._ring_pieces)
PIECE_BYTES = 2 << 20
PIECES_IN_FLIGHT = 4


def in_flight(count, build, before=()):
  """``[build(j) for j in range(count)]``, the ops of ``build(j)`` waiting for the result (a
  tensor or a list of them) of ``build(j - PIECES_IN_FLIGHT)``: at most that many on the wire
  at a time; ``before``: the results of earlier pieces in the same sequence."""
  seq, out = list(before), []
  for j in range(count):
    at = len(seq)
    waits = seq[at - PIECES_IN_FLIGHT] if at >= PIECES_IN_FLIGHT else []
    with tf.control_dependencies(waits if isinstance(waits, list) else [waits]):
      out.append(build(j))
    seq.append(out[-1])
  return out


def assemble(parts, shape):
  """The tensor of ``shape`` whose elements, in row-major order, are those of ``parts`` one
  after the other, each part copied into one buffer (TF's InplaceUpdate on an uninitialised
  Empty: the op writes into its input and passes it on) as soon as it and the part before it
  are ready, instead of one concat after the last part arrives: the ring's 32 pieces of a
  64 MiB all-reduce spent 21 ms in that concat after the link had gone idle (0.547 -> 0.568 s
  of a traced all-reduce, bench/cluster.py ``--trace``).

  The buffer has rows of the largest width that every part's size is a multiple of (then
  every part is whole rows); where that leaves a part more than 64 rows (one copy per row),
  the parts are concatenated instead.
  """
  sizes = [p.shape.num_elements() for p in parts]
  width = functools.reduce(math.gcd, sizes)
  if len(parts) == 1 or max(sizes) // width > 64:
    return tf.reshape(tf.concat([tf.reshape(p, [-1]) for p in parts], axis=0), shape)
  buf = tf.raw_ops.Empty(shape=[sum(sizes) // width, width], dtype=parts[0].dtype)
  row = 0
  for part, size in zip(parts, sizes):
    buf = tf.raw_ops.InplaceUpdate(x=buf, i=tf.range(row, row + size // width),
                                   v=tf.reshape(part, [size // width, width]))
    row += size // width
  return tf.reshape(buf, shape)


def by_worker(group, clients=None):
  """[(worker, the devices it builds, in group order)], workers in group order.

  ``clients[i]`` is the worker whose session drives ``group[i]`` (default: the worker that
  holds the device; a model replica spanning workers is driven by one of them).
  """
  out = []
  for i, d in enumerate(group):
    w = clients[i] if clients is not None else worker_of(d)
    if not out or out[-1][0] != w:
      out.append((w, []))
    out[-1][1].append(d)
  return out


class Collectives:
  """Builds all-reduce / all-gather / broadcast among tensors placed on known devices.

  Args:
    on_gpu: the accelerators are GPUs (NCCL across workers, chunked in-worker reduction).
    chunked: force the in-worker reduction (None: chunked on GPU, one device on CPU).
  """

  def __init__(self, on_gpu, chunked=None):
    self.hint = "nccl" if on_gpu else "ring"
    self.chunked = on_gpu if chunked is None else chunked
    self._groups = {}
    self._next_instance = 1
    log.debug("collectives: in-worker %s sums, %s collectives across workers",
              "chunked" if self.chunked else "one-device", self.hint)

  # ---- keys ----------------------------------------------------------------------------
  def group_key(self, devices):
    """One key per distinct ordered device set (the same on every worker)."""
    key = tuple(devices)
    if key not in self._groups:
      self._groups[key] = len(self._groups) + 1
    return self._groups[key]

  def _instance(self):
    self._next_instance += 1
    return self._next_instance

  # ---- all-reduce ----------------------------------------------------------------------
  def all_reduce(self, tensors, devices, method, group=None, clients=None, channel=0,
                 fp16_scale=None, root=None):
    """Returns one reduced tensor per local input, each on its input's device.

    Args:
      tensors: one tensor per participant on this worker (same shape and dtype).
      devices: the device of each of them.
      method: "mean" or "sum".
      group: every participant's device, all workers included (default: ``devices``); other
        workers build their own part with the same ``group``.
      clients: the worker that builds each member of ``group`` (default: its device's).
      channel: the collective channel across workers (``num_communicators``): each channel
        is its own TF collective group (on GPUs its own NCCL communicator), so buckets on
        different channels run independently.
      fp16_scale: across workers, send float16 (the sum multiplied by this first and divided
        back after): half the bytes on the wire. Sums inside a worker stay in the input dtype.
      root: inside one worker, sum on ``devices[root]`` (zero.level v1: the owner of these
        gradients), never in chunks; the others' results are reads of it, which TF copies
        only where a step uses them.
    """
    assert len(tensors) == len(devices) and method in ("mean", "sum")
    group = tuple(group or devices)
    if len(group) == 1:
      return list(tensors)
    workers = by_worker(group, clients)
    uniform = len({len(ds) for _, ds in workers}) == 1
    sizes = (self._chunk_sizes(tensors[0], len(devices))
             if self.chunked and uniform and root is None else None)
    at = devices[root or 0]
    with tf.name_scope("epl_all_reduce"):
      if sizes is None:
        parts, part_devices = [self._sum(tensors, at)], [at]
        cross_groups = [tuple(ds[0] for _, ds in workers)]
      else:
        parts, part_devices = self._chunk_sums(tensors, devices, sizes), list(devices)
        cross_groups = [tuple(ds[j] for _, ds in workers) for j in range(len(devices))]
      mean_of = len(group) if method == "mean" else None
      if len(workers) > 1:             # the mean folded into the collective (no extra pass)
        parts = [self._collective_sum(p, d, g, channel, fp16_scale, mean_of)
                 for p, d, g in zip(parts, part_devices, cross_groups)]
      elif mean_of:
        parts = [self._scaled(p, d, 1.0 / mean_of) for p, d in zip(parts, part_devices)]
      out = []
      for t, d in zip(tensors, devices):
        with tf.device(d):
          out.append(tf.identity(parts[0]) if len(parts) == 1 else tf.concat(parts, axis=0))
      return out

  @staticmethod
  def _chunk_sizes(tensor, n):
    """Sizes of n chunks of a flat tensor, or None when its size is not static."""
    size = tensor.shape.num_elements() if tensor.shape.is_fully_defined() else None
    if n < 2 or tensor.shape.rank != 1 or size is None or size < n:
      return None
    return [size // n + (1 if j < size % n else 0) for j in range(n)]

  @staticmethod
  def _sum(tensors, device):
    with tf.device(device):
      return tensors[0] if len(tensors) == 1 else tf.add_n(list(tensors))

  @staticmethod
  def _chunk_sums(tensors, devices, sizes):
    pieces = []
    for t, d in zip(tensors, devices):
      with tf.device(d):
        pieces.append(tf.split(t, sizes))
    sums = []
    for j, d in enumerate(devices):
      with tf.device(d):
        sums.append(tf.add_n([p[j] for p in pieces]))
    return sums

  @staticmethod
  def _scaled(t, device, factor):
    with tf.device(device):
      return t * tf.cast(factor, t.dtype)

  def _collective_sum(self, tensor, device, group, channel=0, fp16_scale=None, mean_of=None):
    """The sum of ``tensor`` over ``group`` (one member per worker), divided by ``mean_of``
    when given: by the collective itself when that is its group size (its final op divides
    only the chunk each worker owns before the chunks are gathered: no pass over the whole
    result), else folded into the one multiply that undoes ``fp16_scale`` or a multiply."""
    key = self.group_key(group + (("channel", channel),) if channel else group)
    divide = mean_of == len(group) and fp16_scale is None
    with tf.device(device):
      wire = tensor
      if fp16_scale is not None:
        wire = tf.cast(tensor * tf.cast(fp16_scale, tensor.dtype), tf.float16)
      summed = self._ring_pieces(wire, lambda piece, instance: collective_ops.all_reduce_v2(
          piece, group_size=len(group), group_key=key, instance_key=instance,
          merge_op="Add", final_op="Div" if divide else "Id", communication_hint=self.hint))
      if fp16_scale is not None:
        summed = tf.cast(summed, tensor.dtype) / tf.cast(fp16_scale * (mean_of or 1),
                                                         tensor.dtype)
      elif mean_of and not divide:
        summed = summed * tf.cast(1.0 / mean_of, summed.dtype)
      return summed

  def _ring_pieces(self, tensor, collective):
    """``collective(piece, instance_key)`` over the whole tensor: one collective, or, on the
    ring (TF's gRPC transport between workers) for a tensor over ``PIECE_BYTES``, one per
    piece of at most that size, piece j starting once piece j - PIECES_IN_FLIGHT is done,
    the results assembled back as they arrive (``assemble``).

    One collective sends each ring chunk (half the tensor between 2 workers) as one RecvBuf
    response, a protobuf message copied and parsed whole (perf: page faults and memmove in
    its parse), with one such transfer at a time per neighbour, so the link idles while a
    large chunk is copied: 64 MiB in one all-reduce between 2 hosts reached 0.70 of a
    1 Gbit/s link's ring bound and 0.26 of a 10 Gbit/s one; in 16 pieces of 4 MiB 0.95
    (Horovod/Gloo's figure) and 0.49 (bench/cluster.py, docs/benchmarks.md); with TF's
    pooling allocator (epl.env) 2 MiB pieces did best (0.94 against 0.92 for 4 MiB on a
    slower machine state, where Horovod reached 0.89-0.90), and at most 4 pieces at a time
    better still: all 32 pieces of 64 MiB at once reached 0.90-0.91 where Horovod reached
    0.955, 4 at a time 0.95 (and 0.24 against 0.22 at 10 Gbit/s); the pieces in flight share
    the link and finish together, so the last ones' reduction and copies ran with the link
    idle. Element-wise collectives only (a piece's sums are the whole one's, added in a ring
    order that may differ among 3 or more workers). NCCL pipelines large buffers itself: on
    GPUs a tensor stays whole.
    """
    size = tensor.shape.num_elements() if tensor.shape.is_fully_defined() else None
    width = tensor.dtype.size
    if self.hint != "ring" or size is None or size * width <= PIECE_BYTES:
      return collective(tensor, self._instance())
    per = PIECE_BYTES // width
    sizes = [per] * (size // per) + ([size % per] if size % per else [])
    pieces = tf.split(tf.reshape(tensor, [-1]), sizes)
    summed = in_flight(len(pieces), lambda j: collective(pieces[j], self._instance()))
    return assemble(summed, tensor.shape)

  # ---- reduce-scatter across workers ---------------------------------------------------
  def reduce_scatter(self, tensors, devices, method, group, clients=None, fp16_scale=None):
    """This worker's chunk of the job-wide sum: ``tensors`` (this worker's participants,
    flat, the same length) hold one equal chunk per worker of ``group`` in worker order;
    the result, on ``devices[0]``, is the sum over every participant of this worker's chunk.

    Inside a worker the participants are summed in-graph; across workers TF 2.21 has a
    collective reduce-scatter only for NCCL, so on CPUs it is an all-to-all of the chunks
    (each worker receives every other's chunk for it) and a local sum: the same bytes on the
    wire as a reduce-scatter, none of the chunks the worker does not own. zero.level v1
    across workers uses it: each worker receives only its own variables' gradients.
    """
    workers = by_worker(tuple(group), clients)
    count = len(workers)
    at = devices[0]
    with tf.name_scope("epl_reduce_scatter"), tf.device(at):
      total = self._sum(tensors, at)
      wire = total
      if fp16_scale is not None:
        wire = tf.cast(total * tf.cast(fp16_scale, total.dtype), tf.float16)
      leaders = tuple(ds[0] for _, ds in workers)
      key, instance = self.group_key(leaders), self._instance()
      if self.hint == "nccl":
        mine = tf.cast(gen_collective_ops.collective_reduce_scatter_v2(
            wire, group_size=count, group_key=key, instance_key=instance, ordering_token=[],
            merge_op="Add", final_op="Id", communication_hint="nccl"), total.dtype)
      else:
        chunks = collective_ops.all_to_all_v2(
            tf.reshape(wire, [count, -1]), group_size=count, group_key=key,
            instance_key=instance, communication_hint="auto")
        mine = tf.reduce_sum(tf.cast(chunks, total.dtype), axis=0)
      if fp16_scale is not None:
        mine = mine / tf.cast(fp16_scale, total.dtype)
      if method == "mean":
        mine = mine * tf.cast(1.0 / len(group), mine.dtype)
      return mine

  # ---- all-gather ----------------------------------------------------------------------
  def all_gather(self, tensors, devices, group=None, clients=None):
    """Concatenates the participants' tensors along dimension 0 (group order), on every
    local participant (``clients`` as for ``all_reduce``)."""
    group = tuple(group or devices)
    if len(group) == 1:
      return list(tensors)
    workers = by_worker(group, clients)
    with tf.name_scope("epl_all_gather"):
      with tf.device(devices[0]):
        gathered = tensors[0] if len(tensors) == 1 else tf.concat(list(tensors), axis=0)
        if len(workers) > 1:
          leaders = tuple(ds[0] for _, ds in workers)
          gathered = collective_ops.all_gather_v2(
              gathered, group_size=len(leaders), group_key=self.group_key(leaders),
              instance_key=self._instance(), communication_hint=self.hint)
      out = []
      for d in devices:
        with tf.device(d):
          out.append(tf.identity(gathered))
      return out

  # ---- between a model replica's copies and its split parts (inside one client) -------------
  def gather_rows(self, tensors, device, axis=0):
    """The concatenation (along the batch ``axis``) of the replica's copies' ``tensors`` on
    ``device``: the gather into a split part (TF's send/recv moves each copy's rows). With
    each copy's expert slice for this part as ``tensors`` it is this part's half of an
    all-to-all (MoE dispatch)."""
    with tf.name_scope("epl_gather_rows"), tf.device(device):
      return tensors[0] if len(tensors) == 1 else tf.concat(list(tensors), axis=axis)

  def reduce_to(self, tensors, device):
    """The sum of ``tensors`` on ``device`` (the copies' gradients of a value read whole)."""
    with tf.name_scope("epl_reduce_to"), tf.device(device):
      return tensors[0] if len(tensors) == 1 else tf.add_n(list(tensors))

  def rows_of(self, value, counts, j, k, axis=0):
    """Copy j's rows (along the batch ``axis``) of a replica-wide batch-major ``value``, cut
    on ``value``'s device (only those rows travel): ``counts`` the copies' row counts
    (tensors), None for k even parts. Of a part's expert outputs it is the part's half of an
    all-to-all (MoE combine)."""
    with tf.name_scope("epl_rows_of"), tf.device(value.device):
      if counts is None:
        return tf.split(value, k, axis=axis)[j]
      start = tf.add_n(counts[:j]) if j else 0
      rank = value.shape.rank
      begin = tf.one_hot(axis, rank, on_value=start, off_value=0, dtype=tf.int32)
      size = tf.one_hot(axis, rank, on_value=counts[j], off_value=-1, dtype=tf.int32)
      return tf.slice(value, begin, size)

  # ---- broadcast -----------------------------------------------------------------------
  def broadcast(self, tensor, device, group, root):
    """Returns ``group[root]``'s ``tensor`` on this member (``device``, one of ``group``).

    Every member must be on a different worker (a worker's own devices share values by
    plain reads).

    Args:
      tensor: the value on the root; elsewhere any tensor of the same shape and dtype.
    """
    group = tuple(group)
    if len(group) == 1:
      return tensor
    assert len({worker_of(d) for d in group}) == len(group), group
    key, instance = self.group_key(group), self._instance()
    with tf.device(device):
      if device == group[root]:
        return collective_ops.broadcast_send_v2(
            tensor, group_size=len(group), group_key=key, instance_key=instance,
            communication_hint="auto")
      return collective_ops.broadcast_recv_v2(
          tf.shape(tensor), tensor.dtype, group_size=len(group), group_key=key,
          instance_key=instance, communication_hint="auto")
