"""epl.collectives: in-worker reductions (one-device and chunked) and their results."""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from epl import collectives
from epl.cluster import worker_of
from epl.collectives import Collectives


def _run(build, devices):
  g = tf.Graph()
  with g.as_default():
    values = [np.arange(10, dtype=np.float32) * (i + 1) for i in range(devices)]
    names = ["/device:CPU:%d" % (i + 1) for i in range(devices)]
    inputs = []
    for v, d in zip(values, names):
      with tf.device(d):
        inputs.append(tf.Variable(v) * 1.0)
    outs = build(inputs, names)
    config = tf.ConfigProto(device_count={"CPU": devices + 1})
    with tf.Session(config=config) as sess:
      sess.run(tf.global_variables_initializer())
      results = sess.run(outs)
    ops = g.get_operations()
  return values, results, ops


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("method", ["mean", "sum"])
def test_in_worker_all_reduce(devices, chunked, method):
  coll = Collectives(on_gpu=False, chunked=chunked)
  values, results, ops = _run(lambda xs, ds: coll.all_reduce(xs, ds, method), devices)
  want = np.sum(values, axis=0) / (devices if method == "mean" else 1)
  for r in results:
    np.testing.assert_allclose(r, want, rtol=1e-6)
  assert not [op for op in ops if op.type.startswith("Collective")]
  sums = [op for op in ops if op.type == "AddN"]
  assert len(sums) == (devices if chunked else 1)
  if chunked:                                # each device sums one chunk
    assert sorted(op.device for op in sums) == sorted(
        "/device:CPU:%d" % (i + 1) for i in range(devices))


def test_in_worker_all_gather():
  coll = Collectives(on_gpu=False)
  values, results, _ = _run(lambda xs, ds: coll.all_gather(xs, ds), 2)
  for r in results:
    np.testing.assert_array_equal(r, np.concatenate(values))


def test_worker_of_device_names():
  assert worker_of("/job:worker/replica:0/task:3/device:CPU:1") == 3
  assert worker_of("/device:CPU:1") == 0


@pytest.mark.parametrize("per_worker,chunked,fp16,final,multiplies", [
    (1, False, False, b"Div", 0),      # the mean is the collective's own final op
    (2, False, False, b"Id", 1),       # 4 copies over 2 workers: one multiply after it
    (2, True, False, b"Id", 2),        # chunked: one multiply per chunk
    (1, False, True, b"Id", 1),        # fp16: the mean folded into the unscaling
])
def test_mean_across_workers_costs_at_most_one_pass(per_worker, chunked, fp16, final,
                                                   multiplies):
  """Built, not run (a cross-worker collective needs servers: test_multiworker runs them)."""
  coll = Collectives(on_gpu=False, chunked=chunked)
  group = tuple("/job:worker/replica:0/task:%d/device:CPU:%d" % (w, d + 1)
                for w in range(2) for d in range(per_worker))
  g = tf.Graph()
  with g.as_default():
    mine = group[:per_worker]
    xs = []
    for d in mine:
      with tf.device(d):
        xs.append(tf.ones([8]))
    coll.all_reduce(xs, mine, "mean", group=group, fp16_scale=128 if fp16 else None)
  reduces = [op for op in g.get_operations() if op.type == "CollectiveReduceV2"]
  assert reduces and {op.get_attr("final_op") for op in reduces} == {final}
  ops = g.get_operations()
  after = [op for op in ops[ops.index(reduces[0]):] if op.type in ("Mul", "RealDiv")]
  assert len(after) == multiplies, [op.name for op in after]


def _pieces(count, dtype):
  per = collectives.PIECE_BYTES // dtype.size
  return [per] * (count // per) + ([count % per] if count % per else [])


@pytest.mark.parametrize("on_gpu,dtype,sizes", [
    (False, tf.float32, _pieces(5 << 19, tf.float32)),   # 10 MiB: 5 pieces of 2 MiB
    (False, tf.float16, _pieces(5 << 19, tf.float16)),   # 5 MiB of float16: 2, 2 and 1 MiB
    (True, tf.float32, [5 << 19]),                       # NCCL: whole
])
def test_a_large_tensor_crosses_the_ring_in_pieces(on_gpu, dtype, sizes):
  """Across workers on the ring a tensor over PIECE_BYTES is all-reduced in pieces of at most
  that size, each its own collective instance, assembled back to the tensor's shape."""
  coll = Collectives(on_gpu=on_gpu)
  kind = "GPU" if on_gpu else "CPU"
  group = tuple("/job:worker/replica:0/task:%d/device:%s:0" % (w, kind) for w in range(2))
  g = tf.Graph()
  with g.as_default():
    with tf.device(group[0]):
      x = tf.ones([5 << 18, 2], dtype)
    out = coll.all_reduce([x], group[:1], "mean", group=group)[0]
  reduces = [op for op in g.get_operations() if op.type == "CollectiveReduceV2"]
  assert [op.inputs[0].shape.num_elements() for op in reduces] == sizes
  instances = [op.inputs[3].op.get_attr("value").int_val[0] for op in reduces]
  assert len(set(instances)) == len(reduces)
  k = collectives.PIECES_IN_FLIGHT        # piece j starts once piece j - k is done (TF puts
  waits = [{c.name for c in op.control_inputs}   # the dependency on the op's constant inputs)
           | {c.name for i in op.inputs for c in i.op.control_inputs} for op in reduces]
  assert waits == [{reduces[j - k].name} if j >= k else set() for j in range(len(reduces))]
  assert out.shape == x.shape and out.dtype == dtype


@pytest.mark.parametrize("shape,rows,cuts,dtype,in_place", [
    ([10, 6], True, [3, 3, 3, 1], tf.float32, True),    # row blocks, the last one shorter
    ([13, 5], True, [1, 12], tf.float32, True),         # rows of 5: 12 of them, in place
    ([40], False, [16, 16, 8], tf.float16, True),       # flat pieces: rows of 8 elements
    ([7, 3], False, [7, 7, 7], tf.float64, True),       # flat pieces of 7: a row each
    ([131], False, [65, 66], tf.float32, False),        # no common width: 66 rows, concat
])
def test_assemble_copies_each_part_into_one_buffer(shape, rows, cuts, dtype, in_place):
  """``assemble`` rebuilds the tensor from its consecutive parts (row blocks of it, or
  flat pieces), each part written into one buffer by its own InplaceUpdate (no concat
  after the last part), or concatenated when a part would take over 64 rows."""
  value = np.arange(np.prod(shape)).reshape(shape).astype(dtype.as_numpy_dtype)
  g = tf.Graph()
  with g.as_default():
    whole = tf.constant(value)
    edges = np.cumsum([0] + cuts)
    if rows:
      parts = [whole[lo:hi] for lo, hi in zip(edges, edges[1:])]
    else:
      parts = [tf.reshape(whole, [-1])[lo:hi] for lo, hi in zip(edges, edges[1:])]
    out = collectives.assemble(parts, shape)
    types = [op.type for op in g.get_operations()]
    with tf.Session() as sess:
      got = sess.run(out)
  assert got.dtype == value.dtype and got.shape == tuple(shape)
  np.testing.assert_array_equal(got, value)
  assert types.count("InplaceUpdate") == (len(cuts) if in_place else 0), types
  assert ("ConcatV2" in types) == (not in_place), types
