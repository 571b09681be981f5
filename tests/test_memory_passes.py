"""CPU offload (offload.level v0) and grouped apply (optimizer.num_apply_group): each trains
the local model, and each shows the memory it saves (epl.memory per device)."""
import contextlib
import functools
import re
import types

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.op_tables import VARIABLE_OPS
from epl.passes import grad_sync
from tests import split_models as sm

FEATURES, ROWS, STEPS = 12, 8, 5


class HandWrittenAdam(tf.train.Optimizer):
  """Adam with decoupled weight decay, written the way BERT's optimization.py writes it:
  slots by get_variable, the update as plain ops (temporaries the size of each weight)."""

  def __init__(self, learning_rate):
    super().__init__(False, "HandWrittenAdam")
    self.lr = learning_rate

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    updates = []
    for grad, var in grads_and_vars:
      name = var.op.name
      m = tf.get_variable(name + "/adam_m", var.shape, initializer=tf.zeros_initializer(),
                          trainable=False)
      v = tf.get_variable(name + "/adam_v", var.shape, initializer=tf.zeros_initializer(),
                          trainable=False)
      next_m = 0.9 * m + 0.1 * grad
      next_v = 0.999 * v + 0.001 * tf.square(grad)
      update = next_m / (tf.sqrt(next_v) + 1e-6) + 0.01 * var
      updates += [var.assign(var - self.lr * update), m.assign(next_m), v.assign(next_v)]
    with tf.control_dependencies(updates):
      return global_step.assign_add(1) if global_step is not None else tf.group(*updates)


def mlp(optimizer="adam", widths=(64, 64), classes=10, features=FEATURES, clip=True):
  """(parallel) -> a model builder: a tf.layers MLP, clipping, Adam or HandWrittenAdam."""
  return lambda parallel: functools.partial(_mlp, optimizer, widths, classes, features,
                                            clip, parallel)


def _mlp(optimizer, widths, classes, features, clip, parallel):
  x = tf.placeholder(tf.float32, [None, features], name="x")
  y = tf.placeholder(tf.int64, [None], name="y")
  with epl.replicate(1, name="model") if parallel else contextlib.nullcontext():
    h = x
    for i, w in enumerate(widths):
      h = tf.layers.dense(h, w, activation=tf.nn.relu,
                          kernel_initializer=tf.glorot_uniform_initializer(seed=i + 1),
                          name="dense_%d" % i)
    logits = tf.layers.dense(h, classes, name="logits",
                             kernel_initializer=tf.glorot_uniform_initializer(seed=9))
    loss = tf.losses.sparse_softmax_cross_entropy(y, logits)
  step = tf.train.get_or_create_global_step()
  opt = {"hand": HandWrittenAdam, "adam": tf.train.AdamOptimizer,
         "sgd": tf.train.GradientDescentOptimizer}[optimizer](0.01)
  grads, variables = zip(*opt.compute_gradients(loss))
  if clip:
    grads, _ = tf.clip_by_global_norm(grads, 1.0)
  train_op = opt.apply_gradients(zip(grads, variables), global_step=step)
  return dict(inputs=(x, y), loss=loss, train_op=train_op, step=step)


def train(model, config=None, steps=STEPS, rows=ROWS, data=None, **kw):
  data = data or sm.classification_data(steps * rows, 10)
  return sm.train(model(config is not None), data, steps, rows, config=config,
                  fetch=("loss",), **kw)


def assert_same(run, local):
  np.testing.assert_allclose([f["loss"] for f in run.fetched],
                             [f["loss"] for f in local.fetched], rtol=1e-5, atol=1e-6)
  assert run.variables["global_step"] == len(local.fetched)    # one update per step
  for name, value in local.variables.items():
    np.testing.assert_allclose(run.variables[name], value, rtol=1e-5, atol=1e-5,
                               err_msg=name)


def config(devices, **keys):
  return epl.Config(dict({"cluster.devices_per_worker": devices, "log.level": "warning"},
                         **keys))


# ---- offload -----------------------------------------------------------------------------
@pytest.mark.parametrize("devices,optimizer", [(1, "adam"), (2, "adam"), (2, "hand")])
def test_offload_trains_the_local_model(devices, optimizer):
  local = train(mlp(optimizer))
  run = train(mlp(optimizer), config(devices, **{"offload.level": "v0"}),
              initial=local.initial, measure_memory=True)
  assert_same(run, local)
  # no weight, slot or optimizer state is held by an accelerator device; the host holds
  # every copy's
  report = run.memory
  devices_used = [d for d in report.devices() if not d.endswith("CPU:0")]
  for d in devices_used:
    assert report.held(d) == 0, str(report)
  host = next(d for d in report.devices() if d.endswith("CPU:0"))
  per_copy = sum(v.nbytes for k, v in local.variables.items() if k != "global_step")
  assert report.held(host) >= per_copy * (devices if devices > 1 else 1), str(report)
  offloaded = run.parallel.results["offload"]
  assert len(offloaded.variables) >= len(local.variables) - 1


def test_offload_without_it_weights_sit_on_the_devices():
  """The control: the same measurement sees the weights when offload is off."""
  run = train(mlp(), config(2), measure_memory=True)
  for d in run.memory.devices():
    if not d.endswith("CPU:0"):
      assert run.memory.held(d) > 0, str(run.memory)


@pytest.mark.parametrize("level", ["v1", "v2"])
def test_zero_with_offload_keeps_one_optimizer_state_on_the_host(level):
  """ZeRO x offload (ZeRO-Offload, #51): the weights, the optimizer state and the update on
  the host, the state kept once per job instead of once per copy (v2: the weights too); the
  devices hold nothing between steps; the local model."""
  local = train(mlp("adam"))
  runs = {key: train(mlp("adam"), config(2, **dict({"offload.level": "v0"}, **extra)),
                     initial=local.initial, measure_memory=True)
          for key, extra in (("offload", {}), (level, {"zero.level": level}))}
  for run in runs.values():
    assert_same(run, local)
    for d in run.memory.devices():
      if not d.endswith("CPU:0"):
        assert run.memory.held(d) == 0, str(run.memory)
  weights = sum(v.nbytes for k, v in local.variables.items()
                if re.match(r"(dense_\d|logits)/(kernel|bias)$", k))
  host = {key: max(run.memory.held(d) for d in run.memory.devices() if d.endswith("CPU:0"))
          for key, run in runs.items()}       # offload alone: 2 copies x (weights + m + v)
  saved = 2 * weights + (weights if level == "v2" else 0)   # a copy's m and v (v2: + weights)
  assert host[level] <= host["offload"] - 0.9 * saved, (host, weights)


def test_offload_with_split_keeps_every_part_on_the_host_and_computes_on_the_parts_devices():
  """offload x epl.split (#51): each part of a split weight lives on the host and is sent
  to its part's device in the step (the devices hold nothing between steps); the split's
  compute stays on the parts' devices (sm.check_parts_placed: their readers); the local
  model."""
  from tests import matrix_model as mm
  features = ("split", "offload")
  data = mm.data(ROWS * STEPS + 3)
  local = sm.train(lambda: mm.build(features, local=True), data, STEPS, ROWS, race_free=True)
  run = sm.train(lambda: mm.build(features), data, STEPS, ROWS,
                 config=epl.Config(mm.config(features)), initial=local.initial,
                 measure_memory=True)
  assert_same(run, local)
  for d in run.memory.devices():
    if not d.endswith("CPU:0"):
      assert run.memory.held(d) == 0, str(run.memory)
  parts = sm.part_devices(run.graph)
  assert parts and all(d.endswith("CPU:0") for devices in parts.values() for d in devices)


def test_offload_with_amp_trains_the_local_model_and_sends_half_precision_weights():
  """offload x AMP O1 (#51): the weights stay on the host in float32; epl.amp's per-use casts
  run there, so each weight crosses to the device as float16 (half the bytes), and nothing is
  held on the devices between steps."""
  amp = train(mlp("adam"), config(2, **{"amp.level": "O1"}))      # the model AMP trains
  run = train(mlp("adam"), config(2, **{"offload.level": "v0", "amp.level": "O1"}),
              initial=amp.initial, measure_memory=True)
  assert_same(run, amp)                # the same casts and float16 math: placed elsewhere
  for d in run.memory.devices():
    if not d.endswith("CPU:0"):
      assert run.memory.held(d) == 0, str(run.memory)
  trained = {v.op.name for v in run.graph.get_collection(tf.GraphKeys.TRAINABLE_VARIABLES)}
  casts = [op for op in run.graph.get_operations() if op.type == "Cast" and
           op.name.startswith("epl_amp/") and op.outputs[0].dtype == tf.float16 and
           any(x.op.type in VARIABLE_OPS and x.op.name in trained
               for x in op.inputs[0].op.inputs)]
  assert casts and all(op.device.endswith("CPU:0") for op in casts), \
      [(op.name, op.device) for op in casts]


# ---- grouped apply -----------------------------------------------------------------------
@pytest.mark.parametrize("devices,optimizer", [(1, "hand"), (2, "hand"), (2, "adam")])
def test_grouped_apply_trains_the_local_model(devices, optimizer):
  local = train(mlp(optimizer, widths=(64, 32, 48)))
  run = train(mlp(optimizer, widths=(64, 32, 48)),
              config(devices, **{"optimizer.num_apply_group": 3}), initial=local.initial)
  assert_same(run, local)
  groups = run.parallel.results["apply_groups"]
  (per_tg,) = groups.groups
  assert len(per_tg) == 3
  trained = sorted(v for v in local.variables if re.match(r"(dense_\d|logits)/(kernel|bias)$", v))
  assert sorted(v for g in per_tg for v in g) == trained
  assert groups.barriers == 2 * devices          # per copy: a barrier between two groups


@pytest.mark.parametrize("level", ["v1", "v2"])
def test_grouped_apply_with_zero_groups_each_owners_updates(level):
  """ZeRO x num_apply_group (#51): a copy's groups hold the updates it runs -- those of the
  variables it owns -- so no group waits for an update ZeRO took out of the step (a copy's
  own update of a variable it does not own would read never-initialised slots)."""
  local = train(mlp("adam", widths=(64, 32, 48)))
  run = train(mlp("adam", widths=(64, 32, 48)),
              config(2, **{"optimizer.num_apply_group": 3, "zero.level": level}),
              initial=local.initial)
  assert_same(run, local)
  owners = run.parallel.results["zero"].owners
  assert set(owners.values()) == {0, 1}
  groups = run.parallel.results["apply_groups"]
  (per_tg,) = groups.groups
  # per copy, a barrier between two consecutive groups that hold one of its variables
  expected = sum(max(0, sum(1 for g in per_tg if any(owners[v] == c for v in g)) - 1)
                 for c in (0, 1))
  assert groups.barriers == expected, (per_tg, owners)
  for op in run.graph.get_operations():
    if op.name.startswith("epl_apply_group"):     # waits for one owner's updates only
      ran = {owners.get(_variable_of(x), -1) for x in op.control_inputs}
      assert len(ran) == 1 and -1 not in ran, (op.name, [x.name for x in op.control_inputs])


def _variable_of(update):
  """The trained variable an optimizer's update op writes (``.../update_dense_1/kernel/
  ApplyAdam`` -> ``dense_1/kernel``), or None."""
  parts = update.name.split("/")
  for i, part in enumerate(parts[:-1]):
    if part.startswith("update_"):
      return part[len("update_"):] + "/" + parts[i + 1]
  return None


def _group_sizes(groups, variables):
  return [sum(variables[v].size for v in g) for g in groups]


def test_grouped_apply_balances_by_size():
  local = train(mlp("hand", widths=(256, 16, 16)), steps=1)
  run = train(mlp("hand", widths=(256, 16, 16)), config(1, **{"optimizer.num_apply_group": 2}),
              steps=1)
  (groups,) = run.parallel.results["apply_groups"].groups
  sizes = _group_sizes(groups, local.variables)
  # the 16x256 and 256x16 kernels go to different groups
  assert max(sizes) < 0.6 * sum(sizes), (groups, sizes)


def test_grouped_apply_lowers_the_peak_of_the_update():
  """A hand-written optimizer's temporaries (next_m, next_v, the update: each the size of
  its weight) are alive for one group at a time. The step's peak without them (plain SGD
  updates in place) is the floor; the optimizer's share above it is compared, so the
  scheduling of the backward pass, which grouping does not touch, cannot decide."""
  widths, features = (512,) * 6, 512
  data = sm.classification_data(ROWS, 10)
  data = (np.random.RandomState(0).randn(ROWS, features).astype(np.float32), data[1])
  peaks = {}
  for optimizer, g in (("sgd", 1), ("hand", 1), ("hand", 4)):
    run = train(mlp(optimizer, widths=widths, features=features, clip=False),
                config(1, **{"optimizer.num_apply_group": g}), steps=1, data=data,
                measure_memory=True)
    peaks[optimizer, g] = max(run.memory.peak(d) for d in run.memory.devices())
  floor = peaks["sgd", 1]
  assert peaks["hand", 4] - floor < 0.8 * (peaks["hand", 1] - floor), peaks


# ---- ZeRO v0 / v2 ------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["v0", "v1", "v2"])
@pytest.mark.parametrize("devices,optimizer,micro", [
    (2, "adam", 1), (4, "adam", 1), (2, "hand", 1), (2, "adam", 2)],
    ids=["2 devices", "4 devices", "hand-written Adam", "2 micro-batches (accumulation)"])
def test_zero_trains_the_local_model_with_a_share_per_device(devices, optimizer, micro,
                                                             level):
  widths = (32,) * 6
  local = train(mlp(optimizer, widths=widths))
  keys = {"zero.level": level, "pipeline.num_micro_batch": micro}
  run = train(mlp(optimizer, widths=widths), config(devices, **keys),
              initial=local.initial, measure_memory=True)
  assert_same(run, local)
  done = run.parallel.results["zero"]
  assert done.level == level
  assert sorted(set(done.owners.values())) == list(range(devices))     # every copy owns some
  # v0: every device holds the weights and its share of the slots (balanced by size);
  # v2: its share of the weights and of their slots
  weights = sum(v.nbytes for k, v in local.variables.items()
                if re.match(r"(dense_\d|logits)/(kernel|bias)$", k))
  slots = sum(v.nbytes for k, v in local.variables.items() if k in done.slots)
  assert slots >= 2 * weights
  held = [run.memory.held(d) for d in run.memory.devices() if re.search(r"CPU:[1-9]", d)]
  assert len(held) == devices
  unit = max(sum(v.nbytes for k, v in local.variables.items() if k in done.slots and
                  k.startswith(var + "/")) for var in done.owners)
  if level in ("v0", "v1"):
    for h in held:            # a share: 1/N of the slots, give or take one variable's
      assert weights <= h <= weights + slots / devices + unit, (h, weights, slots, unit)
    assert sum(held) <= devices * weights + slots + devices * 64     # each slot once
  else:
    state = weights + slots
    biggest = max(local.variables[v].nbytes for v in done.owners) + unit
    for h in held:            # 1/N of weights and slots, give or take one variable's
      assert h <= state / devices + biggest, (h, state, biggest)
    assert sum(held) <= state + devices * 64                          # everything once


@pytest.mark.parametrize("level", ["v0", "v1", "v2"])
def test_zero_checkpoint_restores_into_the_local_model(tmp_path, level):
  """The slots (and with v2 the weights) live once, in the user's variables: a checkpoint is
  the local one."""
  run_dir = str(tmp_path / "ckpt")
  run = train(mlp("adam"), config(2, **{"zero.level": level}))
  g = run.graph
  with g.as_default():
    saver = tf.train.Saver()
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      sm.load_whole(sess, g.get_collection(tf.GraphKeys.GLOBAL_VARIABLES), run.variables)
      saver.save(sess, run_dir)
  with tf.Graph().as_default():
    mlp("adam")(False)()
    with tf.Session() as sess:
      tf.train.Saver().restore(sess, run_dir)
      for v in tf.global_variables():
        np.testing.assert_allclose(sess.run(v), run.variables[v.op.name], err_msg=v.op.name)


@pytest.mark.parametrize("level", ["v0", "v1", "v2"])
def test_zero_with_data_parallel_pipeline_stages(level):
  """2 replicas of a 2-stage pipeline with 2 micro-batches: each stage's variables are shared
  by that stage's two devices (owners balanced per stage)."""
  from epl.testing import assert_parity
  from tests import models
  _, dist = assert_parity(
      models.mlp_two_stages, config(4, **{"zero.level": level, "pipeline.num_micro_batch": 2}),
      copies=4, optimizer="adam",
      strategies=[lambda: epl.replicate(1, name="s0"), lambda: epl.replicate(1, name="s1")])
  owners = dist.parallel.results["zero"].owners
  for stage in (["dense/kernel", "dense/bias"], ["dense_1/kernel", "dense_2/kernel"]):
    assert {owners[v] for v in stage} == {0, 1}, owners


def test_zero_v1_sums_each_gradient_on_its_owner():
  local = train(mlp("adam", widths=(32,) * 4))
  run = train(mlp("adam", widths=(32,) * 4), config(4, **{"zero.level": "v1"}),
              initial=local.initial)
  assert_same(run, local)
  owners = run.parallel.results["zero"].owners
  sums = [op for op in run.graph.get_operations()
          if op.name.startswith("epl_grad_sync/epl_all_reduce") and op.type == "AddN"]
  report = run.parallel.results["gradient_sync"]
  assert len(sums) == len(report.buckets) and len(set(owners.values())) == 4
  devices = {op.device for op in sums}
  assert len(devices) == 4, devices          # not all on the first device (v0's place)
  for op, bucket in zip(sorted(sums, key=lambda o: o._id), report.buckets):   # built in order
    assert {owners[v] for v in bucket} == {int(op.device[-1]) - 1}, (op.device, bucket)


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_zero_across_workers_with_a_sparse_gradient(sparse_as_dense):
  """Across workers an embedding's sparse gradient (tf.gather) leaves its variable unowned
  (passes/owners.py); with communication.sparse_as_dense it is refused before the rewrite."""
  from epl.cluster import Cluster
  from epl.errors import NotImplementedYetError
  from epl.passes.owners import sparse_across_workers
  from epl.plan.build import build_plan
  g = tf.Graph()
  with g.as_default():
    epl.init(config(1, **{"zero.level": "v1",
                          "communication.sparse_as_dense": sparse_as_dense}))
    ids = tf.placeholder(tf.int32, [None], name="ids")
    with epl.replicate(1, name="model"):
      table = tf.get_variable("table", [10, 4])
      h = tf.layers.dense(tf.gather(table, ids), 3, name="out")
      loss = tf.reduce_mean(tf.square(h))
    tf.train.AdamOptimizer(0.1).minimize(loss)
    state = epl.Env.get()._state
    cluster = Cluster(("h0:1", "h1:1"), 0, 1, False)
    if sparse_as_dense:
      with pytest.raises(NotImplementedYetError, match=r"zero.level 'v1' across workers .*"
                         r"sparse_as_dense .*table"):
        build_plan(g, state.recorder, state.config, cluster)
      return
    plan = build_plan(g, state.recorder, state.config, cluster)
    assert sparse_across_workers(plan) == ["table"]


def test_zero_v1_across_workers_reduce_scatters_only_gradients_nothing_else_combines():
  """zero.level v1 across workers reduce-scatters the gradients: each worker then holds the
  sums of its own variables only. An op that reads several variables' gradients (clipping's
  global norm, a merged summary) would read other workers' unreduced ones: grad_sync then
  all-reduces them (grad_sync._combined tells the two apart)."""
  graph = tf.Graph()
  with graph.as_default():
    a, b = tf.Variable(tf.ones([3])), tf.Variable(tf.ones([2]))
    loss = tf.reduce_sum(a * a) + tf.reduce_sum(b)
    grads = tf.gradients(loss, [a, b])
    plain = [types.SimpleNamespace(grad=g, variable=v.op.name, per_copy=[g])
             for g, v in zip(grads, [a, b])]
    tf.train.AdamOptimizer(0.1).apply_gradients(zip(grads, [a, b]))
    assert not grad_sync._combined(plain)         # pylint: disable=protected-access
    tf.clip_by_global_norm(grads, 1.0)
    assert grad_sync._combined(plain)             # pylint: disable=protected-access
    # stage functions: the readers read the calls' sums, which the user's gradients do not
    # reach (a clipped step across workers trained another model when only those were walked)
    sums = [tf.identity(tf.zeros_like(g)) for g in grads]
    called = [types.SimpleNamespace(grad=tf.identity(g), variable=v.op.name, per_copy=[s])
              for g, s, v in zip(grads, sums, [a, b])]
    assert not grad_sync._combined(called)        # pylint: disable=protected-access
    tf.clip_by_global_norm(sums, 1.0)
    assert grad_sync._combined(called)            # pylint: disable=protected-access
